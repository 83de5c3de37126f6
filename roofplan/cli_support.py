"""What every roofplan command shares: an argument parser whose errors are one line (exit 2), and a
progress display for long work."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints ``prog: error: message`` on one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class StageProgress:
    """A rich spinner on stderr naming the stage of long work (validation) and its elapsed time;
    a no-op when stderr is not a terminal. Use as a context manager; call the returned function
    with each stage's description as it starts."""

    def __init__(self, enabled: bool, prefix: str) -> None:
        self.enabled = enabled
        self.prefix = prefix
        self.status: Any = None
        self.started = 0.0

    def __enter__(self) -> Callable[[str], None]:
        if not self.enabled:
            return lambda _text: None
        import time

        from rich.console import Console

        self.started = time.perf_counter()
        self.status = Console(stderr=True).status(f"{self.prefix}: starting")
        self.status.__enter__()

        def show(text: str) -> None:
            self.status.update(f"{self.prefix}: {text} ({time.perf_counter() - self.started:.0f} s so far)")

        return show

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.__exit__(None, None, None)


def survives_closed_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """A command whose reader stops early (``plan ... | head``) ends quietly with status 141, as a
    process killed by SIGPIPE does, instead of printing Python's BrokenPipeError traceback."""
    import functools
    import os
    import sys

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the interpreter's own final flush must not fail too
            return 141

    return wrapper
