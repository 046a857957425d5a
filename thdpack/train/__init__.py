"""Training with the whole pipeline (packing, THD, CP, DP): ``python -m thdpack.train`` (Hydra).

``thdpack.train.trainer.run(config)`` runs it from Python with a ``thdpack.train.config.Config``.
"""
