"""The memory walk: a step's allocations op by op (one event loop, engines' hooks) and the exact checkpoint placement."""
