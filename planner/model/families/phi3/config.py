"""Phi-3's defaults for the fields a model file leaves out: Llama's, with the projections fused
(transformers 5.24.0, ``models/phi3/modeling_phi3.py``: ``Phi3Attention.qkv_proj``,
``Phi3MLP.gate_up_proj``)."""

from __future__ import annotations

from typing import Any

from planner.model.families.dense.config import FILE_DEFAULTS as DENSE_DEFAULTS
from planner.model.kinds import Family

FILE_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.PHI3: dict(DENSE_DEFAULTS[Family.LLAMA], fused_projections=True),
}
SECTIONS: dict[Family, tuple[str, ...]] = {}
