"""The generated parts of the documentation site, built from the code and the benchmarks' JSON.

``docs/hooks.py`` calls them while MkDocs builds; ``tests/integration/test_docs.py`` checks them.
Each module returns ``(path, content)`` pairs of pages or pictures, or fills a page's ``{{ key }}``
placeholders, so nothing generated is kept in git and nothing can drift from what it describes.
"""
