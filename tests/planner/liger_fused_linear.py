"""Liger-Kernel 0.8.5's fused linear cross-entropy as a GPU runs it, on plain tensors (test helper).

Liger-Kernel cannot be a test dependency (it needs triton and a GPU to run its kernels). This
module copies the code paths that decide what its loss allocates, from its sources at 0.8.5:

- liger_kernel/transformers/model/loss_utils.py ``LigerForCausalLMLoss`` (labels padded with
  the ignore index and shifted, the shifted copy made contiguous, h viewed as (B T, D)) and
  ``fixed_fused_linear_cross_entropy`` (``reduction="sum"`` and a division by
  ``num_items_in_batch`` when the Trainer passes it, ``"mean"`` otherwise);
- liger_kernel/ops/fused_linear_cross_entropy.py ``fused_linear_cross_entropy_forward`` /
  ``_backward`` and ``LigerFusedLinearCrossEntropyFunction`` for the default arguments
  (no bias, class weights, softcap, z-loss, token scaling; ``accum_dtype=None``), taking the
  branches a CUDA device of compute capability 8 or more takes with torch 2.8 or later:
  ``_can_use_mm_out`` (grad mode is off inside the Function's forward) holds when the input and
  weight share a dtype and, under autocast, that dtype is autocast's; then one (Rc, V) logits
  buffer is written with ``mm(out=)``; the weight gradient is accumulated with
  ``addmm(out_dtype=float32, out=grad_weight)`` for an fp32 accumulator and low-precision
  chunk gradients (the chunk cast to their dtype first), ``addmm(out=grad_weight)`` for a
  low-precision accumulator of their dtype, else ``grad_weight += mm(g^T, h_rows).float()``.

``liger_cross_entropy_kernel`` (triton) writes the loss into ``loss_1d`` and the logits'
gradient over the logits in place, allocating nothing: here it is a call that allocates nothing
(the simulation runs under fake tensors, whose values are never read). The loss's backward
(``element_mul_kernel``) scales the saved gradients in place. ``target_mask.sum().item()``
(a device-to-host read) is the sum without the read. Autocast is CPU autocast standing for
CUDA's: the matmuls (``@``) are in both lower-precision lists, and neither applies to ``out=``
overloads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
LOW = (torch.float16, torch.bfloat16)


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """``chunk_size``: ``min(next_power_of_2(cdiv(BT, cdiv(V, H))), BT)``."""
    inc_factor = -(-vocab // hidden)
    rows = -(-tokens // inc_factor)
    return min(1 << (rows - 1).bit_length(), tokens)


def _can_use_mm_out(_input: torch.Tensor, weight: torch.Tensor) -> bool:
    """``_can_use_mm_out`` on a CUDA device (not HIP), grad mode off, CPU autocast standing for CUDA's."""
    if torch.is_grad_enabled() or _input.dtype != weight.dtype or _input.dtype not in (*LOW, torch.float32):
        return False
    if torch.is_autocast_enabled("cpu"):
        return _input.dtype == torch.get_autocast_dtype("cpu")
    return True


def _cross_entropy_kernel(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
    """``liger_cross_entropy_kernel``: the loss into ``loss``, the gradient over ``logits``, in place."""


def fused_linear_cross_entropy_forward(_input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                       ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, ...]:
    bt, h = _input.shape
    v = weight.shape[0]
    chunk_size = chunk_rows(bt, h, v)
    num_chunks = -(-bt // chunk_size)
    grad_input = torch.zeros_like(_input)
    grad_weight = torch.zeros_like(weight)
    loss_1d = torch.zeros(bt, dtype=torch.float32)
    target_mask = target != ignore_index
    target_mask.sum()  # .item(): read and dropped
    use_mm_out = _can_use_mm_out(_input, weight)
    logits_storage = torch.empty((chunk_size, v), dtype=_input.dtype) if use_mm_out else None
    for chunk_id in range(num_chunks):
        start_idx, end_idx = chunk_id * chunk_size, min((chunk_id + 1) * chunk_size, bt)
        _input_chunk = _input[start_idx:end_idx]
        if logits_storage is not None:
            logits_chunk = logits_storage[: end_idx - start_idx]
            torch.mm(_input_chunk, weight.t(), out=logits_chunk)
        else:
            logits_chunk = _input_chunk @ weight.t()
        target_chunk = target[start_idx:end_idx]
        logits_chunk = logits_chunk.contiguous()
        target_chunk = target_chunk.contiguous()
        loss_1d_slice = loss_1d[start_idx:end_idx]
        _cross_entropy_kernel(logits_chunk, target_chunk, loss_1d_slice)
        grad_logits_chunk = logits_chunk
        del logits_chunk
        loss_1d[start_idx:end_idx] = loss_1d_slice
        if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
            torch.mm(grad_logits_chunk, weight, out=grad_input[start_idx:end_idx])
        else:
            grad_input[start_idx:end_idx] = grad_logits_chunk @ weight
        grad_logits_t = grad_logits_chunk.t()
        if grad_weight.dtype == torch.float32 and grad_logits_t.dtype in LOW:
            input_chunk = _input_chunk
            if input_chunk.dtype != grad_logits_t.dtype:
                input_chunk = input_chunk.to(grad_logits_t.dtype)
            torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32, out=grad_weight)
            del input_chunk
        elif grad_logits_t.dtype in LOW and grad_weight.dtype == grad_logits_t.dtype:
            input_chunk = _input_chunk
            if input_chunk.dtype != grad_logits_t.dtype:
                input_chunk = input_chunk.to(grad_logits_t.dtype)
            torch.addmm(grad_weight, grad_logits_t, input_chunk, out=grad_weight)
            del input_chunk
        else:
            grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()
        del grad_logits_t
        del grad_logits_chunk, _input_chunk, target_chunk
    del logits_storage
    loss = torch.sum(loss_1d)
    grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_input, grad_weight


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        loss, grad_input, grad_weight = fused_linear_cross_entropy_forward(_input, weight, target)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach())
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input, grad_weight, None  # element_mul_kernel scales them in place


def liger_for_causal_lm_loss(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                             hidden_size: int, num_items_in_batch: int | None = None) -> torch.Tensor:
    """``LigerForCausalLMLoss`` without ``shift_labels``."""
    labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_size)
    shift_labels = shift_labels.view(-1)
    loss = LigerFusedLinearCrossEntropyFunction.apply(hidden_states, lm_head_weight, shift_labels)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss  # type: ignore[no-any-return]
