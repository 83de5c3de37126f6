"""The reference model's mixture-of-experts MLP (``ModelConfig.moe``), every MoE family's
(Mixtral, Qwen-MoE, OLMoE; DeepSeek-V3's router and gpt-oss's experts are options of it).

Routing is fixed and balanced so a step's memory and FLOPs are reproducible: the j-th choice of
token t goes to expert ``(t k + j) mod E``, so every expert receives exactly C = N k / E tokens
(N tokens of the micro-batch, k = top_k). The router still runs and its probabilities weight
the experts' outputs, so it trains and its gradients flow as in a learned top-k router; only
the argmax is replaced (as a load-balanced router at equilibrium routes).

The block runs, in order (the planner's graph, ``planner.model.families.moe.blocks``, names each op
the same):
``slots`` (which token each of the E C expert rows holds), ``dispatch`` (index_select the tokens
into an (E C, D) buffer), the experts as three batched matmuls over (E, C, .) with SwiGLU between
(``torch.bmm``: the grouped GEMM with equal groups), the ``router`` linear, ``route`` (fp32
softmax, or DeepSeek-V3's fp32 sigmoid, the chosen probabilities, renormalized if
``norm_topk_prob``, times ``routed_scaling_factor``, in slot order) and
``combine`` (weight each row, index_add into (N, D)); shared experts (a dense SwiGLU MLP on every
token, optionally times ``sigmoid(shared_gate(x))``) are added last. gpt-oss's experts (biased,
one interleaved ``gate_up_proj`` and ``validate.models.gpt_oss.ClampedSwiGLU``) replace the three
matmuls with two ``baddbmm``; its router takes the softmax of the k chosen logits alone. Llama 4's
(``RouterScoring.TOPK_SIGMOID``, transformers 5.24.0 ``Llama4TextMoe``) takes the fp32 sigmoid of
the k chosen logits, multiplies each expert row by its weight BEFORE the experts (``scale``) and
sums the experts' output rows unweighted (``gather``); its router runs (and registers) first.

DeepSeek-V3's router (transformers 5.24.0 ``DeepseekV3TopkRouter``) chooses its experts by
sigmoid score + ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups;
that choice (indices only: no gradient, no FLOPs counted) is replaced by the balanced routing, as
the softmax routers' top-k is. The bias is registered as the (E,) fp32 buffer it is there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import ConfigError
from planner.model.families.moe.config import ExpertActivation, MoeConfig, RouterScoring
from validate.models.gpt_oss import ClampedSwiGLU


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank computes with it: a DTensor's local shard under tensor parallelism
    (``to_local()``, a view: torchtitan's GroupedExperts), else the parameter itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` on its parameters' local shards (the same op as ``nn.Linear.forward``)."""
    return F.linear(x, local(module.weight), None if module.bias is None else local(module.bias))


class _SumGradient(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over ``group`` (a replicated weight whose
    gradient is a partial sum under tensor parallelism: the router's)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed._functional_collectives import all_reduce, wait_tensor

        return wait_tensor(all_reduce(grad, "sum", ctx.group)), None


def replicated_linear(module: nn.Linear, x: torch.Tensor, group: Any) -> torch.Tensor:
    """``module(x)``, whole on every rank of a tensor-parallel ``group`` (None: none) on all its
    tokens, its parameters' gradients summed over the group (torchtitan's NoParallel router with a
    Partial output gradient)."""
    if group is None:
        return module(x)
    bias = None if module.bias is None else _SumGradient.apply(local(module.bias), group)
    return F.linear(x, _SumGradient.apply(local(module.weight), group), bias)


class GroupedLinear(nn.Module):
    """E independent linears applied to E equal groups of rows: ``bmm((E, C, i), (E, i, o))``, with
    an (E, o) bias ``baddbmm(bias[:, None], x, W)`` (gpt-oss's experts: one kernel, the bias added
    in its epilogue)."""

    def __init__(self, groups: int, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(groups, out_features)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, mean=0.0, std=0.02)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.bmm(x, local(self.weight))
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight)


class Experts(nn.Module):
    """E experts of inner size I over (E, C, D) rows: SwiGLU (gate_proj, up_proj, down_proj),
    gpt-oss's clamped SwiGLU (gate_up_proj, act, down_proj), biased if ``expert_bias``, or Llama 4's
    halves of one gate_up_proj (gate_up_proj, down_proj)."""

    def __init__(self, moe: MoeConfig, d_model: int) -> None:
        super().__init__()
        e, i, bias = moe.n_experts, moe.d_ff_expert, moe.expert_bias
        self.clamped = moe.expert_activation is ExpertActivation.CLAMPED_SWIGLU
        self.halves = moe.expert_activation is ExpertActivation.FUSED_SWIGLU  # Llama 4's gate_up_proj
        if self.clamped:
            self.gate_up_proj = GroupedLinear(e, d_model, 2 * i, bias)
            self.act = ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit)
        elif self.halves:
            self.gate_up_proj = GroupedLinear(e, d_model, 2 * i, bias)
        else:
            self.gate_proj = GroupedLinear(e, d_model, i, bias)
            self.up_proj = GroupedLinear(e, d_model, i, bias)
        self.down_proj = GroupedLinear(e, i, d_model, bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.clamped:
            return self.down_proj(self.act(self.gate_up_proj(h)))
        if self.halves:
            return self.down_proj(self._glu(self.gate_up_proj(h)))
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    @staticmethod
    def _glu(gate_up: torch.Tensor) -> torch.Tensor:
        """Llama 4 (``Llama4TextExperts``): ``up * silu(gate)`` of the halves of gate_up (views, the
        ones ``chunk(2, dim=-1)`` gives; the argument keeps gate_up until the product)."""
        i = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :i]) * gate_up[..., i:]


