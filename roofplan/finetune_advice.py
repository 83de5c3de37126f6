"""When nothing fits: what fine-tuning changes, priced (``estimate``) on the smallest plan's knobs.

A full-training request on one GPU is priced again as LoRA adapters (peft's default targets,
``planner.finetune.config``) on the frozen model held in bf16 (``--precision bf16-true``: frozen
weights need no fp32 master copy; only the adapters lose their fp32 state); a LoRA request with an
fp32 base is priced again in bf16. Where that still does not fit, the sequence is halved (the fp32
logits at the loss grow with T x V) until it fits or reaches 512 tokens. Each figure is an
estimate of that plan, so the advice is measured, not guessed; None where it does not apply.
"""

from __future__ import annotations

from hardware.profile import HardwareProfile
from hardware.units import format_bytes
from planner.errors import ConfigError
from planner.finetune.config import FinetuneConfig
from planner.model.config import ModelConfig, TrainConfig
from planner.plan.knobs import Knobs
from planner.precision import PrecisionPolicy
from planner.program.estimate import estimate

SHORTEST_SEQ_LEN = 512


def finetune_advice(model: ModelConfig, training: TrainConfig, hw: HardwareProfile, cap: int, knobs: Knobs) -> str | None:
    """One line: the smallest plan (``knobs``) as LoRA on a bf16 base, and the sequence it fits at."""
    if knobs.parallel.world_size > 1 or (model.finetune is not None and knobs.precision is PrecisionPolicy.BF16_TRUE):
        return None
    tuned = model if model.finetune is not None else model.model_copy(update={"finetune": FinetuneConfig()})
    flags = ("" if model.finetune is not None else "--finetune lora ") + "--precision bf16-true"
    what = ("LoRA adapters (r 8 on q_proj, v_proj) on the frozen model in bf16" if model.finetune is None
            else "the frozen base in bf16 (weights that do not train need no fp32 master copy)")
    knobs = knobs.model_copy(update={"precision": PrecisionPolicy.BF16_TRUE})
    try:
        need = estimate(tuned, training, hw, knobs, cap).memory.device_bytes
        if need <= cap:
            return f"with {what} ({flags}) this plan fits: {format_bytes(need)}"
        line = f"with {what} ({flags}) this plan would still need {format_bytes(need)}"
        seq = training.seq_len // 2
        while seq >= SHORTEST_SEQ_LEN:
            shorter = estimate(tuned, training.model_copy(update={"seq_len": seq}), hw, knobs, cap).memory.device_bytes
            if shorter <= cap:
                return f"{line}; at --seq-len {seq} it fits: {format_bytes(shorter)}"
            seq //= 2
    except ConfigError:  # the smallest plan's knobs do not apply to the tuned model
        return None
    return line
