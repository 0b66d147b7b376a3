"""Name -> object registries: the one mechanism behind every "name it in a recipe" table.

Algorithm pieces (`rl3d.algos.registry`), resharding strategies (`rl3d.hybrid_engine.registry`),
tools (`rl3d.tools.base`) and synthetic tasks (`rl3d.data.task`) each keep one `Registry`:

    LOSSES: Registry[Callable] = Registry("policy loss")

    @LOSSES.register("ppo")
    def ppo_loss(...): ...

    LOSSES.get("ppp")  # ValueError: unknown policy loss 'ppp' (did you mean 'ppo'?); known: ppo

Iteration follows registration order; `names()` and error messages list the names sorted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from rl3d.utils.imports import suggest

T = TypeVar("T")


def _qualname(obj: Any) -> str | None:
    """A class's or function's qualified name (None for plain values)."""
    return getattr(obj, "__qualname__", None)


class Registry(Generic[T]):
    """A mapping from names to objects of one kind, filled by `register` (bare or as a decorator).

    `note` ends the unknown-name error (say where more entries come from); one that starts
    with "," or ";" continues the list of known names."""

    def __init__(self, kind: str, *, note: str = "") -> None:
        self.kind = kind
        self.note = note
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register `obj` under `name`; used bare (`register(name, obj)`) or as a decorator.
        A name is registered once; the same class or function again (its module imported a
        second time, e.g. as `__main__`) replaces the entry."""

        def add(entry: T) -> T:
            if name in self._entries:
                again = _qualname(entry)
                assert again is not None and again == _qualname(self._entries[name]), (
                    f"{self.kind} {name!r} registered twice"
                )
            self._entries[name] = entry
            return entry

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        """The entry of `name`; an unknown name is a ValueError with the closest known name."""
        if name in self._entries:
            return self._entries[name]
        known = self.names()
        note = self.note if self.note[:1] in ("", ",", ";") else f" {self.note}"  # a clause or a remark
        hint = suggest(name, known)
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; known: {', '.join(known)}{note}")

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def values(self) -> tuple[T, ...]:
        return tuple(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
