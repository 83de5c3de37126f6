"""A mixture-of-experts MLP's configuration (``ModelConfig.moe``), in transformers' vocabulary.

The MoE block replaces a block's MLP: a router linear (D -> E) scores each token, the top-k
experts (gated MLPs of inner size I) run on the tokens routed to them, and their outputs are
summed weighted by the router's probabilities; shared experts (one MLP of inner size
``shared_d_ff``, DeepSeek/Qwen2-MoE) run on every token beside them. Field names follow
transformers' configs (``num_local_experts``/``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``,
``router_aux_loss_coef``, ``decoder_sparse_step``, ``first_k_dense_replace``).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator


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
        if self.shared_gate and not self.shared_d_ff:
            raise ValueError("moe.shared_gate gates the shared experts: set moe.shared_d_ff too")
        return self

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
