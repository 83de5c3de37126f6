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
from planner.strategies.tensor import check_tensor_parallel
from search.smallest import first_fitting
from search.space import build_space, divisors


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
    that makes it fit (data parallelism alone, ZeRO-0 to 3, before tensor parallelism, the
    smallest degree first); None if no count does. GPU counts are a divisor of the global batch
    times a tensor-parallel degree the model allows inside a node. With ``GradSync.LAST`` only
    ZeRO-2/3 are tried (the mode exists only there), priced in that mode."""
    degrees = [tp for tp in divisors(gpus_per_node) if _runs(model, training, tp)]
    counts = sorted({dp * tp for dp in divisors(training.global_batch_size) for tp in degrees})
    for gpus in counts:
        if gpus <= start:
            continue
        layouts = [(stage, 1) for stage in MODELLED_STAGES] + [
            (stage, tp) for tp in degrees if tp > 1 and not gpus % tp for stage in (0, 2, 3)]
        for stage, tp in layouts:
            try:
                dims = ParallelDims.data_parallel_of(gpus, stage, tp=tp)
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
                                    fsdp_grad_sync=fsdp_grad_sync if fsdp else GradSync.EVERY, tensor_parallel=tp)
            except ConfigError:  # no policy of the request runs at this layout
                continue
            found = first_fitting(model, training, hw, space, cap_bytes)
            if found is not None:
                return gpus, found.knobs
    return None


def _runs(model: ModelConfig, training: TrainConfig, tp: int) -> bool:
    """Whether PyTorch can run this model at this tensor-parallel degree (with SP)."""
    try:
        check_tensor_parallel(model, training.seq_len, ParallelDims(tp=tp, sp=tp > 1))
    except ConfigError:
        return False
    return True
