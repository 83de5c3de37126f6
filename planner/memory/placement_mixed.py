"""Exact placement of two checkpoint policies on one chain: each block none, policy A or policy B.

Two single-policy profiles (``planner.memory.placement``, measured by their own walks) share the walk
without checkpointing, so a plain block's terms and what one plain block adds (D[none]) are the
same in both. A placement's walk then decomposes as for one policy, with a block of status A
seeing its A terms, a block of status B its B terms, and every block the prefix
``a D[A] + b D[B] + (i - a - b) D[none]`` of the blocks before it; events after the blocks move by
one per-block amount per checkpointed block of each policy, and once when any exists. Both
profiles must agree on what they share (else ``NotDecomposableError``: the caller keeps the
single-policy curves).

A dynamic program over (block, blocks of A so far, blocks of B so far) gives, for every pair of
counts, the placement with the lowest peak: O(L^3) states, vectorized over the counts with numpy
(imported here only: planning one fixed configuration never imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.memory.placement import _AFTER, _CKPT, _NONE, NotDecomposableError, PlacementProfile

_INF = float("inf")


@dataclass(frozen=True)
class MixedProfile:
    """Policy A's and policy B's profiles of one graph (status 1: A, 2: B)."""

    a: PlacementProfile
    b: PlacementProfile

    def __post_init__(self) -> None:
        a, b = self.a, self.b
        shared = (a.first[0] == b.first[0] and a.terms[_NONE] == b.terms[_NONE] and a.last[_NONE] == b.last[_NONE]
                  and a.step[0] == b.step[0] and [o[0] for o in a.outside] == [o[0] for o in b.outside]
                  and a.terms.get(_AFTER) == b.terms.get(_AFTER) and a.last.get(_AFTER) == b.last.get(_AFTER))
        if not shared or set(a.step[1]) != set(a.step[0]) or set(b.step[1]) != set(a.step[0]):
            raise NotDecomposableError("the two policies' walks differ where they should be the same")
        n = a.n_blocks
        for (none, one_a, every_a), (_, one_b, every_b) in zip(a.outside, b.outside, strict=True):
            if (one_a - none) - (every_a - one_a) // (n - 1) != (one_b - none) - (every_b - one_b) // (n - 1):
                raise NotDecomposableError("the events after the blocks jump differently for the two policies")

    def _profile(self, status: int) -> PlacementProfile:
        return self.b if status == 2 else self.a

    def _tail_peak(self, count_a: int, count_b: int) -> int:
        n = self.a.n_blocks
        if count_a + count_b == 0:
            return max((none for none, _, _ in self.a.outside), default=0)
        out = 0
        for (_, one_a, every_a), (_, one_b, every_b) in zip(self.a.outside, self.b.outside, strict=True):
            step_a, step_b = (every_a - one_a) // (n - 1), (every_b - one_b) // (n - 1)
            out = max(out, one_a - step_a + count_a * step_a + count_b * step_b)
        return out

    def peak(self, statuses: tuple[int, ...]) -> int:
        """Peak allocated bytes of the walk for ``statuses`` (0 none, 1 policy A, 2 policy B)."""
        prefix: dict[tuple[int, str], int] = {key: 0 for key in self.a.step[0]}
        best, seen = 0, False
        for index, s in enumerate(statuses):
            kind = _CKPT if s else (_AFTER if seen else _NONE)
            best = max(best, self._profile(s)._block_peak(index, kind, prefix))
            seen = seen or bool(s)
            step = self._profile(s).step[1 if s else 0]
            for key in prefix:
                prefix[key] += step[key]
        return max(best, self._tail_peak(statuses.count(1), statuses.count(2)))

    def min_peak_by_counts(self, most_a: int | None = None, most_b: int | None = None
                           ) -> tuple[list[list[float]], list[Any]]:
        """``best[a][b]`` for a <= ``most_a`` and b <= ``most_b`` (default L): the lowest peak with
        a blocks of A and b of B (inf where a + b > L), and the choices to rebuild a placement
        reaching it (``placement``). Counts only grow along the chain, so the bounds are exact."""
        import numpy as np

        n = self.a.n_blocks
        rows = n if most_a is None else min(n, most_a)
        cols = n if most_b is None else min(n, most_b)
        keys = list(self.a.step[0])
        grid_a, grid_b = np.meshgrid(np.arange(rows + 1, dtype=np.float64), np.arange(cols + 1, dtype=np.float64),
                                     indexing="ij")
        # prefix[key] = a D[A] + b D[B] + (i - a - b) D[none] = i D[none] + (a, b)-part
        slopes = [grid_a * (self.a.step[1][k] - self.a.step[0][k]) + grid_b * (self.b.step[1][k] - self.a.step[0][k])
                  for k in keys]
        tops: dict[tuple[int, int, int], list[float]] = {}  # (profile, place, kind) -> each key's top term

        def peaks(index: int, kind: int, status: int) -> Any:
            """The block's peak for every (a, b): max over its events of term + prefix."""
            place = 0 if index == 0 else 2 if index == n - 1 else 1
            if index == 0 and kind != _CKPT:  # nothing before block 0: never "after" a checkpointed block
                kind = _NONE
            key = (status, place, kind)
            if key not in tops:
                profile = self._profile(status)
                terms = (profile.first, profile.terms, profile.last)[place][kind]
                tops[key] = [max(terms[k]) if k in terms else -_INF for k in keys]
            out = None
            for top, slope, k in zip(tops[key], slopes, keys, strict=True):
                if top == -_INF:
                    continue
                value = slope + (top + index * self.a.step[0][k])
                out = value if out is None else np.maximum(out, value)
            return np.full_like(grid_a, -_INF) if out is None else out

        best = np.full((rows + 1, cols + 1), _INF)
        best[0, 0] = 0.0
        seen = (grid_a + grid_b) > 0
        choices = []
        for i in range(n):
            plain = np.where(seen, peaks(i, _AFTER, 1), peaks(i, _NONE, 1))
            stay = np.maximum(best, plain)
            with_a = np.maximum(best, peaks(i, _CKPT, 1))
            with_b = np.maximum(best, peaks(i, _CKPT, 2))
            new = stay.copy()
            pick = np.zeros((rows + 1, cols + 1), dtype=np.int8)
            shifted_a = np.full_like(best, _INF)
            shifted_a[1:, :] = with_a[:-1, :]
            better = shifted_a <= new  # ties: checkpoint the earlier block
            new, pick = np.where(better, shifted_a, new), np.where(better, 1, pick)
            shifted_b = np.full_like(best, _INF)
            shifted_b[:, 1:] = with_b[:, :-1]
            better = shifted_b <= new
            new, pick = np.where(better, shifted_b, new), np.where(better, 2, pick)
            best = new
            choices.append(pick)
        tail = np.full_like(best, -_INF)
        for (_, one_a, every_a), (_, one_b, every_b) in zip(self.a.outside, self.b.outside, strict=True):
            step_a, step_b = (every_a - one_a) // (n - 1), (every_b - one_b) // (n - 1)
            tail = np.maximum(tail, one_a - step_a + grid_a * step_a + grid_b * step_b)
        tail[0, 0] = self._tail_peak(0, 0)
        out = np.maximum(best, tail)  # inf stays inf: a + b > L
        return out.tolist(), choices

    @staticmethod
    def placement(choices: list[Any], count_a: int, count_b: int) -> tuple[int, ...]:
        """The statuses (0, 1 for A, 2 for B) of the placement ``min_peak_by_counts`` found for
        these counts."""
        statuses: list[int] = []
        a, b = count_a, count_b
        for pick in reversed(choices):
            s = int(pick[a, b])
            statuses.append(s)
            a -= s == 1
            b -= s == 2
        return tuple(reversed(statuses))
