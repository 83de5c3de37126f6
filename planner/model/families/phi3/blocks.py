"""Phi-3's fused projections and partial rotary as ops (``ModelConfig.fused_projections``,
``partial_rotary_factor``), as the reference model's ``validate.models.dense`` runs them
(transformers 5.24.0, ``models/phi3/modeling_phi3.py``); ``planner.graph.blocks`` writes the rest
of the block around them.

``qkv_proj`` is one linear D -> (N + 2K) H; q, k and v are column slices of its output (views:
the one (B, T, (N + 2K) H) tensor stays alive while any of them is, so the core's saved v keeps
all of it). ``gate_up_proj`` is one linear D -> 2F; gate and up are its two halves (views: SiLU's
saved gate and the product's saved up keep the one (B, T, 2F) tensor). Each slice's backward
makes a zeroed gradient of the whole output with its part copied in (``planner.ops.mla``'s
``slice_cost``).
"""

from __future__ import annotations

from planner.graph.description import OpDesc, TpRole, linear_op, simple_op
from planner.model.config import ModelConfig
from planner.ops.base import OpKind


def _slice(name: str, block: int, x: str, keep: int, of: int) -> OpDesc:
    """A view of ``keep`` of every ``of`` columns of ``x`` (``x[..., a:b]``: no copy)."""
    return OpDesc(name=name, kind=OpKind.SLICE, inputs=(x,), block=block, tp=TpRole.LOCAL,
                  fields=(("in_features", of), ("out_features", keep)))


def fused_qkv_ops(model: ModelConfig, b: int, x: str) -> tuple[list[OpDesc], tuple[str, str, str]]:
    """Block ``b``'s ``qkv_proj`` of ``x`` and its q, k, v slices (in that order); their names."""
    n, k, h, d = model.n_heads, model.kv_heads, model.head_dim, model.d_model
    p = f"blocks.{b}.attn"
    width = (n + 2 * k) * h
    ops = [linear_op(f"{p}.qkv_proj", b, x, d, width, bool(model.qkv_bias), TpRole.COLWISE)]
    ops += [_slice(f"{p}.{part}", b, ops[0].name, size, width)
            for part, size in (("query", n * h), ("key", k * h), ("value", k * h))]
    return ops, (ops[1].name, ops[2].name, ops[3].name)


def fused_mlp_ops(model: ModelConfig, b: int, x: str) -> tuple[list[OpDesc], str]:
    """Block ``b``'s ``gate_up_proj`` of ``x``, the gate half through SiLU times the up half; the product's name."""
    d, f, bias = model.d_model, model.d_ff, bool(model.mlp_bias)
    p = f"blocks.{b}.mlp"
    fused = linear_op(f"{p}.gate_up_proj", b, x, d, 2 * f, bias, TpRole.COLWISE)
    gate = _slice(f"{p}.gate", b, fused.name, f, 2 * f)
    act = simple_op(f"{p}.act", OpKind.SILU, b, gate.name, tp=TpRole.LOCAL)
    up = _slice(f"{p}.up", b, fused.name, f, 2 * f)
    glu = simple_op(f"{p}.glu", OpKind.GLU_MUL, b, act.name, up.name, tp=TpRole.LOCAL)
    return [fused, gate, act, up, glu], glu.name


def rotary_op(model: ModelConfig, b: int, q: str, k: str, rope: str) -> OpDesc:
    """RoPE on q and k: of each head's H dims, the first ``model.rope_dim`` rotated (all unless
    ``partial_rotary_factor`` is set; ``planner.ops.rotary.rotary_cost``)."""
    fields: tuple[tuple[str, object], ...] = ()
    if model.rope_dim < model.head_dim:
        fields = (("in_features", model.head_dim), ("out_features", model.rope_dim))
    return OpDesc(name=f"blocks.{b}.attn.rotary", kind=OpKind.ROTARY, inputs=(q, k, rope), block=b, tp=TpRole.LOCAL,
                  fields=fields)


def merge_heads_op(b: int, core: str) -> OpDesc:
    """The copy that merges a head-major flash output's heads (``planner.ops.elementwise``): SDPA's
    output follows its query's layout, which partial rotary's ``cat`` makes head-major."""
    return OpDesc(name=f"blocks.{b}.attn.merge_heads", kind=OpKind.HEAD_MERGE_COPY, inputs=(core,), block=b,
                  tp=TpRole.LOCAL)
