"""thdpack's version: one place, read by the package face, the CLI, the stores' manifests and the
build (``pyproject.toml``'s dynamic version)."""

__version__ = "0.1.0"
