"""gpt-oss's defaults for the fields a model file leaves out (its MoE block is
``planner.model.families.moe.config.MoeConfig`` with ``expert_activation: clamped-swiglu``)."""

from __future__ import annotations

from typing import Any

from planner.model.families.dense.config import FILE_DEFAULTS as DENSE_DEFAULTS
from planner.model.kinds import Family

# GptOssAttention: q, k, v and o biased (attention_bias), a sink logit per head
FILE_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.GPT_OSS: dict(DENSE_DEFAULTS[Family.LLAMA], qkv_bias=True, attn_out_bias=True, attention_sinks=True),
}
SECTIONS: dict[Family, tuple[str, ...]] = {Family.GPT_OSS: ("moe",)}
