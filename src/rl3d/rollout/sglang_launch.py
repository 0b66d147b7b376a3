"""What launching SGLang does to the trainer's process, undone: SGLang's launch writes the
process's environment and installs signal handlers (among them a SIGQUIT handler that kills the
process tree when one of its schedulers fails). `scoped_environ` gives the environment back and
`trainer_signal_handlers` the handlers, with SIGQUIT raising `SGLangSchedulerError` instead, so
a failed scheduler ends the run through rl3d's error path."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# Handlers SGLang's launch may install in the trainer's process; rl3d puts its own back
TRAINER_SIGNALS = ("SIGQUIT", "SIGTERM", "SIGINT", "SIGCHLD", "SIGUSR1")


class SGLangSchedulerError(RuntimeError):
    """An SGLang scheduler process failed (it signals the launching process with SIGQUIT)."""


def _scheduler_failed(signum: int, _frame: Any) -> None:
    raise SGLangSchedulerError(
        f"an SGLang scheduler process failed (it sent signal {signum} to this trainer rank); "
        "its own error is in the log above"
    )


@contextmanager
def trainer_signal_handlers() -> Iterator[dict[str, str]]:
    """Inside, SGLang may install what it likes; afterwards this process's handlers are what they
    were, except SIGQUIT, which SGLang's children send when one fails: it raises
    `SGLangSchedulerError` in the trainer, so the run ends through rl3d's own error path. Yields
    the names of the signals SGLang had changed (filled in on exit)."""
    changed: dict[str, str] = {}
    if threading.current_thread() is not threading.main_thread():
        yield changed  # handlers are the main thread's to set (SGLang sets none either)
        return
    signals = [getattr(signal, name) for name in TRAINER_SIGNALS if hasattr(signal, name)]
    before = {s: signal.getsignal(s) for s in signals}
    try:
        yield changed
    finally:
        for s, handler in before.items():
            if signal.getsignal(s) is not handler:
                changed[signal.Signals(s).name] = repr(signal.getsignal(s))
                signal.signal(s, handler)
        signal.signal(signal.SIGQUIT, _scheduler_failed)


@contextmanager
def scoped_environ(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ is `env` inside, and exactly what it was before afterwards."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)
