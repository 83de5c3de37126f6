"""Per-rank memory of data parallelism as PyTorch implements it, measured op by op on one CPU.

    python benchmarks/distributed_memory_probe.py            # everything (about 1.5-2.5 minutes)
    python benchmarks/distributed_memory_probe.py --quick    # N = 8 only, no extras (about 20 s)

Backs every number in docs/distributed_memory.md. For world sizes 1, 2, 8, 64 and ZeRO stages
0-3 as PyTorch runs them on a small Llama (4 blocks, d_model 256, d_ff 688, vocab 4096, seq 256,
micro-batch 4), in fp32 and in bf16 mixed precision, it measures rank 0 of a fake process group
(``init_process_group("fake")``: every collective is a no-op, every allocation is real):

- stage 0: ``DistributedDataParallel(gradient_as_bucket_view=True)``;
- stage 1: DDP + ``ZeroRedundancyOptimizer(optimizer_class=AdamW)``;
- stage 2 / 3: FSDP2 ``fully_shard`` on every block, then on the root, ``reshard_after_forward``
  False / True, without and with ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``;

one steady-state step (the second: optimizer state exists, ``zero_grad(set_to_none=True)``),
counted by ``validate.tracker.LiveStorageTracker`` (it counts a DTensor through its local shard).
"bf16" means autocast (the project's ``bf16-mixed``) for stages 0/1 and FSDP2's
``MixedPrecisionPolicy`` (no autocast) for stages 2/3. Extras at N = 8: DDP without bucket views
and with ``zero_grad(set_to_none=False)`` (what ``validate.apply.train_step`` does for DDP),
accumulation over 2 micro-batches with and without no-sync, FSDP2 with ``reduce_dtype=bf16``,
with autocast instead of a policy, with the root left to ``fully_shard``'s default, and a
vocabulary of 512 (the peak moves into the blocks); fake vs real tensors; hooks vs no hooks.

Every measured number is printed beside a prediction. Static bytes come from closed forms (the
functions in "Closed forms" below, the formulas of docs/distributed_memory.md). The peak is
predicted the way a planner does it: the single-GPU memory walk of the same step (here measured,
not modelled: a plain model run with the same dtypes, its live bytes recorded at module
boundaries) minus its static bytes, plus the distributed run's static bytes and, boundary by
boundary, the buffers the rules of the spec say are alive (``predict_fsdp``, ``predict_ddp``).
Each phase between two boundaries is compared, not only the peak; a mismatch names the rule.
Exit status 1 if a per-call check fails or a peak is off by 5% or more.

FSDP2 runs under ``FakeTensorMode`` (same bytes as real tensors, checked once); DDP's C++ reducer
needs real data, so stages 0/1 run on real tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from planner.config import ModelConfig, TrainConfig
from planner.knobs import Knobs
from planner.precision import precision_spec
from validate.apply import make_optimizer, precision_context, train_step
from validate.reference_model import build_model
from validate.tracker import LiveStorageTracker, rounded_bytes

CONFIG = ModelConfig(family="llama", name="probe-llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2,
                     d_ff=688, vocab_size=4096, max_seq_len=256)
SEQ, MICRO = 256, 4
# the same blocks with a small vocabulary: the peak moves from the logits into the blocks
BLOCKY = CONFIG.model_copy(update={"name": "probe-llama-v512", "vocab_size": 512})
WORLD_SIZES = (1, 2, 8, 64)
RANK = 0  # the rank measured; with FSDP2's chunking and ZeRO's greedy partition it is the fullest
MiB = 2**20


def r(n_bytes: int) -> int:
    """One allocation as the CUDA caching allocator sizes it (512-byte blocks)."""
    return rounded_bytes(int(n_bytes))


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------

def storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Rounded bytes of the distinct storages behind ``tensors`` (DTensors through their shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            t = t._local_tensor  # type: ignore[attr-defined]
        s = t.untyped_storage()
        seen[id(s)] = r(s.nbytes())
    return sum(seen.values())


class Phases:
    """Live bytes at module boundaries and the peak between consecutive boundaries.

    ``start(label, before)`` closes the running phase (its peak), records the live bytes at the
    boundary, runs ``before`` (the baseline drops gradients there) and opens ``label``. Hooks hold
    no tensors, so they do not change what they measure (checked in ``check_hooks_inert``).
    """

    def __init__(self, tracker: LiveStorageTracker) -> None:
        self.t = tracker
        self.micro = 0
        self.rows: list[list] = []  # [label, live at start, peak]
        self.points: dict[str, int] = {}  # label -> live at the boundary, before ``before`` ran
        self.global_peak = 0

    def start(self, label: str, before: Callable[[], None] | None = None) -> None:
        t = self.t
        if self.rows:
            self.rows[-1][2] = max(self.rows[-1][2], t.peak_bytes)
        key = f"{self.micro}:{label}"
        self.global_peak = max(self.global_peak, t.peak_bytes)
        self.points[key] = t.live_bytes
        if before is not None:
            before()
        self.rows.append([key, t.live_bytes, t.live_bytes])
        t.peak_bytes = t.live_bytes

    def close(self) -> None:
        if self.rows:
            self.rows[-1][2] = max(self.rows[-1][2], self.t.peak_bytes)
        self.global_peak = max(self.global_peak, self.t.peak_bytes)

    def peak_of(self, label: str) -> int:
        return next(row[2] for row in self.rows if row[0] == label)

    def live_of(self, label: str) -> int:
        return next(row[1] for row in self.rows if row[0] == label)


def attach_boundaries(model: torch.nn.Module, phases: Phases, drop_unit: Callable[[int], None] | None = None) -> None:
    """Forward/backward boundaries of the reference model (blocks are the FSDP units).

    Backward boundaries are tensor hooks: the gradient of block u's output is ready when block
    u+1's backward is done and block u's starts (FSDP2 reduces u+1 and unshards u at that moment).
    ``drop_unit(u)`` (baseline only) frees block u's gradients there, as FSDP2's post-backward does.
    """
    n = len(model.blocks)

    def on_grad(label: str, finished: int | None) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            phases.start(label, (lambda: drop_unit(finished)) if drop_unit and finished is not None else None)
        return hook

    def block_pre(index: int) -> Callable:
        def pre(_module: torch.nn.Module, _args: tuple) -> None:
            phases.start(f"fwd:block{index}")
        return pre

    def embed_post(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
        # the embedding's own output: FSDP2 wraps block 0's input in its post-backward Function,
        # whose gradient is ready *before* block 0's reduce-scatter; this one after it
        if torch.is_grad_enabled():
            out.register_hook(on_grad("bwd:embed", 0))

    def block_post(index: int) -> Callable:
        def post(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
            phases.start("fwd:head" if index == n - 1 else f"fwd:gap{index}")
            if torch.is_grad_enabled():
                out.register_hook(on_grad(f"bwd:block{index}", index + 1 if index + 1 < n else None))
        return post

    model.register_forward_pre_hook(lambda _m, _a: phases.start("fwd:root"))
    model.embed.register_forward_hook(embed_post)
    model.register_forward_hook(lambda _m, _a, _o: phases.start("fwd:end"))
    for index, block in enumerate(model.blocks):
        block.register_forward_pre_hook(block_pre(index))
        block.register_forward_hook(block_post(index))


@dataclass
class Loop:
    """One optimizer step as validate.apply.train_step runs it (micro-batches sliced from the batch,
    each loss divided by the count, backward, then step and zero_grad), plus our boundaries and
    optional no-sync. Used for every step here so the probe does not depend on train_step's
    choices (it now zeroes DDP's gradients in place and uses no_sync); ``check_hooks_inert``
    runs train_step itself."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    input_ids: torch.Tensor
    targets: torch.Tensor
    accum: int
    precision: str  # the project's policy for the autocast context ("fp32" or "bf16-mixed")
    phases: Phases | None = None
    no_sync: Callable[[bool], contextlib.AbstractContextManager] | None = None  # (sync?) -> context
    end_of_backward: Callable[[], None] | None = None  # baseline: drop the root's gradients
    set_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)

    def mark(self, label: str, before: Callable[[], None] | None = None) -> None:
        if self.phases is not None:
            self.phases.start(label, before)

    def step(self) -> None:
        spec = precision_spec(self.precision)
        for micro in range(self.accum):
            if self.phases is not None:
                self.phases.micro = micro
            rows = slice(micro * MICRO, (micro + 1) * MICRO)
            sync = micro == self.accum - 1
            ctx = self.no_sync(sync) if self.no_sync else contextlib.nullcontext()
            with ctx:
                with precision_context(spec, "cpu"):
                    loss = self.model(self.input_ids[rows], self.targets[rows]) / self.accum
                self.mark("bwd:head")
                loss.backward()
                del loss
            self.mark("after-bwd", self.end_of_backward)
        self.mark("step")
        self.optimizer.step()
        self.mark("after-step")
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        self.mark("end")
        if self.phases is not None:
            self.phases.close()


