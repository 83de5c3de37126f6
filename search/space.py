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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from hardware.profile import HardwareProfile
from planner.checkpointing import CONTEXT_PARALLEL_REFUSAL, TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.config import AttentionImpl, ModelConfig, TrainConfig
from planner.errors import ConfigError, UnsupportedPrecisionError
from planner.knobs import GradSync, Knobs
from planner.parallel import MODELLED_STAGES, zero_stages
from planner.parallel_dims import ParallelDims, Sharding
from planner.precision import PrecisionPolicy, precision_spec
from planner.strategies import strategy_for
from planner.strategies.context import MIN_CONTEXT_SHARD_TOKENS, check_context_parallel
from planner.strategies.expert import expert_degrees
from planner.strategies.tensor import check_tensor_parallel

# The default policy (README "Search"): by default only a policy that trains like the fp32
# baseline (fp32 master weights and optimizer state, low-precision matmuls under autocast), so
# the fastest plan never silently changes training numerics. bf16-mixed where the device runs
# bf16, else fp16-mixed (loss scaling), else fp32. bf16-true and fp8-mixed trade numerics for
# memory or speed (PrecisionSpec.trades) and are searched only when --precision names them.
DEFAULT_PRECISIONS = (PrecisionPolicy.BF16_MIXED,)
FALLBACK_PRECISIONS = (PrecisionPolicy.FP16_MIXED, PrecisionPolicy.FP32)

