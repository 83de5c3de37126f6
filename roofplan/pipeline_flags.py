"""``--pp``, ``--pp-schedule``, ``--pp-virtual`` and ``--pp-layers`` checked into what a plan
fixes of its pipeline.

Each flag left out is searched: ``--pp`` over the degrees dividing the GPUs (1 included), the
schedule over ``search.space.SEARCHED_SCHEDULES``, the stages per rank at each schedule's default
(``planner.plan.pipeline_schedules.default_virtual``). With every other knob fixed, a plan
without ``--pp-schedule`` runs 1F1B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.errors import ConfigError
from planner.plan.pipeline_schedules import PipelineSchedule, default_virtual


@dataclass(frozen=True)
class PipelineRequest:
    """The pipeline flags a request gives (None: left to the search or the default)."""

    schedule: PipelineSchedule | None
    layers: tuple[int, ...]  # blocks per stage, first stage first (empty: an even split)
    virtual: int | None  # stages per rank

    @property
    def schedule_or_default(self) -> PipelineSchedule:
        return self.schedule or PipelineSchedule.ONE_F_ONE_B

    @property
    def virtual_or_default(self) -> int:
        return self.virtual if self.virtual is not None else default_virtual(self.schedule_or_default)


def pipeline_schedule(value: str | PipelineSchedule | None) -> PipelineSchedule | None:
    """``--pp-schedule`` (None: searched, or 1F1B with everything fixed), refused in one line when
    unknown."""
    if value is None:
        return None
    try:
        return PipelineSchedule(value)
    except ValueError:
        names = ", ".join(s.value for s in PipelineSchedule)
        raise ConfigError(f"--pp-schedule: {value!r} is not a schedule; use one of {names}") from None


def pipeline_layers(value: str | Sequence[int] | None, pp: int | None, virtual: int = 1) -> tuple[int, ...]:
    """``--pp-layers 15,16,16,...``: blocks per stage, first stage first (``()``: an even split);
    ``pp x virtual`` stages."""
    if value is None or value == "":
        return ()
    if pp is None or pp == 1:
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


def pipeline_request(schedule: str | PipelineSchedule | None, layers: str | Sequence[int] | None, pp: int | None,
                     virtual: int | None) -> PipelineRequest:
    """The pipeline flags, each checked on its own (their combination is the schedule's to refuse,
    ``planner.plan.pipeline_plan.check_modelled``)."""
    if pp is not None and pp < 1:
        raise ConfigError(f"--pp: {pp} pipeline ranks; use 1 or more, or leave it out to search it")
    if virtual is not None and virtual < 1:
        raise ConfigError(f"--pp-virtual: {virtual} stages per rank; use 1 or more")
    chosen = pipeline_schedule(schedule)
    if layers not in (None, "") and virtual is None and chosen is None:
        virtual = 1  # an uneven split of --pp stages fixes one stage per rank: 1F1B
    request = PipelineRequest(schedule=chosen, layers=(), virtual=virtual)
    return PipelineRequest(schedule=chosen, layers=pipeline_layers(layers, pp, request.virtual_or_default),
                           virtual=virtual)
