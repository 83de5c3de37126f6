"""What a fine-tuning plan trains: ``finetune: {method, rank, alpha, dropout, target_modules}``.

Field names follow peft's ``LoraConfig`` (peft 0.21.2, ``src/peft/tuners/lora/config.py``: ``r``,
``lora_alpha``, ``lora_dropout``, ``target_modules``); ``scaling = alpha / rank``
(``LoraLayer.update_layer``, ``src/peft/tuners/lora/layer.py``). ``target_modules`` names linears
by the last part of their module name (``q_proj`` matches ``blocks.3.attn.q_proj``), as peft
matches a list of names, or ``all-linear``: every linear but the LM head (peft's
``INCLUDE_LINEAR_LAYERS_SHORTHAND``). QLoRA is refused in one line (``QLORA_REFUSAL``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

ALL_LINEAR = "all-linear"
DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama-like models (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
QLORA_REFUSAL = ("finetune.method: qlora is not priced yet (its NF4 weights and bitsandbytes' CUDA kernels are not "
                 "modelled); use method lora, with --precision bf16-true to hold the frozen base in bf16")


class FinetuneMethod(StrEnum):
    LORA = "lora"
    QLORA = "qlora"


class FinetuneConfig(BaseModel):
    """Adapters trained on a frozen base: every base parameter frozen (no gradient, no optimizer
    state), a rank-``rank`` pair ``lora_A`` (rank x in), ``lora_B`` (out x rank) on each target linear."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: FinetuneMethod = FinetuneMethod.LORA
    rank: PositiveInt = Field(default=8, le=65536, description="r: the adapters' inner size (peft's default 8)")
    alpha: float = Field(default=8.0, gt=0, description="lora_alpha (peft's default 8): the update is scaled by alpha / rank")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="lora_dropout on the adapters' input (0: nn.Identity)")
    target_modules: tuple[str, ...] = Field(default=DEFAULT_TARGETS,
                                            description="linears that get adapters (last name part), or all-linear")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, (list, tuple)) and not value:
            raise ValueError("target_modules: name at least one linear (q_proj, v_proj, ...) or all-linear")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def all_linear(self) -> bool:
        return ALL_LINEAR in self.target_modules
