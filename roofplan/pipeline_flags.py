"""``--pp``, ``--pp-schedule`` and ``--pp-layers`` checked into the knobs a pipeline plan fixes.

Pipeline plans are priced, not searched, for now: with ``--pp`` every other knob is fixed (the
micro-batch, the precision, checkpointing; the layout's other degrees default to 1 and ZeRO-0),
and the schedule is 1F1B unless ``--pp-schedule`` names another that is modelled
(``planner.plan.pipeline_plan``), ``--pp-virtual`` stages per rank for the looped and V ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import ConfigError
from planner.plan.pipeline_schedules import PipelineSchedule

PIPELINE_NEEDS_FIXED = ("--pp: a pipeline-parallel plan is priced with every other knob given (the search over "
                        "pipeline plans is not modelled yet); add --micro-batch, one --precision and --checkpoint")


def pipeline_schedule(value: str | PipelineSchedule | None) -> PipelineSchedule:
    """``--pp-schedule`` (default 1f1b), refused in one line when unknown."""
    if value is None:
        return PipelineSchedule.ONE_F_ONE_B
    try:
        return PipelineSchedule(value)
    except ValueError:
        names = ", ".join(s.value for s in PipelineSchedule)
        raise ConfigError(f"--pp-schedule: {value!r} is not a schedule; use one of {names}") from None


def pipeline_layers(value: str | Sequence[int] | None, pp: int, virtual: int = 1) -> tuple[int, ...]:
    """``--pp-layers 15,16,16,...``: blocks per stage, first stage first (``()``: an even split);
    ``pp x virtual`` stages."""
    if value is None or value == "":
        return ()
    if pp == 1:
        raise ConfigError("--pp-layers: splits the blocks over pipeline stages; give --pp N too, or leave it out")
    try:
        layers = tuple(int(x) for x in value.split(",")) if isinstance(value, str) else tuple(int(x) for x in value)
    except ValueError:
        raise ConfigError(f"--pp-layers: {value!r} must be block counts separated by commas, one per stage "
                          "(for example 15,16,16,17)") from None
    if len(layers) != pp * virtual or min(layers) < 1:
        raise ConfigError(f"--pp-layers: {value!r} must give {pp * virtual} block counts (one per stage: --pp x "
                          "--pp-virtual), each at least 1")
    return layers
