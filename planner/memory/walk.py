"""The walk behind ``planner.memory.step.simulate_step``: one micro-batch's allocations, op by op.

Forward: each op allocates its output; a tensor stays alive while a later op (or a Python frame
that received it) still needs it, or while some op saved it for backward; extras an op saves live
until its backward. A checkpointed unit keeps only its inputs; its ops' saves are dropped and
rebuilt just before the unit's backward. Backward in reverse: input gradients are allocated or
accumulated, the output gradient is freed, saved tensors are freed once their last user has run,
parameter gradients appear on the first micro-batch.

Hot loop: categories are list indices and per-op facts are precomputed lists (``planner.memory.prepared``),
so one Llama-7B micro-batch walks in a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.memory.prepared import Prepared, recompute_span
from planner.memory.types import CATEGORIES, Live, Phase
from planner.plan.checkpointing import op_units

_PARAMS, _GRADS, _OPTIMIZER, _DATA, _ACTIVATIONS, _LOGITS, _TEMPORARIES = range(len(CATEGORIES))


class WalkHooks:
    """Where a data-parallel engine adds its own buffers to the walk (FSDP2: ``planner.parallel.fsdp_units``).
    Every method may add to ``walk.live`` and observe; the defaults do nothing."""

    def forward_start(self, walk: Walk) -> None: ...
    def before_forward(self, walk: Walk, op: int) -> None: ...
    def after_forward(self, walk: Walk, op: int) -> None: ...
    def forward_end(self, walk: Walk) -> None: ...
    def backward_start(self, walk: Walk) -> None: ...
    def before_recompute(self, walk: Walk, op: int) -> None: ...
    def after_recompute(self, walk: Walk, op: int) -> None: ...
    def before_backward(self, walk: Walk, op: int) -> None: ...
    def after_backward(self, walk: Walk, op: int) -> None: ...
    def backward_end(self, walk: Walk) -> None: ...


class Walk:
    """One micro-batch: forward, then backward with recomputation, for a checkpoint placement.

    ``unit_grads``: parameter gradients are allocated afresh every micro-batch and freed by the
    hooks (FSDP2 reduce-scatters and drops a unit's gradients at its post-backward), except
    ``held_grads``, which a previous micro-batch left allocated and this one adds into in place."""

    def __init__(self, prep: Prepared, units: dict[int, int], live: Live, grads_exist: bool,
                 hooks: WalkHooks | None = None, unit_grads: bool = False, held_grads: frozenset[str] = frozenset()) -> None:
        self.p = prep
        self.live = live
        self.grads_exist = grads_exist and not unit_grads
        self.hooks = hooks or WalkHooks()
        self.unit_grads = unit_grads
        self.grad_bytes: dict[str, int] = {}  # parameter gradients this walk allocated
        n = prep.n
        # per op: its checkpoint unit, and whether per-op selective checkpointing keeps its output
        # (held from the forward to the unit's recompute, which returns it instead of running it)
        self.unit, self.cached = op_units(prep.kinds, prep.block, prep.biases, units)
        self.alive = [False] * n  # output tensor allocated
        self.holds = [0] * n  # backward users still holding a tensor
        self.release: list[list[int]] = [[] for _ in range(n)]  # node -> tensors it holds
        self.extras_alive = [False] * n
        self.copies_alive = [False] * n
        self.grad_buffer: list[int] = [0] * n  # tensor -> gradient buffer id (0: none)
        self.buffers: dict[int, list[int]] = {}  # id -> [bytes, category, refcount]
        self.permanent: set[int] = set()  # buffers whose bytes outlive the walk (a stage input's .grad)
        self.kept: list[tuple[int, int]] = []  # (category, bytes) of those, once the walk dropped them
        self.next_buffer = 0
        self.param_grads_seen: set[str] = set(held_grads)  # gradients a previous micro-batch left allocated
        self.pending_sums: dict[str, int] = {}
        self.summed: list[str] = []
        self.recompute_flops = 0.0
        self.recomputed: list[int] = []
        self.pending: dict[int, int] = {}  # forward users still to run (this forward or recompute)
        self.unit_members: dict[int, list[int]] = {}
        for i, u in enumerate(self.unit):
            if u is not None:
                self.unit_members.setdefault(u, []).append(i)
        # non-reentrant checkpoint recomputes a unit when its first saved tensor is unpacked: at
        # the backward of its last op that saves anything; later ops' backwards run before it
        self.trigger: dict[int, int] = {}
        for u, members in self.unit_members.items():
            ran, final = recompute_span([prep.nodes[i].cost for i in members])
            self.trigger[u] = members[final if final is not None else max(0, ran - 1)]

    # --- tensors ----------------------------------------------------------------------------
    def _free_tensor(self, t: int) -> None:
        if self.alive[t]:
            self.alive[t] = False
            self.live.add(self.p.category[t], -self.p.out_bytes[t])
            base = self.p.view_of[t]
            if base is not None:  # the view held its base's storage
                self.holds[base] -= 1
                if self.holds[base] == 0 and self.pending.get(base, 0) == 0 and base != self.p.n - 1:
                    self._free_tensor(base)

    def _hold_for_backward(self, t: int, unit: int | None) -> None:
        """Ops whose backward needs tensor t hold it: savers outside checkpointed units (unit=None),
        or savers inside ``unit`` during its recompute; a checkpointed unit consuming t from
        outside holds it (as a checkpoint input) until the unit's backward ends."""
        users = {s for s in self.p.savers[t] if self.unit[s] == unit}
        if unit is None:
            own = self.unit[t]
            for c in self.p.consumers[t]:
                cu = self.unit[c]
                if cu is not None and cu != own:
                    users.add(self.unit_members[cu][0])
        for user in users:
            self.release[user].append(t)
        self.holds[t] += len(users)

    # --- forward ----------------------------------------------------------------------------
    def _forward_pending(self, members: list[int], phase: Phase, scope: list[int] | None) -> dict[int, int]:
        """Per tensor, its forward users still to run: every use in the full forward; in a recompute
        the uses inside the whole unit (``scope``), so a module frame that ends beyond where the
        recompute stops holds its tensors until then."""
        p = self.p
        if phase is Phase.FORWARD:
            return dict(enumerate(p.full_pending))
        member_set = set(scope if scope is not None else members)
        return {
            i: sum(1 for c in p.consumers[i] if c in member_set) + sum(1 for c in p.frame_users[i] if c in member_set)
            for i in members
        }

    def _recompute_cached(self, i: int, unit: int | None, pending: dict[int, int]) -> None:
        """A recompute reaches op i whose output selective checkpointing kept: SAC returns the kept
        output; what the op saves beyond it and the casts feeding it are made again."""
        p, live = self.p, self.live
        if not p.extras_out[i]:
            live.add(p.category[i], p.extras[i])
            self.extras_alive[i] = True
        if p.copies[i]:
            live.add(_TEMPORARIES, p.copies[i])
            self.copies_alive[i] = True
        self._hold_for_backward(i, unit)
        self._end_uses(i, pending)

    def _run_forward(self, members: list[int], phase: Phase, unit: int | None, scope: list[int] | None = None) -> None:
        """Run ``members``' forwards (the whole forward, or a unit's recompute up to where it stops).

        Hot loop (millions of ops per search): the per-op body stays inline, no extra call per op;
        only the once-per-run setup and the rare SAC-cached recompute branch are helpers."""
        p, live = self.p, self.live
        pending = self.pending = self._forward_pending(members, phase, scope)
        recompute = phase is Phase.RECOMPUTE
        hooks = self.hooks if phase is Phase.FORWARD else WalkHooks()
        for i in members:
            hooks.before_forward(self, i)
            if recompute:
                self.hooks.before_recompute(self, i)
                if self.cached[i]:
                    self._recompute_cached(i, unit, pending)
                    self.hooks.after_recompute(self, i)
                    continue
            cat = p.category[i]
            live.add(cat, p.out_bytes[i])
            self.alive[i] = True
            base = p.view_of[i]
            if base is not None:
                self.holds[base] += 1
            dropped = 0  # an uncached copy in a checkpointed unit's forward: the op's alone
            if p.copies[i] and (p.copies_cached[i] or self.unit[i] is None or unit is not None):
                live.add(_TEMPORARIES, p.copies[i])
                self.copies_alive[i] = True
            elif p.copies[i]:
                dropped = p.copies[i]
            if self.unit[i] is None or unit is not None or (self.cached[i] and p.extras_out[i]):
                live.add(cat, p.extras[i])
                self.extras_alive[i] = True
                transient = p.fwd_transient[i]
            elif p.unsaved_transient[i] is not None:
                transient = p.unsaved_transient[i]  # type: ignore[assignment]
            else:  # checkpointed: the pack hook drops what the op saved once the op returns
                transient = p.extras[i] + p.fwd_transient[i]
            live.observe(phase, p.names[i], transient + dropped)
            self._hold_for_backward(i, unit)
            if self.cached[i] and not recompute:
                self.holds[i] += 1  # SAC's cache holds it until the recompute
            if recompute:
                self.recompute_flops += p.fwd_flops[i]
                self.recomputed.append(i)
            self._end_uses(i, pending)
            hooks.after_forward(self, i)
            if recompute:
                self.hooks.after_recompute(self, i)

    def _end_uses(self, i: int, pending: dict[int, int]) -> None:
        """Op i ran: the tensors it was the last forward user of die unless something holds them."""
        last = self.p.n - 1
        for t in self.p.users_by_op[i]:
            if t in pending:
                pending[t] -= 1
                if pending[t] == 0 and self.holds[t] == 0 and t != last:
                    self._free_tensor(t)
        if pending[i] == 0 and self.holds[i] == 0 and i != last:
            self._free_tensor(i)

    def forward(self) -> tuple[int, int]:
        p = self.p
        self.hooks.forward_start(self)
        self._run_forward(list(range(p.n)), Phase.FORWARD, None)
        self.hooks.forward_end(self)
        # autocast exits: the cached weight copies of checkpointed ops are released
        for i, alive in enumerate(self.copies_alive):
            if alive and self.unit[i] is not None:
                self.copies_alive[i] = False
                self.live.add(_TEMPORARIES, -p.copies[i])
        return self.live.by_category[_ACTIVATIONS], self.live.by_category[_LOGITS]

    # --- backward ---------------------------------------------------------------------------
    def _recompute(self, u: int) -> None:
        """Non-reentrant checkpoint: re-run the unit's forward until every tensor it saved is
        rebuilt (torch raises a stop once the last one is packed). Autograd packs a matmul's
        saved inputs before running it, so a unit ending in a matmul stops short of its kernel:
        only its saves (and any autocast casts, made before the kernel) happen."""
        p = self.p
        members = self.unit_members[u]
        ran, final = recompute_span([p.nodes[i].cost for i in members])
        self._run_forward(members[:ran], Phase.RECOMPUTE, u, scope=members)
        if final is None and ran:
            self.recompute_flops -= p.nodes[members[ran - 1]].cost.unrun_tail_flops
        if final is not None:
            stop = members[final]
            if p.copies[stop]:
                self.live.add(_TEMPORARIES, p.copies[stop])
                self.copies_alive[stop] = True
            self.live.add(p.category[stop], p.extras[stop])
            self.extras_alive[stop] = True
            self.live.observe(Phase.RECOMPUTE, p.names[stop])
            for slot, t in enumerate(p.inputs[stop]):
                if p.saved_slots[stop][slot]:
                    self.release[stop].append(t)
                    self.holds[t] += 1
        for position, i in enumerate(members):  # SAC's cache hands its tensors over to the recomputed graph;
            if self.cached[i]:  # one the recompute stopped short of stays cached until the unit's backward ends
                if position < ran:
                    self.holds[i] -= 1
                else:
                    self.release[members[0]].append(i)
        # the recompute stops: the unit's module frames unwind, and what only they held dies
        unwound = [t for t, uses in self.pending.items() if uses or (self.cached[t] and not self.holds[t])]
        for t in unwound:
            self.pending[t] = 0
        for t in unwound:
            if self.holds[t] == 0 and t != p.n - 1:
                self._free_tensor(t)

    def _new_buffer(self, n_bytes: int, category: int) -> int:
        self.next_buffer += 1
        self.buffers[self.next_buffer] = [n_bytes, category, 1]
        self.live.add(category, n_bytes)
        return self.next_buffer

    def _drop_buffer(self, key: int) -> None:
        if not key:
            return
        entry = self.buffers[key]
        if entry[2] > 1:
            entry[2] -= 1
        else:
            del self.buffers[key]
            if key not in self.permanent:  # a kept gradient stays allocated until ``release_kept``
                self.live.add(entry[1], -entry[0])
            else:
                self.kept.append((entry[1], entry[0]))

    def _param_grads(self, i: int) -> int:
        """Parameter grads of op i: allocated on first sight (returns 0), else a transient that
        is added in place (returns its bytes)."""
        momentary = 0
        for name, n_bytes in self.p.params[i]:
            if self.grads_exist or name in self.param_grads_seen:
                if self.p.first_user[name] < i and name not in self.pending_sums:
                    self.pending_sums[name] = n_bytes  # later users add into it in place
                    self.live.add(_GRADS, n_bytes)
                    continue
                momentary += n_bytes
                if name in self.pending_sums:
                    self.summed.append(name)  # freed once this op's gradient is observed
            else:
                self.param_grads_seen.add(name)
                self.live.add(_GRADS, n_bytes)
                self.grad_bytes[name] = n_bytes
        return momentary

    def _sum_pending(self) -> None:
        """The input buffers summed into .grad at the first user's backward are freed."""
        for name in self.summed:
            self.live.add(_GRADS, -self.pending_sums.pop(name, 0))
        self.summed.clear()

    def release_grads(self, names: Iterable[str]) -> None:
        """Free parameter gradients this walk allocated (a unit's, after its reduce-scatter)."""
        for name in names:
            self.live.add(_GRADS, -self.grad_bytes.pop(name, 0))

    def backward(self, input_only: bool = False, keep_sent: bool = False) -> None:
        """The micro-batch's backward; ``input_only``: a split backward's input half (everything saved
        and each weight op's output gradient held until ``backward_weight``); ``keep_sent``: the stage
        input's gradient outlives the walk (``Schedule.holds_last``)."""
        p, live = self.p, self.live
        n = p.n
        # d loss / d loss (one fp32 scalar), or a pipeline stage's received output gradient
        self.grad_buffer[n - 1] = self._new_buffer(p.seed_bytes, p.grad_category[n - 1])
        self.hooks.backward_start(self)
        self.kept_for_weights: list[int] = []
        for i in range(n - 1, -1, -1):
            self.hooks.before_backward(self, i)
            u = self.unit[i]
            if u is not None and self.trigger[u] == i:
                self._recompute(u)
            cast_later = False
            own = self.grad_buffer[i]
            if p.has_backward[i] and own:
                momentary = [0, 0]  # temporaries, logits
                momentary[p.grad_category[i] == _LOGITS] += p.bwd_transient[i]
                if p.releases_out_grad[i] and self.buffers[own][2] == 1 and not input_only:
                    momentary[p.grad_category[i] == _LOGITS] -= self.buffers[own][0]  # its own gradient, read first
                self._input_grads(i, own, momentary)
                # under autocast the weight grad is computed in low precision (part of the
                # transient) and cast to the fp32 .grad afterwards, once the op has released
                # what it saved (ToCopyBackward runs after the matmul's backward node)
                cast_later = bool(p.copies[i])
                if not cast_later and not input_only:
                    momentary[0] += self._param_grads(i)
                live.observe(Phase.BACKWARD, p.names[i], momentary[0], momentary[1])
                self._sum_pending()
            if input_only:
                if p.params[i] and own:  # the output gradient its weight gradient needs: held
                    self.buffers[own][2] += 1
                    self.kept_for_weights.append(own)
                self._release_grad_buffer(i, own, keep=True)
                self.grad_buffer[i] = 0
                continue
            self._release_grad_buffer(i, own, keep=keep_sent)
            self.grad_buffer[i] = 0
            self._release_saved(i)
            if cast_later:
                live.observe(Phase.BACKWARD, p.names[i], p.copies[i] + self._param_grads(i))
                self._sum_pending()
            self.hooks.after_backward(self, i)
        if not input_only:
            self._end_backward()

    def release_kept(self) -> None:
        """Free what this walk kept past its backward (``backward(keep_sent=True)``): the schedule
        let go of the stage input's gradient."""
        for category, n_bytes in self.kept:
            self.live.add(category, -n_bytes)
        self.kept = []

    def backward_weight(self) -> None:
        """A split backward's second half (``stage_backward_weight``): each weight op's gradient
        from its kept output gradient and saved input, in reverse order; then what the micro-batch
        kept is freed."""
        p, live = self.p, self.live
        for i in range(p.n - 1, -1, -1):
            if p.params[i] and p.has_backward[i]:
                live.observe(Phase.BACKWARD, p.names[i], self._param_grads(i) + p.copies[i])
                self._sum_pending()
            self._release_saved(i)
        for key in self.kept_for_weights:
            self._drop_buffer(key)
        self.kept_for_weights = []
        self._end_backward()

    def _input_grads(self, i: int, own: int, momentary: list[int]) -> None:
        """Op i's input gradients: a new buffer, its output gradient (an alias), or added in place."""
        p = self.p
        aliases = p.aliases[i]
        for slot, t in enumerate(p.inputs[i]):
            if not p.out_grad[t]:
                continue
            if not self.grad_buffer[t]:
                if aliases[slot]:
                    self.buffers[own][2] += 1
                    self.grad_buffer[t] = own
                else:
                    self.grad_buffer[t] = self._new_buffer(p.grad_size[t], p.grad_category[t])
            elif not aliases[slot]:
                momentary[p.grad_category[t] == _LOGITS] += p.grad_size[t]  # accumulated in place

    def _release_grad_buffer(self, i: int, own: int, keep: bool) -> None:
        """Op i's output gradient is done with; ``keep``: a stage input's lives to the step's end."""
        if keep and self.p.keeps_grad[i] and own:
            self.permanent.add(own)
        self._drop_buffer(own)

    def _release_saved(self, i: int) -> None:
        """Op i's backward ran: what it held for it is released."""
        p, live = self.p, self.live
        for t in self.release[i]:
            self.holds[t] -= 1
            if self.holds[t] == 0:
                self._free_tensor(t)
        self.release[i] = []
        if self.extras_alive[i]:
            self.extras_alive[i] = False
            live.add(p.category[i], -p.extras[i])
        if self.copies_alive[i]:
            self.copies_alive[i] = False
            live.add(_TEMPORARIES, -p.copies[i])

    def _end_backward(self) -> None:  # the micro-batch's last references go
        self.hooks.backward_end(self)
        self._free_tensor(self.p.n - 1)
        for key in list(self.buffers):
            self._drop_buffer(key)
