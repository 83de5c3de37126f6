"""Which parallel layouts exist: the one authority that the search space, the fewest-GPUs advice,
the API's and CLI's refusals, estimate's checks and validate's device mesh ask.

A layout is a ``planner.plan.parallel_dims.ParallelDims``, modelled on torchtitan's ``ParallelDims``
(torchtitan/distributed/parallel_dims.py): its validator holds the rules between the degrees
alone (context parallelism under FSDP2, ep dividing dp_shard, HSDP under FSDP2 only), its
``mesh`` the device mesh and ``ranks_per_node`` how many of a communication group's ranks share a
node. This module adds what depends on the model, the workload and the request:

| question | answer |
|---|---|
| does PyTorch run this model at this layout (heads, experts, kernels)? | ``check_layout`` (``planner.plan.layout_rules``) |
| is a (ZeRO stage, tp, cp, ep) point of N GPUs a layout? | ``layout_at`` |
| each dimension's candidates for a request, fixed or searched | ``layout_choices`` |
| every layout a request allows | ``valid_layouts`` |
| the layout of a fully fixed request | ``checked_request``, ``check_fixed_request``, ``fixed_layout`` |
| the tp and cp degrees the fewest-GPUs advice walks | ``scale_out_degrees`` |
| the HSDP replicas a request allows, ``--dp-replicate`` checked | ``replicate_degrees``, ``replica_update`` (``planner.plan.replicas``) |
| a refusal in the flags' words; a layout as flags | ``as_flag``, ``as_flags`` |

Refusals are one line naming the field (``parallel.tp: ...``) or the flag (``--tp: ...``) and the
fix. A new dimension (pipeline parallelism next) adds its field, mesh axis and groups to
``ParallelDims``, its model rules to ``planner.plan.layout_rules``, its candidates and flag here and its
name to ``SEARCHED``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, ValidationError

from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.model.families.moe.config import RouterScoring
from planner.plan.layout_rules import (
    MIN_CONTEXT_SHARD_TOKENS,
    check_context_parallel,
    check_expert_parallel,
    check_layout,
    check_moe_tensor_parallel,
    check_tensor_parallel,
)
from planner.plan.parallel_dims import NOT_MODELLED, ParallelDims, Sharding
from planner.plan.replicas import replica_update, replicate_degrees

MODELLED_STAGES = (0, 1, 2, 3)
# the deepest pipeline the search tries (--pp fixes any): Llama 3 405B trained with PP 16 (Dubey et
# al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4), torchtitan's 405B recipe with
# PP 8; a search over deeper ones walks a rank per stage for little a 16-stage one does not offer
MAX_SEARCHED_PP = 16
MIN_BLOCKS_PER_STAGE = 2  # searched stages of one block are all embedding or head
# the degrees a search chooses, by the names of ``ParallelDims.data_parallel_of``'s arguments (and
# of the search space's dimensions and the CLI's flags), outermost first
SEARCHED = ("zero_stage", "tp", "cp", "ep", "pp", "dp_replicate")
_FLAGS = {"parallel.tp": "--tp", "parallel.sp": "--no-sequence-parallel", "parallel.cp": "--cp", "parallel.ep": "--ep",
          "parallel.pp": "--pp", "parallel.dp_replicate": "--dp-replicate"}
# the most sharding any layout here reaches (the advice when more GPUs do not help)
MOST_SHARDING = (f"sharding everything (ZeRO-3, FSDP2) over as many GPUs as the global batch has sequences, with "
                 f"tensor and sequence parallelism inside a node and context parallelism down to "
                 f"{MIN_CONTEXT_SHARD_TOKENS} tokens of a sequence per GPU")
NOT_MODELLED_NOTE = "(pipeline parallelism is not modelled yet)" if "pp" in NOT_MODELLED else ""


class LayoutRequest(BaseModel):
    """The layout a request fixes, as ``roofplan plan``'s flags and ``api.plan``'s arguments give
    it: ``--gpus``, and ``--zero-stage``, ``--tp``, ``--cp``, ``--ep``, ``--pp``, ``--dp-replicate``
    (None: searched)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpus: int = 1
    zero_stage: int | None = None
    tp: int | None = None
    cp: int | None = None
    ep: int | None = None
    sp: bool = True  # sequence parallelism beside tensor parallelism (--no-sequence-parallel: False)
    pp: int | None = 1  # pipeline ranks (--pp; None: searched)
    dp_replicate: int | None = 1  # HSDP replicas of FSDP2's shard group (--dp-replicate; None: searched)

    @property
    def fixed(self) -> bool:
        """Every degree given (one GPU fixes them all)."""
        return self.gpus == 1 or None not in (self.zero_stage, self.tp, self.cp, self.ep, self.pp, self.dp_replicate)


