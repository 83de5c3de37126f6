"""The registry of model families: one ``FamilySpec`` per family package (its ``reader.FAMILY``),
and the tables built from them: ``model_type`` -> its ``FamilyReader`` (read by
``planner.model.families.config_json``), ``Family`` -> the defaults a model file of it leaves
out and the sections it must have (applied by ``planner.model.checks``).

A new family adds its package and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.model.families.deepseek import reader as deepseek
from planner.model.families.dense import reader as dense
from planner.model.families.fields import FamilyReader, FamilySpec
from planner.model.families.gemma import reader as gemma
from planner.model.families.gpt_oss import reader as gpt_oss
from planner.model.families.llama4 import reader as llama4
from planner.model.families.moe import reader as moe
from planner.model.families.phi3 import reader as phi3
from planner.model.kinds import Family, NormPlacement

# every family, in the order messages list their model types
FAMILIES: tuple[FamilySpec, ...] = (dense.FAMILY, moe.FAMILY, deepseek.FAMILY, gpt_oss.FAMILY, phi3.FAMILY, gemma.FAMILY,
                                   llama4.FAMILY)

READERS: dict[str, FamilyReader] = {
    model_type: reader for family in FAMILIES for reader in family.readers for model_type in reader.model_types
}
HF_TYPES = tuple(READERS)


def _filled(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A family's defaults with what every family shares unless it says otherwise."""
    merged = dict(defaults)
    merged.setdefault("attention_sinks", False)
    merged.setdefault("norm_placement", NormPlacement.PRE)
    return merged


FAMILY_DEFAULTS: dict[Family, dict[str, Any]] = {
    name: _filled(defaults) for family in FAMILIES for name, defaults in family.defaults.items()
}
FAMILY_SECTIONS: dict[Family, tuple[str, ...]] = {
    name: sections for family in FAMILIES for name, sections in family.sections.items()
}
MOE_FAMILIES = frozenset(name for name, sections in FAMILY_SECTIONS.items() if "moe" in sections)
