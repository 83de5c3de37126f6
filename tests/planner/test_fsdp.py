"""ZeRO-2/3 as FSDP2 runs them: per-unit buffers against the bytes measured op by op in
docs/distributed_memory.md (section 4.4), per-rank model state against ZeRO's closed form,
communication volume against the ZeRO paper, and the knobs FSDP2 refuses. The peaks themselves
are checked against FSDP2 running on a fake process group in tests/validate/test_distributed.py."""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.model.config import ModelConfig, TrainConfig
from planner.parallel.collectives import ParallelConfig, model_state_bytes
from planner.parallel.fsdp_units import FsdpLayout, fsdp_bytes_moved, fsdp_collectives
from planner.parallel.strategies import strategy_for
from planner.plan.knobs import GradSync, Knobs
from planner.plan.parallel_dims import ParallelDims
from planner.plan.schedule import accumulation
from planner.program.estimate import cached_graph, compute_spec, estimate, layout_for, static_for
from planner.timing.step_time import Communication, communication, rank_timeline
from roofplan import api

HW = load_hardware("h100-sxm")
# the probe model of docs/distributed_memory.md (Llama-shaped, 4 blocks)
PROBE = ModelConfig(family="llama", name="probe-llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=688,
                    vocab_size=4096, max_seq_len=256)


def fsdp_communication(layout: FsdpLayout, hw: object, parallel: ParallelConfig, accumulation_steps: int,
                       forward_s: float, backward_s: float) -> Communication:
    """A step of ``accumulation_steps`` micro-batches (``forward_s``/``backward_s`` each) with
    FSDP2's collectives placed on its timeline."""
    schedule = accumulation(accumulation_steps, sync_last=layout.grad_sync is GradSync.LAST)
    timeline = rank_timeline(schedule, forward_s, backward_s, 0.0, fsdp_collectives(layout, HW, parallel),
                             HW.overlap_compute_slowdown)
    return communication(timeline, accumulation_steps * (forward_s + backward_s),
                         fsdp_bytes_moved(layout, parallel, accumulation_steps))


def _layout(model: ModelConfig, precision: str, world: int, stage: int = 3):  # noqa: ANN202
    knobs = Knobs(micro_batch_size=4, precision=precision, data_parallel=world, zero_stage=stage)
    graph = cached_graph(model, 4, 256, compute_spec(knobs))
    return graph, knobs, layout_for(graph, knobs, HW)


@pytest.mark.parametrize(("precision", "gather", "gather_input", "root_gather", "root_gather_input"), [
    ("fp32", 2_902_016, 0, 8_389_632, 0),
    ("bf16-mixed", 1_451_008, 181_760, 4_194_816, 524_800),
])
def test_unit_buffers_match_the_measured_calls(precision: str, gather: int, gather_input: int, root_gather: int,
                                               root_gather_input: int) -> None:
    """docs/distributed_memory.md 4.4, N = 8: each figure was read off one FSDP2 call by the tracker."""
    _, _, layout = _layout(PROBE, precision, 8)
    block, root = layout.blocks[1], layout.root
    assert (block.gather_output_bytes, block.gather_input_bytes, block.unsharded_bytes) == (gather, gather_input, gather)
    assert (block.reduce_input_bytes, block.sharded_grad_bytes) == (2_902_016, 363_008)
    assert (root.gather_output_bytes, root.gather_input_bytes, root.unsharded_bytes) == (
        root_gather, root_gather_input, root_gather)
    assert (root.reduce_input_bytes, root.sharded_grad_bytes) == (8_389_632, 1_049_088)


