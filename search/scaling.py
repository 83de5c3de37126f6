"""When nothing fits: the fewest GPUs (and least sharding) on which some plan of the space fits.

Each candidate count is answered exactly (``search.smallest.first_fitting``: every micro-batch,
precision and checkpoint placement the search could choose there, pruned by lower bounds), so
the advice agrees with the smallest plan the message reports.
"""

from __future__ import annotations

from hardware.profile import HardwareProfile
from planner.config import ModelConfig, TrainConfig
from planner.errors import ConfigError
from planner.knobs import GradSync, Knobs
from planner.parallel import MODELLED_STAGES
from planner.parallel_dims import ParallelDims
from planner.precision import PrecisionPolicy
from planner.strategies.context import check_context_parallel
from planner.strategies.tensor import check_tensor_parallel
from search.smallest import first_fitting
from search.space import MIN_CONTEXT_SHARD_TOKENS, build_space, divisors


def fewest_gpus(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    cap_bytes: int,
    precisions: tuple[PrecisionPolicy, ...],
    gpus_per_node: int,
    start: int = 1,
    fsdp_grad_sync: GradSync = GradSync.EVERY,
    allow_segments: bool = True,
) -> tuple[int, Knobs] | None:
    """The smallest GPU count above ``start`` on which some plan fits, with the least sharding
    that makes it fit (data parallelism alone, ZeRO-0 to 3, then tensor parallelism, then context
    parallelism, the smallest degree first); None if no count does. GPU counts are a divisor of
    the global batch times a tensor-parallel degree the model allows inside a node times a
    context-parallel degree it allows (each rank keeping ``MIN_CONTEXT_SHARD_TOKENS`` of a
    sequence). With ``GradSync.LAST`` only ZeRO-2/3 are tried (the mode exists only there), priced
    in that mode."""
    degrees = [tp for tp in divisors(gpus_per_node) if _runs(model, training, tp, 1)]
    contexts = [cp for cp in _powers_of_two(training.seq_len // MIN_CONTEXT_SHARD_TOKENS)
                if _runs(model, training, 1, cp)]
    counts = sorted({dp * tp * cp for dp in divisors(training.global_batch_size) for tp in degrees for cp in contexts})
    for gpus in counts:
        if gpus <= start:
            continue
        layouts = [(stage, 1, 1) for stage in MODELLED_STAGES] + [
            (stage, tp, 1) for tp in degrees if tp > 1 and not gpus % tp for stage in (0, 2, 3)] + [
            (stage, tp, cp) for cp in contexts if cp > 1 for tp in degrees if not gpus % (tp * cp) for stage in (2, 3)]
        for stage, tp, cp in layouts:
            try:
                dims = ParallelDims.data_parallel_of(gpus, stage, tp=tp, cp=cp)
            except ValueError:  # a stage without several data-parallel ranks
                continue
            fsdp = dims.shards_parameters
            if fsdp_grad_sync is GradSync.LAST and not fsdp:  # the mode exists only under FSDP2
                continue
            if tp > 1 and dims.data_parallel > 1 and not fsdp:  # DDP/ZeRO-1 x TP is not modelled
                continue
            try:
                space = build_space(model, training, hw, precisions, allow_segments=allow_segments, gpus=gpus,
                                    gpus_per_node=gpus_per_node, zero_stage=stage,
                                    fsdp_grad_sync=fsdp_grad_sync if fsdp else GradSync.EVERY, tensor_parallel=tp,
                                    context_parallel=cp)
            except ConfigError:  # no policy of the request runs at this layout
                continue
            found = first_fitting(model, training, hw, space, cap_bytes)
            if found is not None:
                return gpus, found.knobs
    return None


def _runs(model: ModelConfig, training: TrainConfig, tp: int, cp: int) -> bool:
    """Whether PyTorch can run this model at these tensor- (with SP) and context-parallel degrees."""
    dims = ParallelDims(tp=tp, sp=tp > 1, cp=cp, sharding="full" if cp > 1 else None)
    try:
        check_tensor_parallel(model, training.seq_len // cp, dims)
        check_context_parallel(model, training.seq_len, dims)
    except ConfigError:
        return False
    return True


def _powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` (at least 1): the context-parallel degrees the advice tries."""
    out = [1]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out
