"""The package version, read by setup.py and folded into every cache key."""

__version__ = "0.1.0"
