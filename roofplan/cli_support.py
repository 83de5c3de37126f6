"""What every roofplan command shares: an argument parser whose errors are one line (exit 2), and
progress displays for long work."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints ``prog: error: message`` on one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# The plan command's integer flags and the SIZE_LIMITS field each is bounded by.
_SIZED_FLAGS = {"micro_batch": "micro_batch_size", "gpus": "gpus", "gpus_per_node": "gpus_per_node", "tp": "tp",
                "cp": "cp", "ep": "ep", "trials": "trials", "steps": "steps"}


def check_flag_sizes(args: argparse.Namespace) -> None:
    """Refuse an integer flag beyond what any real run uses (``planner.model.limits.SIZE_LIMITS``,
    the limits model files meet too), before any work is sized by it."""
    from planner.errors import ConfigError
    from planner.model.limits import size_problem

    for dest, field in _SIZED_FLAGS.items():
        problem = size_problem(field, getattr(args, dest, None), "--" + dest.replace("_", "-"))
        if problem is not None:
            raise ConfigError(problem)


_SEED_MOST = 2**32 - 1  # optuna's samplers seed numpy, which takes 0 .. 2**32 - 1


def check_run_flags(args: argparse.Namespace) -> None:
    """The plan command's flags that only make sense together, refused in one line before any work:
    the seed's range, a study name without storage, and GPUs that do not fill whole nodes."""
    from hardware.registry import load_hardware
    from planner.errors import ConfigError

    if not 0 <= args.seed <= _SEED_MOST:
        raise ConfigError(f"--seed: {args.seed} is outside the sampler's seeds 0 to {_SEED_MOST:,} (numpy's range); "
                          "give a seed in that range")
    if args.study_name is not None and not args.storage:
        raise ConfigError("--study-name: names a study in --storage, and without --storage the search runs in "
                          "memory and keeps no study; add --storage URL (e.g. sqlite:///study.db) or drop --study-name")
    if args.gpus_per_node is not None and args.gpus_per_node <= 0:
        raise ConfigError(f"--gpus-per-node: must be positive, got {args.gpus_per_node}")
    per_node = args.gpus_per_node or load_hardware(args.hardware).gpus_per_node
    if args.gpus > per_node and args.gpus % per_node:
        whole = (args.gpus // per_node) * per_node
        raise ConfigError(f"--gpus: {args.gpus} GPUs do not fill whole nodes of {per_node} (--gpus-per-node); give "
                          f"at most {per_node} (one node) or a multiple of {per_node} ({whole} or {whole + per_node}), "
                          "or set --gpus-per-node to the GPUs each node has")


# Columns of the report when stdout is not a terminal (a file, a pipe) and COLUMNS is unset: rich
# would otherwise cut every table at 80 columns.
PIPED_WIDTH = 160


def output_console() -> Any:
    """The rich console reports print on: the terminal's width on a terminal, ``COLUMNS`` when set,
    else ``PIPED_WIDTH`` columns."""
    import os

    from rich.console import Console

    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(width=PIPED_WIDTH)


def progress_console() -> Any:
    """The console progress is shown on: stderr when it is a terminal, else None (no progress: a
    file or a pipe gets only the result). Tests replace it to force a terminal."""
    import sys

    if not sys.stderr.isatty():
        return None
    from rich.console import Console

    return Console(stderr=True)


class SearchProgress:
    """A rich progress bar while ``plan`` searches, on ``progress_console()`` (a no-op without one):
    the trials (``on_trial``), then each longer step by name (``on_stage``: the polish, pricing the
    reported plans, and when nothing fits the smallest plan, the fused optimizer and the fewest
    GPUs) with its work counted (``on_progress(done, total)``: points priced, GPU counts tried),
    and the elapsed time of each. Use as a context manager; it yields None when disabled."""

    _MIN_REDRAW_S = 0.1  # a count redraws at most this often (a step may count thousands of points)

    def __init__(self) -> None:
        self.bar: Any = None
        self.task: Any = None
        self.drawn = 0.0

    def __enter__(self) -> SearchProgress | None:
        console = progress_console()
        if console is None:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("searching", total=None)
        return self

    def on_trial(self, done: int, total: int) -> None:
        self._show("searching", done, total)

    def on_stage(self, text: str) -> None:
        """A new step: its name, its count not known yet, its clock restarted."""
        self.bar.reset(self.task, description=text, completed=0, total=None)
        self._redraw(force=True)

    def on_progress(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)
        self._redraw(force=done >= total)

    def _show(self, description: str, done: int, total: int) -> None:
        self.bar.update(self.task, description=description, completed=done, total=total)
        self._redraw(force=done >= total)

    def _redraw(self, force: bool) -> None:
        """Draw now (the bar's own refresh thread may not get the interpreter during long pricing)."""
        import time

        now = time.perf_counter()
        if force or now - self.drawn >= self._MIN_REDRAW_S:
            self.bar.refresh()
            self.drawn = now

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


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


INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


def ends_quietly(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """A command's ``main`` that ends without a traceback on the two ways a user stops it: Ctrl-C
    prints ``prog: interrupted`` and returns 130 (128 + SIGINT, as a shell reports it), and a
    reader that stops early (``plan ... | head``) ends it quietly with 141, as SIGPIPE would,
    instead of Python's BrokenPipeError traceback."""
    import functools
    import os
    import sys

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args: Any, **kwargs: Any) -> int:
            try:
                code = main(*args, **kwargs)
                sys.stdout.flush()
                return code
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return INTERRUPTED_EXIT
            except BrokenPipeError:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())  # the interpreter's own final flush must not fail too
                return 141

        return wrapper

    return decorate
