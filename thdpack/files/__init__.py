"""The folders thdpack writes (token stores, the trainer's token cache, checkpoints, output_dir).

:mod:`thdpack.files.publish`: one way to publish a folder (its files, then a checksummed manifest
written last and atomically) and to verify it; :mod:`thdpack.files.lock`: one writer per folder.
Both are standard library only, below every stage that writes a folder.
"""
