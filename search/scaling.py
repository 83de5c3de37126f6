"""When nothing fits: the fewest GPUs (and ZeRO stage) that would hold the smallest plan."""

from __future__ import annotations

from hardware.profile import HardwareProfile
from planner.config import ModelConfig, TrainConfig
from planner.fsdp import FSDP_PRECISIONS
from planner.knobs import GradSync, Knobs
from planner.parallel import MODELLED_STAGES
from planner.precision import PrecisionPolicy
from search.candidates import evaluate
from search.space import divisors


def fewest_gpus(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    cap_bytes: int,
    precisions: tuple[PrecisionPolicy, ...],
    gpus_per_node: int,
    start: int = 1,
    fsdp_grad_sync: GradSync = GradSync.EVERY,
) -> tuple[int, Knobs] | None:
    """The smallest GPU count above ``start`` (a divisor of the global batch) on which some plan
    fits, with the least sharding that makes it fit; None if no count does. With
    ``GradSync.LAST`` only ZeRO-2/3 are tried (the mode exists only there), priced in that mode."""
    for gpus in divisors(training.global_batch_size):
        if gpus <= start:
            continue
        smallest = training.global_batch_size // gpus
        for stage in MODELLED_STAGES:
            if fsdp_grad_sync is GradSync.LAST and stage < 2:
                continue
            for precision in precisions:
                if stage >= 2 and precision not in FSDP_PRECISIONS:
                    continue
                for micro in (1, smallest):
                    if smallest % micro:
                        continue
                    ev = evaluate(model, training, hw, cap_bytes, micro, precision, data_parallel=gpus,
                                  zero_stage=stage, gpus_per_node=gpus_per_node, fsdp_grad_sync=fsdp_grad_sync)
                    if ev.fits:
                        return gpus, ev.knobs
    return None
