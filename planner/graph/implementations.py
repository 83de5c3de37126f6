"""Implementations: how other code runs the model ``planner.graph.blocks`` describes, as data.

The reference model (validate/reference_model.py) is one way to write a decoder; the libraries
people train with save other tensors. ``ModelConfig.implementation`` names whose code runs the
model, and ``adapt`` rewrites the reference description op by op: an ``OpVariant`` on an op
picks its own formula (``planner.ops.impl_ops``), and losses that never hold the whole logits
replace the LM head and cross-entropy (``planner.ops.impl_losses``). What each library does was
read from its source at the version named here:

- **hf**: transformers 5.24.0, src/transformers/models/{gpt2,llama,mistral,qwen2}/modeling_*.py,
  activations.py, loss/loss_utils.py, integrations/sdpa_attention.py. RMSNorm computed in fp32
  (``LlamaRMSNorm``: an fp32 copy of a bf16 input is saved); GPT-2's ``c_attn`` is one q/k/v
  projection (one autocast copy of its input); GPT2Config's default activation ``gelu_new`` is
  written out in Python (three more (B, T, 4D) tensors saved per layer than
  ``gelu_pytorch_tanh``); rotary cos/sin built once per forward and shared, as the reference;
  SDPA with ``is_causal`` and ``enable_gqa`` (no mask, no repeated k/v) when there is no padding;
  ``ForCausalLMLoss``: the logits upcast to fp32, labels padded and shifted (the shifted copy
  saved); the final norm's output and the low-precision logits are locals of
  ``*ForCausalLM.forward``, alive until the loss returns, and the token (and GPT-2's position)
  embeddings locals of ``*Model.forward``, alive until the final norm has run.
- **torchtitan**: torchtitan 0.3.0 (PyPI), torchtitan/models/llama3/, models/common/
  {decoder,attention,rope,nn_modules,feed_forward}.py, components/loss.py. ``nn.RMSNorm``, which
  CUDA runs as the fused ``_fused_rms_norm`` (saves the input and a per-row fp32 rstd); a fused
  ``wqkv`` whose output is split into contiguous q, k, v copies; ``ComplexRoPE``: every layer
  holds a (T, H/2) complex64 cache buffer and rotates in fp32; the default loss is
  ``ChunkedLossWrapper`` over 8 sequence chunks. Family llama only (Llama3Model).
- **fused-linear loss** (any implementation): Liger-Kernel 0.8.5
  liger_kernel/ops/fused_linear_cross_entropy.py, as ``LigerForCausalLMLoss`` calls it.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from planner.graph.description import ModelDesc, OpDesc
from planner.model.config import (
    IMPLEMENTATION_GPT2_ACTIVATION,
    IMPLEMENTATION_LOSS,
    Activation,
    Family,
    Implementation,
    LossKind,
    ModelConfig,
    effective_activation,
    effective_loss,
    effective_loss_chunks,
)
from planner.ops.base import OpKind, OpVariant


class ImplementationSpec(BaseModel):
    """What one implementation runs differently from the reference model."""

    model_config = ConfigDict(frozen=True)

    implementation: Implementation
    library: str  # the library and version the rest was read from
    families: tuple[Family, ...]  # model families it runs
    norm: OpVariant  # how its RMSNorm runs
    fused_qkv: tuple[Family, ...] = ()  # families whose q, k, v come from one projection
    qkv_split_copies: bool = False  # that projection's output is split into contiguous copies
    rotary: OpVariant = OpVariant.REFERENCE
    rope_buffers: bool = False  # per-layer RoPE cache buffers instead of per-forward tables
    rope_tables: OpVariant = OpVariant.REFERENCE
    loss_labels: OpVariant = OpVariant.REFERENCE  # the plain loss's variant
    eager_mask: OpVariant = OpVariant.REFERENCE  # the causal mask eager attention takes
    eager_core: dict[Family, OpVariant] = {}  # eager attention per family
    outputs_held: bool = False  # the final hidden states and logits stay alive until the loss returns
    embeddings_held: bool = False  # the embedding outputs stay alive until the final norm has run
    frames_held: bool = False  # q, k, v stay alive until the attention module returns; a block's
    # input until the block returns (its caller's loop variable)

    @property
    def loss(self) -> LossKind:
        """Its default loss (``planner.model.kinds.IMPLEMENTATION_LOSS``)."""
        return IMPLEMENTATION_LOSS[self.implementation]

    @property
    def gpt2_activation(self) -> Activation:
        """Its GPT-2 MLP's default activation."""
        return IMPLEMENTATION_GPT2_ACTIVATION[self.implementation]


