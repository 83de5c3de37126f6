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
    """The smallest GPU count above ``start`` (a divisor of the global batch) on which some plan
    fits, with the least sharding that makes it fit; None if no count does. With
    ``GradSync.LAST`` only ZeRO-2/3 are tried (the mode exists only there), priced in that mode."""
    for gpus in divisors(training.global_batch_size):
        if gpus <= start:
            continue
        for stage in MODELLED_STAGES:
            fsdp = ParallelDims.data_parallel_of(gpus, stage).shards_parameters
            if fsdp_grad_sync is GradSync.LAST and not fsdp:  # the mode exists only under FSDP2
                continue
            try:
                space = build_space(model, training, hw, precisions, allow_segments=allow_segments, gpus=gpus,
                                    gpus_per_node=gpus_per_node, zero_stage=stage,
                                    fsdp_grad_sync=fsdp_grad_sync if fsdp else GradSync.EVERY)
            except ConfigError:  # no policy of the request runs at this stage
                continue
            found = first_fitting(model, training, hw, space, cap_bytes)
            if found is not None:
                return gpus, found.knobs
    return None
