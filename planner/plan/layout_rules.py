"""The model's rules for each parallel dimension: whether PyTorch runs this model at a layout as
planned (``planner.plan.layouts`` asks them; ``check_layout`` is estimate's one call).

Each refusal is one ``ConfigError`` line naming the field (``parallel.tp``, ``parallel.sp``,
``parallel.cp``, ``parallel.ep``, ``moe.aux_loss_coef``) and the fix. The sources of each rule:

- tensor parallelism (``planner.parallel.tensor``: torchtitan's Llama plan, ``apply_tp`` in
  torchtitan/models/llama3/infra/parallelize.py): the reference implementation's plain loss, no
  multi-head latent attention or attention sinks yet, heads and key/value heads divisible by tp,
  untied embeddings (``parallelize_module`` unties them), FSDP2 beside it (torchtitan runs FSDP2 x
  TP), a sequence that splits over tp under sequence parallelism; MoE blocks as
  ``planner.parallel.tensor_moe`` (torchtitan's ``apply_moe_ep_tp``) runs them;
- context parallelism (``planner.parallel.context``: torch's ``context_parallel``, torchtitan's
  ``train.py``): flash attention (SDPA: the ring), rotary positions, a sequence that splits into
  2 cp load-balanced chunks;
- expert parallelism (``planner.parallel.expert``: torchtitan/distributed/expert_parallel.py):
  MoE blocks whose experts split over ep.

The rules between the degrees alone are ``ParallelDims``' validator's.
"""

from __future__ import annotations

from planner.errors import ConfigError
from planner.model.config import AttentionImpl, Implementation, LossKind, ModelConfig, PositionKind, effective_loss
from planner.model.families.moe.config import ExpertActivation, RouterScoring
from planner.plan.parallel_dims import ParallelDims

# the shortest share of a sequence a searched context-parallel degree leaves a rank: below it the
# ring's blocks ((T/2cp) x (T/cp) per step) are shorter than the lengths where FlashAttention's
# published rates level off (4-8k tokens, docs/kernel_benchmarks.md) and the key/value all-gather
# hides behind less work (torchtitan applies CP to sequences of 32k tokens and more). It also keeps
# the layout search within its time budget (benchmarks/plan_speed.py); --cp fixes any degree
MIN_CONTEXT_SHARD_TOKENS = 4096


def check_layout(model: ModelConfig, seq_len: int, dims: ParallelDims) -> None:
    """Refuse a layout PyTorch cannot run on this model as planned: tensor, then context, then
    expert parallelism's rules (``seq_len`` is the whole sequence; a rank runs 1/cp of it)."""
    check_tensor_parallel(model, seq_len // dims.cp, dims)
    check_context_parallel(model, seq_len, dims)
    check_expert_parallel(model, dims)


def check_tensor_parallel(model: ModelConfig, seq_len: int, dims: ParallelDims) -> None:
    """Refuse layouts PyTorch cannot run as planned, naming the field and the fix (``seq_len``:
    the rank's tokens of each sequence)."""
    tp, sequence_parallel = dims.tp, dims.sp
    if tp == 1:
        return
    if model.implementation is not Implementation.REFERENCE or effective_loss(model) is not LossKind.PLAIN:
        raise ConfigError(f"parallel.tp: tensor parallelism is modelled for the reference implementation with the "
                          f"plain loss, not {model.implementation.value} with the {effective_loss(model).value} loss; "
                          f"use tp 1 (data parallelism) or implementation: reference")
    if model.mla is not None:
        raise ConfigError(f"parallel.tp: tensor parallelism of {model.name}'s multi-head latent attention is not "
                          "modelled yet; use tp 1 (data parallelism, FSDP2)")
    if model.fused_projections:
        raise ConfigError(f"parallel.tp: {model.name}'s fused qkv_proj/gate_up_proj (Phi-3) would be split by columns "
                          "across q, k, v and gate, up (transformers' plan gathers their outputs instead): not "
                          "modelled yet; use tp 1 (data parallelism, FSDP2)")
    if model.attention_sinks:
        raise ConfigError(f"parallel.tp: {model.name}'s attention sinks (one logit per head) are not sharded by the "
                          "tensor-parallel plan yet; use tp 1 (data parallelism, FSDP2)")
    check_moe_tensor_parallel(model, tp)
    if dims.data_parallel > 1 and not dims.shards_parameters:
        raise ConfigError(f"parallel.tp: tensor parallelism with {dims.data_parallel} data-parallel replicas under DDP "
                          "or ZeRO-1 is not modelled (DDP needs its DTensor parameters made local first; torchtitan "
                          "runs FSDP2 x TP): use ZeRO-2 or ZeRO-3 (FSDP2) for the data-parallel dimension")
    if model.tie_embeddings:
        raise ConfigError(f"parallel.tp: {model.name} ties its LM head to the token embedding; PyTorch's "
                          "parallelize_module registers the sharded LM head weight as a parameter of its own, which "
                          "unties them: untie them (tie_embeddings: false) or use tp 1")
    if model.n_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide the {model.n_heads} attention heads of "
                          f"{model.name}; use a tp that divides n_heads")
    if model.kv_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} is more than or does not divide the {model.kv_heads} key/value heads "
                          f"of {model.name}; replicating key/value heads across a tensor-parallel group is not "
                          "modelled: use a tp that divides n_kv_heads")
    if sequence_parallel and seq_len % tp:
        raise ConfigError(f"parallel.sp: sequence parallelism splits the {seq_len} tokens of a sequence over tp {tp}; "
                          "use a seq_len divisible by tp, or no sequence parallelism")


