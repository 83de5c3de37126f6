"""LoRA as peft runs it, written into the model description (``planner.graph.description``).

peft 0.21.2 (``src/peft/tuners/lora/layer.py``) replaces each target ``nn.Linear`` by a
``lora.Linear`` holding the frozen linear as ``base_layer`` and, per adapter, ``lora_A``
(``nn.Linear(in, r, bias=False)``: r x in), ``lora_B`` (``nn.Linear(r, out, bias=False)``:
out x r) and ``lora_dropout`` (``nn.Dropout(p)``, or ``nn.Identity()`` when p is 0:
``LoraLayer.update_layer``). Its ``Linear.forward`` runs::

    result = self.base_layer(x)
    x = self._cast_input_dtype(x, lora_A.weight.dtype)      # a copy where x's dtype differs
    result = result + lora_B(lora_A(dropout(x))) * scaling  # scaling = lora_alpha / r
    result = result.to(torch_result_dtype)                  # no copy: the same dtype

so each target becomes: the base linear (frozen), the input's cast (``ADAPTER_CAST``: none where x
is already in the adapters' dtype; under bf16-mixed the fp32 adapters copy a bf16 input, the
attention output or the SwiGLU product, to fp32), [dropout], ``lora_A``, ``lora_B``, a scale and
an add, the add's output replacing the base's for every later op; the forward's frame holds ``x``
until it returns. Every base parameter is frozen (``inject_adapter_in_model`` marks only the
adapters trainable: ``BaseTuner._mark_only_adapters_as_trainable``). Adapters are kept in the base's
dtype (the plan's parameter dtype), as ``inject_adapter_in_model`` leaves them.
"""

from __future__ import annotations

from dataclasses import replace

from planner.errors import ConfigError
from planner.finetune.config import ALL_LINEAR, QLORA_REFUSAL, FinetuneConfig, FinetuneMethod
from planner.graph.description import ModelDesc, OpDesc, TpRole, linear_op, simple_op
from planner.ops.base import HIDDEN_STATE_LOSSES, OpKind

_HEAD = "lm_head"  # peft's all-linear leaves the output layer out (``_maybe_include_all_linear_layers``)


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _matches(name: str, target: str) -> bool:
    """peft's list matching (``check_target_module_exists``): the whole name or its last parts."""
    return name == target or name.endswith("." + target)


def lora_targets(desc: ModelDesc, finetune: FinetuneConfig, model_name: str) -> frozenset[str]:
    """The linear ops that get adapters; a target naming no linear is one line listing the linears."""
    linears = [op.name for op in desc.ops if op.kind is OpKind.LINEAR]
    if finetune.all_linear:
        names = [n for n in linears if n != _HEAD]
    else:
        names = [n for n in linears if any(_matches(n, t) for t in finetune.target_modules)]
    known = sorted({_short(n) for n in linears}, key=lambda s: [_short(n) for n in linears].index(s))
    for target in finetune.target_modules:
        if target != ALL_LINEAR and not any(_matches(n, target) for n in linears):
            raise ConfigError(f"finetune.target_modules: {target!r} names no linear of {model_name}; its linears are "
                              f"{', '.join(known)} (or use {ALL_LINEAR})")
    return frozenset(names)


def check_finetune(desc: ModelDesc, finetune: FinetuneConfig, model_name: str) -> None:
    """What a fine-tuning plan can price; each refusal one line naming the field."""
    if finetune.method is FinetuneMethod.QLORA:
        raise ConfigError(QLORA_REFUSAL)
    hidden = [op.name for op in desc.ops if op.field("variant") in HIDDEN_STATE_LOSSES]
    if hidden:
        raise ConfigError(f"finetune: the {hidden[0]} op's loss owns the LM head (chunked or fused-linear loss); "
                          "LoRA is priced with the plain loss: set loss: plain in the model file")
    lora_targets(desc, finetune, model_name)


def _frozen(op: OpDesc) -> OpDesc:
    if not op.params:
        return op
    return replace(op, params=tuple(p.model_copy(update={"frozen": True}) for p in op.params))


def lora_description(desc: ModelDesc, finetune: FinetuneConfig, model_name: str = "the model") -> ModelDesc:
    """``desc`` with every parameter frozen and a LoRA adapter beside each target linear (module
    docstring), named as peft's modules: ``<linear>.lora_A.default``, ``<linear>.lora_B.default``."""
    check_finetune(desc, finetune, model_name)
    targets = lora_targets(desc, finetune, model_name)
    rename: dict[str, str] = {}
    ops: list[OpDesc] = []
    holds: list[tuple[str, str]] = []
    for op in desc.ops:
        op = _frozen(replace(op, inputs=tuple(rename.get(t, t) for t in op.inputs),
                             shape_of=rename.get(op.shape_of, op.shape_of) if op.shape_of else None))
        ops.append(op)
        if op.name not in targets:
            continue
        name, block, x = op.name, op.block, op.inputs[0]
        ops.append(OpDesc(name=f"{name}.lora_cast", kind=OpKind.ADAPTER_CAST, inputs=(x,), block=block,
                          tp=TpRole.LOCAL))
        source = cast = ops[-1].name
        if finetune.dropout > 0:
            ops.append(simple_op(f"{name}.lora_dropout.default", OpKind.DROPOUT, block, source, tp=TpRole.LOCAL,
                                 dropout=finetune.dropout))
            source = ops[-1].name
        a = linear_op(f"{name}.lora_A.default", block, source, op.field("in_features"), finetune.rank, False,
                      TpRole.REPLICATE)
        b = linear_op(f"{name}.lora_B.default", block, a.name, finetune.rank, op.field("out_features"), False,
                      TpRole.REPLICATE)
        scale = OpDesc(name=f"{name}.lora_scale", kind=OpKind.SCALE, inputs=(b.name,), block=block, tp=TpRole.LOCAL)
        add = simple_op(f"{name}.lora_add", OpKind.RESIDUAL_ADD, block, name, scale.name, tp=TpRole.LOCAL)
        ops.extend((a, b, scale, add))
        rename[name] = add.name
        # the caller keeps the argument until the call returns, lora.Linear.forward its cast
        holds.extend(((x, add.name), (cast, add.name)))
    holds.extend((rename.get(t, t), rename.get(u, u)) for t, u in desc.held_until)
    return ModelDesc(ops=tuple(ops), held_until=tuple(holds))
