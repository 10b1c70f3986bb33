"""Errors raised while finding or loading a model; each message names the file and the problem."""


class ModelLoadError(RuntimeError):
    """A model file or directory exists but cannot be loaded (corrupt, truncated, unsupported)."""
