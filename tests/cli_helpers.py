"""Running the command-line entry points in-process, for the tests beside this module."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import pytest


def call(main: Callable[[list[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(argv)``'s exit code (argparse's SystemExit included) and what it printed."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def run_plan(*argv: str) -> tuple[int, str, str]:
    """``plan argv`` without a capsys fixture: its exit code, stdout and stderr."""
    from roofplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    return int(code or 0), out.getvalue(), err.getvalue()