MICRO_BATCH = "micro_batch_size"
PRECISION = "precision"
ZERO_STAGE = "zero_stage"
TP = "tp"
CP = "cp"
EP = "ep"
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
    # checkpoint policies tried at every point (solved, not sampled: planner.checkpointing), the
    # per-op policy keeping ``save_list``
    checkpoint_policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,)
    save_list: SaveList = TORCHTITAN_SAVE_LIST
    # the (tp, cp) pairs PyTorch runs here and that leave whole sequences to every data-parallel
    # rank (``layout_degrees``): the tp and cp dimensions' choices combine only as these
    layouts: tuple[tuple[int, int], ...] = ((1, 1),)

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

    def key(self, point: Mapping[str, Any]) -> tuple[Choice, ...]:
        """A point as a hashable tuple, in dimension order."""
        return tuple(point[name] for name in self.names)

    def point(self, **choices: Any) -> Point:
        """A point from keyword choices (enums become their values)."""
        return {name: _plain(choices[name]) for name in self.names}

    # --- which points are plans -----------------------------------------------------------
    def layout(self, point: Mapping[str, Any]) -> ParallelDims:
        """The parallel layout of a point (groups of tp ranks, cp groups to a context-parallel
        group, data parallel over those, ep of the FSDP2 ranks to an expert-parallel group)."""
        tp, cp = int(point.get(TP, 1)), int(point.get(CP, 1))
        return ParallelDims.data_parallel_of(self.world_size, int(point[ZERO_STAGE]), tp=tp,
                                             sp=self.sequence_parallel and tp > 1, cp=cp, ep=int(point.get(EP, 1)))

    def allows(self, point: Mapping[str, Any]) -> bool:
        """Whether a point is a plan: its layout exists (a ZeRO stage needs several ranks to shard
        over; tensor parallelism shares the data-parallel ranks through FSDP2, context parallelism
        always runs under FSDP2, expert parallelism splits FSDP2's data-parallel ranks without
        context parallelism), its precision runs under its strategy and its micro-batch divides
        each data-parallel rank's sequences."""
        tp, cp, stage = int(point.get(TP, 1)), int(point.get(CP, 1)), int(point[ZERO_STAGE])
        if (tp, cp) not in self.layouts:
            return False
        data, ep = self.world_size // (tp * cp), int(point.get(EP, 1))
        if (data * cp == 1 and stage) or (tp > 1 and data > 1 and stage < 2) or (cp > 1 and stage < 2):
            return False
        if ep > 1 and (stage < 2 or cp > 1 or data % ep):
            return False
        layout = self.layout(point)
        if not strategy_for(layout).runs(PrecisionPolicy(point[PRECISION])):
            return False
        return (self.global_batch_size // layout.data_parallel) % int(point[MICRO_BATCH]) == 0

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
        return Knobs(
            micro_batch_size=mb,
            grad_accum_steps=training.global_batch_size // (mb * layout.data_parallel),
            precision=PrecisionPolicy(point[PRECISION]),
            parallel=layout,
            fsdp_grad_sync=self.fsdp_grad_sync if layout.shards_parameters else GradSync.EVERY,
            save_list=self.save_list,
        )

    # --- where the search starts and how it polishes ---------------------------------------
    def known_good(self) -> list[Point]:
        """Priced first: the smallest micro-batch in every precision, with the most sharding that
        precision allows (the likeliest to fit)."""
        out = []
        for precision in self.dimensions[PRECISION]:
            options = [p for p in self.points() if p[PRECISION] == precision]
            if options:
                out.append(min(options, key=lambda p: (int(p[MICRO_BATCH]), -int(p[ZERO_STAGE]), -int(p.get(TP, 1)),
                                                       -int(p.get(CP, 1)), -int(p.get(EP, 1)))))
        return out

    def neighbours(self, point: Mapping[str, Any]) -> list[Point]:
        """Adjacent micro-batches, then for each other choice of every other dimension the plans
        nearest the point with that choice (fewest other dimensions changed, then the nearest
        micro-batch): a layout's choices are coupled (tensor parallelism needs FSDP2 beside it,
        a micro-batch must divide the rank's share), so the same point with one choice changed
        is often no plan while its nearest repair is."""
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
                    out += [p for p in candidates if distance(p) == nearest]
        unique: dict[tuple[Choice, ...], Point] = {}
        for p in out:
            unique.setdefault(self.key(p), p)
        return list(unique.values())


def _plain(value: Any) -> Choice:
    if isinstance(value, bool | int):
        return value
    return str(value.value if hasattr(value, "value") else value)


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def default_checkpoint_policies(model: ModelConfig) -> tuple[CheckpointPolicy, ...]:
    """Whole blocks, and torchtitan's per-op policy; the attention core alone (Korthikanti's
    selective recompute) only where it keeps something worth recomputing: eager attention's
    T x T scores (flash attention saves a log-sum-exp, and rerunning it costs a whole kernel)."""
    policies = (CheckpointPolicy.FULL, CheckpointPolicy.OPS)
    return policies + ((CheckpointPolicy.ATTENTION,) if model.attention is AttentionImpl.EAGER else ())


def layout_refusal(model: ModelConfig, seq_len: int, tp: int, cp: int, sequence_parallel: bool = True) -> str | None:
    """Why PyTorch cannot run this model at these tensor- (with SP) and context-parallel degrees,
    as ``planner.strategies`` words it (``parallel.tp: ...``), or None."""
    dims = ParallelDims(tp=tp, sp=sequence_parallel and tp > 1, cp=cp, sharding=Sharding.FULL if cp > 1 else None)
    try:
        check_tensor_parallel(model, seq_len // cp, dims)
        check_context_parallel(model, seq_len, dims)
    except ConfigError as error:
        return str(error)
    return None


def context_degrees(seq_len: int, candidates: Iterable[int]) -> tuple[int, ...]:
    """The context-parallel degrees the search tries: those leaving each rank at least
    ``MIN_CONTEXT_SHARD_TOKENS`` of a sequence (1 always)."""
    return tuple(cp for cp in candidates if cp == 1 or seq_len // cp >= MIN_CONTEXT_SHARD_TOKENS)


def _as_flag(refusal: str) -> str:
    """``parallel.cp: ...`` -> ``--cp: ...`` (the flag a user sets for that field)."""
    field, _, rest = refusal.partition(": ")
    flag = {"parallel.tp": "--tp", "parallel.sp": "--no-sequence-parallel", "parallel.cp": "--cp"}.get(field)
    return f"{flag}: {rest}" if flag else refusal


def layout_degrees(model: ModelConfig, training: TrainConfig, gpus: int, gpus_per_node: int, fixed_tp: int | None,
                   fixed_cp: int | None, sequence_parallel: bool) -> tuple[tuple[int, int], ...]:
    """The (tensor-, context-parallel) degree pairs a request allows: ``--tp`` / ``--cp`` if given
    (checked, the error naming the flag), else every degree that divides the GPUs and that
    PyTorch can run on this model (``layout_refusal``): tensor parallelism inside a node (its
    collectives are on the critical path: NVLink), context parallelism leaving each rank at least
    ``MIN_CONTEXT_SHARD_TOKENS`` of a sequence. Together they must leave data-parallel ranks that
    divide the global batch (every rank gets whole sequences)."""
    seq, batch = training.seq_len, training.global_batch_size
    for flag, fixed in (("--tp", fixed_tp), ("--cp", fixed_cp)):
        if fixed is not None and (fixed <= 0 or gpus % fixed):
            raise ConfigError(f"{flag}: {fixed} must be a positive divisor of the {gpus} GPUs (--gpus)")
    tps = (fixed_tp,) if fixed_tp is not None else tuple(tp for tp in divisors(gpus) if tp <= gpus_per_node)
    cps = (fixed_cp,) if fixed_cp is not None else context_degrees(seq, divisors(gpus))
    if fixed_tp is not None or fixed_cp is not None:
        refusal = layout_refusal(model, seq, fixed_tp or 1, fixed_cp or 1, sequence_parallel)
        if refusal is not None:
            raise ConfigError(_as_flag(refusal))
    pairs = [(tp, cp) for tp in tps for cp in cps if not gpus % (tp * cp)
             and layout_refusal(model, seq, tp, cp, sequence_parallel) is None]
    whole = tuple((tp, cp) for tp, cp in pairs if not batch % (gpus // (tp * cp)))
    if not whole:
        if fixed_tp is not None or fixed_cp is not None:
            tp, cp = fixed_tp or 1, fixed_cp or 1
            raise ConfigError(f"--gpus: {gpus} GPUs in groups of --tp {tp} x --cp {cp} are {gpus // (tp * cp)} "
                              f"data-parallel ranks, which must divide the global batch {batch} so every rank gets "
                              "whole sequences")
        raise ConfigError(f"--gpus: {gpus} must be a positive divisor of the global batch {batch} (so every GPU gets "
                          "whole sequences), or a multiple of one by tensor- and context-parallel degrees the model "
                          "allows (--tp, --cp)")
    return whole


def build_space(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    precisions: tuple[PrecisionPolicy, ...] | None = None,
    micro_batch_size: int | None = None,
    checkpoint_blocks: tuple[int, ...] | None = None,
    allow_segments: bool = True,
    gpus: int = 1,
    gpus_per_node: int = 8,
    zero_stage: int | None = None,
    fsdp_grad_sync: GradSync = GradSync.EVERY,
    tensor_parallel: int | None = 1,
    sequence_parallel: bool = True,
    context_parallel: int | None = 1,
    checkpoint_policy: CheckpointPolicy | None = None,
    save_list: SaveList = TORCHTITAN_SAVE_LIST,
    expert_parallel: int | None = 1,
) -> SearchSpace:
    """The space: the layout (ZeRO stage, tensor-, context- and expert-parallel degrees on several GPUs),
    micro-batches that divide each data-parallel rank's share of the global batch (accumulation
    derived), the precisions the device runs; a knob given is fixed (``tensor_parallel``,
    ``context_parallel`` or ``expert_parallel`` None: searched; expert parallelism only on a model
    with MoE blocks, over degrees that divide its experts)."""
    stages = zero_stages(training, gpus, gpus_per_node, zero_stage)
    if checkpoint_policy is CheckpointPolicy.OPS and context_parallel != 1:
        if context_parallel is not None:
            raise ConfigError(CONTEXT_PARALLEL_REFUSAL)
        context_parallel = 1  # the only degree the fixed policy runs with
    rebuilt = (checkpoint_policy,) if checkpoint_policy is not None else default_checkpoint_policies(model)
    layouts = layout_degrees(model, training, gpus, gpus_per_node, tensor_parallel, context_parallel, sequence_parallel)
    tps, cps = tuple(sorted({tp for tp, _ in layouts})), tuple(sorted({cp for _, cp in layouts}))
    eps = expert_degrees(model, gpus, expert_parallel)
    shares = {training.global_batch_size * tp * cp // gpus for tp, cp in layouts}  # sequences per data-parallel rank
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
                                                     ZERO_STAGE: stages}
        if gpus > 1:
            dimensions[TP] = tps
            if cps != (1,):
                dimensions[CP] = cps
            if eps != (1,):
                dimensions[EP] = eps
        return SearchSpace(dimensions=dimensions, world_size=gpus, global_batch_size=training.global_batch_size,
                           gpus_per_node=gpus_per_node, fixed_checkpoint=checkpoint_blocks,
                           allow_segments=allow_segments, fsdp_grad_sync=fsdp_grad_sync,
                           sequence_parallel=sequence_parallel, checkpoint_policies=rebuilt, save_list=save_list,
                           layouts=layouts)

    space = space_of(chosen)
    if expert_parallel is not None and expert_parallel > 1 and not any(True for _ in space_of(tuple(PrecisionPolicy))
                                                                      .points()):
        raise ConfigError(f"--ep: expert parallelism splits FSDP2's data-parallel ranks: {expert_parallel} must divide "
                          f"them (--gpus / (--tp x --cp)) with --zero-stage 2 or 3 and no --cp; change --ep or those")
    runnable = tuple(p for p in chosen if any(point[PRECISION] == p.value for point in space.points()))
    if not runnable:
        stage_tps = sorted({(int(point[ZERO_STAGE]), int(point.get(TP, 1)))
                            for point in space_of(tuple(PrecisionPolicy)).points()})
        if not stage_tps:
            raise ConfigError(f"--zero-stage / --tp / --cp: no layout of {gpus} GPUs runs here: ZeRO-1 and DDP need "
                              "one GPU per tensor-parallel group or none and no context parallelism, ZeRO stages "
                              "need several ranks to shard over")
        allowed = ", ".join(p.value for p in PrecisionPolicy if any(
            point[PRECISION] == p.value for point in space_of(tuple(PrecisionPolicy)).points()))
        raise ConfigError(f"--precision: {', '.join(p.value for p in chosen)} cannot run under --zero-stage "
                          f"{stages[0]} (FSDP2) as modelled; use {allowed}, or --zero-stage 0/1")
    return space_of(runnable)


__all__ = ["CP", "EP", "MICRO_BATCH", "MODELLED_STAGES", "PRECISION", "TP", "ZERO_STAGE", "Point", "SearchSpace",
           "build_space", "context_degrees", "divisors", "layout_degrees", "layout_refusal"]
