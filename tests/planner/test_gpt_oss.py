"""gpt-oss: sliding-window layers, attention sinks, biased clamped-SwiGLU experts and the top-k-then-
softmax router. The planner's peak against the live-storage tracker over the reference model,
FLOPs against FlopCounterMode, the config.json reader field by field and its refusals, and exact
parameter counts against transformers 5.24.0's GptOssForCausalLM on the meta device.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hardware.registry import load_hardware
from planner.errors import ConfigError
from planner.graph.params import param_tensors
from planner.model.config import AttentionImpl, Family, LayerType, ModelConfig, TrainConfig
from planner.model.families.config_json import model_from_hf_config
from planner.model.families.moe.config import ExpertActivation, MoeConfig, RouterScoring
from planner.model.sources import load_preset
from planner.plan.knobs import Knobs
from planner.program.estimate import estimate

HW = load_hardware("h100-sxm")
MOE = dict(n_experts=4, top_k=2, d_ff_expert=48, expert_bias=True, router_bias=True, norm_topk_prob=False,
           expert_activation="clamped-swiglu", scoring="topk-softmax")
# head_dim 24 != D/N (as gpt-oss's 64 != 2880/64), block 0 slides over 16 keys, block 1 is full
TINY = ModelConfig(family="gpt_oss", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, attention_head_dim=24, d_ff=48,
                   vocab_size=256, attention="eager", sliding_window=16,
                   layer_types=("sliding_attention", "full_attention"), moe=MOE)

# (precision, accumulation, checkpointed blocks)
# (fp32 with block 0 checkpointed and block 1 not: both in one step)
CASES = [("fp32", 2, (0,)), ("bf16-mixed", 2, ()), ("bf16-mixed", 2, (0, 1))]


@pytest.mark.parametrize(("precision", "accumulation", "blocks"), CASES,
                         ids=[f"{p}-acc{a}-ckpt{len(b)}" for p, a, b in CASES])
def test_planner_matches_pytorch(precision: str, accumulation: int, blocks: tuple[int, ...]) -> None:
    """Peak within 1% of the tracker (measured within 0.35% on small gpt-oss shapes, the formulas
    exact to the byte op by op on MHA shapes); FLOPs, recompute included, equal to FlopCounterMode."""
    pytest.importorskip("torch")
    from validate.simulate import simulate_step

    training = TrainConfig(seq_len=64, global_batch_size=2 * accumulation)
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=accumulation, precision=precision, checkpoint_blocks=blocks)
    predicted = estimate(TINY, training, HW, knobs)
    measured = simulate_step(TINY, training, knobs)
    assert predicted.memory.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=0.01)
    assert predicted.hardware_flops_per_step == pytest.approx(measured.flops_per_step, rel=1e-9)


def test_the_description_is_the_reference_model() -> None:
    """Parameters in registration order (the sinks, the experts' biases, the router's), every
    parametrized op a module of the same name, and the sliding blocks' cores on the window mask."""
    torch = pytest.importorskip("torch")
    from planner.graph.blocks import describe
    from validate.reference_model import build_model

    with torch.device("meta"):
        net = build_model(TINY)
    assert list(param_tensors(TINY).items()) == [(n, p.numel()) for n, p in net.named_parameters()]
    modules = dict(net.named_modules())
    ops = {op.name: op for op in describe(TINY).ops}
    for op in ops.values():
        if op.params:
            assert op.name in modules, op.name
    assert "blocks.0.attn.core.sinks" in dict(param_tensors(TINY))
    assert ops["blocks.0.attn.core"].inputs[-1] == "window_mask" and ops["blocks.1.attn.core"].inputs[-1] == "causal_mask"
    assert [net.blocks[b].windowed for b in range(2)] == [True, False]