@pytest.mark.parametrize(("world", "measured"), [(2, 30_032_896), (8, 7_545_856), (64, 996_352)])
def test_static_bytes_match_the_probe(world: int, measured: int) -> None:
    """Rank 0 between steps (4.3): padded shards + AdamW state of its local shards + the batch.
    The probe's figure also holds 39 host-side AdamW step scalars (512 B each on the tracker;
    host memory on CUDA) and one shared ids/targets tensor where the planner counts two."""
    graph, knobs, _ = _layout(PROBE, "fp32", world)
    training = TrainConfig(seq_len=256, global_batch_size=4 * 2 * world)
    static = static_for(graph, HW, training, knobs.model_copy(update={"grad_accum_steps": 2}))
    host_scalars, second_batch_tensor = 39 * 512, 2 * 4 * 256 * 8
    assert static.params_bytes + static.optimizer_bytes + static.data_bytes == (
        measured - host_scalars + second_batch_tensor)


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
def test_model_state_matches_zero3_formula(precision: str, world: int) -> None:
    """Sharded parameters + sharded gradients + AdamW state per rank vs (P+G+O)Psi/N (Rajbhandari
    et al. 2019, Fig. 1) with FSDP2's bytes: bf16-mixed keeps fp32 shards, gradients and moments.
    Padding every tensor to ceil(rows/N) rows is the difference."""
    model, training = api.load_model("llama2-7b", global_batch_size=world)
    knobs = Knobs(micro_batch_size=1, precision=precision, data_parallel=world, zero_stage=3)
    graph = cached_graph(model, 1, training.seq_len, compute_spec(knobs))
    static = static_for(graph, HW, training, knobs)
    stored = 2 if precision == "bf16-true" else 4
    closed = model_state_bytes(6_738_415_616, world, 3, stored, stored, 2 * stored)
    assert static.params_bytes + static.grads_bytes + static.optimizer_bytes == pytest.approx(closed, rel=0.002)


def test_communication_volume_is_the_zero_papers() -> None:
    """ZeRO (Rajbhandari et al. 2019, Sec. 7.2): stage 2 moves what DDP's all-reduce moves (2 Psi
    per rank: a reduce-scatter and an all-gather), stage 3 1.5x that (the parameters gathered
    again for the backward)."""
    graph, knobs, layout2 = _layout(PROBE, "fp32", 8, stage=2)
    _, _, layout3 = _layout(PROBE, "fp32", 8, stage=3)
    parallel = ParallelConfig(world_size=8)
    ddp_knobs = knobs.model_copy(update={"parallel": ParallelDims.data_parallel_of(8, 0)})
    ddp = strategy_for(ddp_knobs.parallel).bytes_moved(graph, HW, ddp_knobs)
    stage2 = fsdp_communication(layout2, HW, parallel, 1, 1.0, 2.0)
    stage3 = fsdp_communication(layout3, HW, parallel, 1, 1.0, 2.0)
    assert stage2.bytes_moved == pytest.approx(ddp, rel=0.002)  # padding and 512-byte rounding
    assert stage3.bytes_moved == pytest.approx(1.5 * ddp, rel=0.002)


def test_exposed_communication() -> None:
    """Compute hides the blocks' collectives, not the root's first gather and last reduce-scatter;
    with no compute to hide behind, everything is exposed; accumulation repeats it per micro-batch."""
    _, _, layout = _layout(PROBE, "bf16-mixed", 8, stage=3)
    parallel = ParallelConfig(world_size=8)
    hidden = fsdp_communication(layout, HW, parallel, 1, 10.0, 20.0)
    bare = fsdp_communication(layout, HW, parallel, 1, 0.0, 0.0)
    assert 0 < hidden.exposed_s < hidden.total_s
    assert bare.exposed_s == pytest.approx(bare.total_s)
    twice = fsdp_communication(layout, HW, parallel, 2, 10.0, 20.0)
    assert twice.exposed_s == pytest.approx(2 * hidden.exposed_s) and twice.bytes_moved == 2 * hidden.bytes_moved


