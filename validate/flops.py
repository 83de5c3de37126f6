"""FLOP counting with ``torch.utils.flop_counter.FlopCounterMode``, completed for CPU attention.

The CPU build's fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward) has no formula in FlopCounterMode and would count 0 (docs/references.md "Counting FLOPs"). We register one
with the same convention as torch's own SDPA formulas (torch/utils/flop_counter.py
``sdpa_flop_count``): QK^T and PV at 2 FLOPs per multiply-add over the full T x S square,
backward = 2 x forward. Grouped-query attention is counted over the query heads.

The memory-efficient kernel's backward (run where query/key and value head dims differ: MLA) has
torch's formula, which adds the scores' recomputation (2 T S (3 d_q + 2 d_v) per head); it is
counted here by the same convention as the others: 2 x forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


def _sdpa_forward_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    b, h, s_q, d_q = query_shape
    s_k = key_shape[-2]
    d_v = value_shape[-1]
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _sdpa_forward_flops(query, key, value)


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * _sdpa_forward_flops(query, key, value)


def cpu_attention_flop_formulas() -> dict[Any, Any]:
    ops = torch.ops.aten  # FlopCounterMode looks formulas up by op packet, not by overload
    return {
        ops._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
        ops._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
        ops._scaled_dot_product_efficient_attention_backward: _cpu_flash_backward,
    }


def flop_counter(display: bool = False) -> FlopCounterMode:
    """A FlopCounterMode that also counts the CPU fused attention."""
    return FlopCounterMode(display=display, custom_mapping=cpu_attention_flop_formulas())


def transformers_training_flops(config_data: dict[str, Any], seq_len: int, batch: int) -> float:
    """FLOPs of one forward and backward of transformers' own model built from a ``config.json``
    mapping (eager attention, random weights, a ``batch x seq_len`` batch of ids as inputs and
    labels), counted by ``flop_counter``. transformers is imported here only (a test dependency)."""
    import copy

    import transformers

    config = transformers.AutoConfig.for_model(**copy.deepcopy(config_data))
    config._attn_implementation = "eager"
    config.use_cache = False
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    net.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    counter = flop_counter()
    with counter:
        net(input_ids=ids, labels=ids).loss.backward()
    return float(counter.get_total_flops())
