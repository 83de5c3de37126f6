"""FSDP2 under a pipeline, as torchtitan runs it: each stage ``fully_shard``-ed (every block, then
the stage root) with ``reshard_after_forward=False`` (torchtitan's default when pipeline
parallelism is on, whatever the ZeRO stage), driven by ``torch.distributed.pipelining``.

The rules are ``docs/pipeline_memory.md`` section 9, measured with the live-storage tracker on
one pipeline rank of a fake ``[pp, dp_shard]`` mesh (``validate.pipeline_fsdp``) against torch
2.13:

- a stage is all-gathered once per step, at its first forward, and stays gathered through every
  micro-batch's forward and backward (``stage.py`` ``backward_maybe_with_nosync`` sets
  ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` before every
  backward); the first forward carries FSDP2's forward transients (a unit's all-gather output
  held until the next unit's copy-out). The runtime schedules (Interleaved1F1B, LoopedBFS) issue
  ``UNSHARD`` for every stage of the rank before the step's first action: each unit's flat
  all-gather output is held from then until its stage's first forward copies it out;
- each unit's post-backward keeps its unsharded gradients (fp32 ``.grad``, added into in place,
  or under the bf16 policy the fp32 copies ``to_accumulated_grad_if_needed`` makes, the bf16
  gradients added in and freed by the later micro-batches);
- after the stage's last backward, ``perform_reduce_grad`` (the schedule's ``REDUCE_GRAD``) runs
  every unit's post-backward with sync on, the root first and then the blocks in forward order:
  reshard, reduce-scatter input, sharded gradient (``planner.parallel.fsdp_engine``'s syncing
  post-backward), and the final callback frees the last reduce-scatter input.

What FSDP2 allocates per unit is ``planner.parallel.fsdp_units``'s; this module says only when a
pipeline makes FSDP2 allocate it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.errors import ConfigError
from planner.memory.engine import Accumulate, EngineHooks, StaticMemory
from planner.memory.prepared import Prepared
from planner.memory.types import CATEGORIES, Category, Live, Phase
from planner.memory.walk import Walk
from planner.parallel.fsdp_engine import FsdpEngine, FsdpHooks
from planner.parallel.fsdp_units import FsdpLayout
from planner.plan.knobs import Knobs
from planner.plan.pipeline_schedules import SINGLE_STAGE, PipelineSchedule
from planner.plan.schedule import Event

_TEMPORARIES = CATEGORIES.index(Category.TEMPORARIES)

# split backward (I then W) under FSDP2 was not measured (docs/pipeline_memory.md 9.4)
MEASURED_SCHEDULES = (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B,
                      PipelineSchedule.LOOPED_BFS)
MAX_ACTIVE_STAGES = 3  # schedules.py _add_unshard_reshard: more stages per rank are evicted and re-gathered


def modelled_pipeline(schedule: PipelineSchedule, virtual: int) -> bool:
    """Whether FSDP2 is modelled under this schedule with ``virtual`` stages per rank (what a search
    may try; ``check_pipelined`` refuses the rest in one line)."""
    return schedule in MEASURED_SCHEDULES and virtual <= MAX_ACTIVE_STAGES


def check_pipelined(knobs: Knobs, stage: int) -> None:
    """Refuse, in one line naming the flag, a pipeline FSDP2 is not modelled under."""
    schedule = knobs.pp_schedule
    if schedule not in MEASURED_SCHEDULES:
        names = ", ".join(s.value for s in MEASURED_SCHEDULES)
        raise ConfigError(f"--pp-schedule {schedule.value}: splits each backward, which was not measured under "
                          f"FSDP2 (ZeRO-{stage}); use --pp-schedule {names}, or --zero-stage 0/1 with {schedule.value}")
    if knobs.pp_virtual > MAX_ACTIVE_STAGES:
        raise ConfigError(f"--pp-virtual {knobs.pp_virtual}: stages per rank under FSDP2 (ZeRO-{stage}) are "
                          f"resharded and gathered again within the step (torch keeps at most {MAX_ACTIVE_STAGES} "
                          f"gathered), which is not modelled; use --pp-virtual {MAX_ACTIVE_STAGES} or fewer")


def gathers_up_front(schedule: PipelineSchedule) -> bool:
    """Whether the schedule unshards every stage of a rank before its first action (the runtime
    schedules' ``UNSHARD``), rather than FSDP2 gathering a stage in its first forward."""
    return schedule not in SINGLE_STAGE


@dataclass(frozen=True)
class PipelinedFsdpEngine(FsdpEngine):
    """FSDP2's memory in the walk of a pipeline rank: each of its stages' units (``layouts``, the
    rank's stages in order), gathered once per step and reduce-scattered once after the stage's
    last backward."""

    layouts: tuple[FsdpLayout, ...] = ()
    up_front: bool = False  # UNSHARD of every stage before the step's first action

    def hooks(self, prep: Prepared, static: StaticMemory, stage: int = 0) -> EngineHooks:
        return PipelinedFsdpHooks(self.layouts[stage], prep, static, self)

    def joined(self, others: Sequence[Accumulate]) -> Accumulate:
        layouts = [*self.layouts]
        for other in others:
            assert isinstance(other, PipelinedFsdpEngine), "every stage of a rank runs one strategy"
            layouts += other.layouts
        return PipelinedFsdpEngine(layout=self.layout, layouts=tuple(layouts), up_front=self.up_front)


class PipelinedFsdpHooks(FsdpHooks):
    """One stage of a pipeline rank under FSDP2, across the step's micro-batches."""

    reshards_after_backward = False  # set_reshard_after_backward(False) before every backward

    def __init__(self, layout: FsdpLayout, prep: Prepared, static: StaticMemory, engine: PipelinedFsdpEngine) -> None:
        super().__init__(layout, prep, static)
        self.engine = engine
        self.stage3 = False  # reshard_after_forward=False under a pipeline
        self.gathered = False  # the stage's units are unsharded (from its first forward to REDUCE_GRAD)

    def start_step(self, live: Live) -> None:
        """The rank's bytes at the step's start; the runtime schedules' ``UNSHARD`` of every stage
        then all-gathers every unit (``unshard(async_op=True)``: outputs held until copied out)."""
        super().start_step(live)
        if self.engine.up_front:
            for layout in self.engine.layouts:
                for unit in layout.units:
                    self._all_gather(live, unit, Phase.FORWARD, self.names[0])

    # --- the step's events ------------------------------------------------------------------------
    def new_walk(self, units: dict[int, int], live: Live, event: Event) -> Walk:
        self.sync = False
        return Walk(self.prep, units, live, grads_exist=False, hooks=self, unit_grads=True,
                    held_grads=self.held_params)

    def before_backward_event(self, walk: Walk, event: Event) -> None:
        """Every post-backward keeps its gradients; a walk begun before an earlier micro-batch's
        backward adds into the gradients that backward left."""
        self.sync = False
        walk.param_grads_seen |= self.held_params

    def after_backward_event(self, walk: Walk, event: Event) -> None:
        """After the stage's last backward (the one its schedule marks as syncing), ``REDUCE_GRAD``."""
        if not event.sync:
            return
        self.sync = True
        for unit in self.layout.units:  # the root first, then the blocks in forward order (all_states)
            self._post_backward(walk, unit, self.names[0])
        walk.live.add(_TEMPORARIES, -self.held_reduce)  # the final callback drops the last input
        self.held_reduce = 0
        self.sync, self.gathered = False, False

    # --- forward: the first one gathers -----------------------------------------------------------
    def forward_start(self, walk: Walk) -> None:
        if self.gathered:
            return
        self.held_gather = 0
        if not self.engine.up_front:
            self._unshard(walk.live, self.layout.root, Phase.FORWARD, self.names[0])
            return
        live = walk.live  # _assert_unsharded: every unit's prefetched gather copied out, then freed
        for unit in self.layout.units:
            self._copy_out(live, unit, Phase.FORWARD, self.names[0])
            live.add(_TEMPORARIES, -unit.gather_output_bytes)

    def before_forward(self, walk: Walk, op: int) -> None:
        if not self.gathered and not self.engine.up_front:
            super().before_forward(walk, op)

    def forward_end(self, walk: Walk) -> None:
        if not self.gathered:
            super().forward_end(walk)
            self.gathered = True
