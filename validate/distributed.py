"""Several GPUs: run a data-parallel plan across real ranks (torchrun), or emulate one rank.

    torchrun --nproc-per-node N -m roofplan validate plan.json --mode run --device cuda   # NCCL
    torchrun --nproc-per-node 2 -m roofplan validate plan.json --mode run --device cpu    # gloo

Every rank applies the plan (``validate.apply``: DDP with gradient buckets, ZeRO-1's
``ZeroRedundancyOptimizer``, ZeRO-2/3 as FSDP2 ``fully_shard``), trains on its own share of the
global batch, and measures its peak (``max_memory_allocated`` on CUDA, the live-storage tracker
on CPU, counting a DTensor through its local shard) and its step time; rank 0 gathers every
rank's figures and writes the report.

``simulate`` measures the worst rank in one process under fake tensors, for any size. FSDP2
runs for real on rank 0 of a fake process group (``init_process_group("fake")``: every
collective is a no-op on the buffers NCCL would use, every allocation happens). DDP cannot run
under fake tensors (its reducer reads data), so stages 0/1 are emulated: the gradients are
allocated up front as DDP's buckets are and zeroed in place, and with ZeRO-1 the optimizer holds
only that rank's partition (``planner.parallel.collectives.zero1_partition``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from hardware.errors import ConfigError, PlannerError
from hardware.profile import HardwareProfile
from planner.parallel.collectives import zero1_partition
from planner.plan.parallel_dims import ParallelDims, Sharding, layout_label
from planner.precision import precision_spec
from planner.program.estimate import cached_graph, compute_spec, estimate
from planner.program.results import PlanResult
from validate.apply import (
    _optimizer_args,
    configure_model,
    make_optimizer,
    make_scaler,
    optimizer_state,
    param_dtype,
    train_step,
    wrap_data_parallel,
)
from validate.context import ring_attention_on_cpu, shard_batch
from validate.layout import apply_layout, context_mesh, device_mesh
from validate.parallelize import meshes_outside_fake_mode
from validate.reference_model import build_model
from validate.report import TOLERANCES, Figures, Mode, ValidationReport
from validate.run import _predicted, build_report, measure_steps
from validate.simulate import Progress, as_on_a_gpu, shortened_step_note, simulated_dropout_note, steady_state_knobs
from validate.tracker import LiveStorageTracker


class RankFailedError(PlannerError):
    """A torchrun rank ran out of device memory (the plan does not fit there) or its process
    group failed. The rank stops with a one-line message and exit status 1; torchrun then stops
    the other ranks (they wait in collectives this rank will never join: no report is gathered)."""

    exit_code = 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _report(plan: PlanResult, mode: Mode, device: str, steps: int, predicted: Figures, per_rank: list[Figures],
            notes: tuple[str, ...], tolerances: dict[str, float]) -> ValidationReport:
    worst = max(per_rank, key=lambda f: f.peak_allocated_bytes or 0)
    times = [f.step_time_s for f in per_rank if f.step_time_s is not None]
    measured = worst.model_copy(update={"step_time_s": max(times) if times else None,
                                        "tokens_per_s": plan.training.tokens_per_step / max(times) if times else None})
    return build_report(plan, mode, device, steps, predicted, measured, fits=True, notes=notes, tolerances=tolerances,
                        per_rank=tuple(per_rank))


@contextmanager
def fake_process_group(dims: ParallelDims) -> Iterator[Any]:
    """Rank 0 of a process group of ``dims``' world whose collectives do nothing; yields the
    layout's device mesh (``validate.layout.device_mesh``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("simulate: a process group is already running (torchrun?); use --mode run under torchrun")
    forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        yield device_mesh("cpu", dims)  # outside FakeTensorMode: it reads its rank map
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Drop DTensor's cached sharding decisions: they hold device meshes, and a mesh compares
    equal to one of an earlier process group with the same layout (torch 2.13 ``DeviceMesh.__eq__``
    ignores the group), so a later run in this process would be handed a destroyed group's name
    ("Could not resolve the process group registered under the name 7")."""
    import torch.distributed.tensor.debug as dtensor_debug
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = (  # private to torch (2.13 has every one; an older torch may lack some)
        getattr(dtensor_debug, "_clear_sharding_prop_cache", None),  # the Python cache and the C++ fast path's
        getattr(propagator.propagate_op_sharding, "cache_clear", None),
        getattr(getattr(propagator, "_propagate_tensor_meta_cached", None), "cache_clear", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    )
    for clear in clears:
        if clear is not None:
            clear()


def _simulate_layout(plan: PlanResult) -> int:
    """Peak bytes of rank 0 running the plan's step (tensor parallelism, FSDP2) on a fake process
    group under fake tensors."""
    model, training, knobs = plan.model.config, plan.training, steady_state_knobs(plan.best.knobs)
    spec = precision_spec(knobs.precision)
    rows = plan.best.knobs.micro_batch_size * plan.best.knobs.grad_accum_steps  # the whole step's batch
    with fake_process_group(knobs.parallel) as mesh, FakeTensorMode(), meshes_outside_fake_mode(), \
            ring_attention_on_cpu():
        built = configure_model(build_model(model, param_dtype(spec), knobs.parallel.ep), knobs)
        as_on_a_gpu(built)
        net = apply_layout(built, knobs, spec, mesh)
        optimizer = make_optimizer(net, training)
        ids = torch.randint(0, model.vocab_size, (rows, training.seq_len))
        cp_mesh = context_mesh(mesh, knobs.parallel)
        if cp_mesh is not None:
            shard_batch(cp_mesh, ids)  # this rank's share of every sequence, as its data loader hands it out
        step_spec = compute_spec(knobs)

        def step() -> None:
            train_step(net, optimizer, ids, ids, knobs, step_spec, context=cp_mesh)

        step()
        tracker = LiveStorageTracker()
        tracker.track([*net.parameters(), *net.buffers(), ids, *optimizer_state(optimizer)])
        with tracker:
            tracker.reset_peak()
            step()
        return tracker.peak_bytes


def simulate_rank(plan: PlanResult, progress: Progress | None = None) -> ValidationReport:
    """The rank with the most state, in one process under fake tensors (FSDP2 run on a fake
    process group; DDP and ZeRO-1 emulated), with at most three micro-batches per step
    (``steady_state_knobs``: the same peak)."""
    model, training, knobs = plan.model.config, plan.training, steady_state_knobs(plan.best.knobs)
    say = progress or (lambda _text: None)
    dims = knobs.parallel
    say(f"simulating rank 0 of {dims.world_size} under fake tensors")
    predicted = _predicted(plan.best.estimate).model_copy(update={"step_time_s": None, "tokens_per_s": None,
                                                                  "model_flops_per_step": None})
    if dims.shards_parameters or dims.tp > 1 or dims.cp > 1:
        measured = Figures(peak_allocated_bytes=_simulate_layout(plan))
        notes: tuple[str, ...] = (f"simulate: rank 0 of {dims.world_size} running {layout_label(dims)} on a fake process "
                                  "group under fake tensors (collectives are no-ops on the real buffers); no "
                                  "communication time",)
        notes += shortened_step_note(plan.best.knobs, flops_counted=False) + simulated_dropout_note(model)
        return _report(plan, Mode.SIMULATE, "cpu (fake tensors, fake process group)", 1, predicted, [measured], notes,
                       TOLERANCES[(Mode.SIMULATE, "cpu")])
    spec = precision_spec(knobs.precision)
    graph = cached_graph(model, knobs.micro_batch_size, training.seq_len, spec)
    rows = plan.best.knobs.micro_batch_size * plan.best.knobs.grad_accum_steps  # the whole step's batch
    with FakeTensorMode():
        net = configure_model(build_model(model, param_dtype(spec)), knobs)
        as_on_a_gpu(net)
        named = dict(net.named_parameters())
        if knobs.parallel.sharding is Sharding.OPTIMIZER:
            partitions = zero1_partition(list(graph.param_specs.values()), knobs.data_parallel)
            mine = max(partitions, key=lambda part: sum(p.numel for p in part))
            cls, kwargs = _optimizer_args(training)
            optimizer = cls([named[p.name] for p in mine], **kwargs)
        else:
            optimizer = make_optimizer(net, training)
        for p in net.parameters():  # DDP's buckets: every gradient allocated up front
            p.grad = torch.zeros_like(p)
        ids = torch.randint(0, model.vocab_size, (rows, training.seq_len))
        tracker = LiveStorageTracker()

        def step() -> None:  # as with DDP's bucket views: the gradients stay allocated, zeroed in place
            train_step(net, optimizer, ids, ids, knobs, spec, make_scaler(spec, "cpu"), keep_grads=True)

        step()
        tracker.track([*net.parameters(), *net.buffers(), ids, *(p.grad for p in net.parameters() if p.grad is not None),
                       *optimizer_state(optimizer)])
        with tracker:
            tracker.reset_peak()
            step()
    measured = Figures(peak_allocated_bytes=tracker.peak_bytes)
    notes = (f"simulate: rank with the largest optimizer partition of {knobs.data_parallel}, emulated in one process "
             "under fake tensors (gradients held as DDP's buckets, ZeRO-1 state of that rank only); no communication",)
    notes += shortened_step_note(plan.best.knobs, flops_counted=False) + simulated_dropout_note(model)
    return _report(plan, Mode.SIMULATE, "cpu (fake tensors)", 1, predicted, [measured], notes,
                   TOLERANCES[(Mode.SIMULATE, "cpu")])


def run_rank(plan: PlanResult, device: str, steps: int, profile: HardwareProfile | None = None) -> ValidationReport | None:
    """This rank's part of a torchrun validation; returns the report on rank 0, None elsewhere."""
    knobs = plan.best.knobs
    world = int(os.environ["WORLD_SIZE"])
    if world != knobs.parallel.world_size:
        raise ConfigError(f"torchrun: {world} processes, but the plan is for {knobs.parallel.world_size} GPUs; "
                          f"use --nproc-per-node {knobs.parallel.world_size} (times nodes)")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    owned = not dist.is_initialized()  # else the caller owns the process group
    if owned:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    try:
        report = _rank_report(plan, dev, steps, profile)
    except torch.OutOfMemoryError:
        allocated = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        at = f" with {allocated / 2**30:.2f} GiB allocated" if allocated else ""
        predicted = plan.best.estimate.memory.peak_allocated_bytes / 2**30
        raise RankFailedError(
            f"rank {dist.get_rank()} of {world} ran out of memory{at} (predicted peak {predicted:.2f} GiB per rank): "
            "the plan does not fit on this device; torchrun stops the other ranks"
        ) from None
    except dist.DistError as error:  # NCCL/gloo failures (a collective that cannot allocate, a lost peer)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RankFailedError(f"rank {dist.get_rank()} of {world}: {type(error).__name__}: {first}; "
                                   "torchrun stops the other ranks") from None
    if not owned:
        return report
    # Leave together: a rank that exits while rank 0 still builds the report closes its sockets
    # under gloo's background threads, which abort rank 0 (SIGABRT, "Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()
    return report


