"""A data-parallel strategy owns everything that depends on how ranks share the work: the
checks it needs, the precision the step computes in, each rank's static memory and the buffers
its hooks add to the walk, the share of the optimizer step a rank runs, its collectives and the
memory every placement reaches. The planner asks the strategy of a layout
(``planner.parallel.strategies.strategy_for``) and never branches on a ZeRO stage itself.

``SingleDevice`` is the base: one GPU, nothing shared, no communication.
"""

from __future__ import annotations

from collections.abc import Mapping

from hardware.profile import HardwareProfile
from planner.errors import ConfigError
from planner.graph.layer_graph import LayerGraph
from planner.memory.engine import StaticMemory
from planner.ops.base import ParamTensor
from planner.plan.knobs import Knobs
from planner.plan.optimizer import OptimizerSpec
from planner.precision import PrecisionPolicy, PrecisionSpec, precision_spec
from planner.timing.step_time import NO_COLLECTIVES, Collectives


class SingleDevice:
    """One GPU: the whole model, its gradients and optimizer state on the device."""

    label = "one GPU"
    runtime = "one process"  # how PyTorch runs it
    allows_segments = True  # multi-block checkpoint segments
    communicates = False  # runs collectives every step
    shards_params = False  # parameters and gradients split over the data-parallel ranks (FSDP2)
    shards_state = False  # optimizer state split over them (ZeRO-1 and FSDP2)

    def describe(self, knobs: Knobs) -> str:
        """How the data-parallel ranks share the work, for the report."""
        return self.runtime

    def gradients(self, knobs: Knobs) -> str:
        """Where the gradients live between micro-batches, for the report."""
        return "one copy, accumulated in place"

    def check(self, knobs: Knobs) -> None:
        """Raise ``ConfigError`` for knobs this strategy cannot run (naming the field)."""

    def runs(self, precision: PrecisionPolicy) -> bool:
        """Whether this strategy is modelled with ``precision``."""
        return True

    def compute_spec(self, precision: PrecisionPolicy) -> PrecisionSpec:
        """The precision the step computes in (what the graph is built with)."""
        return precision_spec(precision)

    def static(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs, opt: OptimizerSpec,
               base: StaticMemory) -> StaticMemory:
        """This rank's static memory, from ``base`` (the whole model on one device)."""
        return base

    def optimizer_shard_fraction(self, graph: LayerGraph, knobs: Knobs, hw: HardwareProfile) -> float:
        """The share of the parameters this rank's optimizer updates."""
        return 1.0

    def collectives(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> Collectives:
        """This rank's data-parallel collectives around one micro-batch (``planner.timing.step_time``)."""
        return NO_COLLECTIVES

    def once_per_step(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> Collectives:
        """A pipeline stage's collectives issued once per step, around its first forward and after
        its last backward (FSDP2 under a pipeline: its all-gathers and reduce-scatters)."""
        return NO_COLLECTIVES

    def bytes_moved(self, graph: LayerGraph, hw: HardwareProfile, knobs: Knobs) -> float:
        """Bytes this rank's data-parallel collectives send in one step."""
        return 0.0

    def model_state_lower_bound(self, tensors: Mapping[str, ParamTensor], spec: PrecisionSpec, knobs: Knobs,
                                hw: HardwareProfile, state_tensors_per_param: int) -> int:
        """Parameters, optimizer state and (where some exist at the loss of the last micro-batch)
        gradients that every checkpoint placement holds, without building the graph (``tensors``:
        the rank's parameters, as its description has them)."""
        params = sum(hw.round_alloc(p.numel * spec.param_dtype.n_bytes) for p in tensors.values())
        state = sum(hw.round_alloc(p.state_elements * spec.param_dtype.n_bytes) for p in tensors.values())
        grads = sum(hw.round_alloc(p.grad_elements * spec.grad_dtype.n_bytes) for p in tensors.values())
        return params + state * state_tensors_per_param + (grads if self._grads_at_loss(knobs) else 0)

    def _grads_at_loss(self, knobs: Knobs) -> bool:
        return knobs.grad_accum_steps > 1


def refuse(field: str, message: str) -> None:
    raise ConfigError(f"knobs.{field}: {message}")
