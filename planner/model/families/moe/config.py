"""A mixture-of-experts MLP's configuration (``ModelConfig.moe``), in transformers' vocabulary, and
the MoE families' defaults for the fields a model file leaves out.

The MoE block replaces a block's MLP: a router linear (D -> E) scores each token, the top-k
experts (gated MLPs of inner size I) run on the tokens routed to them, and their outputs are
summed weighted by the router's probabilities; shared experts (one MLP of inner size
``shared_d_ff``, DeepSeek/Qwen2-MoE) run on every token beside them. Field names follow
transformers' configs (``num_local_experts``/``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``,
``router_aux_loss_coef``, ``decoder_sparse_step``, ``first_k_dense_replace``).

DeepSeek-V3's router (transformers 5.24.0 ``DeepseekV3TopkRouter``) scores with a sigmoid instead
of a softmax, adds a per-expert correction bias (``e_score_correction_bias``: a buffer, not a
parameter) to the scores it chooses by, keeps only the ``topk_group`` best of ``n_group`` expert
groups (a group's score: the sum of its two best), and multiplies the chosen weights by
``routed_scaling_factor``.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from planner.model.families.dense.config import FILE_DEFAULTS as DENSE_DEFAULTS
from planner.model.kinds import Family, QkNorm


class RouterScoring(StrEnum):
    """How the router turns logits into routing weights (transformers' ``scoring_func``)."""

    SOFTMAX = "softmax"  # Mixtral, Qwen-MoE, OLMoE: softmax over the experts
    SIGMOID = "sigmoid"  # DeepSeek-V3: each expert's sigmoid, chosen by score + correction bias
    # gpt-oss (GptOssTopKRouter): the k largest logits, softmax over those k alone (norm_topk_prob is
    # moot: the k weights already sum to 1, and is ignored)
    TOPK_SOFTMAX = "topk-softmax"
    # Llama 4 (Llama4Router, transformers 5.24.0): the k largest logits, each through an fp32 sigmoid
    # (cast back), not renormalized; the scores multiply the experts' INPUT rows (Llama4TextMoe:
    # routed_in = hidden * scores), and the experts' outputs are summed unweighted
    TOPK_SIGMOID = "topk-sigmoid"


class ExpertActivation(StrEnum):
    """What an expert computes between its input and output projections."""

    SWIGLU = "swiglu"  # silu(gate_proj x) * up_proj x (Mixtral, Qwen, OLMoE, DeepSeek)
    # gpt-oss (transformers' GptOssExperts._apply_gate): gate and up interleaved in one gate_up_proj
    # (E, D, 2I) (even columns gate, odd up); gate clamped above at swiglu_limit, up to +-swiglu_limit;
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    CLAMPED_SWIGLU = "clamped-swiglu"
    # Llama 4 (transformers 5.24.0 Llama4TextExperts): one gate_up_proj (E, D, 2I), gate its first half
    # and up its second (views), up * silu(gate)
    FUSED_SWIGLU = "fused-swiglu"


class MoeConfig(BaseModel):
    """Experts, routing and which blocks are sparse."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_experts: PositiveInt = Field(description="routed experts per MoE block (E)")
    top_k: PositiveInt = Field(description="experts each token is routed to (k)")
    d_ff_expert: PositiveInt = Field(description="each routed expert's MLP inner size (I)")
    shared_d_ff: NonNegativeInt = Field(
        default=0, description="inner size of the shared experts, run on every token as one MLP (0: none; "
        "DeepSeek: n_shared_experts x moe_intermediate_size, Qwen2-MoE: shared_expert_intermediate_size)")
    shared_gate: bool = Field(default=False, description="a sigmoid gate (linear D -> 1) scales the shared "
                              "experts' output (Qwen2-MoE)")
    norm_topk_prob: bool = Field(default=True, description="renormalize the k routing weights to sum to 1")
    router_bias: bool = Field(default=False, description="the router linear has a bias (gpt-oss)")
    expert_bias: bool = Field(default=False, description="the experts' projections have biases (gpt-oss)")
    scoring: RouterScoring = Field(default=RouterScoring.SOFTMAX, description="softmax, sigmoid (DeepSeek-V3: "
                                   "an fp32 sigmoid, chosen by score + e_score_correction_bias), topk-softmax "
                                   "(gpt-oss: softmax over the k largest logits) or topk-sigmoid (Llama 4: the k "
                                   "largest logits' sigmoids, multiplied into the experts' input)")
    score_correction_bias: bool = Field(default=False, description="an (E,) fp32 buffer added to the scores the "
                                        "experts are chosen by (DeepSeek-V3's e_score_correction_bias); sigmoid only")
    n_group: PositiveInt = Field(default=1, description="expert groups for group-limited routing (DeepSeek-V3's n_group)")
    topk_group: PositiveInt = Field(default=1, description="groups a token's experts may come from (topk_group)")
    routed_scaling_factor: float = Field(default=1.0, gt=0.0, description="the routed experts' weights are "
                                         "multiplied by it (DeepSeek-V3: 2.5); 1: no multiply")
    expert_activation: ExpertActivation = Field(
        default=ExpertActivation.SWIGLU, description="swiglu (gate_proj, up_proj, down_proj) or clamped-swiglu "
        "(gpt-oss: one interleaved gate_up_proj, clamped, (up + 1) * gate * sigmoid(alpha gate), down_proj) or "
        "fused-swiglu (Llama 4: one gate_up_proj, its halves gate and up, up * silu(gate), down_proj)")
    swiglu_alpha: float = Field(default=1.702, gt=0.0, description="clamped-swiglu: the sigmoid's gain (alpha)")
    swiglu_limit: float = Field(default=7.0, gt=0.0, description="clamped-swiglu: the clamp on gate and up")
    first_dense_layers: NonNegativeInt = Field(
        default=0, description="the first blocks keep a dense MLP of d_ff (DeepSeek's first_k_dense_replace)")
    every: PositiveInt = Field(default=1, description="block i is sparse when (i + 1) % every == 0 "
                               "(Qwen2-MoE's decoder_sparse_step)")
    aux_loss_coef: float = Field(default=0.0, ge=0.0, description="weight of the load-balancing loss "
                                 "(Switch Transformer's E * sum f_e P_e) added to the cross-entropy; 0: none")
    capacity_factor: float | None = Field(
        default=None, gt=0.0, description="each expert takes at most capacity_factor x N k / E tokens, the rest "
        "are dropped (GShard/Switch); None: dropless")
    routing_imbalance: float = Field(
        default=1.0, ge=1.0, description="the busiest expert's tokens over the mean (1: balanced); a dropless "
        "expert buffer is sized for the busiest expert")

    @model_validator(mode="after")
    def _k_within_e(self) -> MoeConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k ({self.top_k}) exceeds moe.n_experts ({self.n_experts}); a token is "
                             "routed to at most every expert")
        if self.scoring is RouterScoring.TOPK_SOFTMAX and self.aux_loss_coef:
            raise ValueError("moe.aux_loss_coef: the load-balancing loss over a top-k-then-softmax router (gpt-oss) "
                             "is not modelled yet; set it to 0")
        if self.scoring is RouterScoring.TOPK_SOFTMAX and self.routed_scaling_factor != 1.0:
            raise ValueError("moe.routed_scaling_factor: the top-k-then-softmax router (gpt-oss) has no scaling; "
                             "set it to 1")
        if self.scoring is RouterScoring.TOPK_SIGMOID and (self.aux_loss_coef or self.norm_topk_prob
                                                           or self.routed_scaling_factor != 1.0):
            raise ValueError("moe.scoring: the top-k-then-sigmoid router (Llama 4) scales the experts' input by the "
                             "k sigmoids as they are: set aux_loss_coef 0, norm_topk_prob false, routed_scaling_factor 1")
        if self.shared_gate and not self.shared_d_ff:
            raise ValueError("moe.shared_gate gates the shared experts: set moe.shared_d_ff too")
        self._check_groups()
        return self

    def _check_groups(self) -> None:
        e, g = self.n_experts, self.n_group
        if self.scoring is not RouterScoring.SIGMOID and (g > 1 or self.score_correction_bias):
            raise ValueError("moe.n_group / moe.score_correction_bias: group-limited routing and the correction bias "
                             "are DeepSeek-V3's sigmoid router's; set moe.scoring: sigmoid or drop them")
        if self.scoring is RouterScoring.SIGMOID and self.aux_loss_coef:
            raise ValueError("moe.aux_loss_coef: the sigmoid router (DeepSeek-V3) adds no load-balancing loss in "
                             "transformers (it balances with e_score_correction_bias); set it to 0")
        if e % g:
            raise ValueError(f"moe.n_group ({g}) must divide moe.n_experts ({e})")
        if g > 1 and e // g < 2:
            raise ValueError(f"moe.n_group: a group's score is the sum of its two best experts; {e} experts in {g} "
                             "groups leave fewer than two per group")
        if self.topk_group > g:
            raise ValueError(f"moe.topk_group ({self.topk_group}) exceeds moe.n_group ({g})")
        if self.top_k > self.topk_group * (e // g):
            raise ValueError(f"moe.top_k ({self.top_k}) exceeds the {self.topk_group * (e // g)} experts of the "
                             f"topk_group ({self.topk_group}) groups a token may use")

    def is_sparse(self, block: int) -> bool:
        """Whether block ``block`` (0-based) has the MoE MLP."""
        return block >= self.first_dense_layers and (block + 1) % self.every == 0

    def expert_rows(self, tokens: int) -> int:
        """Rows each expert's buffer holds for ``tokens`` tokens (C): N k / E balanced, the busiest
        expert's under imbalance, capped by the capacity factor; at least 1."""
        mean = tokens * self.top_k / self.n_experts
        if self.capacity_factor is not None:
            return max(1, math.ceil(self.capacity_factor * mean))
        return max(1, math.ceil(self.routing_imbalance * mean))


FILE_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.MIXTRAL: dict(DENSE_DEFAULTS[Family.MISTRAL]),  # Mistral with MoE MLPs
    Family.QWEN2_MOE: dict(DENSE_DEFAULTS[Family.QWEN2]),  # Qwen2 with MoE MLPs, a gated shared expert
    Family.QWEN3_MOE: dict(DENSE_DEFAULTS[Family.QWEN2], qkv_bias=False, qk_norm=QkNorm.HEAD),
    Family.OLMOE: dict(DENSE_DEFAULTS[Family.LLAMA], qk_norm=QkNorm.FULL),
}
# the sections a model file of these families must have (planner.model.checks names a missing one)
SECTIONS: dict[Family, tuple[str, ...]] = {family: ("moe",) for family in FILE_DEFAULTS}