_ALL = (Family.GPT2, Family.LLAMA, Family.MISTRAL, Family.QWEN2)

IMPLEMENTATIONS: dict[Implementation, ImplementationSpec] = {
    Implementation.REFERENCE: ImplementationSpec(
        implementation=Implementation.REFERENCE, library="roofplan validate/reference_model.py", families=_ALL,
        norm=OpVariant.REFERENCE),
    Implementation.HF: ImplementationSpec(
        implementation=Implementation.HF, library="transformers 5.24.0", families=_ALL, norm=OpVariant.NORM_FP32,
        fused_qkv=(Family.GPT2,), rope_tables=OpVariant.SCALED_TABLES, eager_mask=OpVariant.FLOAT_MASK,
        eager_core={Family.GPT2: OpVariant.EAGER_MASK_ADDED, Family.LLAMA: OpVariant.EAGER_FP32_SOFTMAX,
                    Family.MISTRAL: OpVariant.EAGER_FP32_SOFTMAX, Family.QWEN2: OpVariant.EAGER_FP32_SOFTMAX}, loss_labels=OpVariant.SHIFTED_LABELS,
        outputs_held=True, embeddings_held=True, frames_held=True),
    Implementation.TORCHTITAN: ImplementationSpec(
        implementation=Implementation.TORCHTITAN, library="torchtitan 0.3.0", families=(Family.LLAMA,),
        norm=OpVariant.NORM_FUSED, fused_qkv=(Family.LLAMA,), qkv_split_copies=True,
        rotary=OpVariant.COMPLEX_ROTARY, rope_buffers=True),
}

_WRITTEN_GELUS = {Activation.GELU_NEW: OpVariant.GELU_NEW, Activation.GELU_FAST: OpVariant.GELU_FAST}


def implementation_spec(model: ModelConfig) -> ImplementationSpec:
    return IMPLEMENTATIONS[model.implementation]


def _variant(op: OpDesc, variant: OpVariant, **fields: object) -> OpDesc:
    return op.with_fields(variant=variant, **fields) if variant is not OpVariant.REFERENCE or fields else op