@contextlib.contextmanager
def using_config(config: ModelConfig) -> Iterator[None]:
    """Run with another model (every builder reads the module-level CONFIG)."""
    global CONFIG
    saved, CONFIG = CONFIG, config
    try:
        yield
    finally:
        CONFIG = saved


def make_batch(accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (MICRO * accum, SEQ), generator=g)
    tgt = torch.randint(0, CONFIG.vocab_size, (MICRO * accum, SEQ), generator=g)
    return ids, tgt


# ----------------------------------------------------------------------------------------------
# Closed forms (docs/distributed_memory.md)
# ----------------------------------------------------------------------------------------------

Shape = tuple[int, ...]


def numel(shape: Shape) -> int:
    return math.prod(shape)


def fsdp_rows(shape: Shape, n: int) -> int:
    """Rows of dim 0 per rank: torch.chunk's chunk size, ceil(d0 / N)."""
    return -(-shape[0] // n)


def fsdp_padded_numel(shape: Shape, n: int) -> int:
    """Elements of every rank's padded shard (_fsdp_param.py FSDPParam._init_sharded_param)."""
    return fsdp_rows(shape, n) * (numel(shape) // shape[0])


def fsdp_local_numel(shape: Shape, n: int, rank: int) -> int:
    """Elements of rank ``rank``'s unpadded shard (the DTensor's local tensor)."""
    c = fsdp_rows(shape, n)
    return max(0, min(c, shape[0] - rank * c)) * (numel(shape) // shape[0])


@dataclass(frozen=True)
class FsdpUnit:
    """Bytes of one FSDP unit (one fully_shard call) on one rank."""

    name: str
    shapes: tuple[Shape, ...]
    n: int
    rank: int
    orig: int  # bytes per element of the sharded parameter (fp32: 4)
    compute: int  # of the unsharded parameter: param_dtype (bf16: 2) or orig
    reduce: int  # of the reduce-scatter: reduce_dtype or the gradient's dtype

    @property
    def padded(self) -> int:
        return sum(fsdp_padded_numel(s, self.n) for s in self.shapes)

    @property
    def sharded_params(self) -> int:  # one padded storage per parameter, same on every rank
        return sum(r(fsdp_padded_numel(s, self.n) * self.orig) for s in self.shapes)

    def adam_state(self, rank: int | None = None) -> int:  # exp_avg + exp_avg_sq of the unpadded shard
        rank = self.rank if rank is None else rank
        return sum(2 * r(fsdp_local_numel(s, self.n, rank) * self.orig) for s in self.shapes)

    @property
    def step_scalars(self) -> int:  # AdamW's per-parameter `step` (host memory on CUDA)
        return len(self.shapes) * r(4)

    @property
    def ag_in(self) -> int:
        """The all-gather input: with param_dtype, one flat cast copy of the padded shards."""
        if self.compute == self.orig or self.n == 1:
            return 0
        return r(self.padded * self.compute)

    @property
    def ag_out(self) -> int:
        """The flat all-gather output (none on one rank)."""
        return r(self.padded * self.n * self.compute) if self.n > 1 else 0

    @property
    def copy_extra(self) -> int:
        """World size 1 has no all-gather: the copy-out casts parameter by parameter, and a cast is
        bound to a loop variable, so the previous one is freed only once the next exists. Returns
        the peak of (casts alive + unsharded so far) - all unsharded."""
        if self.compute == self.orig or self.n > 1:
            return 0
        casts = [r(numel(s) * self.compute) for s in self.shapes]
        done, prev, best = 0, 0, 0
        for cast in casts:
            best = max(best, done + prev + cast, done + cast + cast)  # new cast; then its output
            done, prev = done + cast, cast
        return best - done

    @property
    def unsharded(self) -> int:
        """The unsharded parameters: one padded storage per parameter, resized 0 <-> full."""
        return sum(r(fsdp_padded_numel(s, self.n) * self.n * self.compute) for s in self.shapes)

    @property
    def rs_in(self) -> int:
        return r(self.padded * self.n * self.reduce)

    @property
    def rs_out(self) -> int:
        """The reduce-scatter output; the sharded gradients are views of it (in orig dtype)."""
        out = r(self.padded * self.reduce)
        return out if self.reduce == self.orig else r(self.padded * self.orig)

    @property
    def unsharded_grads(self) -> int:  # autograd's gradients of the unsharded parameters
        return sum(r(numel(s) * self.compute) for s in self.shapes)

    def rs_out_extra(self, grad_itemsize: int) -> int:
        """Live change at the RS output's peak, relative to the RS input's moment: gradients freed
        (``unsharded_grads.clear()``), except, for N > 1, the unit's last one, still bound to the
        loop variable of foreach_reduce's shard-dim check; plus the output, and its cast to the
        parameter dtype when reduce_dtype differs (both alive until foreach_reduce returns)."""
        grads = [r(numel(s) * grad_itemsize) for s in self.shapes]
        kept = grads[-1] if self.n > 1 else 0
        cast = r(self.padded * self.orig) if self.reduce != self.orig else 0
        return -sum(grads) + kept + r(self.padded * self.reduce) + cast

    @property
    def acc_grads(self) -> int:  # no-sync accumulation with param_dtype: fp32 copies of them
        return sum(r(numel(s) * self.reduce) for s in self.shapes) if self.compute != self.reduce else 0

    def acc_transient(self) -> int:
        """Peak extra while post-backward upcasts the gradients one by one (bf16 alive with fp32)."""
        extra, best = 0, 0
        for s in self.shapes:
            best = max(best, extra + r(numel(s) * self.reduce))
            extra += r(numel(s) * self.reduce) - r(numel(s) * self.compute)
        return best


def unit_shapes(model: torch.nn.Module) -> dict[str, tuple[Shape, ...]]:
    """Parameter shapes per FSDP unit: the root (what no block owns) and each block."""
    blocks = {id(p) for p in model.blocks.parameters()}
    units = {"root": tuple(tuple(p.shape) for p in model.parameters() if id(p) not in blocks)}
    for i, b in enumerate(model.blocks):
        units[f"blocks.{i}"] = tuple(tuple(p.shape) for p in b.parameters())
    return units


def zero1_partition(shapes: Sequence[Shape], n: int) -> list[list[Shape]]:
    """ZeroRedundancyOptimizer._partition_parameters: largest first, to the least-loaded rank
    (ties to the lowest rank)."""
    ranks: list[list[Shape]] = [[] for _ in range(n)]
    sizes = [0] * n
    for s in sorted(shapes, key=numel, reverse=True):  # sorted() is stable: ties keep model order
        k = min(range(n), key=lambda i: (sizes[i], i))
        ranks[k].append(s)
        sizes[k] += numel(s)
    return ranks


def ddp_buckets(shapes_ready_order: Sequence[Shape], itemsize: int, first_cap: int = MiB,
                cap: int = 25 * MiB) -> list[int]:
    """Bytes of DDP's rebuilt buckets (reducer.cpp compute_bucket_assignment_by_size with the
    limits [1 MiB, 25 MiB]): a bucket closes once it reaches its limit."""
    buckets, current, limit = [], 0, first_cap
    for s in shapes_ready_order:
        current += numel(s) * itemsize
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    if current:
        buckets.append(current)
    return buckets


def adam_foreach_temp(numels: Sequence[int], itemsize: int) -> int:
    """_multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(...) over the rank's parameters (the
    host scalar added to the CPU `step`s is freed before it)."""
    return sum(r(k * itemsize) for k in numels)


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def process_group(n: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=n)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_allreduce_hook(_state, bucket):
    """The fake PG's work has no future value, which DDP's built-in all-reduce rejects; return the
    bucket itself, as NCCL's in-place all-reduce does (same memory)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@dataclass
class Result:
    label: str
    n: int
    stage: int
    precision: str
    static_measured: int
    peak_measured: int
    static_predicted: int = 0
    peak_predicted: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # breakdown at the predicted peak
    peak_where: str = ""
    notes: str = ""
    phases: Phases | None = None
    events: list[tuple] = field(default_factory=list)
    phase_count: int = 0
    phase_bad: int = 0
    phase_exact: int = 0
    init: tuple[int, int] = (0, 0)  # FSDP2: live bytes after fully_shard, peak while sharding
    static_parts: dict[str, int] = field(default_factory=dict)  # predicted static bytes by kind

    def judge(self, candidates: list[Candidate], show: bool = False) -> None:
        self.phase_count, self.phase_bad, self.phase_exact = compare_phases(self, candidates, show)
        if self.phase_bad and not show:  # print the phases to see which rule broke
            print(f"  {self.label}{self.notes} N={self.n}: {self.phase_bad} phase(s) off:")
            compare_phases(self, candidates, True)


def run_baseline(dtype: torch.dtype, precision: str, policy: Sequence[str], accum: int = 1,
                 set_to_none: bool = True) -> tuple[Phases, int]:
    """The single-GPU step with the same dtypes (the planner's existing walk), fake tensors.

    ``policy[m]`` says what micro-batch m does with gradients, to mirror the distributed run:
    "keep" (plain PyTorch), "drop" (freed as soon as accumulated: DDP with bucket views copies
    each gradient into its bucket and drops it), "unit" (a block's gradients freed when its
    backward ends, the root's at the end of backward: FSDP2's post-backward).
    """
    with FakeTensorMode():
        tracker = LiveStorageTracker()
        with tracker:
            torch.manual_seed(0)
            model = build_model(CONFIG, dtype)
            model.train()
            optimizer = make_optimizer(model, TrainConfig(seq_len=SEQ, global_batch_size=MICRO * accum))
            ids, tgt = make_batch(accum)
            phases = Phases(tracker)

            def drop_params(params: Iterator[torch.nn.Parameter]) -> None:
                for p in params:
                    p.grad = None

            def drop_unit(u: int) -> None:
                if policy[phases.micro] == "unit":
                    drop_params(model.blocks[u].parameters())

            def drop_root() -> None:
                if policy[phases.micro] == "unit":
                    blocks = {id(p) for p in model.blocks.parameters()}
                    drop_params(p for p in model.parameters() if id(p) not in blocks)

            def on_accumulated(p: torch.nn.Parameter) -> None:
                if policy[phases.micro] == "drop":
                    p.grad = None

            for p in model.parameters():
                p.register_post_accumulate_grad_hook(on_accumulated)
            loop = Loop(model, optimizer, ids, tgt, accum, precision, set_to_none=set_to_none)
            loop.step()  # step 1: optimizer state appears
            attach_boundaries(model, phases, drop_unit)
            loop.phases, loop.end_of_backward = phases, drop_root
            gc.collect()
            tracker.reset_peak()
            phases.start("start")
            loop.step()
    return phases, phases.live_of("0:start")


def measure(loop: Loop, tracker: LiveStorageTracker, model: torch.nn.Module) -> Phases:
    phases = Phases(tracker)
    attach_boundaries(model, phases)
    loop.phases = phases
    gc.collect()
    tracker.reset_peak()
    phases.start("start")
    loop.step()
    return phases


# ---------------------------------------------------------------------------------- FSDP2 ----

@dataclass
class FsdpSetup:
    n: int
    reshard: bool  # reshard_after_forward of the blocks
    mp: bool
    root_auto: bool = False  # pass reshard_after_forward=None for the root (fully_shard's default)
    accum: int = 1
    no_sync: bool = False
    autocast: bool = False  # fp32 params, no MixedPrecisionPolicy, forward under bf16 autocast
    reduce_bf16: bool = False  # MixedPrecisionPolicy(reduce_dtype=bfloat16)

    @property
    def stage(self) -> int:
        return 3 if self.reshard else 2

    @property
    def root_reshards(self) -> bool:
        return False if self.root_auto else self.reshard


def build_fsdp(setup: FsdpSetup, mesh: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model(CONFIG)
    model.train()
    kw = {}
    if setup.mp:
        reduce = torch.bfloat16 if setup.reduce_bf16 else torch.float32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=setup.reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if setup.root_auto else setup.reshard, **kw)
    optimizer = make_optimizer(model, TrainConfig(seq_len=SEQ, global_batch_size=MICRO * setup.accum))
    return model, optimizer


EVENTS = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")


@contextlib.contextmanager
def fsdp_event_log(tracker: LiveStorageTracker, log: list[tuple]) -> Iterator[None]:
    """Wrap FSDP2's collective helpers: (event, unit, live before, live after, peak - before)."""
    originals = {name: getattr(_fsdp_param_group, name) for name in EVENTS}
    methods = {name: getattr(_fsdp_param_group.FSDPParamGroup, name)
               for name in ("wait_for_unshard", "reshard", "post_backward", "pre_backward")}

    def wrap(name: str, fn: Callable, unit_of: Callable[[tuple], str]) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            saved, before = tracker.peak_bytes, tracker.live_bytes
            tracker.peak_bytes = before
            out = fn(*args, **kwargs)
            log.append((name, unit_of(args), before, tracker.live_bytes, tracker.peak_bytes - before))
            tracker.peak_bytes = max(saved, tracker.peak_bytes)
            return out
        return wrapper

    def unit_of_params(args: tuple) -> str:
        params = args[0] if isinstance(args[0], list) else args[1]
        fqn = getattr(params[0], "_param_fqn", "") or ""
        return fqn.split(".mlp")[0].split(".attn")[0] if fqn.startswith("blocks.") else "root"

    try:
        for name, fn in originals.items():
            setattr(_fsdp_param_group, name, wrap(name, fn, unit_of_params))
        for name, fn in methods.items():
            setattr(_fsdp_param_group.FSDPParamGroup, name,
                    wrap(name, fn, lambda args: args[0]._module_fqn or "root"))
        yield
    finally:
        for name, fn in originals.items():
            setattr(_fsdp_param_group, name, fn)
        for name, fn in methods.items():
            setattr(_fsdp_param_group.FSDPParamGroup, name, fn)


def run_fsdp(setup: FsdpSetup, events: bool = False, fake: bool = True) -> Result:
    with process_group(setup.n):
        mesh = init_device_mesh("cpu", (setup.n,))  # outside FakeTensorMode: it reads its rank map
        with FakeTensorMode() if fake else contextlib.nullcontext():
            return _run_fsdp(setup, events, mesh)


def _run_fsdp(setup: FsdpSetup, events: bool, mesh: object) -> Result:
    tracker = LiveStorageTracker()
    log: list[tuple] = []
    with tracker:
        model, optimizer = build_fsdp(setup, mesh)
        init = (tracker.live_bytes, tracker.peak_bytes)
        ids, tgt = make_batch(setup.accum)

        def no_sync(sync: bool) -> contextlib.AbstractContextManager:
            model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()

        loop = Loop(model, optimizer, ids, tgt, setup.accum, "bf16-mixed" if setup.autocast else "fp32",
                    no_sync=no_sync if setup.no_sync else None)
        loop.step()  # step 1: the optimizer state appears
        with fsdp_event_log(tracker, log) if events else contextlib.nullcontext():
            phases = measure(loop, tracker, model)
        parts = {
            "params": storage_bytes(p for p in model.parameters()),
            "optimizer": storage_bytes(t for st in optimizer.state.values() for t in st.values()),
            "batch": storage_bytes(iter((ids, tgt))),
        }
    prec = "bf16" if setup.mp else "fp32"
    res = Result(f"fsdp s{setup.stage} {prec}", setup.n, setup.stage, prec, phases.live_of("0:start"),
                 phases.global_peak, phases=phases, events=log)
    res.parts = {f"measured {k}": v for k, v in parts.items()}
    res.init = init
    return res


def fsdp_units(setup: FsdpSetup) -> dict[str, FsdpUnit]:
    with FakeTensorMode():
        shapes = unit_shapes(build_model(CONFIG))
    compute, reduce = (2 if setup.mp else 4), (2 if setup.reduce_bf16 else 4)
    return {name: FsdpUnit(name, s, setup.n, RANK, 4, compute, reduce) for name, s in shapes.items()}


def fsdp_static(setup: FsdpSetup) -> dict[str, int]:
    units = fsdp_units(setup).values()
    return {
        "params": sum(u.sharded_params for u in units),
        "optimizer": sum(u.adam_state() + u.step_scalars for u in units),
        "batch": 2 * r(MICRO * setup.accum * SEQ * 8),
    }


@dataclass
class Candidate:
    """Predicted live bytes at one moment: the phase of the distributed run it falls in, and why."""

    total: int
    phase: str  # the distributed run's phase (between two of our boundaries)
    what: str
    parts: dict[str, int]


def predict_fsdp(setup: FsdpSetup, base: Phases, base_static: int, res: Result) -> list[Candidate]:
    """Overlay FSDP2's buffers on the single-GPU walk, boundary by boundary (spec section 4).

    Live bytes of the FSDP2 run at any moment = the single-GPU walk at the same moment - its
    static bytes + FSDP2's static bytes + the FSDP2 buffers alive then. The walk's gradients are
    freed per unit exactly as FSDP2 frees the unsharded gradients ("unit" policy), so only FSDP2's
    own buffers need rules. Moments inside FSDP2's hooks are placed in the phase of our
    boundaries that contains them (FSDP2's hooks run before ours at the same module boundary).
    """
    units = fsdp_units(setup)
    root, blocks = units["root"], [units[f"blocks.{i}"] for i in range(CONFIG.n_layers)]
    last_block = len(blocks) - 1
    static = fsdp_static(setup)
    s = sum(static.values())
    res.static_predicted, res.static_parts = s, static
    s3, s3_root, mp_nosync = setup.reshard, setup.root_reshards, setup.no_sync and setup.mp
    out: list[Candidate] = []
    state = {"sharded grads": 0, "fp32 acc grads": 0}  # persistent across phases

    def add(walk_bytes: int, phase: str, what: str, **extra: int) -> None:
        parts = {"static": s, "walk": walk_bytes - base_static, **state, **extra}
        parts = {k: v for k, v in parts.items() if v}
        out.append(Candidate(sum(parts.values()), phase, what, parts))

    for m in range(setup.accum):
        p, reduce = f"{m}:", m == setup.accum - 1 or not setup.no_sync
        before_fwd = f"{m - 1}:after-bwd" if m else "0:start"
        # ---- forward. Root pre-forward: all-gather (cast input + flat output), then copy-out
        at = base.points[p + "fwd:root"]
        add(at, before_fwd, "root all-gather", ag_in=root.ag_in, ag_out=root.ag_out)
        add(at, before_fwd, "root copy-out", ag_out=root.ag_out, unsharded=root.unsharded + root.copy_extra)
        add(base.peak_of(p + "fwd:root"), p + "fwd:root", "embedding", root=root.unsharded, ag_held=root.ag_out)
        prev_ag, gathered, host = root.ag_out, 0, p + "fwd:root"
        for i, b in enumerate(blocks):
            at = base.points[p + f"fwd:block{i}"]
            common = {"root": root.unsharded, "gathered": gathered, "ag_prev": prev_ag}
            add(at, host, f"block {i} all-gather", **common, ag_in=b.ag_in, ag_out=b.ag_out)
            add(at, host, f"block {i} copy-out", **common, ag_out=b.ag_out, unsharded=b.unsharded + b.copy_extra)
            add(base.peak_of(p + f"fwd:block{i}"), p + f"fwd:block{i}", f"block {i} forward",
                root=root.unsharded, gathered=gathered, unsharded=b.unsharded, ag_held=b.ag_out)
            gathered += 0 if s3 else b.unsharded  # reshard_after_forward=False keeps it
            host = p + ("fwd:head" if i == last_block else f"fwd:gap{i}")
            add(base.peak_of(host), host, "after block", root=root.unsharded, gathered=gathered, ag_held=b.ag_out)
            prev_ag = b.ag_out
        # root post-forward: reshard the root (if it reshards) and free the last all-gather output
        root_left = 0 if s3_root else root.unsharded
        add(base.peak_of(p + "fwd:end"), p + "fwd:end", "loss / accum", root=root_left, gathered=gathered)
        # ---- backward. Root pre-backward at the loss gradient (two scalar gradients exist then)
        at, head = base.points[p + "bwd:head"] + 2 * r(4), p + "bwd:head"
        if s3_root:
            add(at, head, "root all-gather", gathered=gathered, ag_in=root.ag_in, ag_out=root.ag_out)
            add(at, head, "root copy-out", gathered=gathered, ag_out=root.ag_out,
                unsharded=root.unsharded + root.copy_extra)
        if s3:  # prefetch: all-gather the last block
            add(at, head, "prefetch last block", root=root.unsharded, ag_in=blocks[-1].ag_in,
                ag_prefetch=blocks[-1].ag_out)
        add(base.peak_of(head), head, "head backward", root=root.unsharded, gathered=gathered,
            ag_prefetch=blocks[-1].ag_out if s3 else 0)
        rs_held, host = 0, head
        for i in reversed(range(len(blocks))):
            b, nxt = blocks[i], (blocks[i - 1] if i > 0 else None)
            label = p + f"bwd:block{i}"
            at = base.points[label]  # the gradient of block i's output is ready
            if s3:  # pre-backward(i): copy out the prefetched all-gather, prefetch block i-1
                add(at, host, f"block {i} copy-out", root=root.unsharded, rs_held=rs_held, ag_prefetch=b.ag_out,
                    unsharded=b.unsharded)
                if nxt is not None:
                    add(at, host, f"prefetch block {i - 1}", root=root.unsharded, rs_held=rs_held,
                        unsharded=b.unsharded, ag_in=nxt.ag_in, ag_prefetch=nxt.ag_out)
                held, prefetch = b.unsharded, (nxt.ag_out if nxt else 0)
            else:
                held, prefetch = gathered, 0  # stage 2: blocks 0..i still gathered
            add(base.peak_of(label), label, f"block {i} backward", root=root.unsharded, gathered=held,
                rs_held=rs_held, ag_prefetch=prefetch)
            # post-backward(i), when the gradient of block i's input is ready: reshard, drop the
            # previous RS input, then allocate this RS input while the unsharded gradients live
            end = p + ("bwd:embed" if i == 0 else f"bwd:block{i - 1}")
            at = base.points[end]
            if reduce:
                # with mixed-precision no-sync the bf16 gradients were added into the fp32 copies
                walk = at - (b.unsharded_grads if mp_nosync else 0)
                common = {"root": root.unsharded, "gathered": held - b.unsharded, "ag_prefetch": prefetch}
                add(walk, label, f"block {i} reduce-scatter input", **common, rs_in=b.rs_in)
                grad_size = b.reduce if mp_nosync else b.compute
                add(walk, label, f"block {i} reduce-scatter output", **common, rs_in=b.rs_in,
                    rs_out=b.rs_out_extra(grad_size))
                rs_held = b.rs_in
                state["fp32 acc grads"] -= b.acc_grads if mp_nosync else 0
                if m == 0 or setup.no_sync:  # later micro-batches add into the existing shards
                    state["sharded grads"] += b.rs_out
            elif setup.mp:  # no-sync with param_dtype: the gradients are upcast to reduce_dtype
                add(at, label, f"block {i} upcast", root=root.unsharded, gathered=held - b.unsharded,
                    ag_prefetch=prefetch, upcast=b.acc_transient())
                state["fp32 acc grads"] += b.acc_grads
            if not s3:
                gathered -= b.unsharded
            host = label
        add(base.peak_of(p + "bwd:embed"), p + "bwd:embed", "embedding backward", root=root.unsharded,
            rs_held=rs_held)
        # root post-backward, in autograd's final callback: the root's gradients are still alive,
        # and so are the two scalar gradients autograd frees only when backward() returns
        at = base.points[p + "after-bwd"] + 2 * r(4)
        if reduce:
            walk = at - (root.unsharded_grads if mp_nosync else 0)
            add(walk, p + "bwd:embed", "root reduce-scatter input", rs_in=root.rs_in)
            add(walk, p + "bwd:embed", "root reduce-scatter output", rs_in=root.rs_in,
                rs_out=root.rs_out_extra(root.reduce if mp_nosync else root.compute))
            state["fp32 acc grads"] -= root.acc_grads if mp_nosync else 0
            if m == 0 or setup.no_sync:
                state["sharded grads"] += root.rs_out
        elif setup.mp:
            add(at, p + "bwd:embed", "root upcast", upcast=root.acc_transient())
            state["fp32 acc grads"] += root.acc_grads
    # ---- optimizer step over the local shards
    local = [fsdp_local_numel(sh, setup.n, RANK) for u in units.values() for sh in u.shapes]
    step = f"{setup.accum - 1}:step"
    out.append(Candidate(s + state["sharded grads"] + adam_foreach_temp(local, 4), step, "optimizer step",
                         {"static": s, "sharded grads": state["sharded grads"],
                          "adam temporaries": adam_foreach_temp(local, 4)}))
    best = max(out, key=lambda c: c.total)
    res.peak_predicted, res.peak_where = best.total, f"{best.phase} {best.what}"
    res.parts.update({k: v for k, v in best.parts.items()})
    return out


# ------------------------------------------------------------------------------ DDP / ZeRO ----

@dataclass
class DdpSetup:
    n: int
    stage: int  # 0: DDP, 1: DDP + ZeroRedundancyOptimizer
    bf16: bool  # autocast (bf16-mixed)
    bucket_view: bool = True
    accum: int = 1
    no_sync: bool = False
    set_to_none: bool = True  # False: what validate.apply.train_step does for DDP


def run_ddp(setup: DdpSetup) -> tuple[Result, list[int]]:
    with process_group(setup.n):
        tracker = LiveStorageTracker()
        with tracker:
            torch.manual_seed(0)
            model = build_model(CONFIG)
            model.train()
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=setup.bucket_view)
            ddp.register_comm_hook(None, fake_allreduce_hook)
            if setup.stage == 1:
                optimizer = ZeroRedundancyOptimizer(list(ddp.parameters()), optimizer_class=torch.optim.AdamW,
                                                    lr=1e-4, weight_decay=0.1, foreach=True)
            else:
                optimizer = make_optimizer(ddp, TrainConfig(seq_len=SEQ, global_batch_size=MICRO * setup.accum))
            ids, tgt = make_batch(setup.accum)
            precision = "bf16-mixed" if setup.bf16 else "fp32"

            def no_sync(sync: bool) -> contextlib.AbstractContextManager:
                return contextlib.nullcontext() if sync else ddp.no_sync()

            loop = Loop(ddp, optimizer, ids, tgt, setup.accum, precision,
                        no_sync=no_sync if setup.no_sync else None, set_to_none=setup.set_to_none)
            loop.step()  # step 1: the optimizer state appears; DDP rebuilds its buckets in step 2
            phases = measure(loop, tracker, model)
            opt_state = optimizer.optim.state if setup.stage == 1 else optimizer.state
            parts = {
                "params": storage_bytes(p for p in model.parameters()),
                "optimizer": storage_bytes(t for st in opt_state.values() for t in st.values()),
                "batch": storage_bytes(iter((ids, tgt))),
            }
        sizes = [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    prec = "bf16" if setup.bf16 else "fp32"
    res = Result(f"ddp s{setup.stage} {prec}", setup.n, setup.stage, prec, phases.live_of("0:start"),
                 phases.global_peak, phases=phases)
    res.parts = {f"measured {k}": v for k, v in parts.items()}
    return res, sizes


def ddp_static(setup: DdpSetup) -> tuple[dict[str, int], list[int], list[Shape]]:
    with FakeTensorMode():
        model = build_model(CONFIG)
        shapes = [tuple(p.shape) for p in model.parameters()]
    buckets = ddp_buckets(list(reversed(shapes)), 4)
    local = zero1_partition(shapes, setup.n)[RANK] if setup.stage == 1 else shapes
    static = {
        "params": sum(r(numel(sh) * 4) for sh in shapes),
        "buckets": sum(r(b) for b in buckets),
        "optimizer": sum(2 * r(numel(sh) * 4) + r(4) for sh in local),
        "batch": 2 * r(MICRO * setup.accum * SEQ * 8),
    }
    return static, buckets, local


def predict_ddp(setup: DdpSetup, base: Phases, base_static: int, res: Result) -> list[Candidate]:
    """The single-GPU walk - its static bytes + DDP's static bytes, phase by phase.

    The walk frees each gradient as soon as it is accumulated ("drop": DDP copies it into its
    bucket view and drops it) or keeps it (``gradient_as_bucket_view=False``: param.grad stays a
    separate tensor); DDP's buckets are static. The optimizer step is added from closed forms.
    """
    static, buckets, local = ddp_static(setup)
    grads = 0
    if not setup.bucket_view:  # param.grad are separate tensors until zero_grad
        with FakeTensorMode():
            grads = sum(r(p.numel() * 4) for p in build_model(CONFIG).parameters())
    if not setup.set_to_none:  # zeroed in place: they stay, and are static
        static["separate grads"], grads = grads, 0
    s = sum(static.values())
    res.static_predicted, res.static_parts = s, static
    out = []
    for label, _start, peak in base.rows:
        if label.split(":")[1] in ("step", "after-step", "end"):
            continue
        out.append(Candidate(s + peak - base_static, label, "walk", {"static": s, "walk": peak - base_static}))
    # DDP rebuilds its buckets in the first forward after the first synchronized backward: here
    # step 2 unless step 1 already had a synchronized micro-batch before its last one
    rebuild = setup.accum == 1 or setup.no_sync
    with FakeTensorMode():
        n_tensors = len(list(build_model(CONFIG).parameters()))
    # reducer.cpp sync_bucket_indices: four small int tensors broadcast the new assignment,
    # freed before the new buckets are allocated
    index = 2 * r(4 * (n_tensors + 1)) + 2 * r(4 * (len(buckets) + 1))
    if rebuild:
        out.append(Candidate(s + index, "0:start", "bucket-index broadcast", {"static": s, "index tensors": index}))
    if rebuild and setup.bucket_view and not setup.set_to_none:
        # step 2 rebuilds the buckets before the forward: the gradients still view the old
        # buckets until each is copied into its new bucket, so both sets coexist
        out.append(Candidate(s + sum(r(b) for b in buckets), "0:start", "bucket rebuild",
                             {"static": s, "old buckets": sum(r(b) for b in buckets)}))
    temp = adam_foreach_temp([numel(sh) for sh in local], 4)
    out.append(Candidate(s + grads + temp, f"{setup.accum - 1}:step", "optimizer step",
                         {"static": s, "grads": grads, "adam temporaries": temp}))
    best = max(out, key=lambda c: c.total)
    res.peak_predicted, res.peak_where = best.total, f"{best.phase} {best.what}"
    res.parts.update({k: v for k, v in best.parts.items() if v})
    return out


def compare_phases(res: Result, candidates: list[Candidate], show: bool = False) -> tuple[int, int, int]:
    """Every phase's measured peak vs the largest prediction placed in it: (phases, off by more
    than 0.1%, exact to the byte)."""
    assert res.phases is not None
    by_phase: dict[str, Candidate] = {}
    for c in candidates:
        if c.phase not in by_phase or c.total > by_phase[c.phase].total:
            by_phase[c.phase] = c
    bad, count, exact = 0, 0, 0
    for label, _start, peak in res.phases.rows:
        c = by_phase.get(label)
        if c is None:
            continue
        count += 1
        err = c.total - peak
        bad += abs(err) > 0.001 * peak
        exact += err == 0
        if show:
            parts = ", ".join(f"{k} {v / 1e6:.3f}" for k, v in c.parts.items() if k != "static")
            print(f"    {label:<16} measured {peak:>11} predicted {c.total:>11} ({err:+d})  {c.what}: {parts}")
    return count, bad, exact


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------

def mb(x: int) -> str:
    return f"{x / 1e6:8.3f}"


def pct(pred: int, meas: int) -> str:
    return f"{(pred - meas) / meas:+.1%}" if meas else "-"


def print_table(results: list[Result]) -> None:
    """One row per run; the breakdown is the prediction at the predicted peak (MB): params (as the
    rank holds them), optimizer state, gradients that persist (DDP's buckets, separate grads,
    FSDP2's sharded or accumulated grads), data-parallel buffers alive then (gathered params,
    all-gather and reduce-scatter buffers), and the walk (activations, logits, transients and
    the gradients the single-GPU walk holds then); + the batch = the peak."""
    print(f"{'config':<28}{'N':>3} | {'static':>8} {'pred':>8} {'err':>6} | {'peak':>8} {'pred':>8} {'err':>6} | "
          f"{'exact':>5} | {'params':>6} {'optim':>6} {'grads':>6} {'buffers':>7} {'walk':>7} | predicted peak at")
    grad_keys = ("buckets", "separate grads", "sharded grads", "fp32 acc grads", "grads")
    for res in results:
        st, parts = res.static_parts, res.parts
        grads = sum(st.get(k, 0) for k in grad_keys) + sum(parts.get(k, 0) for k in grad_keys)
        skip = {"static", "walk", *grad_keys}
        buffers = sum(v for k, v in parts.items() if k not in skip and not k.startswith("measured"))
        cells = [st.get("params", 0), st.get("optimizer", 0), grads, buffers, parts.get("walk", 0)]
        print(f"{res.label + res.notes:<28}{res.n:>3} | {res.static_measured / 1e6:8.3f} "
              f"{res.static_predicted / 1e6:8.3f} {pct(res.static_predicted, res.static_measured):>6} | "
              f"{res.peak_measured / 1e6:8.3f} {res.peak_predicted / 1e6:8.3f} "
              f"{pct(res.peak_predicted, res.peak_measured):>6} | {res.phase_exact:>2}/{res.phase_count:<2} | "
              + " ".join(f"{c / 1e6:{w}.3f}" for c, w in zip(cells, (6, 6, 6, 7, 7), strict=True))
              + f" | {res.peak_where}")


def print_static_parts(res: Result, predicted: dict[str, int]) -> None:
    meas = {k.removeprefix("measured "): v for k, v in res.parts.items() if k.startswith("measured")}
    cells = ", ".join(f"{k} {mb(meas.get(k, 0)).strip()}/{mb(v).strip()}" for k, v in predicted.items())
    print(f"    static parts measured/predicted (MB): {cells}")


def check_fsdp_events(setup: FsdpSetup, res: Result) -> int:
    """Each collective's buffers for one block and the root: measured vs closed form."""
    units = fsdp_units(setup)
    failures = 0
    print(f"  events, {res.label} N={setup.n} (bytes; 'transient' = peak inside the call - live before):")
    seen: set[tuple[str, str]] = set()
    phase_of = {"foreach_all_gather": 0}
    for name, unit, before, after, transient in res.events:
        if unit not in ("blocks.1", "root"):
            continue
        u = units[unit]
        key = (name, unit)
        count = phase_of[key] = phase_of.get(key, 0) + 1
        if name == "foreach_all_gather":
            checks = {"delta (flat output)": (after - before, u.ag_out),
                      "transient (cast input + output)": (transient, u.ag_in + u.ag_out)}
        elif name == "foreach_all_gather_copy_out":
            checks = {"delta (unsharded params)": (after - before, u.unsharded)}
        elif name == "reshard":
            if after == before:
                continue
            checks = {"delta (free unsharded)": (after - before, -u.unsharded)}
        elif name == "foreach_reduce":
            checks = {"transient (RS in, or out)": (transient, max(u.rs_in, u.rs_in + u.rs_out_extra(u.compute))),
                      "delta (RS in + out - grads)": (after - before, u.rs_in + u.rs_out - u.unsharded_grads)}
        else:
            continue
        if (name, unit, count > 1) in seen:
            continue
        seen.add((name, unit, count > 1))
        for what, (m, p) in checks.items():
            ok = m == p
            failures += not ok
            print(f"    {unit:<9}{name:<29}#{count} {what:<32} measured {m:>10} predicted {p:>10} "
                  f"{'ok' if ok else 'MISMATCH'}")
    return failures


def check_hooks_inert() -> tuple[int, int]:
    """Peak of the project's train_step with and without our boundary hooks (FSDP2 s3 bf16, N=8)."""
    peaks = []
    for hooks in (False, True):
        setup = FsdpSetup(8, True, True)
        with process_group(8):
            mesh = init_device_mesh("cpu", (8,))
            with FakeTensorMode(), LiveStorageTracker() as tracker:
                model, optimizer = build_fsdp(setup, mesh)
                ids, tgt = make_batch(1)
                knobs, spec = Knobs(micro_batch_size=MICRO, precision="fp32"), precision_spec("fp32")
                train_step(model, optimizer, ids, tgt, knobs, spec)
                phases = Phases(tracker)
                if hooks:
                    attach_boundaries(model, phases)
                gc.collect()
                tracker.reset_peak()
                train_step(model, optimizer, ids, tgt, knobs, spec)
                phases.close()  # the hooks move the tracker's running peak into phases.global_peak
                peaks.append(max(phases.global_peak, tracker.peak_bytes))
    return peaks[0], peaks[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="world size 8 only, no extra rows")
    args = parser.parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    worlds = (8,) if args.quick else WORLD_SIZES
    print(f"torch {torch.__version__}; model {CONFIG.name}: {CONFIG.n_layers} blocks, d_model {CONFIG.d_model}, "
          f"d_ff {CONFIG.d_ff}, vocab {CONFIG.vocab_size}, {CONFIG.n_heads} heads / {CONFIG.n_kv_heads} kv heads; "
          f"seq {SEQ}, micro-batch {MICRO}; rank {RANK}; AdamW foreach; bytes rounded to 512")

    baselines: dict[tuple, tuple[Phases, int]] = {}

    def baseline(dtype: torch.dtype, precision: str, policy: tuple[str, ...], accum: int = 1,
                 set_to_none: bool = True) -> tuple[Phases, int]:
        key = (CONFIG.name, dtype, precision, policy, accum, set_to_none)
        if key not in baselines:
            baselines[key] = run_baseline(dtype, precision, policy, accum, set_to_none)
        return baselines[key]

    results: list[Result] = []
    failures = 0
    # ---- stages 0 and 1
    for stage in (0, 1):
        for bf16 in (False, True):
            for n in worlds:
                setup = DdpSetup(n, stage, bf16)
                res, sizes = run_ddp(setup)
                base, base_static = baseline(torch.float32, "bf16-mixed" if bf16 else "fp32", ("drop",))
                res.judge(predict_ddp(setup, base, base_static, res))
                results.append(res)
                if n == worlds[-1]:
                    static, buckets, _ = ddp_static(setup)
                    print(f"  {res.label} N={n}: DDP rebuilt buckets {sizes} (predicted {buckets})")
                    print_static_parts(res, {k: v for k, v in static.items() if k != "buckets"})
    # ---- stages 2 and 3
    for reshard in (False, True):
        for mp in (False, True):
            for n in worlds:
                setup = FsdpSetup(n, reshard, mp)
                res = run_fsdp(setup, events=(n == 8))
                base, base_static = baseline(torch.bfloat16 if mp else torch.float32, "fp32", ("unit",))
                show = n == 8 and reshard and mp
                if show:
                    print(f"  phases, {res.label} N={n} (bytes; prediction = walk - its static + FSDP2 static + "
                          "buffers alive):")
                res.judge(predict_fsdp(setup, base, base_static, res), show)
                results.append(res)
                if n == 8:
                    failures += check_fsdp_events(setup, res)
                    print_static_parts(res, fsdp_static(setup))
                    units = fsdp_units(setup)
                    full = sum(r(numel(sh) * 4) for u in units.values() for sh in u.shapes)
                    after, peak = sum(u.sharded_params for u in units.values()), full + units["blocks.0"].sharded_params
                    ok = res.init == (after, peak)
                    failures += not ok
                    print(f"    init (model built unsharded, then fully_shard): live after {res.init[0]} "
                          f"(predicted {after}), peak {res.init[1]} (predicted {peak}) {'ok' if ok else 'MISMATCH'}")
    print()
    print("Per-rank bytes of one steady-state step (rank 0), measured vs predicted:")
    print_table(results)
    extras: list[Result] = []
    if not args.quick:
        print("\nExtras (N = 8): DDP without bucket views, accumulation (2 micro-batches), root left to "
              "fully_shard's default, fake vs real tensors:")
        setup = DdpSetup(8, 0, False, bucket_view=False)
        res, _ = run_ddp(setup)
        res.notes = " views=False"
        res.judge(predict_ddp(setup, *baseline(torch.float32, "fp32", ("keep",)), res))
        extras.append(res)
        for views in (True, False):  # validate.apply.train_step's choice for DDP: zero in place
            setup = DdpSetup(8, 0, False, bucket_view=views, set_to_none=False)
            res, _ = run_ddp(setup)
            res.notes = f" views={views} keep"
            res.judge(predict_ddp(setup, *baseline(torch.float32, "fp32", ("keep",), set_to_none=False), res))
            extras.append(res)
        setup = DdpSetup(8, 0, False, accum=2, no_sync=True, set_to_none=False)
        res, _ = run_ddp(setup)
        res.notes = " acc2 nosync keep"
        res.judge(predict_ddp(setup, *baseline(torch.float32, "fp32", ("keep", "keep"), 2, False), res))
        extras.append(res)
        for no_sync in (False, True):
            setup = DdpSetup(8, 0, False, accum=2, no_sync=no_sync)
            res, _ = run_ddp(setup)
            policy = ("keep", "drop") if no_sync else ("drop", "drop")
            res.notes = " acc2" + (" nosync" if no_sync else "")
            res.judge(predict_ddp(setup, *baseline(torch.float32, "fp32", policy, 2), res))
            extras.append(res)
        for reshard, mp, no_sync in ((True, False, False), (True, True, False), (True, False, True),
                                     (True, True, True), (False, False, False)):
            setup = FsdpSetup(8, reshard, mp, accum=2, no_sync=no_sync)
            res = run_fsdp(setup)
            policy = ("keep", "unit") if (no_sync and not mp) else ("unit", "unit")
            res.notes = " acc2" + (" nosync" if no_sync else "")
            res.judge(predict_fsdp(setup, *baseline(torch.bfloat16 if mp else torch.float32, "fp32", policy, 2), res))
            extras.append(res)
        for setup, note, dtype, precision in (
            (FsdpSetup(8, True, True, reduce_bf16=True), " reduce bf16", torch.bfloat16, "fp32"),
            (FsdpSetup(8, True, False, autocast=True), " autocast", torch.float32, "bf16-mixed"),
            (FsdpSetup(8, True, True, root_auto=True), " root=None", torch.bfloat16, "fp32"),
        ):
            res = run_fsdp(setup)
            res.notes = note
            res.judge(predict_fsdp(setup, *baseline(dtype, precision, ("unit",)), res))
            extras.append(res)
        with using_config(BLOCKY):
            for reshard, mp in ((True, True), (True, False), (False, False)):
                setup = FsdpSetup(8, reshard, mp)
                res = run_fsdp(setup)
                res.notes = " v512"
                res.judge(predict_fsdp(setup, *baseline(torch.bfloat16 if mp else torch.float32, "fp32", ("unit",)),
                                       res), show=reshard and not mp)
                extras.append(res)
            setup = DdpSetup(8, 1, False)
            res, _ = run_ddp(setup)
            res.notes = " v512"
            res.judge(predict_ddp(setup, *baseline(torch.float32, "fp32", ("drop",)), res))
            extras.append(res)
        real = run_fsdp(FsdpSetup(8, True, True), fake=False)
        fake = next(x for x in results if x.label == "fsdp s3 bf16" and x.n == 8)
        same = (real.static_measured, real.peak_measured) == (fake.static_measured, fake.peak_measured)
        failures += not same
        print(f"  fsdp s3 bf16 N=8 real tensors: static {real.static_measured} peak {real.peak_measured}; "
              f"fake tensors: static {fake.static_measured} peak {fake.peak_measured} -> {'same' if same else 'DIFFER'}")
        plain, hooked = check_hooks_inert()
        failures += plain != hooked
        print(f"  validate.apply.train_step peak without / with boundary hooks: {plain} / {hooked} -> "
              f"{'same' if plain == hooked else 'DIFFER'}")
        print_table(extras)
    worst = max(abs(x.peak_predicted - x.peak_measured) / x.peak_measured for x in results + extras)
    worst_static = max(abs(x.static_predicted - x.static_measured) / x.static_measured for x in results + extras)
    bad_phases = sum(x.phase_bad for x in results + extras)
    n_phases = sum(x.phase_count for x in results + extras)
    exact = sum(x.phase_exact for x in results + extras)
    print(f"\nworst peak error {worst:.3%}, worst static error {worst_static:.3%}; phase peaks within 0.1%: "
          f"{n_phases - bad_phases}/{n_phases} ({exact} exact to the byte); event mismatches {failures}; "
          f"{time.time() - t0:.0f} s")
    return 0 if failures == 0 and worst < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
