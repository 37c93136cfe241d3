"""Packaged model configs (JSON), read with importlib.resources."""
