"""Price one (micro-batch, precision) point: the fastest checkpoint placement that fits the cap.

Step time grows with every checkpointed block, so the fastest placement that fits is the one
with the fewest checkpointed blocks whose peak fits; among placements with that count, the
exact solver (``planner.memory.placement``; ``planner.memory.placement_kinds`` where the blocks
are of several kinds) picks the one with the lowest peak. When even
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
from planner.graph.layer_graph import LayerGraph
from planner.memory.placement import NotDecomposableError, PlacementProfile, optimizer_step_bytes, placement_profile
from planner.memory.placement_kinds import block_kinds, exact_profile
from planner.memory.step import Phase, Timeline, checkpoint_units, recomputed_by_unit, simulate_step
from planner.model.config import ModelConfig, TrainConfig
from planner.parallel.strategies import strategy_for
from planner.plan.checkpointing import CheckpointPolicy, modelled_with_context_parallelism
from planner.plan.knobs import Knobs
from planner.program.estimate import (
    check_knobs,
    device_bytes,
    estimate,
    peak_lower_bound,
    static_for,
    step_program,
)
from planner.program.results import ParetoPoint
from planner.program.step_program import StepProgram
from planner.timing.op_times import TimeBreakdown
from search.bounds import static_floor_at, static_floor_bytes
from search.mixed import mixed_points
from search.pipeline_points import least_memory_pipelined, pipelined_placement

__all__ = ["Evaluation", "evaluate", "forward_floor_bytes", "least_memory_at", "segment_plans", "static_floor_bytes"]

BRUTE_FORCE_MAX_BLOCKS = 12
# blocks of more kinds than the exact solver separates, too many to enumerate: this many counts of
# checkpointed blocks (earliest first)
FALLBACK_COUNTS = 13


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
    all_checkpointed: Timeline, plain: list[Timeline] | None = None,
    profiles: dict[CheckpointPolicy, PlacementProfile] | None = None,
) -> list[tuple[int, tuple[int, ...]]]:
    """For k = 0..L checkpointed blocks: the lowest peak and a placement reaching it (``graph``:
    the point's rank graph; ``plain`` keeps the walk without checkpointing for the next policy,
    ``profiles`` the policy's placement profile when the exact solver applies)."""
    static = static_for(graph, hw, training, base)
    policy, save = base.checkpoint_policy, base.save_list
    plain = [] if plain is None else plain
    if not plain:
        plain.append(simulate_step(graph, static, hw.round_alloc, checkpoint_units(model.n_layers, ()),
                                   base.schedule, record_trace=True))
    try:  # blocks alike (planner.memory.placement) or of a few kinds (planner.memory.placement_kinds)
        profile = exact_profile(graph, static, hw.round_alloc, base.schedule, all_checkpointed, policy, save, plain[0])
        if profiles is not None and isinstance(profile, PlacementProfile):  # the two-policy solver needs alike blocks
            profiles[policy] = profile
        return profile.min_peak_by_count()
    except NotDecomposableError:
        pass
    n = model.n_layers
    best: dict[int, tuple[int, tuple[int, ...]]] = {}
    # blocks of more kinds than the exact solver separates, too many to enumerate: earliest first,
    # at FALLBACK_COUNTS counts from none to all (each walk is a whole step)
    counts = sorted({round(j * n / (FALLBACK_COUNTS - 1)) for j in range(FALLBACK_COUNTS)})
    statuses = itertools.product((0, 1), repeat=n) if n <= BRUTE_FORCE_MAX_BLOCKS else (
        tuple(1 if i < k else 0 for i in range(n)) for k in counts
    )
    for bits in statuses:
        units = checkpoint_units(n, [i for i, b in enumerate(bits) if b], (), policy, save)
        peak = simulate_step(graph, static, hw.round_alloc, units, base.schedule).peak.bytes
        k = sum(bits)
        if k not in best or peak < best[k][0]:
            best[k] = (peak, tuple(bits))
    return [best[k] for k in sorted(best)]


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
    beat: tuple[float, int] | None = None,
    policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,),
    mix_policies: bool = True,
) -> Evaluation:
    """The fastest plan at this point (``base``: its micro-batch, precision and layout,
    checkpointing nothing) that fits ``cap_bytes`` (or the smallest one if none fits), each
    checkpoint ``policies`` solved exactly for its placement.

    With ``prune``, a point whose lower bound already exceeds the cap is not walked at all, nor
    one dominated by plans found before (``beat``: a step time and device bytes): its step time
    without recompute or communication (what every placement of it takes at least) above the
    time, and the least memory any placement reaches not below the bytes. With ``mix_policies``, when checkpointing is needed,
    plans mixing two policies across blocks (``search.mixed``) join the single-policy ones."""
    if fixed_checkpoint is not None:
        knobs = base.model_copy(update={"checkpoint_blocks": fixed_checkpoint, "checkpoint_policy": policies[0]})
        est = estimate(model, training, hw, knobs, cap_bytes)
        point = ParetoPoint(step_time_s=est.step_time_s, device_bytes=est.memory.device_bytes, knobs=knobs)
        return Evaluation(chosen=point, points=(point,), cap_bytes=cap_bytes)
    if base.parallel.pp > 1:  # placed per pipeline rank (search.pipeline_points)
        chosen, priced, pruned = pipelined_placement(model, training, hw, cap_bytes, base, policies, prune,
                                                     beat if prune else None)
        return Evaluation(chosen=chosen, points=priced, cap_bytes=cap_bytes, pruned=pruned)
    check_knobs(model, training, hw, base)
    floor = device_bytes(peak_lower_bound(model, training, hw, base), hw)
    if prune and floor > cap_bytes:
        point = ParetoPoint(step_time_s=math.inf, device_bytes=floor, knobs=base)
        return Evaluation(chosen=point, points=(), cap_bytes=cap_bytes, pruned=True)
    program = step_program(model, training, hw, base)  # the point's program: every placement walks and times it
    graph, static, times = program.busiest.graph, program.busiest.static, program.busiest.times
    no_recompute = program.compute_time(frozenset())
    if prune and beat is not None and no_recompute.step_time_s > beat[0] and floor >= beat[1]:
        point = ParetoPoint(step_time_s=no_recompute.step_time_s, device_bytes=floor, knobs=base)
        return Evaluation(chosen=point, points=(), cap_bytes=cap_bytes, pruned=True)
    fwd_s = dict(zip(times.names, times.fwd_s, strict=True))
    points: list[ParetoPoint] = []
    all_peak = None
    plain: list[Timeline] = []  # the walk without checkpointing, shared by the policies
    runs: dict[CheckpointPolicy, _PolicyRun] = {}
    profiles: dict[CheckpointPolicy, PlacementProfile] = {}
    for policy in policies:  # a policy whose plan without checkpointing fits needs no other
        if _fits_plain(points, cap_bytes):
            break
        if not modelled_with_context_parallelism(policy, base.parallel.cp):
            continue
        knobs = base.model_copy(update={"checkpoint_policy": policy})
        runs[policy] = _policy_points(model, training, hw, knobs, program, fwd_s, no_recompute, cap_bytes,
                                      plain, profiles)
        points += runs[policy].points
        if policy is CheckpointPolicy.FULL:
            all_peak = runs[policy].all_peak
    if mix_policies and len(runs) > 1 and not _fits_plain(points, cap_bytes) and any(
            p.device_bytes <= cap_bytes for p in points):
        alike = len(set(block_kinds(graph))) == 1  # the two-policy solver needs blocks alike
        for policy, run in runs.items():  # a policy too big on its own can still mix
            if alike and policy not in profiles and plain:
                try:
                    profiles[policy] = placement_profile(graph, static, hw.round_alloc, base.schedule, run.all_walk,
                                                         policy, base.save_list, plain[0])
                except NotDecomposableError:
                    pass
        single = [c for run in runs.values() for c in run.compute]
        points += mixed_points(profiles, {p: r.rerun_s for p, r in runs.items()}, single, cap_bytes, program,
                               base, no_recompute)
    fitting = [p for p in points if p.device_bytes <= cap_bytes]
    # segments keep one input per segment instead of one per block: at best they save all but
    # one block input; skip them when even that cannot reach the cap
    block_input = hw.round_alloc(graph.node("blocks.0.attn_norm").cost.output.n_bytes)
    best_case = device_bytes(all_peak - (model.n_layers - 1) * block_input, hw) if all_peak is not None else None
    if (not fitting and allow_segments and strategy_for(base.parallel).allows_segments and best_case is not None
            and best_case <= cap_bytes):
        for segments in segment_plans(model.n_layers):
            knobs = base.model_copy(update={"checkpoint_segments": segments})
            est = estimate(model, training, hw, knobs, cap_bytes)
            points.append(ParetoPoint(step_time_s=est.step_time_s, device_bytes=est.memory.device_bytes, knobs=knobs))
        fitting = [p for p in points if p.device_bytes <= cap_bytes]
    if fitting:
        chosen = min(fitting, key=lambda p: (p.step_time_s, p.device_bytes))
    else:
        chosen = min(points, key=lambda p: (p.device_bytes, p.step_time_s))
    return Evaluation(chosen=chosen, points=tuple(points), cap_bytes=cap_bytes)


