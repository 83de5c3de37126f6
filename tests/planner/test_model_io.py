"""Loading --model: presets, YAML/JSON model files, transformers config.json, overrides, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from planner.errors import ConfigError, ConfigWarning, UnknownPresetError
from planner.model.config import (
    AttentionImpl,
    Family,
    MlpKind,
    ModelConfig,
    NormKind,
    PositionKind,
    TrainConfig,
)
from planner.model.sources import (
    Workload,
    list_presets,
    load_preset,
    load_workload,
    model_from_hf_config,
    resolve,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"

REQUIRED_PRESETS = (
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl",
    "llama2-7b", "llama2-13b", "llama2-70b",
    "llama3-8b", "llama3-70b", "llama3-405b",
    "mistral-7b", "tiny-llama", "tiny-gpt2",
)

# Published architectures (transformers config.json of each model on the Hugging Face hub):
# n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, max_seq_len, tie, norm_eps, rope_theta
ARCHITECTURES: dict[str, tuple[int, int, int, int, int, int, int, bool, float, float]] = {
    "gpt2": (12, 768, 12, 12, 3072, 50257, 1024, True, 1e-5, 10000.0),
    "gpt2-medium": (24, 1024, 16, 16, 4096, 50257, 1024, True, 1e-5, 10000.0),
    "gpt2-large": (36, 1280, 20, 20, 5120, 50257, 1024, True, 1e-5, 10000.0),
    "gpt2-xl": (48, 1600, 25, 25, 6400, 50257, 1024, True, 1e-5, 10000.0),
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000, 4096, False, 1e-5, 10000.0),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 4096, False, 1e-5, 10000.0),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 4096, False, 1e-5, 10000.0),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, False, 1e-5, 500000.0),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, False, 1e-5, 500000.0),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 131072, False, 1e-5, 500000.0),
    "mistral-7b": (32, 4096, 32, 8, 14336, 32000, 32768, False, 1e-5, 10000.0),
    "tiny-llama": (2, 128, 4, 2, 344, 1000, 256, False, 1e-5, 10000.0),
    "tiny-gpt2": (2, 128, 4, 4, 512, 1000, 256, True, 1e-5, 10000.0),
}

# seq_len, global_batch_size: the documented defaults cited in each preset file
TRAINING: dict[str, tuple[int, int]] = {
    "gpt2": (1024, 480),  # nanoGPT config/train_gpt2.py: 12 x 5 x 8 sequences of 1024
    "gpt2-medium": (1024, 512),  # GPT-2 paper: batch 512, context 1024
    "gpt2-large": (1024, 512),
    "gpt2-xl": (1024, 512),
    "llama2-7b": (4096, 1024),  # Llama 2 paper: 4M tokens of 4096-token sequences
    "llama2-13b": (4096, 1024),
    "llama2-70b": (4096, 1024),
    "llama3-8b": (8192, 512),
    "llama3-70b": (8192, 512),
    "llama3-405b": (8192, 2048),  # Llama 3 paper: 16M tokens of 8192-token sequences
    "mistral-7b": (8192, 512),
    "tiny-llama": (128, 8),
    "tiny-gpt2": (128, 8),
}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def write_yaml(tmp_path: Path, data: Any, name: str = "cfg.yaml") -> Path:
    return write(tmp_path, name, yaml.safe_dump(data, sort_keys=False))


def load_fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def one_line_error(excinfo: pytest.ExceptionInfo[ConfigError], *needles: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


TINY_MODEL = {
    "family": "llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
    "d_ff": 128, "vocab_size": 100, "max_seq_len": 64,
}


# ---------------------------------------------------------------------------------------------
# presets


def test_list_presets_has_every_required_name_sorted() -> None:
    presets = list_presets()
    assert set(REQUIRED_PRESETS) <= set(presets)
    assert list(presets) == sorted(presets)


@pytest.mark.parametrize("name", list_presets())
def test_preset_is_consistent(name: str) -> None:
    workload = load_preset(name)
    assert isinstance(workload, Workload)
    assert workload.model.name == name
    assert workload.training is not None
    assert workload.model.dropout == 0.0
    # flash, except where only eager attention runs the model (gpt-oss's sinks, Gemma 2's soft-capped scores:
    # transformers has no SDPA path)
    eager_only = workload.model.attention_sinks or workload.model.attn_logit_softcapping is not None
    assert workload.model.attention is (AttentionImpl.EAGER if eager_only else AttentionImpl.FLASH)
    if workload.model.positions is PositionKind.LEARNED:
        assert workload.training.seq_len <= workload.model.max_seq_len


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_preset_architecture_figures(name: str) -> None:
    m = load_preset(name).model
    got = (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.d_ff, m.vocab_size, m.max_seq_len, m.tie_embeddings,
           m.norm_eps, m.rope_theta)
    assert got == ARCHITECTURES[name]
    assert (load_preset(name).training.seq_len, load_preset(name).training.global_batch_size) == TRAINING[name]


def test_preset_families_and_kinds() -> None:
    gpt2 = load_preset("gpt2").model
    assert gpt2.family is Family.GPT2 and gpt2.positions is PositionKind.LEARNED
    assert gpt2.norm is NormKind.LAYERNORM and gpt2.mlp is MlpKind.GELU and gpt2.qkv_bias and gpt2.norm_bias
    llama = load_preset("llama3-8b").model
    assert llama.family is Family.LLAMA and llama.positions is PositionKind.ROTARY
    assert llama.norm is NormKind.RMSNORM and llama.mlp is MlpKind.SWIGLU and not llama.qkv_bias
    assert load_preset("mistral-7b").model.family is Family.MISTRAL


def test_load_preset_is_cached() -> None:
    assert load_preset("gpt2") is load_preset("gpt2")
    assert load_workload("gpt2") is load_preset("gpt2")


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(UnknownPresetError) as excinfo:
        load_preset("llama9-1t")
    one_line_error(excinfo, "llama9-1t", "gpt2", "llama3-8b", "mistral-7b")


def test_unknown_name_is_unknown_preset_error() -> None:
    with pytest.raises(UnknownPresetError) as excinfo:
        load_workload("gtp2")
    message = one_line_error(excinfo, "gtp2", "llama2-7b", "tiny-llama")
    assert isinstance(excinfo.value, ConfigError)
    assert "no such file" in message


# ---------------------------------------------------------------------------------------------
# files and mappings


def test_yaml_file_with_model_and_training(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": {"name": "mine", **TINY_MODEL}, "training": {"seq_len": 32, "global_batch_size": 4}})
    workload = load_workload(path)
    assert workload.model.name == "mine" and workload.model.kv_heads == 2
    assert workload.training == TrainConfig(seq_len=32, global_batch_size=4)
    assert load_workload(str(path)) == workload


def test_yaml_file_without_training(tmp_path: Path) -> None:
    workload = load_workload(write_yaml(tmp_path, {"model": TINY_MODEL}))
    assert workload.training is None
    assert workload.model.norm is NormKind.RMSNORM  # family defaults applied


def test_yaml_preset_with_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "cfg.yaml", "model:\n  preset: llama3-8b\n  attention: eager\n  n_layers: 4\n")
    workload = load_workload(path)
    base = load_preset("llama3-8b")
    assert workload.model.attention is AttentionImpl.EAGER
    assert workload.model.n_layers == 4
    assert workload.model.d_model == base.model.d_model and workload.model.rope_theta == 500000.0
    assert workload.training == base.training  # inherited from the preset


def test_yaml_preset_training_fields_override_preset_training(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": {"preset": "llama2-7b"}, "training": {"global_batch_size": 64}})
    training = load_workload(path).training
    assert training is not None
    assert (training.seq_len, training.global_batch_size) == (4096, 64)


def test_yaml_model_as_preset_name(tmp_path: Path) -> None:
    workload = load_workload(write(tmp_path, "cfg.yaml", "model: gpt2\n"))
    assert workload == load_preset("gpt2")


def test_yaml_preset_override_can_change_family(tmp_path: Path) -> None:
    # the preset's raw fields are merged before family defaults apply
    workload = load_workload(write_yaml(tmp_path, {"model": {"preset": "tiny-llama", "family": "qwen2"}}))
    assert workload.model.family is Family.QWEN2 and workload.model.qkv_bias


def test_yaml_unknown_preset_key(tmp_path: Path) -> None:
    with pytest.raises(UnknownPresetError) as excinfo:
        load_workload(write_yaml(tmp_path, {"model": {"preset": "nope"}}))
    one_line_error(excinfo, "cfg.yaml", "model.preset", "nope", "llama3-8b")


def test_json_transformers_config_is_detected() -> None:
    workload = load_workload(FIXTURES / "llama.json")
    assert workload.training is None
    assert workload.model.family is Family.LLAMA and workload.model.rope_theta == 500000.0
    assert workload.model.name == "llama"
    assert load_workload(FIXTURES / "gpt2.json").model.name == "tiny-gpt2"  # from _name_or_path


def test_config_json_named_after_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-llama"
    folder.mkdir()
    data = load_fixture("llama")
    (folder / "config.json").write_text(json.dumps(data))
    assert load_workload(folder / "config.json").model.name == "my-llama"


def test_json_model_training_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "cfg.json", json.dumps({"model": TINY_MODEL, "training": {"seq_len": 16, "global_batch_size": 2}}))
    workload = load_workload(path)
    assert workload.model.d_model == 64 and workload.training is not None and workload.training.seq_len == 16


def test_mappings_in_both_forms() -> None:
    assert load_workload({"model": TINY_MODEL}).model.n_layers == 2
    hf = load_workload(load_fixture("qwen2"))
    assert hf.model.family is Family.QWEN2 and hf.training is None


def test_model_config_and_workload_pass_through() -> None:
    model = ModelConfig(**TINY_MODEL)
    assert load_workload(model) == Workload(model=model, training=None)
    workload = load_preset("tiny-gpt2")
    assert load_workload(workload) is workload


def test_workload_is_frozen() -> None:
    workload = load_preset("tiny-llama")
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        workload.training = None  # type: ignore[misc]


def test_mapping_input_is_not_mutated() -> None:
    source = {"model": {"preset": "tiny-llama", "n_layers": 3}}
    load_workload(source)
    assert source == {"model": {"preset": "tiny-llama", "n_layers": 3}}


# ---------------------------------------------------------------------------------------------
# bad files


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "cfg.yaml", "model:\n  family: llama\n  n_layers: [2\n  d_model: 64\n")
    with pytest.raises(ConfigError) as excinfo:
        load_workload(path)
    one_line_error(excinfo, "cfg.yaml", "line ", "malformed YAML")


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "cfg.json", '{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(ConfigError) as excinfo:
        load_workload(path)
    one_line_error(excinfo, "cfg.json", "line 3", "malformed JSON")


@pytest.mark.parametrize("spec", ["missing.yaml", "configs/missing.json", "./nothing-here"])
def test_missing_file(tmp_path: Path, spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        load_workload(spec)
    one_line_error(excinfo, spec, "no such file")


def test_missing_path_object(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(tmp_path / "missing.yaml")
    one_line_error(excinfo, "missing.yaml")


def test_directory_is_not_readable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(tmp_path)
    one_line_error(excinfo, str(tmp_path), "cannot read")


@pytest.mark.parametrize(
    ("model_changes", "field"),
    [
        ({"family": "gpt5"}, "model.family"),
        ({"d_model": 66}, "n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_layers": 0}, "model.n_layers"),
        ({"d_model": -64}, "model.d_model"),
        ({"n_heads": 0}, "model.n_heads"),
        ({"d_ff": -1}, "model.d_ff"),
        ({"vocab_size": 0}, "model.vocab_size"),
        ({"max_seq_len": 0}, "model.max_seq_len"),
        ({"n_kv_heads": 0}, "model.n_kv_heads"),
        ({"dropout": 1.5}, "model.dropout"),
        ({"attention": "fast"}, "model.attention"),
        ({"n_layerz": 2}, "model.n_layerz"),
    ],
)
def test_bad_model_field_names_file_and_field(tmp_path: Path, model_changes: dict[str, Any], field: str) -> None:
    path = write_yaml(tmp_path, {"model": {**TINY_MODEL, **model_changes}, "training": {"seq_len": 8, "global_batch_size": 1}})
    with pytest.raises(ConfigError) as excinfo:
        load_workload(path)
    one_line_error(excinfo, "model file", "cfg.yaml", field)


def test_missing_model_field(tmp_path: Path) -> None:
    model = {k: v for k, v in TINY_MODEL.items() if k != "d_ff"}
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write_yaml(tmp_path, {"model": model}))
    one_line_error(excinfo, "cfg.yaml", "model.d_ff", "missing")


@pytest.mark.parametrize(
    ("training", "field"),
    [
        ({"seq_len": 0, "global_batch_size": 4}, "training.seq_len"),
        ({"seq_len": 32, "global_batch_size": -4}, "training.global_batch_size"),
        ({"seq_len": 32, "global_batch_size": 4, "optimizer": "lion"}, "training.optimizer"),
        ({"seq_len": 32, "global_batch_size": 4, "batch": 4}, "training.batch"),
    ],
)
def test_bad_training_field(tmp_path: Path, training: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write_yaml(tmp_path, {"model": TINY_MODEL, "training": training}))
    one_line_error(excinfo, "cfg.yaml", field)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write_yaml(tmp_path, {"model": TINY_MODEL, "optimizer": {"lr": 1}}))
    one_line_error(excinfo, "cfg.yaml", "optimizer", "unknown top-level key")


def test_flat_model_fields_at_top_level_hint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write_yaml(tmp_path, TINY_MODEL))
    one_line_error(excinfo, "cfg.yaml", "family", "model:")


def test_missing_model_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write_yaml(tmp_path, {"training": {"seq_len": 8, "global_batch_size": 1}}))
    one_line_error(excinfo, "cfg.yaml", "model:", "missing")


@pytest.mark.parametrize("text", ["", "- 1\n- 2\n", "just a string\n"])
def test_not_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write(tmp_path, "cfg.yaml", text))
    one_line_error(excinfo, "cfg.yaml", "mapping")


@pytest.mark.parametrize(("section", "value"), [("model", [1, 2]), ("training", 5)])
def test_section_not_a_mapping(tmp_path: Path, section: str, value: Any) -> None:
    data: dict[str, Any] = {"model": TINY_MODEL, section: value}
    with pytest.raises(ConfigError) as excinfo:
        load_workload(write_yaml(tmp_path, data))
    one_line_error(excinfo, "cfg.yaml", f"{section}:", "mapping")


def test_bad_mapping_is_named_as_mapping() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload({"model": {**TINY_MODEL, "n_layers": -1}})
    one_line_error(excinfo, "model mapping", "model.n_layers")


def test_bad_source_type() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_workload(42)  # type: ignore[arg-type]
    one_line_error(excinfo, "int")


# ---------------------------------------------------------------------------------------------
# transformers config.json


def test_hf_gpt2() -> None:
    model = model_from_hf_config(load_fixture("gpt2"), name="g")
    assert model.name == "g" and model.family is Family.GPT2
    assert (model.n_layers, model.d_model, model.n_heads, model.d_ff, model.vocab_size, model.max_seq_len) == (
        2, 128, 4, 512, 1000, 256)
    assert model.tie_embeddings and model.positions is PositionKind.LEARNED and model.mlp is MlpKind.GELU
    assert model.qkv_bias and model.attn_out_bias and model.mlp_bias and model.norm_bias
    assert model.dropout == 0.1 and model.norm_eps == 1e-5


def test_hf_gpt2_tie_default_and_n_inner() -> None:
    data = load_fixture("gpt2")
    data.pop("tie_word_embeddings", None)
    data["n_inner"] = 300
    model = model_from_hf_config(data)
    assert model.tie_embeddings is True and model.d_ff == 300


def test_hf_llama() -> None:
    model = model_from_hf_config(load_fixture("llama"))
    assert model.family is Family.LLAMA and model.positions is PositionKind.ROTARY and model.mlp is MlpKind.SWIGLU
    assert (model.n_heads, model.kv_heads, model.d_ff, model.max_seq_len) == (4, 2, 344, 512)
    assert not model.tie_embeddings and not model.qkv_bias and not model.attn_out_bias and not model.mlp_bias
    assert model.norm_eps == 1e-5 and model.rope_theta == 500000.0 and model.dropout == 0.0


def test_hf_llama_attention_bias_sets_qkv_and_out() -> None:
    data = {**load_fixture("llama"), "attention_bias": True, "mlp_bias": True}
    model = model_from_hf_config(data)
    assert model.qkv_bias and model.attn_out_bias and model.mlp_bias


def test_hf_llama_without_optional_keys_uses_transformers_defaults() -> None:
    data = load_fixture("llama")
    for key in ("tie_word_embeddings", "num_key_value_heads", "rope_theta", "rms_norm_eps", "head_dim",
                "max_position_embeddings", "attention_bias", "hidden_act"):
        data.pop(key)
    model = model_from_hf_config(data)
    assert not model.tie_embeddings and model.kv_heads == model.n_heads
    assert model.rope_theta == 10000.0 and model.norm_eps == 1e-6 and model.max_seq_len == 2048


def test_hf_mistral() -> None:
    model = model_from_hf_config(load_fixture("mistral"))
    assert model.family is Family.MISTRAL and (model.n_heads, model.kv_heads) == (8, 2)
    assert not (model.qkv_bias or model.attn_out_bias or model.mlp_bias) and not model.tie_embeddings


@pytest.mark.parametrize(("fixture", "absent"), [("llama", 32), ("mistral", 8), ("qwen2", 32)])
def test_hf_kv_heads_absent_or_null(fixture: str, absent: int) -> None:
    data = {**load_fixture(fixture), "hidden_size": 1024, "num_attention_heads": 32}
    assert model_from_hf_config({**data, "num_key_value_heads": None}).kv_heads == 32  # null: MHA
    data.pop("num_key_value_heads")
    # absent: the config class's default (LlamaConfig MHA, MistralConfig 8, Qwen2Config 32)
    assert model_from_hf_config(data).kv_heads == absent


def test_hf_qwen2() -> None:
    model = model_from_hf_config(load_fixture("qwen2"))
    assert model.family is Family.QWEN2 and model.tie_embeddings and model.kv_heads == 1
    assert model.qkv_bias and not model.attn_out_bias and not model.mlp_bias
    assert model.norm_eps == 1e-6 and model.rope_theta == 1_000_000.0


def test_hf_qwen2_tie_default_is_false() -> None:
    data = load_fixture("qwen2")
    data.pop("tie_word_embeddings")
    assert model_from_hf_config(data).tie_embeddings is False


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_hf_rope_theta_nested(key: str) -> None:
    data = load_fixture("llama")
    data.pop("rope_theta")
    data[key] = {"rope_type": "default", "rope_theta": 250000.0}
    assert model_from_hf_config(data).rope_theta == 250000.0


def test_hf_attention_dropout() -> None:
    assert model_from_hf_config({**load_fixture("mistral"), "attention_dropout": 0.2}).dropout == 0.2


def test_hf_unknown_model_type_lists_supported() -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**load_fixture("llama"), "model_type": "falcon"})
    one_line_error(excinfo, "model_type", "falcon", "gpt2", "llama", "mistral", "qwen2")


def test_hf_unknown_model_type_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "config.json", json.dumps({**load_fixture("llama"), "model_type": "bert"}))
    with pytest.raises(ConfigError) as excinfo:
        load_workload(path)
    one_line_error(excinfo, "config.json", "model_type", "bert")


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh", ["silu"]])
def test_hf_unsupported_hidden_act(act: Any) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**load_fixture("llama"), "hidden_act": act})
    one_line_error(excinfo, "hidden_act", str(act))


def test_hf_unsupported_gpt2_activation() -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**load_fixture("gpt2"), "activation_function": "relu"})
    one_line_error(excinfo, "activation_function", "relu")


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh", "gelu"])
def test_hf_gpt2_gelu_variants(act: str) -> None:
    assert model_from_hf_config({**load_fixture("gpt2"), "activation_function": act}).mlp is MlpKind.GELU


def test_hf_explicit_head_dim_differs() -> None:
    # GPT2Attention splits n_embd into n_head heads and reads no head_dim; LlamaAttention honours it
    # (tests/planner/test_readers_dense.py prices it)
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**load_fixture("gpt2"), "head_dim": 64})
    one_line_error(excinfo, "head_dim", "not supported")
    assert model_from_hf_config({**load_fixture("llama"), "head_dim": 64}).head_dim == 64


def test_hf_explicit_head_dim_equal_is_fine() -> None:
    assert model_from_hf_config({**load_fixture("mistral"), "head_dim": 16}).head_dim == 16


@pytest.mark.parametrize(
    ("fixture", "changes", "field"),
    [
        ("llama", {"hidden_size": 130}, "num_attention_heads"),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("llama", {"num_hidden_layers": 0}, "num_hidden_layers"),
        ("llama", {"intermediate_size": -5}, "intermediate_size"),
        ("qwen2", {"vocab_size": "many"}, "vocab_size"),
        ("gpt2", {"n_embd": 0}, "n_embd"),
        ("gpt2", {"n_head": 3}, "n_head"),
        ("llama", {"rms_norm_eps": "small"}, "rms_norm_eps"),
        ("llama", {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ("llama", {"rms_norm_eps": -1.0}, "norm_eps"),
        ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_hf_bad_values_name_the_key(fixture: str, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config({**load_fixture(fixture), **changes})
    one_line_error(excinfo, field)


@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                                 "vocab_size"])
def test_hf_missing_required_key(key: str) -> None:
    data = load_fixture("llama")
    data.pop(key)
    with pytest.raises(ConfigError) as excinfo:
        model_from_hf_config(data)
    one_line_error(excinfo, key, "missing")


def test_hf_error_in_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "config.json", json.dumps({**load_fixture("llama"), "num_key_value_heads": 3}))
    with pytest.raises(ConfigError) as excinfo:
        load_workload(path)
    one_line_error(excinfo, "config.json", "num_key_value_heads")


# ---------------------------------------------------------------------------------------------
# resolve


def test_resolve_preset_defaults() -> None:
    model, train = resolve("llama2-7b")
    assert model == load_preset("llama2-7b").model
    assert (train.seq_len, train.global_batch_size) == (4096, 1024)


def test_resolve_flags_override() -> None:
    model, train = resolve("llama3-8b", seq_len=2048, global_batch_size=16, attention="eager", dropout=0.1)
    assert (train.seq_len, train.global_batch_size) == (2048, 16)
    assert model.attention is AttentionImpl.EAGER and model.dropout == 0.1
    assert model.d_model == 4096 and model.name == "llama3-8b"
    _, train = resolve("llama3-8b", global_batch_size=16)
    assert train.seq_len == 8192
    model, _ = resolve("llama3-8b", attention=AttentionImpl.EAGER)
    assert model.attention is AttentionImpl.EAGER


def test_resolve_keeps_training_options(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": TINY_MODEL, "training": {"seq_len": 32, "global_batch_size": 4,
                                                                   "optimizer": "sgd", "optimizer_impl": "fused"}})
    _, train = resolve(path, seq_len=16)
    assert (train.seq_len, train.global_batch_size, train.optimizer.value, train.optimizer_impl.value) == (
        16, 4, "sgd", "fused")


def test_resolve_missing_training_names_flag() -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve(FIXTURES / "llama.json")
    message = one_line_error(excinfo, "training.seq_len: missing; pass --seq-len N or add it to the training section")
    assert message.startswith("training.seq_len")
    with pytest.raises(ConfigError) as excinfo:
        resolve(FIXTURES / "llama.json", seq_len=128)
    one_line_error(excinfo, "training.global_batch_size: missing", "--global-batch")
    _, train = resolve(FIXTURES / "llama.json", seq_len=128, global_batch_size=8)
    assert (train.seq_len, train.global_batch_size) == (128, 8)


def test_resolve_model_config_without_training() -> None:
    model, train = resolve(ModelConfig(**TINY_MODEL), seq_len=32, global_batch_size=2)
    assert model.n_layers == 2 and train.tokens_per_step == 64


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seq_len": 0}, "training.seq_len"),
        ({"global_batch_size": -1}, "training.global_batch_size"),
        ({"seq_len": True}, "training.seq_len"),
        ({"attention": "fast"}, "attention"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_resolve_bad_flag(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve("tiny-llama", **kwargs)
    one_line_error(excinfo, field)


def test_resolve_seq_len_beyond_learned_positions() -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve("gpt2", seq_len=2048)
    one_line_error(excinfo, "training.seq_len", "2048", "1024")
    _, train = resolve("gpt2", seq_len=1024)
    assert train.seq_len == 1024


def test_resolve_seq_len_beyond_max_allowed_with_rotary() -> None:
    with pytest.warns(ConfigWarning, match="beyond model.max_seq_len 4096"):
        model, train = resolve("llama2-7b", seq_len=16384)
    assert train.seq_len == 16384 > (model.max_seq_len or 0)


def test_resolve_learned_positions_checked_for_file_training(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": {"preset": "tiny-gpt2"}, "training": {"seq_len": 512}})
    with pytest.raises(ConfigError) as excinfo:
        resolve(path)
    one_line_error(excinfo, "training.seq_len")
    _, train = resolve(path, seq_len=256)
    assert (train.seq_len, train.global_batch_size) == (256, 8)
