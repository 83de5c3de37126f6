"""The longer steps of a search that have no trials to count (the polish, pricing the reported
plans in full, the smallest plan when nothing fits): named as each starts, its work counted."""

from __future__ import annotations

from collections.abc import Callable


class Steps:
    """The longer steps of a search that have no trials to count: each named as it starts
    (``on_stage``), its work counted (``on_progress(done, total)``); either may be None."""

    def __init__(self, on_stage: Callable[[str], None] | None, on_progress: Callable[[int, int], None] | None) -> None:
        self.on_stage = on_stage
        self.on_progress = on_progress

    def stage(self, text: str) -> None:
        if self.on_stage is not None:
            self.on_stage(text)

    def count(self, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(done, total)
