"""Hardware profiles (cited YAML data), byte parsing and the roofline op-time model.

Imports nothing else of roofplan's: it is the bottom of the one-way dependency flow.
"""

from hardware.dtypes import ComputePrecision, DType
from hardware.errors import ConfigError, PlannerError, UnknownHardwareError
from hardware.profile import DeviceKind, HardwareProfile, Source
from hardware.registry import DEFAULT_HARDWARE, bundled_names, load_hardware
from hardware.roofline import Bound, OpTime, op_time
from hardware.units import format_bytes, format_count, parse_bytes

__all__ = [
    "DEFAULT_HARDWARE",
    "Bound",
    "ComputePrecision",
    "ConfigError",
    "DType",
    "DeviceKind",
    "HardwareProfile",
    "OpTime",
    "PlannerError",
    "Source",
    "UnknownHardwareError",
    "bundled_names",
    "format_bytes",
    "format_count",
    "load_hardware",
    "op_time",
    "parse_bytes",
]