def _fits_plain(points: list[ParetoPoint], cap_bytes: int) -> bool:
    """A plan without checkpointing fits: no policy (nor mix) can be faster."""
    return any(p.device_bytes <= cap_bytes and not p.knobs.checkpoint_blocks for p in points)


@dataclass(frozen=True)
class _PolicyRun:
    """One policy's plans at a point, its walk with every block checkpointed (and that peak), and
    what each block's recompute takes under it."""

    points: list[ParetoPoint]
    all_walk: Timeline
    all_peak: int
    rerun_s: list[float]
    compute: list[tuple[float, int]]  # each point's step time before communication, and its peak


def _policy_points(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, knobs: Knobs,
                   program: StepProgram, fwd_s: dict[str, float], no_recompute: TimeBreakdown, cap_bytes: int,
                   plain: list[Timeline],
                   profiles: dict[CheckpointPolicy, PlacementProfile]) -> _PolicyRun:
    """The exact placements of ``knobs``' checkpoint policy, one per count of checkpointed blocks
    (a step's time is additive in the forward time each checkpointed block's policy runs again)."""
    n, graph = model.n_layers, program.busiest.graph
    policy, save = knobs.checkpoint_policy, knobs.save_list
    # every block its own unit: what each one's recompute runs
    rerun_ops = recomputed_by_unit(graph, checkpoint_units(n, tuple(range(n)), (), policy, save))
    # each block's ops summed in graph order (fwd_s's), not in its frozenset's order, which depends on
    # the hash seed: the same digits on every run
    backwards = knobs.schedule.count(Phase.BACKWARD)
    unit_of = {name: b for b, names in rerun_ops.items() for name in names}
    per_block = [0.0] * n
    for name, t in fwd_s.items():  # one pass, in graph order
        if name in unit_of:
            per_block[unit_of[name]] += t
    rerun_s = [backwards * t for t in per_block]
    all_walk = program.walk(checkpoint_units(n, tuple(range(n)), (), policy, save), record_trace=True)
    all_peak = all_walk.peak.bytes
    if device_bytes(all_peak, hw) <= cap_bytes:
        curve = _per_block_curve(model, training, hw, knobs, graph, all_walk, plain, profiles)
    else:  # not even every block checkpointed fits: no per-block placement can
        curve = [(all_peak, (1,) * n)]
    points, compute = [], []
    for peak, placement in curve:
        blocks = tuple(i for i, s in enumerate(placement) if s)
        rerun = sum(rerun_s[b] for b in blocks)
        time = no_recompute.model_copy(update={"recompute_s": rerun, "step_time_s": no_recompute.step_time_s + rerun})
        placed = knobs.model_copy(update={"checkpoint_blocks": blocks})
        step_s = program.placed(time).step_time_s
        points.append(ParetoPoint(step_time_s=step_s, device_bytes=device_bytes(peak, hw), knobs=placed))
        compute.append((time.step_time_s, peak))
    return _PolicyRun(points=points, all_walk=all_walk, all_peak=all_peak, rerun_s=rerun_s, compute=compute)