def test_sharding_lowers_the_peak() -> None:
    """Same knobs on 8 GPUs: ZeRO-3 < ZeRO-2 < ZeRO-1 < DDP per-rank peak (probe model)."""
    training = TrainConfig(seq_len=256, global_batch_size=64)
    peaks = [estimate(PROBE, training, HW, Knobs(micro_batch_size=4, grad_accum_steps=2, data_parallel=8,
                                                 zero_stage=stage, precision="fp32")).memory.peak_allocated_bytes
             for stage in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


@pytest.mark.parametrize(("update", "field"), [
    ({"precision": "fp16-mixed"}, "knobs.precision"),
    ({"checkpoint_segments": ((0, 1),)}, "knobs.checkpoint_segments"),
])
def test_what_fsdp2_does_not_run_is_refused(update: dict, field: str) -> None:
    knobs = Knobs(micro_batch_size=4, data_parallel=8, zero_stage=3, **update)
    with pytest.raises(ConfigError, match=field):
        estimate(PROBE, TrainConfig(seq_len=256, global_batch_size=32), HW, knobs)


def test_gradient_sync_on_the_last_micro_batch_moves_one_reduce_scatter_per_step() -> None:
    """``fsdp_grad_sync="last"``: every micro-batch still all-gathers, only the last one
    reduce-scatters, so the step moves (A gathers + 1 reduce-scatter), not A of each."""
    _, _, every = _layout(PROBE, "bf16-mixed", 8, stage=3)
    knobs = Knobs(micro_batch_size=4, precision="bf16-mixed", data_parallel=8, zero_stage=3, fsdp_grad_sync="last")
    layout = layout_for(cached_graph(PROBE, 4, 256, compute_spec(knobs)), knobs, HW)
    parallel = ParallelConfig(world_size=8)
    factor = 7 / 8
    gathered = 2 * sum(u.gather_output_bytes for u in layout.units)  # stage 3: forward and backward
    scattered = sum(u.reduce_input_bytes for u in layout.units)
    last = fsdp_communication(layout, HW, parallel, 4, 10.0, 20.0)
    assert last.bytes_moved == pytest.approx(factor * (4 * gathered + scattered))
    per_micro_batch = fsdp_communication(every, HW, parallel, 4, 10.0, 20.0)
    assert per_micro_batch.bytes_moved == pytest.approx(factor * 4 * (gathered + scattered))
    assert last.exposed_s <= per_micro_batch.exposed_s and last.total_s < per_micro_batch.total_s
    one = fsdp_communication(layout, HW, parallel, 1, 10.0, 20.0)  # nothing to accumulate: the same
    assert one.bytes_moved == pytest.approx(fsdp_communication(every, HW, parallel, 1, 10.0, 20.0).bytes_moved)


def test_holding_unsharded_gradients_costs_the_full_models_gradients() -> None:
    """Without a policy the held gradients are the parameters' own .grad: the peak grows by about
    the whole model's gradients less the shards they replace (docs section 4.9)."""
    training = TrainConfig(seq_len=256, global_batch_size=64)
    every, last = (estimate(PROBE, training, HW, Knobs(micro_batch_size=4, grad_accum_steps=2, data_parallel=8,
                                                       zero_stage=3, precision="fp32", fsdp_grad_sync=sync))
                   for sync in ("every", "last"))
    grads = 4 * api.summarize_model(PROBE).n_params
    grown = last.memory.peak_allocated_bytes - every.memory.peak_allocated_bytes
    assert grads / 8 < grown <= grads * 1.01


@pytest.mark.parametrize(("call", "needle"), [
    ({"gpus": 1}, "--fsdp-grad-sync"),
    ({"gpus": 8, "zero_stage": 1}, "--fsdp-grad-sync"),
    ({"gpus": 8, "zero_stage": 3, "value": "sometimes"}, "not a mode"),
])
def test_gradient_sync_mode_is_checked(call: dict, needle: str) -> None:
    model, training = api.load_model("tiny-llama", global_batch_size=16)
    with pytest.raises(ConfigError, match=needle):
        api.plan(model, training, HW, micro_batch_size=2, precisions=["fp32"], checkpoint="none",
                 gpus=call["gpus"], zero_stage=call.get("zero_stage"), fsdp_grad_sync=call.get("value", "last"))
    with pytest.raises(ValueError, match="fsdp_grad_sync"):
        Knobs(micro_batch_size=2, data_parallel=8, zero_stage=1, fsdp_grad_sync="last")
