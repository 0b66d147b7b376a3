"""The data layer's one error type."""


class DataError(ValueError):
    """The data cannot be used as configured; the message names the file (and row or column)."""
