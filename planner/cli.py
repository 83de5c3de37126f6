"""``plan``: the command line, a thin layer over ``planner.api``.

Exit codes: 0 success, 1 nothing fits (the estimate says so), 2 bad input. User errors print
one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from hardware.errors import PlannerError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan", description="Plan the fastest training configuration that fits in GPU memory.")
    p.add_argument("--model", required=True, help="preset name, YAML file (model:/training:) or transformers config.json")
    p.add_argument("--hardware", default=None, help="profile name (see `hardware list`) or a profile YAML; default h100-sxm")
    p.add_argument("--hbm", default=None, help="memory cap per GPU: 80GB (10^9), 80GiB (2^30) or bytes; default the device's")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (overrides the training section)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (overrides)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward on one GPU")
    p.add_argument("--precision", default=None, help="fp32, tf32, bf16-mixed, fp16-mixed, bf16-true, fp8-mixed")
    p.add_argument("--checkpoint", default=None, help="blocks to checkpoint: none, all, or indices like 0,2,5-9")
    p.add_argument("--attention", choices=("flash", "eager"), default=None, help="attention implementation")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability")
    p.add_argument("--optimizer", choices=("adamw", "sgd-momentum", "sgd"), default=None)
    p.add_argument("--optimizer-impl", choices=("foreach", "fused"), default=None)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _run(args: argparse.Namespace) -> int:
    from planner import api
    from planner.errors import ConfigError
    from planner.knobs import Knobs

    model, training = api.load_model(
        args.model,
        seq_len=args.seq_len,
        global_batch_size=args.global_batch,
        attention=args.attention,
        dropout=args.dropout,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
    )
    free = [flag for flag, value in (("--micro-batch", args.micro_batch), ("--precision", args.precision),
                                     ("--checkpoint", args.checkpoint)) if value is None]
    if free:
        raise ConfigError(
            f"{', '.join(free)}: not given; the search over free knobs is not available yet, so fix "
            "--micro-batch, --precision and --checkpoint"
        )
    if "," in args.precision:
        raise ConfigError("--precision: give one policy when all knobs are fixed")
    if args.micro_batch <= 0 or training.global_batch_size % args.micro_batch:
        raise ConfigError(
            f"--micro-batch: {args.micro_batch} must be a positive divisor of the global batch {training.global_batch_size}"
        )
    try:
        knobs = Knobs(
            micro_batch_size=args.micro_batch,
            grad_accum_steps=training.global_batch_size // args.micro_batch,
            precision=args.precision,
            checkpoint_blocks=api.parse_checkpoint_spec(args.checkpoint, model.n_layers),
        )
    except ValueError as error:
        first = str(error).splitlines()
        raise ConfigError(f"--precision: {args.precision!r} is not a policy; use fp32, tf32, bf16-mixed, "
                          f"fp16-mixed, bf16-true or fp8-mixed" if "precision" in str(error) else first[0]) from None
    result = api.estimate_plan(model, training, args.hardware, knobs, hbm=args.hbm)
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        from planner.render import print_report

        print_report(result)
    return 0 if result.best.estimate.memory.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except PlannerError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
