"""torchtitan 0.3.0's Llama 3 training step, reproduced op for op on plain tensors (test helper).

torchtitan 0.3.0 (PyPI) cannot be a test dependency: it needs ``triton`` to import, and pulls
in wandb, tensorboard, datasets and pyarrow. This module copies the code paths that decide what
its Llama 3 step allocates, from its sources at that version:

- torchtitan/models/llama3/model.py ``Llama3TransformerBlock.forward``:
  ``h = x + attention(attention_norm(x), masks, positions); out = h + feed_forward(ffn_norm(h))``;
- models/common/attention.py ``FusedQKVLinear`` (``fuse_qkv=True``: one ``wqkv``, split and
  made contiguous) and ``GQAttention.forward`` (q, k rotated, the inner attention, ``.contiguous()``,
  ``flatten(2)``, ``wo``);
- models/common/rope.py ``ComplexRoPE`` (a (T, H/2) complex64 ``cache`` buffer per layer,
  gathered at the dataloader's per-document positions, the product in fp32, ``type_as``);
- models/common/nn_modules.py ``RMSNorm`` = ``nn.RMSNorm``, run here as CUDA runs it
  (``validate.implementations.FusedRMSNormFunction``; CPU's F.rms_norm is decomposed);
- models/common/feed_forward.py ``FeedForward``: ``w2(silu(w1(x)) * w3(x))``;
- models/common/decoder.py ``Decoder.forward`` with ``_skip_lm_head`` (the loss applies it);
- components/loss.py ``ChunkedLossWrapper`` (8 chunks), ``GradAccumulator``,
  ``_DecoderOutputGradientBackProp``, ``CrossEntropyLoss`` (sum / global valid tokens);
- trainer.py ``_forward_backward_body``: ``pred = model(...)``, ``loss_fn(pred, labels, ...)``,
  ``del pred``, ``loss.backward()``; activation checkpointing per block, non-reentrant.

One substitution: torchtitan's language models run FlexAttention (compiled) with block-causal
document masks; this runs SDPA's causal flash kernel, which saves the same tensors (q, k, v, the
output and a per-row log-sum-exp). ``tests/planner/test_implementations.py`` checks the planner
against this module; run against the real torchtitan 0.3.0 (in a scratch environment with
triton, SDPA as its inner attention), its peaks were equal to the byte.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from validate.implementations import FusedRMSNorm

IGNORE_INDEX = -100


class ComplexRoPE(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, device=freqs.device), freqs).float()
        self.register_buffer("cache", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seqlen = q.shape[:2]
        width = self.cache.shape[-1]
        if positions.size(0) == 1:
            cache = self.cache[positions.squeeze(0)].view(1, seqlen, 1, width)
        else:
            expanded = self.cache[None, :, None, :].expand(bsz, -1, -1, -1)
            cache = torch.gather(expanded, dim=1, index=positions.view(bsz, seqlen, 1, 1).expand(bsz, seqlen, 1, width))
        xq_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        xq_out = torch.view_as_real(xq_ * cache).flatten(3)
        xk_out = torch.view_as_real(xk_ * cache).flatten(3)
        return xq_out.type_as(q), xk_out.type_as(k)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.heads_per_kv = n_heads // n_kv_heads
        self.enable_gqa = n_heads > n_kv_heads
        self.rope = ComplexRoPE(self.head_dim, max_seq_len, theta)
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs, seqlen, _ = x.shape
        qkv = self.wqkv(x)
        qkv = qkv.view(bs, seqlen, -1, self.heads_per_kv + 2, self.head_dim)
        xq, xk, xv = torch.split(qkv, [self.heads_per_kv, 1, 1], dim=-2)
        return (xq.reshape(bs, seqlen, -1, self.head_dim).contiguous(),
                xk.reshape(bs, seqlen, -1, self.head_dim).contiguous(),
                xv.reshape(bs, seqlen, -1, self.head_dim).contiguous())

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        xq, xk, xv = self.qkv(x)
        xq, xk = self.rope(xq, xk, positions)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True, enable_gqa=self.enable_gqa).transpose(1, 2)
        out = out.contiguous()
        return self.wo(out.flatten(2))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, max_seq_len: int, theta: float,
                 eps: float) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, max_seq_len, theta)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = FusedRMSNorm(dim, eps)
        self.ffn_norm = FusedRMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    """``Decoder`` with ``_skip_lm_head``: returns the final norm's output."""

    def __init__(self, n_layers: int, dim: int, n_heads: int, n_kv_heads: int, hidden: int, vocab: int,
                 max_seq_len: int, theta: float = 500000.0, eps: float = 1e-5, checkpoint: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, n_kv_heads, hidden, max_seq_len, theta, eps)
                                     for i in range(n_layers)})
        self.norm = FusedRMSNorm(dim, eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(layer, h, positions, use_reentrant=False)
            else:
                h = layer(h, positions)
        return self.norm(h)


class _DecoderOutputGradientBackProp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, accumulated_grad, loss):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(accumulated_grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def, override]
        (accumulated_grad,) = ctx.saved_tensors
        return accumulated_grad, None, None