def forward_floor_bytes(every_checkpointed: Timeline) -> int:
    """A lower bound of the peak of every per-block placement, of every policy: the largest forward
    or optimizer-step event of the walk with every block checkpointed whole (recorded with its
    trace). A forward keeps only each block's input there, and another placement or policy holds
    at each forward event what it does plus what it keeps on top; the optimizer step sees no
    activation at all. Segments keep fewer block inputs, so they are not bounded by it
    (tests/search/test_least_memory.py checks the bound against every placement of small models)."""
    return max(e.live_bytes for e in every_checkpointed.trace if e.phase in (Phase.FORWARD, Phase.OPTIMIZER))


def least_memory_at(
    model: ModelConfig,
    training: TrainConfig,
    hw: HardwareProfile,
    base: Knobs,
    fixed_checkpoint: tuple[int, ...] | None = None,
    allow_segments: bool = True,
    policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,),
    above_bytes: int | None = None,
) -> tuple[Knobs, int]:
    """The placement of ``base`` (micro-batch, precision, sharding) with the least peak allocated
    bytes, and that peak: the exact solver's lowest peak over every count of checkpointed blocks
    of every policy (ties: the first policy, fewer blocks, so less recompute) and every uniform
    segmentation the search may choose.

    No placement goes below the live bytes at the optimizer step (``static_floor_bytes``, found
    without a walk, and ``optimizer_step_bytes`` of the walk with nothing checkpointed, which the
    solver needs anyway: no activation is left there, and a plan whose peak is that step is done
    after that one walk), nor, where segments are not allowed, below ``forward_floor_bytes`` of the
    walk with every block checkpointed whole. The options stop at the first that reaches that floor (a later
    one could only tie, and ties go to the first). With ``above_bytes`` (device bytes), a point
    whose floor already needs more returns ``base`` and the floor, unsolved: the caller wants only
    plans within ``above_bytes``."""
    if fixed_checkpoint is not None:
        knobs = base.model_copy(update={"checkpoint_blocks": fixed_checkpoint, "checkpoint_policy": policies[0]})
        return knobs, estimate(model, training, hw, knobs, None).memory.peak_allocated_bytes
    if base.parallel.pp > 1:  # placed per pipeline rank (search.pipeline_points)
        return least_memory_pipelined(model, training, hw, base, policies)
    floor = static_floor_at(model, training, hw, base)  # one graph per layout: the same at every micro-batch
    if above_bytes is not None and device_bytes(floor, hw) > above_bytes:
        return base, floor  # not one walk
    program = step_program(model, training, hw, base)
    n, segments = model.n_layers, allow_segments and strategy_for(base.parallel).allows_segments
    plain = [program.walk(checkpoint_units(n, ()), record_trace=True)]
    floor = max(floor, optimizer_step_bytes(plain[0]))
    valid = [p for p in policies if modelled_with_context_parallelism(p, base.parallel.cp)]
    if valid and plain[0].peak.bytes == floor:  # nothing checkpointed already reaches the floor: one walk
        return base.model_copy(update={"checkpoint_policy": valid[0], "checkpoint_blocks": ()}), floor
    if above_bytes is not None and device_bytes(floor, hw) > above_bytes:
        return base, floor
    every = {CheckpointPolicy.FULL: _every_walk(program, base, CheckpointPolicy.FULL)}
    floor = max(floor, 0 if segments else forward_floor_bytes(every[CheckpointPolicy.FULL]))  # no segment: per block
    if above_bytes is not None and device_bytes(floor, hw) > above_bytes:
        return base, floor
    if valid and plain[0].peak.bytes == floor:
        return base.model_copy(update={"checkpoint_policy": valid[0], "checkpoint_blocks": ()}), floor
    options: list[tuple[int, Knobs]] = []
    for policy in valid:
        knobs = base.model_copy(update={"checkpoint_policy": policy})
        all_walk = every[policy] if policy in every else _every_walk(program, knobs, policy)
        curve = _per_block_curve(model, training, hw, knobs, program.busiest.graph, all_walk, plain)
        peak, placement = min(curve, key=lambda c: c[0])
        options.append((peak, knobs.model_copy(
            update={"checkpoint_blocks": tuple(i for i, s in enumerate(placement) if s)})))
        if peak == floor:  # the first option to reach the floor: a later one could only tie
            return options[-1][1], peak
    if segments:  # as the search
        for plan in segment_plans(n):
            knobs = base.model_copy(update={"checkpoint_segments": plan})
            options.append((estimate(model, training, hw, knobs, None).memory.peak_allocated_bytes, knobs))
    peak, knobs = min(options, key=lambda option: option[0])  # ties: the first (no segments)
    return knobs, peak


def _every_walk(program: StepProgram, knobs: Knobs, policy: CheckpointPolicy) -> Timeline:
    """The walk of ``program`` with every block checkpointed with ``policy``, with its trace."""
    n = program.busiest.graph.model.n_layers
    return program.walk(checkpoint_units(n, tuple(range(n)), (), policy, knobs.save_list), record_trace=True)
