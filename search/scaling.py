"""When nothing fits: the fewest GPUs (and least sharding) on which some plan of the space fits.

Each candidate count is answered exactly (``search.smallest.first_fitting``: every micro-batch,
precision and checkpoint placement the search could choose there, pruned by lower bounds), so
the advice agrees with the smallest plan the message reports.
"""

from __future__ import annotations

from collections.abc import Callable

from hardware.profile import HardwareProfile
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.checkpointing import TORCHTITAN_SAVE_LIST, CheckpointPolicy, SaveList
from planner.plan.knobs import GradSync, Knobs
from planner.plan.layouts import MODELLED_STAGES, divisors, layout_at, pipeline_degrees, scale_out_degrees
from planner.plan.pipeline_schedules import PipelineSchedule
from planner.precision import PrecisionPolicy
from search.smallest import first_fitting
from search.space import build_space


def fewest_gpus(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    cap_bytes: int,
    precisions: tuple[PrecisionPolicy, ...],
    start: int = 1,
    fsdp_grad_sync: GradSync = GradSync.EVERY,
    allow_segments: bool = True,
    checkpoint_policy: CheckpointPolicy | None = None,
    save_list: SaveList = TORCHTITAN_SAVE_LIST,
    on_progress: Callable[[int, int], None] | None = None,
    pipeline: tuple[int, PipelineSchedule | None, int | None] | None = None,
) -> tuple[int, Knobs] | None:
    """The smallest GPU count above ``start`` on which some plan fits, with the least sharding
    that makes it fit (data parallelism alone, ZeRO-0 to 3, then tensor parallelism, then context
    parallelism, then across nodes pipeline stages, the smallest degree first); None if no count does. GPU counts are a divisor of
    the global batch times a tensor-parallel degree the model allows inside a node times a
    context-parallel degree it allows (each rank keeping ``MIN_CONTEXT_SHARD_TOKENS`` of a
    sequence). With ``GradSync.LAST`` only ZeRO-2/3 are tried (the mode exists only there), priced
    in that mode; a fixed ``checkpoint_policy`` is kept, and a fixed pipeline (``pipeline``: the
    request's ``--pp``, schedule and stages per rank): then every count is a multiple of its
    degree and only its layouts are tried. ``on_progress(tried, counts)`` follows the
    GPU counts above ``start`` as each is tried (``counts`` when it ends)."""
    degrees, contexts = scale_out_degrees(model, training.seq_len, hw.gpus_per_node)
    fixed_pp = pipeline[0] if pipeline is not None else 1
    contexts = contexts if fixed_pp == 1 else (1,)  # context parallelism is not modelled inside a pipeline
    counts = sorted({dp * tp * cp * fixed_pp for dp in divisors(training.global_batch_size) for tp in degrees
                     for cp in contexts})
    above = [n for n in counts if n > start]
    for tried, gpus in enumerate(counts):
        if gpus <= start:
            continue
        if on_progress is not None:
            on_progress(tried - (len(counts) - len(above)), len(above))
        layouts = [(stage, tp, 1, fixed_pp) for tp in degrees if not gpus % (tp * fixed_pp)
                   for stage in MODELLED_STAGES] if fixed_pp > 1 else [(stage, 1, 1, 1) for stage in MODELLED_STAGES] + [
            (stage, tp, 1, 1) for tp in degrees if tp > 1 and not gpus % tp for stage in MODELLED_STAGES] + [
            (stage, tp, cp, 1) for cp in contexts if cp > 1 for tp in degrees if not gpus % (tp * cp)
            for stage in MODELLED_STAGES] + [
            (stage, tp, 1, pp) for pp in pipeline_degrees(model, gpus, None, hw.gpus_per_node) if pp > 1
            for tp in degrees if not gpus % (tp * pp) for stage in MODELLED_STAGES]
        for stage, tp, cp, pp in layouts:
            dims = layout_at(gpus, True, stage, tp, cp, 1, pp)  # None: no such layout (planner.plan.layouts)
            if dims is None:
                continue
            fsdp = dims.shards_parameters
            if fsdp_grad_sync is GradSync.LAST and not fsdp:  # the mode exists only under FSDP2
                continue
            try:
                space = build_space(model, training, hw, precisions, allow_segments=allow_segments, gpus=gpus,
                                    zero_stage=stage,
                                    fsdp_grad_sync=fsdp_grad_sync if fsdp else GradSync.EVERY, tensor_parallel=tp,
                                    context_parallel=cp, checkpoint_policy=checkpoint_policy, save_list=save_list,
                                    expert_parallel=None, pipeline_parallel=pp,
                                    pp_schedule=pipeline[1] if pipeline is not None else None,
                                    pp_virtual=pipeline[2] if pipeline is not None else None)
            except ConfigError:  # no policy of the request runs at this layout
                continue
            found = first_fitting(model, training, hw, space, cap_bytes)
            if found is not None:
                return gpus, found.knobs
    if on_progress is not None:
        on_progress(len(above), len(above))
    return None
