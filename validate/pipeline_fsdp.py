"""One pipeline rank whose stages are FSDP2-sharded over a data-parallel group (torchtitan's PP + FSDP).

``measure_fsdp_rank(case, rank)`` (reached through ``validate.pipeline.measure_rank`` when
``case.dp_shard > 1``) starts rank ``rank · dp_shard`` of a fake process group of ``pp · dp_shard``
ranks laid out as the 2-D mesh [pp, dp_shard] (``init_device_mesh("cpu", ...)`` on the fake
backend, as ``validate.distributed`` does), builds the pipeline rank's stages with the "pp"
sub-group as their ``PipelineStage`` group, then ``fully_shard``s every block and the stage root
over the "dp_shard" mesh with ``reshard_after_forward`` as the case says and, with
``case.mixed_precision``, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. Sharding
after ``PipelineStage`` is built is torchtitan's order (``pipeline_llm``: split, then parallelize
each model part and set ``stage.submod``); ``fully_shard`` changes the module in place.

torch drives FSDP2 from the pipeline itself (torch 2.13, ``torch/distributed/pipelining/``):
``stage.py:781 backward_maybe_with_nosync`` sets ``set_is_last_backward(False)``,
``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` before *every*
backward (``stage.py:844-847``, the last micro-batch's included), and ``stage.py:1164
perform_reduce_grad`` (called once per step by every schedule after the stage's last backward:
``schedules.py:960`` GPipe, ``:1177`` 1F1B, ``:2605`` the runtime's REDUCE_GRAD) sets them back
to True, runs every group's ``post_backward`` (reduce-scatter, reshard) and the root's final
callback, then ``scale_grads`` divides the sharded gradients in place. The runtime schedules
(``ScheduleInterleaved1F1B``...) also insert UNSHARD/RESHARD actions (``schedules.py:1285
_add_unshard_reshard``, at most 3 stages active) that call ``FSDPModule.unshard(async_op=True)``
/ ``reshard()`` on every FSDP module of a stage.

Nothing else needs patching beyond ``validate.pipeline.fake_pipeline_group``: the fake group's
all-gathers and reduce-scatters allocate what NCCL's would and leave the buffers as they are.
Actions recorded besides the harness's: ``UNSHARD`` / ``RESHARD`` (one per FSDP module, runtime
schedules only) and ``REDUCE_GRAD`` (``perform_reduce_grad``). Categories (``FSDP_CATEGORIES``,
claimed before the harness's own): sharded params, unsharded params (the gathered storages,
``FSDPParam.all_gather_outputs``), all-gather outputs still held (``_all_gather_result``,
``comm_ctx.all_gather_state``), unsharded gradients (the unsharded params' ``.grad`` and fp32
``unsharded_accumulated_grad``), reduce-scatter inputs held (``comm_ctx.reduce_scatter_states``),
sharded gradients; what FSDP allocates and frees within a call (the bf16 all-gather input, the
reduce-scatter output before it becomes the sharded gradient) is "other".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from validate.distributed import forget_meshes
from validate.pipeline import (
    CATEGORIES,
    PipelineCase,
    PipelineTracker,
    RankMeasurement,
    _instrument,
    _make_schedule,
    _make_stages,
    _Recorder,
    classify,
    fake_pipeline_group,
    run_steps,
)
from validate.pipeline_split import StageModel

FSDP_CATEGORIES = ("sharded_params", "unsharded_params", "all_gather", "unsharded_grads", "reduce_scatter",
                   "sharded_grads")
ALL_CATEGORIES = FSDP_CATEGORIES + tuple(c for c in CATEGORIES if c not in ("params", "grads"))


@contextlib.contextmanager
def fake_pipeline_mesh(case: PipelineCase, rank: int) -> Iterator[DeviceMesh]:
    """``fake_pipeline_group`` of ``pp · dp_shard`` ranks and its [pp, dp_shard] mesh."""
    forget_meshes()
    try:
        with fake_pipeline_group(case, rank):
            yield init_device_mesh("cpu", (case.pp, case.dp_shard), mesh_dim_names=("pp", "dp_shard"))
    finally:
        forget_meshes()


def shard_stage(model: StageModel, mesh: DeviceMesh, case: PipelineCase) -> None:
    """torchtitan's ``apply_fsdp`` on one stage: every block, then the stage root (its embedding,
    final norm and head, if any), each one FSDP unit."""
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": case.reshard_after_forward}
    if case.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def fsdp_modules(stage: PipelineStage) -> list[FSDPModule]:
    return [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]


def param_groups(stages: list[PipelineStage]) -> list[Any]:
    """Every ``FSDPParamGroup`` of the rank's stages (a unit without parameters has none)."""
    return [group for stage in stages for module in fsdp_modules(stage)
            for group in module._get_fsdp_state()._fsdp_param_groups]


