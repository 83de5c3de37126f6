"""Price one (micro-batch, precision) point: the fastest checkpoint placement that fits the cap.

Step time grows with every checkpointed block, so the fastest placement that fits is the one
with the fewest checkpointed blocks whose peak fits; among placements with that count, the
exact solver (``planner.placement``) picks the one with the lowest peak. When even
checkpointing every block alone does not fit, segments of consecutive blocks checkpointed as one
unit (Chen et al. 2016, "Training deep nets with sublinear memory cost": segments of about
sqrt(L) blocks) keep fewer block inputs. The chosen knobs are priced again by the full memory
walk, so the reported figures never rest on the decomposition alone.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hardware.profile import HardwareProfile
from planner.config import ModelConfig, TrainConfig
from planner.estimate import (
    check_knobs,
    device_bytes,
    estimate,
    peak_lower_bound,
    rank_graph,
    rank_timing,
    static_for,
    with_communication,
)
from planner.graph import LayerGraph
from planner.knobs import Knobs
from planner.memory import Phase, Timeline, checkpoint_units, recomputed_ops, simulate_step
from planner.placement import NotDecomposableError, placement_profile
from planner.results import ParetoPoint
from planner.strategies import strategy_for

BRUTE_FORCE_MAX_BLOCKS = 12


@dataclass(frozen=True)
class Evaluation:
    """The best plan at one search point, and every placement priced on the way.

    ``chosen`` carries the solver's step time and device bytes; the search re-prices the plans
    it reports with the full memory walk.
    """

    chosen: ParetoPoint
    points: tuple[ParetoPoint, ...]
    cap_bytes: int
    # only lower bounds were priced: nothing here can fit (step time infinite), or nothing here can
    # beat the fastest plan found before it (step time the bound, device bytes a lower bound)
    pruned: bool = False

    @property
    def knobs(self) -> Knobs:
        return self.chosen.knobs

    @property
    def fits(self) -> bool:
        return self.chosen.device_bytes <= self.cap_bytes


def _per_block_curve(
    model: ModelConfig, training: TrainConfig, hw: HardwareProfile, base: Knobs, graph: LayerGraph,
    all_checkpointed: Timeline,
) -> list[tuple[int, tuple[int, ...]]]:
    """For k = 0..L checkpointed blocks: the lowest peak and a placement reaching it (``graph``:
    the point's rank graph)."""
    static = static_for(graph, hw, training, base)
    try:
        profile = placement_profile(graph, static, hw.round_alloc, base.schedule, all_checkpointed)
        return profile.min_peak_by_count()
    except NotDecomposableError:
        pass
    n = model.n_layers
    best: dict[int, tuple[int, tuple[int, ...]]] = {}
    statuses = itertools.product((0, 1), repeat=n) if n <= BRUTE_FORCE_MAX_BLOCKS else (
        tuple(1 if i < k else 0 for i in range(n)) for k in range(n + 1)  # earliest-first when too many
    )
    for bits in statuses:
        units = checkpoint_units(n, [i for i, b in enumerate(bits) if b])
        peak = simulate_step(graph, static, hw.round_alloc, units, base.schedule).peak.bytes
        k = sum(bits)
        if k not in best or peak < best[k][0]:
            best[k] = (peak, tuple(bits))
    return [best[k] for k in range(n + 1)]


def segment_plans(n_layers: int) -> list[tuple[tuple[int, int], ...]]:
    """Uniform segmentations of all blocks: lengths 2, 3, 4, sqrt(L) and 2 sqrt(L) (Chen et al.)."""
    root = max(2, round(math.sqrt(n_layers)))
    lengths = sorted({s for s in (2, 3, 4, root, 2 * root) if 2 <= s <= n_layers})
    return [tuple((i, min(i + s - 1, n_layers - 1)) for i in range(0, n_layers, s)) for s in lengths]


def evaluate(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    cap_bytes: int,
    base: Knobs,
    fixed_checkpoint: tuple[int, ...] | None = None,
    allow_segments: bool = True,
    prune: bool = True,
    gpus_per_node: int = 8,
    beat_s: float | None = None,
) -> Evaluation:
    """The fastest plan at this point (``base``: its micro-batch, precision and layout,
    checkpointing nothing) that fits ``cap_bytes`` (or the smallest one if none fits).

    With ``prune``, a point whose lower bound already exceeds the cap is not walked at all, nor
    one whose step time without recompute or communication (what every placement of it takes at
    least) is above ``beat_s``, the fastest plan found so far: neither can be the answer."""
    if fixed_checkpoint is not None:
        knobs = base.model_copy(update={"checkpoint_blocks": fixed_checkpoint})
        est = estimate(model, training, hw, knobs, cap_bytes, gpus_per_node)
        point = ParetoPoint(step_time_s=est.step_time_s, device_bytes=est.memory.device_bytes, knobs=knobs)
        return Evaluation(chosen=point, points=(point,), cap_bytes=cap_bytes)
    spec = check_knobs(model, training, hw, base)
    floor = device_bytes(peak_lower_bound(model, training, hw, base), hw)
    if prune and floor > cap_bytes:
        point = ParetoPoint(step_time_s=math.inf, device_bytes=floor, knobs=base)
        return Evaluation(chosen=point, points=(), cap_bytes=cap_bytes, pruned=True)
    graph = rank_graph(model, training, base, spec, gpus_per_node)
    times, no_recompute = rank_timing(graph, hw, training, base, frozenset())
    if prune and beat_s is not None and no_recompute.step_time_s > beat_s:
        point = ParetoPoint(step_time_s=no_recompute.step_time_s, device_bytes=floor, knobs=base)
        return Evaluation(chosen=point, points=(), cap_bytes=cap_bytes, pruned=True)
    fwd_s = dict(zip(times.names, times.fwd_s, strict=True))
    # a step's time is additive in the forward time each checkpointed block runs again
    rerun_s = [
        base.schedule.count(Phase.BACKWARD)
        * sum(fwd_s[name] for name in recomputed_ops(graph, checkpoint_units(model.n_layers, (b,))))
        for b in range(model.n_layers)
    ]
    points: list[ParetoPoint] = []
    every = tuple(range(model.n_layers))
    static = static_for(graph, hw, training, base)
    all_walk = simulate_step(graph, static, hw.round_alloc, checkpoint_units(model.n_layers, every),
                             base.schedule, record_trace=True)
    all_peak = all_walk.peak.bytes
    if device_bytes(all_peak, hw) <= cap_bytes:
        curve = _per_block_curve(model, training, hw, base, graph, all_walk)
    else:  # not even every block checkpointed fits: no per-block placement can
        curve = [(all_peak, (1,) * model.n_layers)]
    for peak, placement in curve:
        blocks = tuple(i for i, s in enumerate(placement) if s)
        rerun = sum(rerun_s[b] for b in blocks)
        time = no_recompute.model_copy(update={"recompute_s": rerun, "step_time_s": no_recompute.step_time_s + rerun})
        knobs = base.model_copy(update={"checkpoint_blocks": blocks})
        step_s = with_communication(graph, hw, knobs, gpus_per_node, time).step_time_s
        points.append(ParetoPoint(step_time_s=step_s, device_bytes=device_bytes(peak, hw), knobs=knobs))
    fitting = [p for p in points if p.device_bytes <= cap_bytes]
    # segments keep one input per segment instead of one per block: at best they save all but
    # one block input; skip them when even that cannot reach the cap
    block_input = hw.round_alloc(graph.node("blocks.0.attn_norm").cost.output.n_bytes)
    best_case = device_bytes(all_peak - (model.n_layers - 1) * block_input, hw)
    if not fitting and allow_segments and strategy_for(base.parallel).allows_segments and best_case <= cap_bytes:
        for segments in segment_plans(model.n_layers):
            knobs = base.model_copy(update={"checkpoint_segments": segments})
            est = estimate(model, training, hw, knobs, cap_bytes, gpus_per_node)
            points.append(ParetoPoint(step_time_s=est.step_time_s, device_bytes=est.memory.device_bytes, knobs=knobs))
        fitting = [p for p in points if p.device_bytes <= cap_bytes]
    if fitting:
        chosen = min(fitting, key=lambda p: (p.step_time_s, p.device_bytes))
    else:
        chosen = min(points, key=lambda p: (p.device_bytes, p.step_time_s))
    return Evaluation(chosen=chosen, points=tuple(points), cap_bytes=cap_bytes)


def least_memory_at(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    base: Knobs,
    fixed_checkpoint: tuple[int, ...] | None = None,
    allow_segments: bool = True,
    gpus_per_node: int = 8,
) -> tuple[Knobs, int]:
    """The placement of ``base`` (micro-batch, precision, sharding) with the least peak allocated
    bytes, and that peak: the exact solver's lowest peak over every count of checkpointed blocks
    (ties: fewer blocks, so less recompute) and every uniform segmentation the search may choose."""
    if fixed_checkpoint is not None:
        knobs = base.model_copy(update={"checkpoint_blocks": fixed_checkpoint})
        return knobs, estimate(model, training, hw, knobs, None, gpus_per_node).memory.peak_allocated_bytes
    spec = check_knobs(model, training, hw, base)
    graph = rank_graph(model, training, base, spec, gpus_per_node)
    static = static_for(graph, hw, training, base)
    every = tuple(range(model.n_layers))
    all_walk = simulate_step(graph, static, hw.round_alloc, checkpoint_units(model.n_layers, every),
                             base.schedule, record_trace=True)
    peak, placement = min(_per_block_curve(model, training, hw, base, graph, all_walk), key=lambda c: c[0])
    options = [(peak, base.model_copy(update={"checkpoint_blocks": tuple(i for i, s in enumerate(placement) if s)}))]
    if allow_segments and strategy_for(base.parallel).allows_segments:  # as the search
        for segments in segment_plans(model.n_layers):
            knobs = base.model_copy(update={"checkpoint_segments": segments})
            options.append((estimate(model, training, hw, knobs, None, gpus_per_node).memory.peak_allocated_bytes, knobs))
    peak, knobs = min(options, key=lambda option: option[0])  # ties: the first (no segments)
    return knobs, peak