def adapt(desc: ModelDesc, model: ModelConfig) -> ModelDesc:
    """``desc`` (the reference description of ``model``) as ``model.implementation`` runs it,
    with ``model``'s loss; unchanged for the reference with the plain loss."""
    spec = implementation_spec(model)
    loss = effective_loss(model)
    if spec.implementation is Implementation.REFERENCE and loss is LossKind.PLAIN:
        return desc
    fused = model.family in spec.fused_qkv
    gelu = _WRITTEN_GELUS.get(effective_activation(model))
    head = next(op for op in desc.ops if op.name == "lm_head")
    ops: list[OpDesc] = []
    tables = next((op for op in desc.ops if op.kind is OpKind.ROPE_TABLES), None)
    if spec.rope_buffers and tables is not None:  # the buffers exist before the step: first
        ops.append(replace(tables, name="rope_cache", shape_of=None, inputs=(),
                           fields=(("head_dim", model.head_dim), ("in_features", model.n_layers),
                                   ("variant", OpVariant.ROPE_BUFFERS))))
    holds = dict(desc.held_until)
    for op in desc.ops:
        leaf = op.name.rsplit(".", 1)[-1]
        if op.kind is OpKind.RMSNORM:
            op = _variant(op, spec.norm)
        elif op.kind is OpKind.GELU and gelu is not None:
            op = _variant(op, gelu)
        elif op.kind is OpKind.LINEAR and fused and leaf == "k_proj":
            op = _variant(op, OpVariant.SHARED_CAST)
        elif op.kind is OpKind.LINEAR and fused and leaf == "v_proj":
            if spec.qkv_split_copies:
                op = _variant(op, OpVariant.SPLIT_COPIES, n_heads=model.n_heads, n_kv_heads=model.kv_heads,
                              head_dim=model.head_dim)
            else:
                op = _variant(op, OpVariant.SHARED_CAST)
        elif op.kind is OpKind.ROPE_TABLES:
            if spec.rope_buffers:
                holds.pop(op.name, None)
                continue
            op = _variant(op, spec.rope_tables)
        elif op.kind is OpKind.CAUSAL_MASK:
            op = _variant(op, spec.eager_mask)
            if spec.eager_mask is not OpVariant.REFERENCE:
                holds[op.name] = "final_norm"  # the causal_mask local of *Model.forward
        elif op.kind is OpKind.ATTENTION_EAGER:
            op = _variant(op, spec.eager_core.get(model.family, OpVariant.REFERENCE))
        elif op.kind is OpKind.ROTARY and spec.rope_buffers:
            op = replace(_variant(op, spec.rotary, head_dim=model.head_dim), inputs=(*op.inputs[:2], "rope_cache"))
        elif op.name == "lm_head" and loss is not LossKind.PLAIN:
            continue
        elif op.kind in (OpKind.EMBEDDING, OpKind.POS_EMBEDDING) and spec.embeddings_held:
            holds[op.name] = "final_norm"  # inputs_embeds, position_embeds: locals of *Model.forward
        elif op.kind is OpKind.CROSS_ENTROPY:
            op = _loss(op, head, loss, spec, model)
            if spec.outputs_held:  # locals of *ForCausalLM.forward: outputs.last_hidden_state, logits
                holds[head.inputs[0]] = op.name
                if loss is LossKind.PLAIN:
                    holds[head.name] = op.name
        ops.append(op)
    if spec.frames_held:
        holds.update(_frame_holds(ops))
    return replace(desc, ops=tuple(ops), held_until=tuple(holds.items()))


def _frame_holds(ops: list[OpDesc]) -> dict[str, str]:
    """transformers' Python frames (modeling_llama.py / modeling_gpt2.py, 5.24.0): the attention
    module's locals ``query_states``/``key_states`` (rotated, where there is rotary) and
    ``value_states`` live until it returns (after ``o_proj``, and GPT-2's ``resid_dropout``), as
    does its argument; GPT-2's MLP returns after its dropout; the decoder layer's input is its
    caller's loop variable until the layer returns."""
    names = {op.name for op in ops}
    holds: dict[str, str] = {}
    for op in ops:
        if op.block is None:
            continue
        p = f"blocks.{op.block}"
        end = f"{p}.attn_dropout" if f"{p}.attn_dropout" in names else f"{p}.attn.o_proj"
        leaf = op.name.removeprefix(p + ".")
        if leaf == "attn_norm":
            holds[op.inputs[0]] = f"{p}.mlp_residual"
            holds[op.name] = end  # the attention module's argument, until it returns
        elif leaf == "mlp_norm" and f"{p}.mlp_dropout" in names:
            holds[op.name] = f"{p}.mlp_dropout"  # GPT-2's MLP applies its dropout before returning
        elif leaf in ("attn.v_proj", "attn.rotary") or (leaf in ("attn.q_proj", "attn.k_proj")
                                                        and f"{p}.attn.rotary" not in names):
            holds[op.name] = end
    return holds


def _loss(op: OpDesc, head: OpDesc, loss: LossKind, spec: ImplementationSpec, model: ModelConfig) -> OpDesc:
    if loss is LossKind.PLAIN:
        return _variant(op, spec.loss_labels)
    fields = dict(head.fields)
    fields["variant"] = OpVariant.CHUNKED_LOSS if loss is LossKind.CHUNKED else OpVariant.FUSED_LINEAR_LOSS
    if loss is LossKind.CHUNKED:
        fields["chunks"] = effective_loss_chunks(model)
    return replace(op, inputs=head.inputs, params=head.params, fields=tuple(sorted(fields.items())))
