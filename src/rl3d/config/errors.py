"""The one error type of the config system: it names the file and the dotted key."""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe problem, found before any process group exists.

    `key` is the dotted path (``actor.parallel.tp``); `source` is the file (or ``command line``)
    that set it, when known.
    """

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        self.key = key
        self.source = source
        where = ": ".join(part for part in (source, key) if part)
        super().__init__(f"{where}: {message}" if where else message)


class FieldError(ValueError):
    """Raised by a component config's own checks; `field` is relative to that component.

    The typed loader turns it into a ConfigError with the full dotted key and the file.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
