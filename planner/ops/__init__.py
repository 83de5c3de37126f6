"""Per-op cost formulas, one family per module, registered by op kind (``planner.ops.registry``)."""
