"""Read a user's input file (model, plan, hardware profile) as text, with a size limit.

Every reader of a file the user names goes through ``read_text_file``: a directory, a device
(``/dev/zero``), a fifo or a socket, a file larger than ``MAX_INPUT_BYTES`` or one that is not
UTF-8 text is refused with one line naming the file and what to give instead, before anything
reads it whole.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from hardware.errors import ConfigError

# The largest input file read: 8 MiB. The biggest real inputs are a few tens of kB (a plan file of
# DeepSeek-V3 on 64 GPUs: 55 kB; a hardware profile: 25 kB; a transformers config.json: a few kB).
MAX_INPUT_BYTES = 8 * 2**20
# How deep a parsed input may nest, and how many values it may hold once YAML aliases are expanded:
# real files nest 4 levels and hold a few thousand values. Deeper flow nesting ([[[[...) crashes
# libyaml's C parser (a segmentation fault, not an exception); aliases can make a small file stand
# for billions of values.
MAX_NESTING = 64
MAX_VALUES = 1_000_000
_BRACKET = re.compile(r"[][{}]")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "something else"


def read_text_file(path: str | Path, context: str, what: str = "a YAML or JSON file") -> str:
    """The UTF-8 text of ``path``; a ``ConfigError`` ``context: cannot read it (why); give what``
    (one line) for a file that cannot be opened, is not a regular file, is over
    ``MAX_INPUT_BYTES`` or is binary. ``what`` names what the user should give instead."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{context}: cannot read it ({why}); give {what}")

    try:
        # O_NONBLOCK: opening a fifo must not wait for a writer; it is refused just below
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise refuse(error.strerror or str(error)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise refuse(f"it is {_kind(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(MAX_INPUT_BYTES + 1)
        except OSError as error:
            raise refuse(error.strerror or str(error)) from None
    if len(data) > MAX_INPUT_BYTES:
        raise refuse(f"it is larger than {MAX_INPUT_BYTES // 2**20} MiB, the most an input file may hold; real "
                     "ones are a few kB")
    nul = data.find(b"\0")
    if nul >= 0:
        raise refuse(f"a binary file: a NUL byte at byte {nul}, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise refuse(f"a binary file: byte {error.start} ({data[error.start]:#04x}) is not UTF-8 text") from None


def _flow_depth_exceeds(text: str, limit: int) -> bool:
    """Whether ``[``/``{`` nest deeper than ``limit`` anywhere (quotes ignored: only over-counts)."""
    depth = 0
    for match in _BRACKET.finditer(text):
        depth += 1 if match.group() in "[{" else -1
        if depth > limit:
            return True
    return False


def _too_big(data: Any) -> str | None:
    """Why ``data`` is beyond ``MAX_NESTING`` / ``MAX_VALUES`` (aliases counted each time), or None."""
    stack, seen = [(data, 0)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return f"it stands for more than {MAX_VALUES:,} values (YAML aliases?); real files hold a few thousand"
        if depth > MAX_NESTING:
            return f"it nests deeper than {MAX_NESTING} levels; real files nest a few"
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return None


def parse_text(text: str, context: str, *, as_json: bool = False) -> Any:
    """``text`` parsed as YAML (libyaml when present) or JSON; malformed, too deeply nested or
    alias-bombed input is a one-line ``ConfigError`` naming ``context`` (and the line)."""
    if _flow_depth_exceeds(text, MAX_NESTING):
        raise ConfigError(f"{context}: brackets nest deeper than {MAX_NESTING} levels; real files nest a few")
    if as_json:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{context}: line {error.lineno}: malformed JSON ({error.msg})") from None
    else:
        import yaml

        try:
            data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" line {mark.line + 1}:" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError(f"{context}:{where} malformed YAML ({problem})") from None
    why = _too_big(data)
    if why is not None:
        raise ConfigError(f"{context}: {why}")
    return data


__all__ = ["MAX_INPUT_BYTES", "MAX_NESTING", "MAX_VALUES", "parse_text", "read_text_file"]
