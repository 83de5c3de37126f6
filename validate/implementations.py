"""Run other implementations' code as a GPU runs it: transformers models built from a plan, and
the few CPU/fake-tensor differences that would otherwise change what is measured.

- ``hf_model``: ``AutoModelForCausalLM.from_config`` for a ``ModelConfig`` (transformers 5.24.0
  config classes: GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, each family's built by
  ``validate.models.dense.HF_CONFIGS``), ``attn_implementation``
  sdpa for flash attention and eager for eager, ``use_cache=False``, parameters created in the
  policy's dtype; its parameter count must equal the plan's.
- ``as_a_gpu_runs_it``: while simulating,
  (1) transformers' ``find_packed_sequence_indices`` cannot read fake position ids and assumes
  packed sequences (a full mask, repeated k/v); a real run with plain sequences finds none, so
  it returns None (masking_utils.py, 5.24.0);
  (2) CUDA autocast runs ``pow``, ``rsqrt``, ``layer_norm`` in fp32 and ``softmax`` /
  ``log_softmax`` with an fp32 result (aten/src/ATen/autocast_mode.cpp); CPU autocast does not,
  so those ops get CUDA's casts (``cuda_autocast_lists``);
  (3) ``F.dropout`` on CPU saves a float mask, CUDA's ``native_dropout`` a bool one: it calls
  ``native_dropout``; attention dropout inside SDPA is left out, as
  ``validate.simulate.as_on_a_gpu`` does for the reference model.
- ``FusedRMSNorm``: ``F.rms_norm`` as CUDA runs it (``_fused_rms_norm``: saves the input and a
  per-row fp32 rstd), for code that calls ``nn.RMSNorm`` (torchtitan), whose CPU kernel is
  decomposed in torch 2.13.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hardware.errors import ConfigError
from planner.model.config import AttentionImpl, ModelConfig
from validate.models.dense import HF_CONFIGS

HF_VERSION = "5.24.0"  # the transformers whose sources planner.graph.implementations describes


_FP32_OPS = ((torch, "pow"), (torch.Tensor, "pow"), (torch, "rsqrt"), (torch.Tensor, "rsqrt"), (F, "layer_norm"))
_FP32_RESULT_OPS = ((torch, "softmax"), (torch.Tensor, "softmax"), (F, "softmax"), (torch, "log_softmax"),
                    (torch.Tensor, "log_softmax"), (F, "log_softmax"))


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """Under CPU autocast, give the ops of CUDA autocast's fp32 lists CUDA's casts: bf16/fp16
    inputs of ``pow``, ``rsqrt`` and ``layer_norm`` are cast to fp32 (a copy, as
    ``cached_cast(kFloat)`` makes), ``softmax``/``log_softmax`` without a dtype get ``float32``.
    The functions are replaced for the duration (a checkpoint's recompute runs in autograd's
    backward, where torch-function modes do not apply)."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in _FP32_OPS + _FP32_RESULT_OPS]

    def fp32_inputs(func: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if torch.is_autocast_enabled("cpu"):
                args = tuple(_to_fp32(a) for a in args)
            return func(*args, **kwargs)
        return wrapped

    def fp32_result(func: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if torch.is_autocast_enabled("cpu") and kwargs.get("dtype") is None and len(args) < 3:
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        return wrapped

    for owner, name, func in originals:
        setattr(owner, name, (fp32_inputs if (owner, name) in _FP32_OPS else fp32_result)(func))
    try:
        yield
    finally:
        for owner, name, func in originals:
            setattr(owner, name, func)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value


def _gpu_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` as CUDA runs it: ``native_dropout``, a bool mask saved (1 byte per element)."""
    return torch.native_dropout(input, p, training)[0] if training and p > 0 else input


class FusedRMSNormFunction(torch.autograd.Function):
    """``_fused_rms_norm`` as CUDA runs it: output in the input's dtype; saved the input, the
    weight and the per-row rstd in fp32 (tools/autograd/derivatives.yaml). CUDA's kernels keep
    nothing else; here forward and backward work through row blocks of 1/16 of the tensor so
    their own temporaries stay small."""

    BLOCKS = 16

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        step = max(1, -(-rows.shape[0] // FusedRMSNormFunction.BLOCKS))
        for start in range(0, rows.shape[0], step):
            block = rows[start:start + step].float()
            r = torch.rsqrt(block.pow(2).mean(-1, keepdim=True) + eps)
            rstd[start:start + step] = r
            out[start:start + step] = block * r * weight.float()
        ctx.save_for_backward(x, weight, rstd)
        return out.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        rows, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        grad_x = torch.empty_like(rows)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        step = max(1, -(-rows.shape[0] // FusedRMSNormFunction.BLOCKS))
        for start in range(0, rows.shape[0], step):
            r = rstd[start:start + step]
            normed = rows[start:start + step].float() * r
            g = grads[start:start + step].float()
            grad_w += (g * normed).sum(0)
            g = g * weight.float()
            grad_x[start:start + step] = r * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.view_as(x), grad_w.to(weight.dtype), None


class FusedRMSNorm(nn.Module):
    """``nn.RMSNorm`` over the last dimension, running ``FusedRMSNormFunction``."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FusedRMSNormFunction.apply(x, self.weight, self.eps)  # type: ignore[no-any-return]


@contextlib.contextmanager
def as_a_gpu_runs_it(net: nn.Module, autocast: bool, fused_attention: bool) -> Iterator[tuple[str, ...]]:
    """While simulating transformers' ``net``: plain (unpacked) sequences, CUDA autocast's fp32
    lists, bool dropout masks, no dropout inside the fused attention. Yields the report's notes."""
    import transformers.masking_utils as masking

    notes: list[str] = ["transformers cannot read fake position ids and would assume packed sequences (a full "
                        "attention mask); simulate gives it a real run's answer: no packed sequences",
                        "dropout saves bool masks, as CUDA's native_dropout does (CPU's saves float noise)"]
    if fused_attention:
        dropped = False
        module: Any
        for module in net.modules():
            inner = getattr(module, "attn_dropout", None)  # GPT-2 passes its p to SDPA as dropout_p
            if isinstance(inner, nn.Dropout) and inner.p > 0:
                inner.p, dropped = 0.0, True
            if getattr(module, "attention_dropout", 0.0):  # Llama-like attention: from the config
                module.attention_dropout, dropped = 0.0, True
        if dropped:
            notes.append("attention dropout is left out of the simulated fused attention (the CPU's has none; a "
                         "GPU's flash kernel keeps only its RNG state)")
    replaced = [(masking, "find_packed_sequence_indices", lambda position_ids: None), (F, "dropout", _gpu_dropout)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    for owner, name, value in replaced:
        setattr(owner, name, value)
    try:
        if autocast:
            notes.append("CPU autocast runs pow, rsqrt, layer_norm and softmax in bf16; simulate applies CUDA "
                         "autocast's fp32 lists to them")
            with cuda_autocast_lists():
                yield tuple(notes)
        else:
            yield tuple(notes)
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def hf_config(model: ModelConfig) -> Any:
    """The transformers config of ``model``, by its family's builder (``validate.models.dense.HF_CONFIGS``;
    one line naming the field for what it cannot express)."""
    build = HF_CONFIGS.get(model.family)
    if build is None:
        raise ConfigError(f"model: implementation hf runs families {', '.join(sorted(HF_CONFIGS))} (their transformers "
                          f"code), not {model.family.value}; use implementation: reference")
    return build(model)


def hf_model(model: ModelConfig, dtype: torch.dtype, n_params: int) -> nn.Module:
    """transformers' causal LM for ``model``, parameters in ``dtype``, training mode."""
    import transformers

    attention = "sdpa" if model.attention is AttentionImpl.FLASH else "eager"
    net = transformers.AutoModelForCausalLM.from_config(hf_config(model), attn_implementation=attention, dtype=dtype)
    net.train()
    count = sum(p.numel() for p in net.parameters())
    if count != n_params:
        raise ConfigError(f"model: transformers builds {count:,} parameters for {model.name}, the plan has "
                          f"{n_params:,}; the model section describes another model than transformers' "
                          f"{model.family.value}")
    return net