class SharedExpert(nn.Module):
    """The shared experts as one dense SwiGLU MLP of inner size ``shared_d_ff``."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a block's MLP; input and output (B, T, D).

    Under expert parallelism (``ep`` > 1) this rank holds E/ep experts, and the expert rows go
    to their experts' ranks and back by ``all_to_all_single`` over ``ep_group`` (set by
    ``validate.layout``), regrouped by expert around them (torchtitan's expert parallelism)."""

    def __init__(self, moe: MoeConfig, d_model: int, ep: int = 1) -> None:
        super().__init__()
        self.moe = moe
        self.ep = ep
        self.ep_group: Any = None  # a ProcessGroup, set by validate.layout
        self.tp_group: Any = None  # under tensor parallelism (validate.moe_parallel): its ProcessGroup
        # Llama 4 (scores into the experts' input): the router runs before the experts and registers first
        self.scores_input = moe.scoring is RouterScoring.TOPK_SIGMOID
        if self.scores_input:
            self.router = nn.Linear(d_model, moe.n_experts, bias=moe.router_bias)
        self.experts = Experts(moe.model_copy(update={"n_experts": moe.n_experts // ep}), d_model)
        if not self.scores_input:
            self.router = nn.Linear(d_model, moe.n_experts, bias=moe.router_bias)
        self.shared_expert = SharedExpert(d_model, moe.shared_d_ff) if moe.shared_d_ff else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if moe.shared_gate else None
        if moe.score_correction_bias:  # DeepSeek-V3's e_score_correction_bias: a buffer (E,) fp32, kept in fp32
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_experts, dtype=torch.float32))
        # where the forward puts its load-balancing loss (aux_loss_coef > 0): a list the model's
        # forward owns, None outside it, so a checkpoint's recompute (in the backward) keeps none
        self.aux_sink: list[torch.Tensor] | None = None

    def rows(self, n_tokens: int) -> int:
        """C: each expert's rows; balanced routing needs N k / E whole."""
        moe = self.moe
        if (n_tokens * moe.top_k) % moe.n_experts or moe.routing_imbalance != 1.0 or moe.capacity_factor is not None:
            raise ConfigError(f"moe: validate routes {n_tokens} tokens x top_k {moe.top_k} evenly over {moe.n_experts} "
                              "experts: use a micro-batch x seq_len whose tokens x top_k divide by n_experts, "
                              "routing_imbalance 1 and no capacity_factor")
        return n_tokens * moe.top_k // moe.n_experts

    def slots(self, n_tokens: int, device: torch.device) -> torch.Tensor:
        """Token of each expert row, expert-major: row e C + c holds flat choice c E + e."""
        e = self.moe.n_experts
        rows = self.rows(n_tokens)
        return torch.arange(n_tokens * self.moe.top_k, device=device).view(rows, e).t().reshape(-1) // self.moe.top_k

    def route(self, logits: torch.Tensor) -> torch.Tensor:
        """The routing weight of each expert row (E C,) in fp32."""
        moe = self.moe
        n = logits.numel() // moe.n_experts
        choice = (torch.arange(n * moe.top_k, device=logits.device) % moe.n_experts).view(n, moe.top_k)
        if moe.scoring is RouterScoring.TOPK_SOFTMAX:  # gpt-oss: softmax over the k chosen logits alone
            weights = torch.softmax(logits.reshape(n, moe.n_experts).gather(1, choice), dim=-1, dtype=torch.float32)
            order = torch.arange(n * moe.top_k, device=logits.device).view(self.rows(n), moe.n_experts).t().reshape(-1)
            return weights.view(-1).index_select(0, order)
        if moe.scoring is RouterScoring.TOPK_SIGMOID:  # Llama 4: the k chosen logits' fp32 sigmoids, cast back
            weights = torch.sigmoid(logits.reshape(n, moe.n_experts).gather(1, choice).float()).to(logits.dtype)
            order = torch.arange(n * moe.top_k, device=logits.device).view(self.rows(n), moe.n_experts).t().reshape(-1)
            return weights.view(-1).index_select(0, order)
        if moe.scoring is RouterScoring.SIGMOID:  # DeepSeek-V3: each expert's sigmoid, in fp32
            probs = torch.sigmoid(logits.float()).view(n, moe.n_experts)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).view(n, moe.n_experts)
        if moe.aux_loss_coef and self.aux_sink is not None:
            # Switch Transformer's E sum_e f_e P_e, f_e the share of rows expert e takes (1/E here),
            # P_e its mean probability: coef * sum_e P_e
            self.aux_sink.append(moe.aux_loss_coef * probs.mean(0).sum())
        weights = probs.gather(1, choice)
        if moe.norm_topk_prob and moe.scoring is RouterScoring.SIGMOID:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        elif moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        order = torch.arange(n * moe.top_k, device=logits.device).view(self.rows(n), moe.n_experts).t().reshape(-1)
        return weights.view(-1).index_select(0, order)

    def dispatch(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The expert rows (E, C, D): each row a copy of its token."""
        b, t, d = x.shape
        return x.reshape(b * t, d).index_select(0, tokens).view(self.moe.n_experts, -1, d)

    @staticmethod
    def scale(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Llama 4: each expert row (E, C, D) times its routing weight, before the experts."""
        return rows * weights.to(rows.dtype).view(rows.shape[0], -1, 1)

    @staticmethod
    def gather(out: torch.Tensor, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Llama 4: the (already weighted) rows summed into their tokens: (B, T, D)."""
        d = out.shape[-1]
        return torch.zeros(shape[0] * shape[1], d, dtype=out.dtype, device=out.device).index_add_(
            0, tokens, out.view(-1, d)).view(shape)

    @staticmethod
    def combine(out: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Each row times its weight, summed into its token: (B, T, D) in the experts' dtype."""
        d = out.shape[-1]
        return torch.zeros(shape[0] * shape[1], d, dtype=out.dtype, device=out.device).index_add_(
            0, tokens, out.view(-1, d) * weights.to(out.dtype).unsqueeze(1)).view(shape)

    def away(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: the (E, C, D) rows to their experts' ranks, received as (ep, E/ep,
        C, D) by source rank, regrouped (E/ep, ep C, D) by local expert."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        e, c, d = rows.shape
        received = all_to_all_single_autograd(rows.reshape(e * c, d), None, None, self.ep_group)
        return received.view(self.ep, e // self.ep, c, d).transpose(0, 1).reshape(e // self.ep, self.ep * c, d)

    def home(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' (E/ep, ep C, D) output back by source rank, and home: (E C, D)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        local, rows, d = out.shape
        back = out.view(local, self.ep, rows // self.ep, d).transpose(0, 1).reshape(-1, d)
        return all_to_all_single_autograd(back, None, None, self.ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial

        if isinstance(x, DTensor):  # tensor parallelism: every path's input gradient is a partial sum
            x = x.to_local(grad_placements=(Partial(),))
        # one expression: only ``x`` and ``tokens`` (saved by dispatch and combine) are locals
        tokens = self.slots(x.shape[0] * x.shape[1], x.device)
        if self.scores_input:  # Llama 4 (Llama4TextMoe): the rows scaled by their weights, summed unweighted
            if self.ep > 1 or self.tp_group is not None:
                raise ConfigError("moe.scoring: the top-k-then-sigmoid router (Llama 4) is validated without expert "
                                  "or tensor parallelism; use ep 1 and tp 1")
            y = self.gather(self.experts(self.scale(self.dispatch(x, tokens), self.route(self.router(x)))), tokens,
                            x.shape)
        elif self.ep > 1:
            out = self.home(self.experts(self.away(self.dispatch(x, tokens))))
            y = self.combine(out, self.route(replicated_linear(self.router, x, self.tp_group)), tokens, x.shape)
        else:
            y = self.combine(self.experts(self.dispatch(x, tokens)),
                             self.route(replicated_linear(self.router, x, self.tp_group)), tokens, x.shape)
        if self.shared_expert is None:
            return y
        if self.shared_gate is None:
            return y + self.shared_expert(x)
        return y + self.shared_expert(x) * torch.sigmoid(replicated_linear(self.shared_gate, x, self.tp_group))