class LayoutChoices(BaseModel):
    """Each layout dimension's candidate degrees for a request; they combine only where
    ``layout_at`` finds a layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    world_size: int
    sequence_parallel: bool = True
    zero_stages: tuple[int, ...]
    tp_cp: tuple[tuple[int, int], ...]  # the (tp, cp) pairs the model runs that leave whole sequences per rank
    ep: tuple[int, ...] = (1,)
    pp: tuple[int, ...] = (1,)
    dp_replicate: tuple[int, ...] = (1,)  # HSDP replicas

    def dimensions(self) -> dict[str, tuple[int, ...]]:
        """The search's layout dimensions by name (``SEARCHED``): the ZeRO stage, and on several
        GPUs tp, then cp, ep, pp and dp_replicate where they offer more than 1."""
        out = {"zero_stage": self.zero_stages}
        if self.world_size > 1:
            out["tp"] = tuple(sorted({tp for tp, _ in self.tp_cp}))
            cps = tuple(sorted({cp for _, cp in self.tp_cp}))
            if cps != (1,):
                out["cp"] = cps
            if self.ep != (1,):
                out["ep"] = self.ep
            if self.pp != (1,):
                out["pp"] = self.pp
            if self.dp_replicate != (1,):
                out["dp_replicate"] = self.dp_replicate
        return out

    def layouts(self) -> tuple[ParallelDims, ...]:
        """Every layout the choices combine into."""
        found = (layout_at(self.world_size, self.sequence_parallel, stage, tp, cp, ep, pp, replicas)
                 for stage in self.zero_stages for tp, cp in self.tp_cp for ep in self.ep for pp in self.pp
                 for replicas in self.dp_replicate)
        return tuple(dims for dims in found if dims is not None)


@lru_cache(maxsize=4096)
def layout_at(world_size: int, sequence_parallel: bool, zero_stage: int, tp: int = 1, cp: int = 1,
              ep: int = 1, pp: int = 1, dp_replicate: int = 1) -> ParallelDims | None:
    """The layout of ``world_size`` GPUs at these degrees (``ParallelDims.data_parallel_of``), or
    None where none exists: a ZeRO stage needs several ranks to shard over, context and expert
    parallelism run under FSDP2 (ep dividing its data-parallel ranks, without cp), tensor
    parallelism shares data-parallel ranks only through FSDP2 (``check_tensor_parallel``), and
    pipeline parallelism runs with what ``ParallelDims`` allows beside it; ``dp_replicate`` > 1
    (HSDP) replicates FSDP2's shard groups (ZeRO-2/3, without cp, ep or pp)."""
    try:
        dims = ParallelDims.data_parallel_of(world_size, zero_stage, tp=tp, sp=sequence_parallel and tp > 1, cp=cp,
                                             ep=ep, pp=pp, dp_replicate=dp_replicate)
    except ValueError:
        return None
    if dims.tp > 1 and dims.data_parallel > 1 and not dims.shards_parameters:
        return None
    return dims


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending (trial division up to its square root: ``n`` may be a
    global batch or a sequence length of millions)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def zero_stages(training: TrainConfig, gpus: int, gpus_per_node: int, zero_stage: int | None) -> tuple[int, ...]:
    """The ZeRO stages a request allows (checking ``--gpus``, ``--gpus-per-node``, ``--zero-stage``;
    that the global batch splits over the data-parallel ranks is ``layout_degrees``' to check)."""
    if gpus <= 0:
        raise ConfigError(f"--gpus: must be positive, got {gpus}")
    if gpus_per_node <= 0:
        raise ConfigError(f"--gpus-per-node: must be positive, got {gpus_per_node}")
    if zero_stage is not None and zero_stage not in MODELLED_STAGES:
        raise ConfigError(f"--zero-stage: {zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    if gpus == 1:
        if zero_stage:
            raise ConfigError("--zero-stage: sharding needs several GPUs; add --gpus N or use --zero-stage 0")
        return (0,)
    if zero_stage is None:
        return MODELLED_STAGES
    return (zero_stage,)


def layout_refusal(model: ModelConfig, seq_len: int, tp: int, cp: int, sequence_parallel: bool = True) -> str | None:
    """Why PyTorch cannot run this model at these tensor- (with SP) and context-parallel degrees,
    as ``check_layout`` words it (``parallel.tp: ...``), or None."""
    dims = ParallelDims(tp=tp, sp=sequence_parallel and tp > 1, cp=cp, sharding=Sharding.FULL if cp > 1 else None)
    try:
        check_layout(model, seq_len, dims)
    except ConfigError as error:
        return str(error)
    return None


def context_degrees(seq_len: int, candidates: Iterable[int]) -> tuple[int, ...]:
    """The context-parallel degrees the search tries: those leaving each rank at least
    ``MIN_CONTEXT_SHARD_TOKENS`` of a sequence (1 always)."""
    return tuple(cp for cp in candidates if cp == 1 or seq_len // cp >= MIN_CONTEXT_SHARD_TOKENS)


def as_flag(refusal: str) -> str:
    """``parallel.cp: ...`` -> ``--cp: ...`` (the flag a user sets for that field)."""
    field, _, rest = refusal.partition(": ")
    flag = _FLAGS.get(field)
    return f"{flag}: {rest}" if flag else refusal


def as_flags(dims: ParallelDims) -> str:
    """``--gpus 16 --zero-stage 3 --tp 2 --cp 2``: the flags that fix this layout."""
    degrees = "".join(f" --{name} {getattr(dims, name)}" for name in ("tp", "cp", "ep", "pp")
                      if getattr(dims, name) > 1)
    if dims.hsdp:
        degrees += f" --dp-replicate {dims.dp_replicate}"
    return f"--gpus {dims.world_size} --zero-stage {dims.zero_stage}{degrees}"


def layout_degrees(model: ModelConfig, training: TrainConfig, gpus: int, gpus_per_node: int, fixed_tp: int | None,
                   fixed_cp: int | None, sequence_parallel: bool,
                   pps: tuple[int, ...] = (1,)) -> tuple[tuple[int, int], ...]:
    """The (tensor-, context-parallel) degree pairs a request allows: ``--tp`` / ``--cp`` if given
    (checked, the error naming the flag), else every degree that divides the GPUs and that
    PyTorch can run on this model (``layout_refusal``): tensor parallelism inside a node (its
    collectives are on the critical path: NVLink), context parallelism leaving each rank at least
    ``MIN_CONTEXT_SHARD_TOKENS`` of a sequence. Together with one of the pipeline degrees ``pps``
    they must leave data-parallel ranks that divide the global batch (every rank gets whole
    sequences)."""
    seq, batch = training.seq_len, training.global_batch_size
    for flag, fixed in (("--tp", fixed_tp), ("--cp", fixed_cp)):
        if fixed is not None and (fixed <= 0 or gpus % fixed):
            raise ConfigError(f"{flag}: {fixed} must be a positive divisor of the {gpus} GPUs (--gpus)")
    tps = (fixed_tp,) if fixed_tp is not None else tuple(tp for tp in divisors(gpus) if tp <= gpus_per_node)
    cps = (fixed_cp,) if fixed_cp is not None else context_degrees(seq, divisors(gpus))
    if fixed_tp is not None or fixed_cp is not None:
        refusal = layout_refusal(model, seq, fixed_tp or 1, fixed_cp or 1, sequence_parallel)
        if refusal is not None:
            raise ConfigError(as_flag(refusal))
    pairs = [(tp, cp) for tp in tps for cp in cps if not gpus % (tp * cp)
             and layout_refusal(model, seq, tp, cp, sequence_parallel) is None]
    whole = tuple((tp, cp) for tp, cp in pairs
                  if any(not gpus % (tp * cp * pp) and not batch % (gpus // (tp * cp * pp)) for pp in pps))
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


def expert_degrees(model: ModelConfig, gpus: int, fixed: int | None) -> tuple[int, ...]:
    """The expert-parallel degrees a request allows: ``--ep`` if given (checked against the model
    and the GPUs, the error naming the flag), else every degree dividing both the GPUs and the
    experts of a model with MoE blocks (1 for a dense model); ``layout_at`` keeps those that divide
    a point's data-parallel ranks under FSDP2."""
    if fixed is not None:
        if fixed <= 0 or gpus % fixed:
            raise ConfigError(f"--ep: {fixed} must be a positive divisor of the {gpus} GPUs (--gpus)")
        if fixed > 1 and model.moe is None:
            raise ConfigError(f"--ep: {model.name} has no mixture-of-experts blocks to split; leave --ep out")
        if fixed > 1 and model.moe is not None and model.moe.n_experts % fixed:
            raise ConfigError(f"--ep: {fixed} does not divide the {model.moe.n_experts} experts of {model.name}; use a "
                              "divisor of them")
        return (fixed,)
    if model.moe is None or model.moe.scoring is RouterScoring.TOPK_SIGMOID:  # Llama 4's: check_expert_parallel
        return (1,)
    return tuple(ep for ep in range(1, gpus + 1) if gpus % ep == 0 and model.moe.n_experts % ep == 0)


def pipeline_degrees(model: ModelConfig, gpus: int, fixed: int | None, gpus_per_node: int = 8) -> tuple[int, ...]:
    """The pipeline degrees a request allows: ``--pp`` if given (checked against the GPUs and the
    blocks), else 1 and, across nodes, every degree dividing the GPUs, up to one stage per node and
    ``MAX_SEARCHED_PP``, that leaves each stage ``MIN_BLOCKS_PER_STAGE`` blocks: pipelines are what
    big runs put across nodes, where their point-to-point sends cost less than data parallelism's
    collectives (inside a node the search leaves them out unless ``--pp`` asks)."""
    if fixed is not None:
        if fixed <= 0 or gpus % fixed:
            raise ConfigError(f"--pp: {fixed} must be a positive divisor of the {gpus} GPUs (--gpus)")
        if fixed > model.n_layers:
            raise ConfigError(f"--pp: {fixed} stages for the {model.n_layers} blocks of {model.name}; use at most "
                              f"{model.n_layers}")
        return (fixed,)
    nodes = max(1, gpus // gpus_per_node)
    return tuple(pp for pp in divisors(gpus) if pp == 1 or (pp <= min(nodes, MAX_SEARCHED_PP)
                                                           and model.n_layers >= MIN_BLOCKS_PER_STAGE * pp))


def layout_choices(model: ModelConfig, training: TrainConfig, request: LayoutRequest,
                   gpus_per_node: int) -> LayoutChoices:
    """Each dimension's candidates for ``request`` (its fixed degrees checked, the refusal naming
    the flag): the ZeRO stages, the (tp, cp) pairs, the ep and pp degrees."""
    stages = zero_stages(training, request.gpus, gpus_per_node, request.zero_stage)
    pps = pipeline_degrees(model, request.gpus, request.pp, gpus_per_node)
    pairs = layout_degrees(model, training, request.gpus, gpus_per_node, request.tp, request.cp, request.sp, pps)
    eps = expert_degrees(model, request.gpus, request.ep)
    replicas = replicate_degrees(request.gpus, request.dp_replicate, gpus_per_node)
    return LayoutChoices(world_size=request.gpus, sequence_parallel=request.sp, zero_stages=stages, tp_cp=pairs,
                         ep=eps, pp=pps, dp_replicate=replicas)


def valid_layouts(model: ModelConfig, training: TrainConfig, request: LayoutRequest,
                  gpus_per_node: int) -> tuple[ParallelDims, ...]:
    """Every layout ``request`` allows on this model and workload."""
    return layout_choices(model, training, request, gpus_per_node).layouts()


def no_layout_refusal(request: LayoutRequest) -> str:
    """Why no layout of the request's candidates exists (its fixed ep, else the stage rules)."""
    if request.dp_replicate is not None and request.dp_replicate > 1:
        return (f"--dp-replicate: HSDP replicates FSDP2's shard groups: {request.dp_replicate} must divide the "
                "data-parallel ranks (--gpus / --tp) and leave several per replica, with --zero-stage 2 or 3 and no "
                "--cp, --ep or --pp")
    if request.ep is not None and request.ep > 1:
        return (f"--ep: expert parallelism splits FSDP2's data-parallel ranks: {request.ep} must divide them (--gpus "
                "/ (--tp x --cp)) with --zero-stage 2 or 3 and no --cp; change --ep or those")
    return (f"--zero-stage / --tp / --cp: no layout of {request.gpus} GPUs runs here: ZeRO-1 and DDP need one GPU per "
            "tensor-parallel group or none and no context parallelism, ZeRO stages need several ranks to shard over")


def checked_request(model: ModelConfig, request: LayoutRequest) -> LayoutRequest:
    """The request with what it implies filled in (one GPU: every degree 1; a dense model: ep 1),
    refusing flags that contradict each other."""
    if request.gpus == 1:
        for flag, degree in (("--tp", request.tp), ("--cp", request.cp), ("--ep", request.ep)):
            if degree is not None and degree != 1:
                raise ConfigError(f"{flag}: {degree} needs several GPUs; give --gpus (a multiple of {degree}) or leave "
                                  f"{flag} out")
        request = request.model_copy(update={"tp": 1, "cp": 1, "ep": 1, "pp": 1, "dp_replicate": 1})
    if request.ep is None and model.moe is None:
        request = request.model_copy(update={"ep": 1})
    others = {"pp": request.pp, "cp": request.cp, "ep": request.ep}
    request = request.model_copy(update=replica_update(request.gpus, request.dp_replicate, request.zero_stage, others))
    cp, stage = request.cp, request.zero_stage
    if cp is not None and cp > 1 and stage is not None and stage < 2:
        raise ConfigError(f"--cp: context parallelism runs with FSDP2 over the data- and context-parallel ranks; "
                          f"--zero-stage {stage} is DDP or ZeRO-1: use --zero-stage 2 or 3, or leave it out")
    return request


def check_fixed_request(model: ModelConfig, training: TrainConfig, request: LayoutRequest,
                        gpus_per_node: int) -> None:
    """Refuse the flags of a request that fixes every degree (``LayoutRequest.fixed``) one by one:
    the ZeRO stage, ep against the model, tp and cp dividing the GPUs (``fixed_layout`` then
    refuses their combination)."""
    gpus, tp, cp, ep, pp = request.gpus, request.tp, request.cp, request.ep, request.pp
    assert tp is not None and cp is not None and ep is not None and pp is not None, "a fixed request gives every degree"
    if pp < 1 or gpus % pp:
        raise ConfigError(f"--pp: {pp} must be a positive divisor of the {gpus} GPUs (--gpus)")
    zero_stages(training, gpus // pp, gpus_per_node, request.zero_stage)
    expert_degrees(model, gpus, ep)
    replicate_degrees(gpus, request.dp_replicate)
    for flag, degree in (("--tp", tp), ("--cp", cp)):
        if degree <= 0 or gpus % degree:
            raise ConfigError(f"{flag}: {degree} must be a positive divisor of the {gpus} GPUs (--gpus)")
    if gpus % (tp * cp * pp):
        raise ConfigError(f"--tp x --cp x --pp: {tp} x {cp} x {pp} must divide the {gpus} GPUs (--gpus)")
    data, replicas = gpus // (tp * cp * pp), request.dp_replicate or 1
    if replicas > 1 and (data % replicas or data == replicas):
        raise ConfigError(f"--dp-replicate: {replicas} must divide the {data} data-parallel ranks (--gpus / --tp) and "
                          "leave several per replica to shard over")


def fixed_layout(request: LayoutRequest) -> ParallelDims:
    """The layout of a fixed request whose flags ``check_fixed_request`` passed, or the one-line
    refusal of their combination; the model's own rules are ``check_layout``'s (estimate's)."""
    tp, cp, ep = request.tp, request.cp, request.ep
    assert tp is not None and cp is not None and ep is not None, "a fixed request gives every degree"
    flags = "--zero-stage / --tp / --cp / --ep / --pp" + (" / --dp-replicate" if (request.dp_replicate or 1) > 1 else "")
    try:
        return ParallelDims.data_parallel_of(request.gpus, request.zero_stage or 0, tp=tp, sp=request.sp and tp > 1,
                                             cp=cp, ep=ep, pp=request.pp or 1, dp_replicate=request.dp_replicate or 1)
    except ValidationError as error:
        raise ConfigError(f"{flags}: {error.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    except ValueError as error:
        raise ConfigError(f"{flags}: {error}") from None


def scale_out_degrees(model: ModelConfig, seq_len: int, gpus_per_node: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensor-parallel degrees inside a node and the context-parallel degrees (each rank keeping
    ``MIN_CONTEXT_SHARD_TOKENS`` of a sequence) the model runs, each alone: what the fewest-GPUs
    advice multiplies the data-parallel ranks by."""
    tps = tuple(tp for tp in divisors(gpus_per_node) if layout_refusal(model, seq_len, tp, 1) is None)
    cps = tuple(cp for cp in context_degrees(seq_len, divisors(seq_len))
                if layout_refusal(model, seq_len, 1, cp) is None)
    return tps, cps


__all__ = [
    "MIN_CONTEXT_SHARD_TOKENS", "MODELLED_STAGES", "MOST_SHARDING", "NOT_MODELLED_NOTE", "SEARCHED", "LayoutChoices",
    "LayoutRequest", "as_flag", "as_flags", "check_context_parallel", "check_expert_parallel", "check_fixed_request",
    "check_layout", "check_moe_tensor_parallel", "check_tensor_parallel", "checked_request", "context_degrees",
    "divisors", "expert_degrees", "fixed_layout", "layout_at", "layout_choices", "layout_degrees", "layout_refusal",
    "no_layout_refusal", "pipeline_degrees", "replicate_degrees", "scale_out_degrees", "valid_layouts", "zero_stages",
]
