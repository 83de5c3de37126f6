"""Byte sizes: parsing what users type (SI vs IEC units) and printing what we computed."""

from __future__ import annotations

import pytest

from hardware.errors import ConfigError
from hardware.units import format_bytes, format_count, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("80gb", 80 * 10**9),
        ("80 GiB", 80 * 2**30),
        ("  80GB  ", 80 * 10**9),
        ("1.5TB", 1_500_000_000_000),
        ("1.5KiB", 1536),
        ("512MiB", 512 * 2**20),
        ("1KB", 1000),
        ("1MB", 10**6),
        ("2TiB", 2 * 2**40),
        ("1PB", 10**15),
        ("100B", 100),
        ("85899345920", 85_899_345_920),
        (" 1024 ", 1024),
        ("1e3", 1000),
        (1024, 1024),
        (85_899_345_920, 85_899_345_920),
        (2.0, 2),
    ],
)
def test_parse_bytes(text: str | float, expected: int) -> None:
    result = parse_bytes(text)
    assert result == expected
    assert type(result) is int


def test_si_and_iec_differ() -> None:
    # 80 GiB is 7.4% more than 80 GB: confusing them misplans by gigabytes
    assert parse_bytes("80GiB") - parse_bytes("80GB") == 80 * (2**30 - 10**9)


@pytest.mark.parametrize(
    "value",
    ["", "   ", "abc", "80XB", "80 G", "80k", "GB", "-5GB", "-1", "0", "0GB", 0, -1, "1.5", "0.5B", 1.5, True, False, None],
)
def test_parse_bytes_rejects(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes(value, field="--hbm")  # type: ignore[arg-type]
    message = str(info.value)
    assert "--hbm" in message
    assert "\n" not in message


def test_parse_bytes_default_field_name() -> None:
    with pytest.raises(ConfigError, match="^size:"):
        parse_bytes("80XB")


@pytest.mark.parametrize("value", ["1e400", "1e400GB", float("inf")])
def test_parse_bytes_overflow_is_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match="--hbm"):
        parse_bytes(value, field="--hbm")  # type: ignore[arg-type]


def test_parse_bytes_nan_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--hbm"):
        parse_bytes(float("nan"), field="--hbm")


@pytest.mark.parametrize(
    ("n_bytes", "binary", "expected"),
    [
        (0, False, "0 B"),
        (999, False, "999 B"),
        (1000, False, "1.0 KB"),
        (80e9, False, "80.0 GB"),
        (1.5e12, False, "1.5 TB"),
        (1023, True, "1023 B"),
        (1024, True, "1.0 KiB"),
        (80 * 2**30, True, "80.0 GiB"),
        (80 * 2**30, False, "85.9 GB"),
        (5e18, False, "5000.0 PB"),
    ],
)
def test_format_bytes(n_bytes: float, binary: bool, expected: str) -> None:
    assert format_bytes(n_bytes, binary=binary) == expected


@pytest.mark.parametrize("text", ["80GB", "1.5TB", "512MB", "3KB"])
def test_format_parse_round_trip(text: str) -> None:
    assert format_bytes(parse_bytes(text)).replace(" ", "").replace(".0", "") == text.replace(".0", "")


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, "0"),
        (999, "999"),
        (1000, "1.0K"),
        (6700, "6.7K"),
        (124_439_808, "124.4M"),
        (6_738_415_616, "6.74B"),
        (8.03e9, "8.03B"),
        (1.5e12, "1.50T"),
    ],
)
def test_format_count(count: float, expected: str) -> None:
    assert format_count(count) == expected


@pytest.mark.parametrize("value", [2**53 + 1, str(2**53 + 1)])
def test_parse_bytes_large_integers_are_exact(value: int | str) -> None:
    assert parse_bytes(value) == 2**53 + 1
