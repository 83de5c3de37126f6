"""What the search may choose: a dictionary of named dimensions, as optuna's distributions are.

Each dimension is a name and its choices (plain ints, strings, booleans: what optuna's
``CategoricalDistribution`` stores); a point is one choice per dimension. Not every combination
is a plan (FSDP2 runs fewer precision policies; a micro-batch must divide the sequences each
data-parallel rank gets): ``SearchSpace.allows`` says which are. Checkpoint placement is not a
dimension: it is solved exactly per point (``search.candidates``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from hardware.profile import HardwareProfile
from planner.errors import ConfigError, UnsupportedPrecisionError
from planner.model.config import AttentionImpl, ModelConfig, TrainConfig
from planner.parallel.fsdp_pipeline import modelled_pipeline
from planner.parallel.strategies import strategy_for
from planner.plan.checkpointing import CONTEXT_PARALLEL_REFUSAL, TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.plan.knobs import GradSync, Knobs
from planner.plan.layouts import (
    MIN_CONTEXT_SHARD_TOKENS,
    MODELLED_STAGES,
    SEARCHED,
    LayoutRequest,
    context_degrees,
    divisors,
    layout_at,
    layout_choices,
    layout_degrees,
    layout_refusal,
    no_layout_refusal,
)
from planner.plan.parallel_dims import ParallelDims
from planner.plan.pipeline_plan import check_modelled
from planner.plan.pipeline_schedules import PipelineSchedule, default_virtual
from planner.precision import PrecisionPolicy, precision_spec
from search.pipeline_space import SEARCHED_SCHEDULES, check_fixed_pipeline, searched_schedules

# The default policy (README "Search"): by default only a policy that trains like the fp32
# baseline (fp32 master weights and optimizer state, low-precision matmuls under autocast), so
# the fastest plan never silently changes training numerics. bf16-mixed where the device runs
# bf16, else fp16-mixed (loss scaling), else fp32. bf16-true and fp8-mixed trade numerics for
# memory or speed (PrecisionSpec.trades) and are searched only when --precision names them.
DEFAULT_PRECISIONS = (PrecisionPolicy.BF16_MIXED,)
FALLBACK_PRECISIONS = (PrecisionPolicy.FP16_MIXED, PrecisionPolicy.FP32)

MICRO_BATCH = "micro_batch_size"
PRECISION = "precision"
PP_SCHEDULE = "pp_schedule"
ZERO_STAGE, TP, CP, EP, PP, DP_REPLICATE = SEARCHED  # the layout's dimensions: planner.plan.layouts' names
Choice = int | str | bool
Point = dict[str, Choice]


class SearchSpace(BaseModel):
    """The discrete knobs the sampler picks, by name; checkpoint placement is solved per point."""

    model_config = ConfigDict(frozen=True)
    dimensions: dict[str, tuple[Choice, ...]]  # name -> choices, in the order neighbours are taken
    fsdp_grad_sync: GradSync = GradSync.EVERY  # fixed: how ZeRO-2/3 points accumulate gradients
    sequence_parallel: bool = True  # fixed: tensor-parallel points run with sequence parallelism
    world_size: int = 1
    global_batch_size: int = 1  # sequences per step: a micro-batch must divide each data-parallel rank's share
    gpus_per_node: int = 8
    fixed_checkpoint: tuple[int, ...] | None = None
    allow_segments: bool = True
    # checkpoint policies tried at every point (solved, not sampled: planner.plan.checkpointing), the
    # per-op policy keeping ``save_list``
    checkpoint_policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,)
    save_list: SaveList = TORCHTITAN_SAVE_LIST
    # the (tp, cp) pairs PyTorch runs here and that leave whole sequences to every data-parallel
    # rank (``planner.plan.layouts.layout_degrees``): the tp and cp dimensions' choices combine only as these
    layouts: tuple[tuple[int, int], ...] = ((1, 1),)
    n_layers: int = 1  # the model's blocks: what pipeline stages split
    pp_virtual: int | None = None  # fixed stages per pipeline rank (None: each schedule's default)
    pp_layers: tuple[int, ...] = ()  # fixed blocks per stage (empty: an even split)

    # --- the dimensions -------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.dimensions)

    @property
    def size(self) -> int:
        """Combinations of the choices (``allows`` rules some out)."""
        return math.prod(len(c) for c in self.dimensions.values())

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.dimensions[MICRO_BATCH])

    @property
    def precisions(self) -> tuple[PrecisionPolicy, ...]:
        return tuple(PrecisionPolicy(str(c)) for c in self.dimensions[PRECISION])

    @property
    def zero_stages(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.dimensions[ZERO_STAGE])

    @property
    def tensor_parallel(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.dimensions.get(TP, (1,)))

    @property
    def context_parallel(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.dimensions.get(CP, (1,)))

    @property
    def expert_parallel(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.dimensions.get(EP, (1,)))

    @property
    def pipeline_parallel(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.dimensions.get(PP, (1,)))

    def pipeline(self, point: Mapping[str, Any]) -> tuple[PipelineSchedule, int]:
        """A point's pipeline schedule and stages per rank (``pp_virtual`` if fixed, else the
        schedule's default: 2 for the looped and V ones, 1 for GPipe and 1F1B)."""
        schedule = PipelineSchedule(str(point.get(PP_SCHEDULE, self.dimensions.get(PP_SCHEDULE, ("1f1b",))[0])))
        return schedule, default_virtual(schedule) if self.pp_virtual is None else self.pp_virtual

    def key(self, point: Mapping[str, Any]) -> tuple[Choice, ...]:
        """A point as a hashable tuple, in dimension order."""
        return tuple(point[name] for name in self.names)

    def point(self, **choices: Any) -> Point:
        """A point from keyword choices (enums become their values)."""
        return {name: _plain(choices[name]) for name in self.names}

    # --- which points are plans -----------------------------------------------------------
    def degrees(self, point: Mapping[str, Any]) -> dict[str, int]:
        """A point's layout degrees by ``planner.plan.layouts.SEARCHED``'s names (the ZeRO stage is
        always a dimension; a degree that is not is 1)."""
        return {name: int(point[name] if name == ZERO_STAGE else point.get(name, 1)) for name in SEARCHED}

    def layout(self, point: Mapping[str, Any]) -> ParallelDims:
        """The parallel layout of a point (groups of tp ranks, cp groups to a context-parallel
        group, data parallel over those, ep of the FSDP2 ranks to an expert-parallel group)."""
        degrees = self.degrees(point)
        return ParallelDims.data_parallel_of(self.world_size, sp=self.sequence_parallel and degrees[TP] > 1, **degrees)

    def allows(self, point: Mapping[str, Any]) -> bool:
        """Whether a point is a plan: its (tp, cp) pair is one of ``layouts``, its layout exists
        (``planner.plan.layouts.layout_at``), its precision runs under its strategy, its micro-batch
        divides each data-parallel rank's sequences, and a pipeline's schedule runs that many
        micro-batches over its stages (``check_modelled``; without a pipeline, only the first
        schedule stands for the point)."""
        degrees = self.degrees(point)
        if (degrees[TP], degrees[CP]) not in self.layouts:
            return False
        if degrees[PP] == 1 and PP_SCHEDULE in self.dimensions and point[PP_SCHEDULE] != self.dimensions[PP_SCHEDULE][0]:
            return False
        layout = layout_at(self.world_size, self.sequence_parallel, **degrees)
        if layout is None or not strategy_for(layout).runs(PrecisionPolicy(point[PRECISION])):
            return False
        if self.global_batch_size % layout.data_parallel:
            return False
        share = self.global_batch_size // layout.data_parallel
        if share % int(point[MICRO_BATCH]):
            return False
        if layout.pp == 1:
            return True
        schedule, virtual = self.pipeline(point)
        if layout.shards_parameters and not modelled_pipeline(schedule, virtual):
            return False
        if degrees[ZERO_STAGE] == 2 and 3 in self.zero_stages:  # under a pipeline ZeRO-2 is ZeRO-3's twin
            return False  # (planner.parallel.fsdp_pipeline: reshard_after_forward=False for both)
        try:
            check_modelled(schedule, layout.pp, share // int(point[MICRO_BATCH]), self.n_layers, self.pp_layers, virtual)
        except ConfigError:
            return False
        return True

    def points(self) -> Iterator[Point]:
        """Every allowed point, in dimension order."""
        for combo in itertools.product(*self.dimensions.values()):
            point = dict(zip(self.names, combo, strict=True))
            if self.allows(point):
                yield point

    def knobs_at(self, training: TrainConfig, point: Mapping[str, Any]) -> Knobs:
        """The knobs of one point, checkpointing nothing; accumulation fills each rank's share."""
        layout = self.layout(point)
        mb = int(point[MICRO_BATCH])
        schedule, virtual = self.pipeline(point)
        pipelined = layout.pp > 1
        return Knobs(
            micro_batch_size=mb,
            grad_accum_steps=training.global_batch_size // (mb * layout.data_parallel),
            precision=PrecisionPolicy(point[PRECISION]),
            parallel=layout,
            fsdp_grad_sync=self.fsdp_grad_sync if layout.shards_parameters else GradSync.EVERY,
            save_list=self.save_list,
            pp_schedule=schedule if pipelined else PipelineSchedule.ONE_F_ONE_B,
            pp_virtual=virtual if pipelined else 1,
            pp_layers=self.pp_layers if pipelined else (),
        )

    # --- where the search starts and how it polishes ---------------------------------------
    def known_good(self) -> list[Point]:
        """Priced first: the smallest micro-batch in every precision, with the most sharding that
        precision allows (the likeliest to fit)."""
        out = []
        for precision in self.dimensions[PRECISION]:
            options = [p for p in self.points() if p[PRECISION] == precision]
            if options:
                out.append(min(options, key=lambda p: (int(p[MICRO_BATCH]), *(-d for d in self.degrees(p).values()))))
        return out

    def neighbours(self, point: Mapping[str, Any]) -> list[Point]:
        """Adjacent micro-batches, then for each other choice of every other dimension the plans
        nearest the point with that choice (fewest other dimensions changed, then the nearest
        micro-batch), each also at the next smaller micro-batch: a layout's choices are coupled
        (tensor parallelism needs FSDP2 beside it, a micro-batch must divide the rank's share, a
        layout with less sharding needs a smaller micro-batch to fit), so the same point with one
        choice changed is often no plan, or too big, while its nearest repair is not."""
        sizes = self.dimensions[MICRO_BATCH]
        i = sizes.index(point[MICRO_BATCH])
        out: list[Point] = [{**point, MICRO_BATCH: sizes[j]} for j in (i - 1, i + 1) if 0 <= j < len(sizes)]
        out = [p for p in out if self.allows(p)]
        plans = list(self.points())
        for name, choices in self.dimensions.items():
            if name == MICRO_BATCH:
                continue
            others = [n for n in self.names if n not in (name, MICRO_BATCH)]

            def distance(p: Point, others: list[str] = others) -> tuple[int, int]:
                return sum(p[n] != point[n] for n in others), abs(sizes.index(p[MICRO_BATCH]) - i)

            for choice in choices:
                if choice == point[name]:
                    continue
                candidates = [p for p in plans if p[name] == choice]
                if candidates:
                    nearest = min(distance(p) for p in candidates)
                    found = [p for p in candidates if distance(p) == nearest]
                    # and each at the next smaller micro-batch: another layout that does not fit at the
                    # point's micro-batch often fits at a smaller one
                    smaller = [{**p, MICRO_BATCH: sizes[sizes.index(p[MICRO_BATCH]) - 1]} for p in found
                               if sizes.index(p[MICRO_BATCH]) > 0]
                    out += found + [p for p in smaller if self.allows(p)]
        unique: dict[tuple[Choice, ...], Point] = {}
        for p in out:
            unique.setdefault(self.key(p), p)
        return list(unique.values())


def left_out_note(space: SearchSpace) -> str | None:
    """One line naming the precisions of ``space`` that some of its layouts do not run, and why
    (FSDP2 is not modelled with fp16-mixed or fp8-mixed), or None when every layout runs every
    precision. A precision no layout runs is left out of the search altogether."""
    layouts: dict[tuple[int, ...], set[str]] = {}
    for point in space.points():
        layouts.setdefault(tuple(space.degrees(point).values()), set()).add(str(point[PRECISION]))
    parts = []
    for precision in space.dimensions[PRECISION]:
        missing = [key for key, runs in layouts.items() if precision not in runs]
        if not missing:
            continue
        kept = len(layouts) - len(missing)
        where = (f"left out of {len(missing)} of the {len(layouts)} layouts (those sharded by FSDP2, ZeRO-2/3)"
                 if kept else "left out of the search (every layout here is sharded by FSDP2, ZeRO-2/3)")
        parts.append(f"{precision} {where}")
    if not parts:
        return None
    return (f"--precision: {'; '.join(parts)}: FSDP2 is not modelled with it (it needs a sharded grad scaler for "
            "fp16 and Float8 training for fp8)")


def _plain(value: Any) -> Choice:
    if isinstance(value, bool | int):
        return value
    return str(value.value if hasattr(value, "value") else value)


def default_checkpoint_policies(model: ModelConfig) -> tuple[CheckpointPolicy, ...]:
    """Whole blocks, and torchtitan's per-op policy; the attention core alone (Korthikanti's
    selective recompute) only where it keeps something worth recomputing: eager attention's
    T x T scores (flash attention saves a log-sum-exp, and rerunning it costs a whole kernel)."""
    policies = (CheckpointPolicy.FULL, CheckpointPolicy.OPS)
    return policies + ((CheckpointPolicy.ATTENTION,) if model.attention is AttentionImpl.EAGER else ())


def build_space(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    precisions: tuple[PrecisionPolicy, ...] | None = None,
    micro_batch_size: int | None = None,
    checkpoint_blocks: tuple[int, ...] | None = None,
    allow_segments: bool = True,
    gpus: int = 1,
    zero_stage: int | None = None,
    fsdp_grad_sync: GradSync = GradSync.EVERY,
    tensor_parallel: int | None = 1,
    sequence_parallel: bool = True,
    context_parallel: int | None = 1,
    checkpoint_policy: CheckpointPolicy | None = None,
    save_list: SaveList = TORCHTITAN_SAVE_LIST,
    expert_parallel: int | None = 1,
    on_left_out: Callable[[str], None] | None = None,
    pipeline_parallel: int | None = 1,
    pp_schedule: PipelineSchedule | None = None,
    pp_virtual: int | None = None,
    pp_layers: tuple[int, ...] = (),
    dp_replicate: int | None = 1,
) -> SearchSpace:
    """The space: the layout (ZeRO stage, tensor-, context- and expert-parallel degrees on several GPUs),
    micro-batches that divide each data-parallel rank's share of the global batch (accumulation
    derived), the precisions the device runs; a knob given is fixed (``tensor_parallel``,
    ``context_parallel`` or ``expert_parallel`` None: searched; expert parallelism only on a model
    with MoE blocks, over degrees that divide its experts; ``pipeline_parallel`` None: searched over
    the degrees that divide the GPUs, each with ``pp_schedule`` or the ``SEARCHED_SCHEDULES``).
    ``on_left_out(line)`` is told which precisions the space leaves out of some or all of its
    layouts, and why (``left_out_note``)."""
    if checkpoint_policy is CheckpointPolicy.OPS and context_parallel != 1:
        if context_parallel is not None:
            raise ConfigError(CONTEXT_PARALLEL_REFUSAL)
        context_parallel = 1  # the only degree the fixed policy runs with
    request = LayoutRequest(gpus=gpus, zero_stage=zero_stage, tp=tensor_parallel, cp=context_parallel,
                            ep=expert_parallel, sp=sequence_parallel, pp=pipeline_parallel, dp_replicate=dp_replicate)
    choices = layout_choices(model, training, request, hw.gpus_per_node)
    rebuilt = (checkpoint_policy,) if checkpoint_policy is not None else default_checkpoint_policies(model)
    layouts = choices.tp_cp
    shares = {training.global_batch_size * tp * cp * pp // gpus for tp, cp in layouts for pp in choices.pp
              if not gpus % (tp * cp * pp) and not training.global_batch_size % (gpus // (tp * cp * pp))}
    # sequences per data-parallel rank
    schedules = searched_schedules(choices.pp, pp_schedule, pp_virtual)
    if micro_batch_size is not None:
        if micro_batch_size <= 0 or not any(share % micro_batch_size == 0 for share in shares):
            per = " or ".join(str(share) for share in sorted(shares))
            raise ConfigError(f"--micro-batch: {micro_batch_size} must be a positive divisor of the {per} "
                              f"sequences each data-parallel rank gets per step")
        sizes: tuple[int, ...] = (micro_batch_size,)
    else:
        sizes = tuple(sorted({d for share in shares for d in divisors(share)}))
    if precisions is None:
        chosen = tuple(p for p in DEFAULT_PRECISIONS if hw.supports(precision_spec(p).matmul_precision))
        if not chosen:
            chosen = tuple(p for p in FALLBACK_PRECISIONS if hw.supports(precision_spec(p).matmul_precision))[:1]
    else:
        for p in precisions:
            spec = precision_spec(p)
            if not hw.supports(spec.matmul_precision):
                runs = ", ".join(x.value for x in hw.precisions)
                raise UnsupportedPrecisionError(
                    f"--precision: {p.value} needs {spec.matmul_precision.value} matmuls, which {hw.name} does not run "
                    f"(it runs {runs})"
                )
        chosen = tuple(dict.fromkeys(precisions))

    def space_of(policies: tuple[PrecisionPolicy, ...]) -> SearchSpace:
        dimensions: dict[str, tuple[Choice, ...]] = {MICRO_BATCH: sizes, PRECISION: tuple(p.value for p in policies),
                                                     **choices.dimensions()}
        if schedules:
            dimensions[PP] = choices.pp  # also when fixed: the schedule's dimension goes with it
            dimensions[PP_SCHEDULE] = tuple(s.value for s in schedules)
        return SearchSpace(dimensions=dimensions, world_size=gpus, global_batch_size=training.global_batch_size,
                           gpus_per_node=hw.gpus_per_node, fixed_checkpoint=checkpoint_blocks,
                           allow_segments=allow_segments, fsdp_grad_sync=fsdp_grad_sync,
                           sequence_parallel=sequence_parallel, checkpoint_policies=rebuilt, save_list=save_list,
                           layouts=layouts, n_layers=model.n_layers, pp_virtual=pp_virtual, pp_layers=pp_layers)

    space = space_of(chosen)
    fixed_pp = [pp for pp in space.pipeline_parallel if pp > 1]
    if len(fixed_pp) == 1 and schedules and shares:  # what no point of a fixed --pp could run: refused
        check_fixed_pipeline(model.n_layers, fixed_pp[0], space.pp_layers,
                             tuple((s, space.pipeline({PP_SCHEDULE: s.value})[1]) for s in schedules),
                             max(share // min(sizes) for share in shares), bool(checkpoint_blocks))
    runnable = tuple(p for p in chosen if any(point[PRECISION] == p.value for point in space.points()))
    note = left_out_note(space) if on_left_out is not None and runnable else None
    if note is not None and on_left_out is not None:
        on_left_out(note)
    if not runnable:
        if not any(True for _ in space_of(tuple(PrecisionPolicy)).points()):
            raise ConfigError(no_layout_refusal(request))
        allowed = ", ".join(p.value for p in PrecisionPolicy if any(
            point[PRECISION] == p.value for point in space_of(tuple(PrecisionPolicy)).points()))
        raise ConfigError(f"--precision: {', '.join(p.value for p in chosen)} cannot run under --zero-stage "
                          f"{choices.zero_stages[0]} (FSDP2) as modelled; use {allowed}, or --zero-stage 0/1")
    return space_of(runnable)


__all__ = ["CP", "EP", "MICRO_BATCH", "MIN_CONTEXT_SHARD_TOKENS", "MODELLED_STAGES", "PP", "PP_SCHEDULE", "PRECISION",
           "SEARCHED_SCHEDULES", "TP", "ZERO_STAGE",
           "Point", "SearchSpace", "build_space", "context_degrees", "divisors", "layout_degrees", "layout_refusal"]
