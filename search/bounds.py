"""Lower bounds of a point's least memory that need no memory walk, shared by its micro-batches.

At the optimizer step every backward has freed its activations: a rank holds its parameters,
their gradients, the optimizer state, the step's temporaries and the data batch, whatever the
checkpoint placement (``static_floor_bytes``, checked against the walk in
tests/search/test_least_memory.py). None of these depends on the micro-batch: the parameters
are the model's, and the batch holds every sequence of the rank's step (micro-batch x
accumulation, the same at every micro-batch of a layout). So:

- ``step_floor_bound`` bounds it from the rank's parameter sizes alone (its tensor- and
  expert-parallel shard, as ``peak_lower_bound`` reads them), without building the graph: the
  smallest plan and the fewest-GPUs advice skip whole layouts with it;
- ``static_floor_at`` is the exact figure, found once per layout (one graph, the first
  micro-batch asked) and reused by every other micro-batch of it (tests/search/test_bounds.py
  checks both against the graph's static memory at every micro-batch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hardware.profile import HardwareProfile
from planner.cache import IdentityCache
from planner.graph.description import ModelDesc
from planner.memory.step import StaticMemory
from planner.model.config import ModelConfig, TrainConfig
from planner.ops.base import ParamTensor
from planner.parallel.collectives import zero1_partition
from planner.parallel.expert import shard_experts
from planner.parallel.strategies import strategy_for
from planner.parallel.tensor import rank_description
from planner.plan.knobs import Knobs
from planner.plan.optimizer import optimizer_spec
from planner.precision import precision_spec
from planner.program.estimate import check_knobs, rank_graph, static_for


@dataclass(frozen=True)
class _RankParams:
    """A rank's parameter tensors (registration order: ZeRO-1's partition reads it) and the same
    tensors grouped by what the floor reads of each, with their counts: the floor's sums run over
    the few distinct tensor shapes, not over every block's tensors again at every layout."""

    tensors: tuple[ParamTensor, ...]
    groups: tuple[tuple[int, int, bool, int, int], ...]  # (numel, grad elements, expert-parallel, count, state elements)


def _rank_params(desc: ModelDesc) -> _RankParams:
    tensors = tuple(desc.params.values())
    counts = Counter((p.numel, p.grad_elements, p.expert_parallel, p.state_elements) for p in tensors)
    return _RankParams(tensors, tuple((numel, grads, expert, count, state)
                                      for (numel, grads, expert, state), count in counts.items()))


_DESCRIPTIONS: IdentityCache[_RankParams] = IdentityCache()
_STEP_FLOORS: IdentityCache[int] = IdentityCache(maxsize=4096)
_STATIC_FLOORS: IdentityCache[int] = IdentityCache(maxsize=4096)


def _layout_key(knobs: Knobs) -> tuple[object, ...]:
    """What the optimizer step's memory depends on: everything but how the rank's sequences are
    split into micro-batches."""
    return (knobs.precision, knobs.parallel, knobs.fsdp_grad_sync, knobs.micro_batch_size * knobs.grad_accum_steps)


def step_floor_bound(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    """Bytes every placement of ``knobs`` holds at the optimizer step, without the graph: at most
    ``static_floor_bytes`` of its static memory (fewer where rounding and FSDP2's padding add)."""
    return _STEP_FLOORS.get((model, training, hw), _layout_key(knobs),
                            lambda: _step_floor(model, training, hw, knobs))


def _step_floor(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    if knobs.parallel.pp > 1:  # the pipeline ranks split the model state: the busiest holds at least the average
        return _whole_step_floor(model, training, hw, knobs) // knobs.parallel.pp
    return _whole_step_floor(model, training, hw, knobs)


def _whole_step_floor(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    spec = precision_spec(knobs.precision)
    opt = optimizer_spec(training.optimizer, training.optimizer_impl)
    dims = knobs.parallel
    rank = _DESCRIPTIONS.get((model,), (dims.tp, dims.sp, dims.ep), lambda: _rank_params(shard_experts(
        rank_description(model, dims.tp, dims.sp, 1), dims.ep, 1)))
    strategy = strategy_for(dims)
    per_param = opt.state_tensors_per_param + opt.step_temporaries_per_param  # both mirror the rank's shard
    data = 2 * hw.round_alloc(knobs.micro_batch_size * knobs.grad_accum_steps * training.seq_len * 8)
    width = spec.param_dtype.n_bytes
    if strategy.shards_params:  # FSDP2: padded shards of each tensor, its gradient's too
        ranks, expert_ranks = dims.fsdp_ranks, dims.expert_shard_ranks
        shards = sum(count * (numel * width // (expert_ranks if expert else ranks))
                     for numel, _, expert, count, _ in rank.groups)
        return shards * (2 + per_param) + data
    params = sum(count * hw.round_alloc(numel * width) for numel, _, _, count, _ in rank.groups)
    grads = sum(count * hw.round_alloc(grad * spec.grad_dtype.n_bytes) for _, grad, _, count, _ in rank.groups)
    # a fine-tuning plan's frozen base has no state (ParamTensor.state_elements 0)
    state = sum(count * hw.round_alloc(elements * width) for _, _, _, count, elements in rank.groups)
    if strategy.shards_state:  # ZeRO-1: state and temporaries of the largest partition
        one = max(sum(hw.round_alloc(p.numel * width) for p in part)
                  for part in zero1_partition(list(rank.tensors), knobs.data_parallel))
        return params + grads + one * per_param + data
    return params + state * per_param + grads + data


def static_floor_bytes(static: StaticMemory) -> int:
    """A lower bound of every placement's peak, without a walk: at the optimizer step the rank holds
    its parameters, optimizer state, data batch and every gradient, plus the step's temporaries
    (tests/search/test_least_memory.py checks it against the walk's optimizer step)."""
    return (static.params_bytes + static.optimizer_bytes + static.data_bytes + static.grads_bytes
            + static.optimizer_step_temp_bytes)


def static_floor_at(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs) -> int:
    """``static_floor_bytes`` of ``knobs``' static memory, from one graph per layout (checked)."""
    check_knobs(model, training, hw, knobs)
    return _STATIC_FLOORS.get((model, training, hw), _layout_key(knobs), lambda: static_floor_bytes(static_for(
        rank_graph(model, training, knobs, check_knobs(model, training, hw, knobs), hw), hw, training, knobs)))