def check_moe_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Refuse MoE blocks tensor parallelism cannot run as planned, naming the field and the fix."""
    moe = model.moe
    if moe is None or tp == 1:
        return
    if moe.aux_loss_coef:
        raise ConfigError(f"moe.aux_loss_coef: under tensor parallelism the load-balancing loss's gradient is whole on "
                          f"every rank while the router's is a partial sum; not modelled: use tp 1 or "
                          f"aux_loss_coef 0 for {model.name}")
    if moe.expert_bias or moe.expert_activation is not ExpertActivation.SWIGLU:
        raise ConfigError(f"parallel.tp: tensor parallelism of {model.name}'s biased or interleaved gate_up experts "
                          "(gpt-oss; Llama 4's fused ones) is not modelled yet; use tp 1 (data and expert parallelism, "
                          "FSDP2)")
    for field, size in (("d_ff_expert", moe.d_ff_expert), ("shared_d_ff", moe.shared_d_ff)):
        if size % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide moe.{field} {size} of {model.name}; use a tp that "
                              "divides every expert's inner size")


def check_context_parallel(model: ModelConfig, seq_len: int, dims: ParallelDims) -> None:
    """Refuse layouts PyTorch cannot run as planned, naming the field and the fix."""
    cp = dims.cp
    if cp == 1:
        return
    if model.implementation is not Implementation.REFERENCE or effective_loss(model) is not LossKind.PLAIN:
        raise ConfigError(f"parallel.cp: context parallelism is modelled for the reference implementation with the "
                          f"plain loss, not {model.implementation.value} with the {effective_loss(model).value} loss; "
                          f"use cp 1 (data parallelism) or implementation: reference")
    if model.mla is not None:
        raise ConfigError(f"parallel.cp: context parallelism of {model.name}'s multi-head latent attention (query/key "
                          "and value head dims differ) is not modelled yet; use cp 1")
    if model.attention is not AttentionImpl.FLASH:
        raise ConfigError(f"parallel.cp: context parallelism runs scaled_dot_product_attention as ring attention; "
                          f"{model.name} uses eager attention: use attention: flash, or cp 1")
    if model.positions is not PositionKind.ROTARY:
        raise ConfigError(f"parallel.cp: {model.name} adds learned positions to the whole sequence, which context "
                          "parallelism (as torchtitan runs it, sharding rotary tables) does not model: use a rotary "
                          "model, or cp 1")
    if seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp: load-balanced context parallelism splits each sequence into 2 x cp = {2 * cp} "
                          f"equal chunks; seq_len {seq_len} does not divide: use a seq_len divisible by {2 * cp}, or "
                          "another cp")


def check_expert_parallel(model: ModelConfig, dims: ParallelDims) -> None:
    """Refuse layouts PyTorch cannot run as planned, naming the field and the fix."""
    ep = dims.ep
    if ep == 1:
        return
    if model.moe is None:
        raise ConfigError(f"parallel.ep: {model.name} has no mixture-of-experts blocks to split; use ep 1")
    if model.moe.n_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide the {model.moe.n_experts} experts of {model.name}; use an "
                          "ep that divides n_experts")
    if model.moe.scoring is RouterScoring.TOPK_SIGMOID:
        raise ConfigError(f"parallel.ep: expert parallelism of {model.name}'s experts, which take their rows already "
                          "scaled by the router (Llama 4), is not modelled yet; use ep 1 (data parallelism, FSDP2)")