def _rank_report(plan: PlanResult, dev: torch.device, steps: int, profile: HardwareProfile | None) -> ValidationReport | None:
    knobs, model, training = plan.best.knobs, plan.model.config, plan.training
    world = dist.get_world_size()
    rank = dist.get_rank()
    spec = precision_spec(knobs.precision)
    torch.manual_seed(1234 + rank)
    with torch.device(dev):
        net = configure_model(build_model(model, param_dtype(spec), knobs.parallel.ep), knobs)
    cp_mesh = None
    if knobs.parallel.shards_parameters or knobs.parallel.tp > 1:
        mesh = device_mesh(dev.type, knobs.parallel)
        wrapped: torch.nn.Module = apply_layout(net, knobs, spec, mesh)
        optimizer = make_optimizer(wrapped, training)
        cp_mesh = context_mesh(mesh, knobs.parallel)
    else:
        wrapped = wrap_data_parallel(net, dev)
        optimizer = make_optimizer(wrapped, training, knobs.parallel.sharding)
    step_spec = compute_spec(knobs)
    rows = knobs.micro_batch_size * knobs.grad_accum_steps
    # the ranks of a tensor- and context-parallel group share their batch (mesh: tp innermost, then cp)
    torch.manual_seed(4321 + rank // (knobs.parallel.tp * knobs.parallel.cp))
    ids = torch.randint(0, model.vocab_size, (rows, training.seq_len), device=dev)
    if cp_mesh is not None:
        shard_batch(cp_mesh, ids)
    scaler = make_scaler(spec, dev.type)

    def step() -> None:
        with ring_attention_on_cpu() if dev.type == "cpu" else contextlib.nullcontext():
            train_step(wrapped, optimizer, ids, ids, knobs, step_spec, scaler, context=cp_mesh)

    def resident() -> list[torch.Tensor]:  # DDP's bucket views keep the gradients between steps
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        return [*net.parameters(), *net.buffers(), ids, *grads, *optimizer_state(optimizer)]

    times, peak, _ = measure_steps(step, dev, steps, resident)
    mine = Figures(peak_allocated_bytes=int(peak), step_time_s=statistics.median(times))
    gathered: list[Figures | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    est = estimate(model, training, profile.with_gpus_per_node(plan.parallel.gpus_per_node), knobs,
                   plan.hbm_cap_bytes) if profile \
        else plan.best.estimate
    predicted = _predicted(est).model_copy(update={"model_flops_per_step": None})
    kind = "cuda" if dev.type == "cuda" else "cpu"
    tolerances = dict(TOLERANCES[(Mode.RUN, kind)])
    notes: tuple[str, ...] = (f"{world} ranks over {'nccl' if kind == 'cuda' else 'gloo'}; memory: the largest "
                              "rank; step time: the slowest rank",)
    if kind == "cpu":
        tolerances.pop("step_time", None)  # ranks share this machine's cores: time is reported, not judged
        notes += ("CPU ranks share the host's cores: step time is reported, not judged",)
    label = f"{kind} x {world} ranks" + (f": {torch.cuda.get_device_name(dev)}" if kind == "cuda" else "")
    return _report(plan, Mode.RUN, label, steps, predicted, [f for f in gathered if f is not None], notes, tolerances)