def test_window_and_sinks_cost_what_the_eager_kernel_runs() -> None:
    """The eager path computes the full square whatever the window: the same FLOPs and time, one
    more T x T bool mask held for the forward. Sinks add no FLOPs (FlopCounterMode counts the two
    matmuls) and a column to the saved softmax output."""
    training = TrainConfig(seq_len=256, global_batch_size=2)
    knobs = Knobs(micro_batch_size=2)
    full = TINY.model_copy(update={"sliding_window": None, "layer_types": None})
    plain = full.model_copy(update={"attention_sinks": False})
    est = {name: estimate(m, training, HW, knobs) for name, m in (("window", TINY), ("full", full), ("plain", plain))}
    assert est["window"].model_flops_per_step == est["full"].model_flops_per_step == est["plain"].model_flops_per_step
    from planner.program.estimate import check_knobs, rank_graph

    graphs = {name: rank_graph(m, training, knobs, check_knobs(m, training, HW, knobs), HW)
              for name, m in (("window", TINY), ("full", full), ("plain", plain))}
    t = training.seq_len
    assert graphs["window"].node("window_mask").cost.output.n_bytes == t * t
    assert "window_mask" not in graphs["full"].ops
    # the sliding core's cost (FLOPs, bytes, kernel shape, memory) is the full core's
    assert graphs["window"].node("blocks.0.attn.core").cost == graphs["full"].node("blocks.0.attn.core").cost
    b, n = 2, TINY.n_heads
    sinks = graphs["full"].node("blocks.0.attn.core").cost.saved_extra_bytes
    none = graphs["plain"].node("blocks.0.attn.core").cost.saved_extra_bytes
    assert sum(sinks) - sum(none) == b * n * t * 4  # the softmax output's extra fp32 column


def test_refusals_name_the_field() -> None:
    # flash with a window: refused once the window binds (tests/planner/test_readers_dense.py)
    flash = ModelConfig.model_validate({**TINY.model_dump(), "attention": "flash", "attention_sinks": False})
    assert flash.window_refusal(16) is None and "sliding_window: 16 keys" in str(flash.window_refusal(17))
    with pytest.raises(ValueError, match="attention_sinks: PyTorch's SDPA has no sink logit"):
        ModelConfig.model_validate({**TINY.model_dump(), "attention": "flash", "sliding_window": None,
                                    "layer_types": None})
    with pytest.raises(ValueError, match="layer_types: 3 entries for n_layers 2"):
        ModelConfig.model_validate({**TINY.model_dump(), "layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="sliding_window: layer_types lists sliding_attention"):
        ModelConfig.model_validate({**TINY.model_dump(), "sliding_window": None})
    with pytest.raises(ValueError, match="implementation: hf's sliding-window and sink attention"):
        ModelConfig.model_validate({**TINY.model_dump(), "moe": None, "family": "llama", "implementation": "hf"})
    with pytest.raises(ValueError, match="moe.aux_loss_coef: the load-balancing loss over a top-k-then-softmax"):
        MoeConfig(**{**MOE, "aux_loss_coef": 0.01})
    from planner.plan.parallel_dims import ParallelDims

    dense = ModelConfig.model_validate({**TINY.model_dump(), "moe": None, "family": "llama"})
    tp2 = Knobs(micro_batch_size=2, parallel=ParallelDims(tp=2, dp_shard=1))
    with pytest.raises(ConfigError, match="parallel.tp: .*attention sinks"):
        estimate(dense, TrainConfig(seq_len=64, global_batch_size=2), HW, tp2)
    no_sinks = TINY.model_copy(update={"attention_sinks": False})
    with pytest.raises(ConfigError, match="parallel.tp: .*biased or interleaved gate_up experts"):
        estimate(no_sinks, TrainConfig(seq_len=64, global_batch_size=2), HW, tp2)


# ---------------------------------------------------------------------------------------------
# the config.json reader

_LAYERS = {24: ["sliding_attention", "full_attention"] * 12, 36: ["sliding_attention", "full_attention"] * 18}
_MXFP4 = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                     "lm_head"], "quant_method": "mxfp4"}
# openai/gpt-oss-20b (https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json)
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": _LAYERS[24], "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": _MXFP4, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
# openai/gpt-oss-120b (https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json): 36 layers, 128 experts
GPT_OSS_120B: dict[str, Any] = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                                "layer_types": _LAYERS[36]}
# preset -> (published config.json, total parameters of transformers 5.24.0's model on the meta device)
PUBLISHED = {"gpt-oss-20b": (GPT_OSS_20B, 20_914_757_184), "gpt-oss-120b": (GPT_OSS_120B, 116_829_156_672)}

_NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
TINY_JSON: dict[str, Any] = {
    "model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 48, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 512, "sliding_window": 16, **_NO_TOKENS}
TINY_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("tiny", TINY_JSON),
    ("head_dim = D/N", {**TINY_JSON, "head_dim": 16}),
    ("no attention biases, MHA", {**TINY_JSON, "attention_bias": False, "num_key_value_heads": 4}),
    ("tied, 4 layers all full", {**TINY_JSON, "tie_word_embeddings": True, "num_hidden_layers": 4,
                                 "layer_types": ["full_attention"] * 4}),
    ("num_experts alias, top-1", {**{k: v for k, v in TINY_JSON.items() if k != "num_local_experts"},
                                  "num_experts": 6, "num_experts_per_tok": 1}),
]


def test_gpt_oss_20b_field_by_field() -> None:
    model = model_from_hf_config(GPT_OSS_20B, "gpt-oss-20b")
    assert model.family is Family.GPT_OSS
    assert (model.n_layers, model.d_model, model.n_heads, model.kv_heads, model.head_dim, model.vocab_size) == (
        24, 2880, 64, 8, 64, 201088)
    assert model.attention_head_dim == 64  # 64 x 64 = 4096 != 2880: q projects 2880 -> 4096
    assert model.qkv_bias and model.attn_out_bias and not model.mlp_bias and not model.tie_embeddings
    assert (model.max_seq_len, model.norm_eps, model.rope_theta, model.dropout) == (131072, 1e-5, 150000.0, 0.0)
    assert model.attention is AttentionImpl.EAGER and model.attention_sinks
    assert model.sliding_window == 128 and model.layer_types == tuple(LayerType(t) for t in _LAYERS[24])
    assert [model.window(b) for b in range(4)] == [128, None, 128, None]
    assert model.moe == MoeConfig(n_experts=32, top_k=4, d_ff_expert=2880, norm_topk_prob=False, router_bias=True,
                                  expert_bias=True, expert_activation=ExpertActivation.CLAMPED_SWIGLU,
                                  scoring=RouterScoring.TOPK_SOFTMAX, swiglu_alpha=1.702, swiglu_limit=7.0)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_its_published_config(name: str) -> None:
    from_json = model_from_hf_config(PUBLISHED[name][0], name).model_dump(exclude={"activation"})
    assert load_preset(name).model.model_dump(exclude={"activation"}) == from_json


def test_layer_types_and_head_dim_defaults() -> None:
    data = {k: v for k, v in TINY_JSON.items() if k not in ("head_dim", "sliding_window")}
    model = model_from_hf_config({**data, "num_hidden_layers": 3})
    assert model.layer_types == (LayerType.SLIDING, LayerType.FULL, LayerType.SLIDING)  # even layers slide
    assert model.sliding_window == 128 and model.head_dim == 64  # GptOssConfig's defaults
    only_full = model_from_hf_config({**TINY_JSON, "layer_types": ["full_attention"] * 2})
    assert only_full.sliding_window is None and only_full.layer_types is None
    swiglu = model_from_hf_config({**TINY_JSON, "swiglu_limit": 5.0, "swiglu_alpha": 1.5}).moe
    assert swiglu is not None and (swiglu.swiglu_limit, swiglu.swiglu_alpha) == (5.0, 1.5)


REFUSALS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("linear rope", {**TINY_JSON, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     ("rope_parameters", "linear", "yarn")),
    ("layer type", {**TINY_JSON, "layer_types": ["chunked_attention", "full_attention"]}, ("layer_types",)),
    ("layer count", {**TINY_JSON, "layer_types": ["full_attention"] * 3}, ("layer_types", "3 entries")),
    ("null window", {**TINY_JSON, "sliding_window": None}, ("sliding_window", "null")),
    ("aux loss", {**TINY_JSON, "output_router_logits": True}, ("output_router_logits", "false")),
    ("top-k", {**TINY_JSON, "num_experts_per_tok": 5}, ("num_experts_per_tok", "num_local_experts")),
    ("limit", {**TINY_JSON, "swiglu_limit": 0}, ("swiglu_limit", "positive")),
    ("null head_dim", {**TINY_JSON, "head_dim": None}, ("head_dim", "null")),
]


