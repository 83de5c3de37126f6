"""Korthikanti et al. 2022 (arXiv:2205.05198), Table 2: activation bytes per transformer layer.

Their setting: GPT blocks, 16-bit activations, dropout, eager attention; s seq, b micro-batch,
h hidden, a heads. No recompute: s*b*h*(34 + 5*a*s/h); full recompute: 2*s*b*h (the layer
input); selective recompute of the attention core: 34*s*b*h. Flash attention removes the 5as/h
term. They ignore LayerNorm's (b, s) fp32 statistics
(16*s*b bytes per layer, < 0.1% here), so the tolerance is 0.5%.
"""

from __future__ import annotations

import pytest

from hardware.registry import load_hardware
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.program.estimate import estimate

HW = load_hardware("h100-sxm")
S, B, H, A = 2048, 1, 2048, 16  # seq, micro-batch, hidden, heads


def _gpt(n_layers: int, attention: str = "eager") -> ModelConfig:
    return ModelConfig(family="gpt2", n_layers=n_layers, d_model=H, n_heads=A, d_ff=4 * H, vocab_size=50257,
                       max_seq_len=S, attention=attention, dropout=0.1)


def _per_layer_bytes(attention: str = "eager", all_checkpointed: bool = False, policy: str = "full") -> int:
    training = TrainConfig(seq_len=S, global_batch_size=B)

    def saved(n_layers: int) -> int:
        blocks = tuple(range(n_layers)) if all_checkpointed else ()
        knobs = Knobs(micro_batch_size=B, precision="bf16-true", checkpoint_blocks=blocks, checkpoint_policy=policy)
        return estimate(_gpt(n_layers, attention), training, HW, knobs).memory.activations_bytes

    return saved(3) - saved(2)


def test_no_recompute_eager() -> None:
    # Korthikanti et al. 2022, Table 2, "no recomputation": sbh(34 + 5as/h)
    expected = S * B * H * (34 + 5 * A * S / H)
    assert _per_layer_bytes() == pytest.approx(expected, rel=0.005)


def test_full_recompute_keeps_the_layer_input() -> None:
    # Korthikanti et al. 2022, Table 2, "full recomputation": 2sbh
    assert _per_layer_bytes(all_checkpointed=True) == pytest.approx(2 * S * B * H, rel=0.005)


def test_selective_recompute_keeps_all_but_the_attention_core() -> None:
    # Korthikanti et al. 2022, Table 2, "selective activation recomputation": 34sbh (the attention
    # core, its 5as/h of scores, softmax, dropout, is recomputed)
    assert _per_layer_bytes(all_checkpointed=True, policy="attention") == pytest.approx(34 * S * B * H, rel=0.005)


def test_flash_attention_removes_the_quadratic_term() -> None:
    # docs/references.md "Activation memory": flash saves the output and a log-sum-exp per row, not the T x T scores
    flash = _per_layer_bytes(attention="flash")
    assert flash == pytest.approx(S * B * H * 34, rel=0.005)
    assert flash < _per_layer_bytes() / 2


def test_pytorch_itself_reproduces_the_table() -> None:
    """Independent of the planner: the live-storage tracker over the reference model's real
    forward, in the same setting at a smaller size, gives the table's per-layer bytes."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from validate.reference_model import build_model
    from validate.tracker import LiveStorageTracker

    s, b, h, a = 512, 2, 512, 8

    def saved_after_forward(n_layers: int) -> int:
        config = ModelConfig(family="gpt2", n_layers=n_layers, d_model=h, n_heads=a, d_ff=4 * h, vocab_size=1024,
                             max_seq_len=s, attention="eager", dropout=0.1)
        with FakeTensorMode():
            model = build_model(config, torch.bfloat16)
            ids = torch.randint(0, 1024, (b, s))
            tracker = LiveStorageTracker()
            tracker.track([*model.parameters(), ids])  # views of weights are not new memory
            with tracker:
                before = tracker.live_bytes
                loss = model(ids, ids)
                after = tracker.live_bytes
            del loss
        return after - before

    per_layer = saved_after_forward(3) - saved_after_forward(2)
    assert per_layer == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.005)


def test_graph_saved_bytes_sum_to_the_table() -> None:
    """The per-op ``saved_bytes`` of one block's graph nodes add up to the same table entry
    (LayerNorm statistics aside), so the per-op figures are an exact split of the per-layer total."""
    from planner.graph.layer_graph import build_graph
    from planner.precision import precision_spec

    graph = build_graph(_gpt(2), B, S, precision_spec("bf16-true"))
    block = sum(graph.saved_bytes(name) for name in graph.order if graph.node(name).spec.block == 1)
    assert block == pytest.approx(S * B * H * (34 + 5 * A * S / H), rel=0.005)
    assert graph.saved_bytes("blocks.1.attn.core") > graph.saved_bytes("blocks.1.mlp.act")  # the T x T terms
