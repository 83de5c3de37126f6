"""The memory a plan may use per GPU: ``--hbm`` read against the device's usable memory, less the
``--headroom`` kept free.

A device's usable memory is its profile's ``hbm_bytes`` (the driver-reported total, named by
``hbm_source``): an "80GB" H100 reports 81559 MiB, 79.6 GiB. A cap of the size the device is sold
as (``marketed_hbm_gb``, read as GB or GiB: ``--hbm 80GiB`` on that H100) means the whole device;
any other cap above its memory is refused, with the devices that do have that much.
"""

from __future__ import annotations

import re

from hardware.profile import HardwareProfile
from hardware.registry import bundled_names, load_hardware
from hardware.units import format_bytes, parse_bytes
from planner.errors import ConfigError

_FRACTION = re.compile(r"^\s*(0?\.[0-9]+|0|[0-9]+(?:\.[0-9]+)?\s*%)\s*$")


def hbm_cap(hardware: HardwareProfile, hbm: str | int | None) -> int:
    """The memory cap: ``--hbm`` if given (``80GB``, ``80GiB``, bytes), else the device's memory.

    A cap above the device's memory is refused (no plan can use memory the device lacks), unless
    it is the size the device is sold as: then it is the whole device."""
    if hbm is None:
        return hardware.hbm_bytes
    cap = parse_bytes(hbm, "--hbm")
    usable = hardware.usable_cap_bytes(cap)
    if usable is None:
        raise ConfigError(_too_large(hardware, hbm, cap))
    return usable


def _too_large(hardware: HardwareProfile, hbm: str | int, cap: int) -> str:
    """One line: the cap, what the device really has and where that figure comes from, the
    devices that have more."""
    larger = sorted((other for other in map(load_hardware, bundled_names())
                     if other.kind == hardware.kind and _more_memory(other, hardware)
                     and other.usable_cap_bytes(cap) is not None), key=lambda other: other.hbm_bytes)
    names = " or ".join(other.name for other in larger)
    other = f"--hardware {names}" if names else "no bundled profile has that much; a profile YAML"
    source = f"; {hardware.hbm_source}" if hardware.hbm_source else ""
    return (f"--hbm: {hbm} ({format_bytes(cap)}) is more than the {format_bytes(hardware.hbm_bytes)} "
            f"({format_bytes(hardware.hbm_bytes, binary=True)}{source}) of one {hardware.name}{_whole(hardware)}; "
            f"give a cap of at most that, or a device with more memory ({other})")


def _more_memory(other: HardwareProfile, hardware: HardwareProfile) -> bool:
    """``other`` has more memory than ``hardware``: more usable bytes, and not a card sold as the
    same size (an A100 80GB reports 80 GiB where an H100 80GB reports 79.6: the same 80 GB class)."""
    if other.marketed_hbm_gb is not None and hardware.marketed_hbm_gb is not None:
        if other.marketed_hbm_gb <= hardware.marketed_hbm_gb:
            return False
    return other.hbm_bytes > hardware.hbm_bytes


def _whole(hardware: HardwareProfile) -> str:
    """``; it is sold as 80 GB: --hbm 80GiB means the whole device`` (the readings of its marketed
    size that are the whole device, not a cap below it)."""
    if hardware.marketed_hbm_gb is None:
        return ""
    gb = hardware.marketed_hbm_gb
    whole = [f"{gb:g}{unit}" for unit, scale in (("GB", 10**9), ("GiB", 2**30))
             if hardware.usable_cap_bytes(round(gb * scale)) == hardware.hbm_bytes]
    return f"; it is sold as {gb:g} GB: --hbm {' or '.join(whole)} means the whole device" if whole else ""


def headroom_bytes(cap_bytes: int, headroom: str | int | float | None) -> int:
    """``--headroom``: bytes of the cap kept free, given as a fraction of it (``0.05``, ``5%``)
    or as a size (``2GB``, ``2GiB``, bytes); None or 0 keeps none. It must leave some of the cap."""
    if headroom is None:
        return 0
    if isinstance(headroom, bool):
        raise ConfigError(f"--headroom: expected a fraction or a size, got {headroom!r}")
    text = str(headroom)
    match = _FRACTION.match(text)
    if match is not None:
        value = match.group(1)
        fraction = float(value.rstrip("% ")) / 100 if value.endswith("%") else float(value)
        if fraction >= 1:
            raise ConfigError(f"--headroom: {text} would keep the whole cap free; give a fraction below 1 "
                              "(0.05 or 5%) or a size like 2GB")
        return int(cap_bytes * fraction)
    try:
        kept = parse_bytes(headroom, "--headroom")
    except ConfigError:
        raise ConfigError(f"--headroom: {text!r} is neither a fraction of the cap below 1 (0.05 or 5%) nor a size "
                          "(2GB, 2GiB or bytes)") from None
    if kept >= cap_bytes:
        raise ConfigError(f"--headroom: {text} ({format_bytes(kept)}) leaves nothing of the {format_bytes(cap_bytes)} "
                          "cap to plan in; give less, or a fraction like 0.05")
    return kept