def chunked_loss(lm_head: nn.Module, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                 positions: torch.Tensor, num_chunks: int = 8) -> torch.Tensor:
    """``ChunkedLossWrapper.__call__`` on plain tensors (training: the hidden states need grad)."""
    def chunk(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        length = t.shape[1] // num_chunks
        return tuple(c.contiguous() for c in torch.split(t, [length] * num_chunks, dim=1))

    h_chunks = [c.detach().requires_grad_(True) for c in chunk(pred)]
    label_chunks = list(chunk(labels))
    input_chunks = {"positions": chunk(positions)}  # noqa: F841  (chunked and forwarded; CE ignores them)
    accumulator = GradAccumulator(pred, num_chunks)
    total_loss = pred.new_zeros((), dtype=torch.float32)
    for h_chunk, label_chunk in zip(h_chunks, label_chunks, strict=True):
        logits = lm_head(h_chunk)
        chunk_loss = F.cross_entropy(logits.flatten(0, 1).float(), label_chunk.flatten(0, 1), reduction="sum",
                                     ignore_index=IGNORE_INDEX) / global_valid_tokens
        total_loss = total_loss + chunk_loss.detach()
        chunk_loss.backward()
        accumulator.add(h_chunk.grad)
        h_chunk.grad = None
    accumulated_grad = accumulator.buffer.to(pred.dtype)
    return _DecoderOutputGradientBackProp.apply(pred, accumulated_grad, total_loss)  # type: ignore[no-any-return]


class GradAccumulator:
    """``zeros_like(reference, float32)``; ``add`` writes each chunk's gradient at its place."""

    def __init__(self, reference: torch.Tensor, num_chunks: int) -> None:
        self.buffer = torch.zeros_like(reference, dtype=torch.float32)
        self.next = 0

    def add(self, chunk_grad: torch.Tensor) -> None:
        if chunk_grad.dtype != self.buffer.dtype:
            chunk_grad = chunk_grad.to(self.buffer.dtype)
        length = chunk_grad.shape[1]
        self.buffer[:, self.next * length:(self.next + 1) * length] = chunk_grad
        self.next += 1


def train_step(model: Llama3, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, labels: torch.Tensor,
               positions: torch.Tensor, micro_batch: int, accumulation: int, num_chunks: int = 8) -> None:
    """``grad_accum_steps`` micro-batches of ``_forward_backward_body``, then the optimizer."""
    valid = torch.tensor(float(math.prod(labels.shape)))
    for micro in range(accumulation):
        rows = slice(micro * micro_batch, (micro + 1) * micro_batch)
        pred = model(tokens[rows], positions[rows])
        loss = chunked_loss(model.lm_head, pred, labels[rows], valid, positions[rows], num_chunks)
        del pred
        loss.backward()
        del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
