"""The real torchtitan 0.3.0 Llama 3 step, for ``test_reproduction_equals_torchtitan`` where
torchtitan and triton are installed (a scratch environment: ``pip install torchtitan==0.3.0
triton``). Its Llama3Model is built from its own config classes with SDPA as the inner attention
(its language models default to FlexAttention, compiled, which saves the same tensors) and its
``nn.RMSNorm`` run as CUDA runs it; its ``ChunkedLossWrapper`` computes the loss, as its trainer's
``_forward_backward_body`` calls it."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from validate.implementations import FusedRMSNormFunction
from validate.tracker import LiveStorageTracker


def real_peak(shape: dict[str, int], seq: int, batch: int, accumulation: int, dtype: Any, checkpoint: bool) -> int:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    RMSNorm.forward = lambda self, x: FusedRMSNormFunction.apply(x, self.weight, self.eps or 1e-5)  # as on CUDA
    d, n, k, f, v = shape["d_model"], shape["n_heads"], shape["n_kv_heads"], shape["d_ff"], shape["vocab_size"]
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=d, eps=1e-5), ffn_norm=RMSNorm.Config(normalized_shape=d, eps=1e-5),
        attention=make_gqa_config(dim=d, n_heads=n, n_kv_heads=k, wqkv_param_init={}, wo_param_init={},
                                  inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True,
                                  rope=ComplexRoPE.Config(dim=d // n, max_seq_len=seq, theta=500000)),
        feed_forward=make_ffn_config(dim=d, hidden_dim=f, w1_param_init={}, w2w3_param_init={}))
        for _ in range(shape["n_layers"])]
    config = Llama3Model.Config(dim=d, vocab_size=v, tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d),
                                norm=RMSNorm.Config(normalized_shape=d, eps=1e-5),
                                lm_head=Linear.Config(in_features=d, out_features=v), layers=layers)
    with FakeTensorMode():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = config.build()
        finally:
            torch.set_default_dtype(previous)
        model._skip_lm_head = True
        if checkpoint:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for name, layer in list(model.layers.items()):
                model.layers[name] = checkpoint_wrapper(layer, preserve_rng_state=False)
        loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=v)).build()
        loss_fn.set_lm_head(model.lm_head)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        rows = batch * accumulation
        tokens, labels = (torch.randint(0, v, (rows, seq)) for _ in range(2))
        positions = torch.arange(seq).expand(rows, seq).contiguous()
        tracker = LiveStorageTracker()
        tracker.track([*model.parameters(), *model.buffers(), tokens, labels, positions])

        def step() -> None:
            valid = torch.tensor(float(rows * seq))
            for micro in range(accumulation):
                r = slice(micro * batch, (micro + 1) * batch)
                pred = model(tokens[r], positions[r])
                loss, _ = loss_fn(pred, labels[r], valid, positions=positions[r])
                del pred
                loss.backward()
                del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with tracker:
            step()
            tracker.reset_peak()
            step()
        return tracker.peak_bytes
