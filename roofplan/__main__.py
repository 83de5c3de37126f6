"""``python -m roofplan COMMAND ...``: the console scripts as one module (torchrun needs a module:
``torchrun --nproc-per-node 8 -m roofplan validate plan.json``).

    python -m roofplan plan --model llama3-8b
    python -m roofplan validate plan.json --mode simulate
    python -m roofplan hardware list
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _command(name: str) -> Callable[[Sequence[str] | None], int] | None:
    if name == "plan":
        from roofplan.cli import main
    elif name == "validate":
        from roofplan.validate_cli import main
    elif name == "hardware":
        from roofplan.hardware_cli import main
    else:
        return None
    return main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        command = _command(args[0]) if args else None
    except KeyboardInterrupt:  # Ctrl-C while the command's modules load; the command handles its own
        print("roofplan: interrupted", file=sys.stderr)
        return 130
    if command is None:
        given = f"{args[0]!r} is not a command; " if args else ""
        print(f"roofplan: error: {given}use python -m roofplan plan|validate|hardware ...", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
