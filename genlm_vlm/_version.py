"""The package version: the single source (``pyproject.toml`` reads it, see ``[tool.setuptools.dynamic]``)."""

__version__ = "0.1.0"
