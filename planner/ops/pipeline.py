"""The ops a pipeline-parallel stage adds to its rank's program (``planner.graph.stages``).

A stage after the first runs its blocks on the activation the stage before it sent:
``torch.distributed.pipelining``'s ``PipelineStage`` receives it into a tensor of the boundary's
shape and dtype (``stage.py``: ``_PipelineStageBase._retrieve_recv_activations``), marks it
``requires_grad`` and, after the stage's backward, sends its gradient back
(``get_bwd_send_ops``). What torch 2.13 allocates for it was measured with the live-storage
tracker (``docs/pipeline_memory.md`` sections 2 and 4). The receive has no FLOPs and no kernel of the stage's own; its time is
the pipeline's p2p transfer, placed on the schedule's timeline, not in the stage's op times.
"""

from __future__ import annotations

from planner.ops.base import LayerCost, LayerSpec, OpContext, OpKind, TensorInfo
from planner.ops.registry import register


@register(OpKind.STAGE_INPUT)
def stage_input_cost(spec: LayerSpec, ctx: OpContext) -> LayerCost:
    """The received activation x (the boundary tensor, ``ctx.inputs[0]``: (B, T, D) of the
    residual stream in its dtype, T the rank's share under sequence or context parallelism). It is
    the micro-batch's receive buffer itself, allocated once for the whole step (``stage.py``
    ``_setup_forward_recv_info``: one per micro-batch; ``_retrieve_recv_activations`` makes it
    the autograd leaf), so the op allocates nothing; its gradient, x's size, is sent back and also
    kept as the buffer's ``.grad`` until the next step clears it (``stage_backward``:
    ``inp.grad = dinput``). Saves nothing of its own (the blocks that read it save it)."""
    x = ctx.inputs[0]
    return LayerCost(output=TensorInfo(numel=x.numel, dtype=x.dtype), fwd_kernels=0, bwd_kernels=0,
                     output_preallocated=True, keeps_grad=True)