def fsdp_holders(stages: list[PipelineStage]) -> list[tuple[Any, str]]:
    """(tensors, category) for what FSDP2 holds now, in ``FSDP_CATEGORIES`` order of precedence."""
    held: dict[str, list[Any]] = {category: [] for category in FSDP_CATEGORIES}
    for group in param_groups(stages):
        for param in group.fsdp_params:
            held["sharded_params"].append(param._sharded_param_data)
            held["unsharded_params"] += [*param.all_gather_outputs, *getattr(param, "_unsharded_inner_tensors", [])]
            unsharded = getattr(param, "_unsharded_param", None)
            held["unsharded_grads"] += [unsharded.grad if unsharded is not None else None,
                                        param.unsharded_accumulated_grad]
            held["sharded_grads"].append(param.sharded_param.grad)
        result, state = group._all_gather_result, getattr(group.comm_ctx, "all_gather_state", None)
        held["all_gather"] += [result.all_gather_output if result is not None else None,
                               state.all_gather_result.all_gather_output if state is not None else None]
        held["reduce_scatter"] += [rs.reduce_scatter_input for rs in getattr(group.comm_ctx, "reduce_scatter_states", ())]
    return [(items, category) for category, items in held.items()]


def classify_fsdp(stages: list[PipelineStage], schedule: Any, batch: list[torch.Tensor],
                  live: dict[int, int]) -> dict[str, int]:
    """Live bytes by holder: FSDP2's buffers first, the rest as ``validate.pipeline.classify``."""
    owner: dict[int, str] = {}

    def mark(item: Any, category: str) -> None:
        if is_traceable_wrapper_subclass(item):  # a DTensor: its local shard
            for attr in item.__tensor_flatten__()[0]:
                mark(getattr(item, attr), category)
        elif isinstance(item, torch.Tensor):
            owner.setdefault(id(item.untyped_storage()), category)
        elif isinstance(item, list | tuple):
            for inner in item:
                mark(inner, category)

    for items, category in fsdp_holders(stages):
        mark(items, category)
    totals = dict.fromkeys(ALL_CATEGORIES, 0)
    rest = {}
    for key, n_bytes in live.items():
        if key in owner:
            totals[owner[key]] += n_bytes
        else:
            rest[key] = n_bytes
    for category, n_bytes in classify(stages, schedule, batch, rest).items():
        totals[category if category in totals else "other"] += n_bytes
    return totals


class _FsdpRecorder(_Recorder):
    """The harness's recorder; an action called inside another (the metadata clean-up's reshard
    in the first step's ``init``) belongs to the outer one."""

    depth = 0

    def run(self, kind: str, stage: int, microbatch: int, call: Callable[[], Any]) -> Any:
        if self.depth:
            return call()
        self.depth += 1
        try:
            return super().run(kind, stage, microbatch, call)
        finally:
            self.depth -= 1


def _recorded(recorder: _Recorder, kind: str, stage: int, call: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return recorder.run(kind, stage, -1, lambda: call(*args, **kwargs))

    return run


def _record_fsdp_actions(stages: list[PipelineStage], recorder: _Recorder) -> None:
    """Record ``perform_reduce_grad`` (REDUCE_GRAD) and the runtime's UNSHARD/RESHARD calls
    (instance attributes shadow the methods; the schedules call them through the objects)."""
    for stage in stages:
        index = stage.stage_index
        stage.perform_reduce_grad = _recorded(recorder, "REDUCE_GRAD", index,  # type: ignore[method-assign]
                                              stage.perform_reduce_grad)
        for module in fsdp_modules(stage):
            for name in ("unshard", "reshard"):
                object.__setattr__(module, name, _recorded(recorder, name.upper(), index, getattr(module, name)))


def measure_fsdp_rank(case: PipelineCase, rank: int, steps: int = 2) -> RankMeasurement:
    """``validate.pipeline.measure_rank`` with every stage FSDP2-sharded over ``case.dp_shard``
    ranks; ``param_bytes`` is the rank's sharded parameters (padded shards)."""
    if not 0 <= rank < case.pp:
        raise ValueError(f"rank {rank} is not in a pipeline of {case.pp}")
    with fake_pipeline_mesh(case, rank) as mesh:
        stages = _make_stages(case, rank, mesh.get_group("pp"))
        for stage in stages:
            shard_stage(stage.submod, mesh["dp_shard"], case)  # type: ignore[arg-type]
        schedule = _make_schedule(case, stages)
        torch.manual_seed(1)
        ids = torch.randint(0, case.config.vocab_size, (case.micro_batch * case.n_microbatches, case.seq_len))
        targets = torch.roll(ids, -1, dims=1)
        has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        params = [p for s in stages for p in s.submod.parameters()]
        batch = [ids, targets]
        classifier = lambda live: classify_fsdp(stages, schedule, batch, live)  # noqa: E731
        tracker = PipelineTracker(classifier)
        tracker.track(params)
        param_bytes = tracker.live_bytes
        tracker.track(batch)
        recorder = _FsdpRecorder(tracker, classifier)
        _instrument(stages, schedule, recorder)
        _record_fsdp_actions(stages, recorder)
        with tracker:
            run_steps(case, schedule, tracker, recorder, steps, ids if has_first else None,
                      targets if has_last else None, params)
        return RankMeasurement(case, rank, [s.stage_index for s in stages], param_bytes, recorder.steps)