@pytest.mark.parametrize(("case", "data", "needles"), REFUSALS, ids=[case for case, _, _ in REFUSALS])
def test_refusals_are_one_line_naming_the_key(case: str, data: dict[str, Any], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config(data)
    message = str(excinfo.value)
    assert "\n" not in message and "transformers config" in message
    for needle in needles:
        assert needle in message, message


# ---------------------------------------------------------------------------------------------
# against transformers: omitted keys, exact parameter counts on the meta device

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(data: dict[str, Any]) -> Any:
    data = copy.deepcopy(data)
    data.pop("quantization_config", None)  # MXFP4 is the checkpoint's storage; training runs bf16/fp32
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_omitted_keys_take_transformers_defaults() -> None:
    data = {"model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 16,
            "intermediate_size": 96, "vocab_size": 100}
    model = model_from_hf_config(data)
    config = transformers.AutoConfig.for_model(**data)
    assert model.tie_embeddings is bool(config.tie_word_embeddings)
    assert (model.max_seq_len, model.norm_eps, model.dropout) == (
        config.max_position_embeddings, config.rms_norm_eps, config.attention_dropout)
    assert model.rope_theta == config.rope_parameters["rope_theta"]
    assert config.rope_parameters["rope_type"] == "yarn"  # priced as plain RoPE
    assert (model.kv_heads, model.head_dim, model.sliding_window) == (
        config.num_key_value_heads, config.head_dim, config.sliding_window)
    assert [t.value for t in model.layer_types or ()] == config.layer_types
    assert model.qkv_bias is config.attention_bias
    moe = model.moe
    assert moe is not None and (moe.n_experts, moe.top_k, moe.d_ff_expert) == (
        config.num_local_experts, config.num_experts_per_tok, config.intermediate_size)
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (config.swiglu_alpha, config.swiglu_limit)
    assert not config.output_router_logits
    # transformers picks eager attention for gpt-oss (no SDPA): what the planner plans
    assert hf_model(data).config._attn_implementation == "eager"
    assert sum(param_tensors(model).values()) == sum(p.numel() for p in hf_model(data).parameters())


@pytest.mark.parametrize(("case", "data"), TINY_VARIANTS, ids=[case for case, _ in TINY_VARIANTS])
def test_tiny_count_equals_transformers(case: str, data: dict[str, Any]) -> None:
    ours = sum(param_tensors(model_from_hf_config(data)).values())
    assert ours == sum(p.numel() for p in hf_model(data).parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_size_count_equals_transformers(name: str) -> None:
    """transformers builds exactly the published totals, and the planner counts the same."""
    data, total = PUBLISHED[name]
    assert sum(p.numel() for p in hf_model(data).parameters()) == total
    assert sum(param_tensors(model_from_hf_config(data, name)).values()) == total
    assert sum(param_tensors(load_preset(name).model).values()) == total


def test_expert_parallelism_runs_the_biased_experts() -> None:
    """Expert parallelism over gpt-oss's experts on rank 0 of a fake process group (2 ranks, ep 2,
    FSDP2 ZeRO-3): each rank holds E/ep experts and their biases; the per-rank peak within 1%
    (measured +0.76%; the same model under ZeRO-3 without ep: +0.74%)."""
    pytest.importorskip("torch")
    from planner.plan.parallel_dims import ParallelDims
    from roofplan import api
    from validate.api import validate

    training = TrainConfig(seq_len=64, global_batch_size=4)
    knobs = Knobs(micro_batch_size=2, precision="bf16-mixed", parallel=ParallelDims.data_parallel_of(2, 3, ep=2))
    plan = api.estimate_plan(TINY, training, "h100-sxm", knobs)
    report = validate(plan, mode="simulate")
    assert abs(report.errors["peak_allocated"]) < 0.01, report.notes
