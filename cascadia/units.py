"""Quantities with units, as written in specs and printed in reports: sizes, rates, durations, compute.

Parsing is exact (decimal arithmetic, then one rounding) and formatting, by default, writes the shortest text that
parses back to the same value, so a spec printed by `cascadia spec show` loads to the same spec. A bare number is in
base units: bytes, bytes/s, seconds, FLOP/s.

    parse_bytes("61.2GiB") == 65712999629        parse_rate("1gbit") == 125e6 (bytes/s)
    parse_duration("100us") == 1e-4              parse_flops("30 TFLOPS") == 30e12
    format_bytes(65712999629) == "61.2 GiB"      format_rate(125e6, bits=True) == "1 Gbit/s"
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, DecimalException

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_PREFIXES = {**_DECIMAL, **_BINARY}
_NUMBER = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*")
_LARGEST = Decimal(10) ** 30  # beyond any real size, rate or FLOP count: a typo, and a guard against huge ints


class UnitError(ValueError):
    """A quantity that cannot be read: the message says what was expected."""


# Unit tables: the unit as written (after `_key`) -> its factor to base units; "" is a bare number.
# Sizes are bytes whatever the case: "64gb" = "64GB".
_SIZE_UNITS = {"": 1, **{p + "b": f for p, f in _PREFIXES.items()}}
_RATE_UNITS = {  # capital B is bytes, lowercase b or "bit" is bits (so "Gb/s" is gigabits, as on a NIC's box)
    "": 1,
    **{p + form: Decimal(f) / 8 for p, f in _PREFIXES.items() for form in ("bit", "bit/s", "bits/s", "bps", "b/s")},
    **{p + form: Decimal(f) for p, f in _PREFIXES.items() for form in ("B/s", "Bps")},
}
_TIME_UNITS = {"ns": Decimal("1e-9"), "us": Decimal("1e-6"), "µs": Decimal("1e-6"), "μs": Decimal("1e-6"),
               "ms": Decimal("1e-3"), "s": 1, "": 1}
_FLOP_UNITS = {"": 1, **{p + form: f for p, f in _DECIMAL.items() for form in ("flops", "flop/s")}}


def _key(unit: str, case_matters: str = "") -> str:
    """Lowercase a unit except the letters whose case carries meaning."""
    return "".join(c if c in case_matters else c.lower() for c in unit)


def _parse(value: object, units: dict[str, Decimal | int], what: str, example: str, case_matters: str = "") -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UnitError(f"expected {what} like {example!r}, got {value!r}")
    if isinstance(value, str):
        match = _NUMBER.fullmatch(value)
        factor = units.get(_key(match.group(2), case_matters)) if match else None
        if factor is None:
            raise UnitError(f"expected {what} like {example!r}, got {value!r}")
        try:
            quantity = Decimal(match.group(1)) * factor
        except DecimalException:
            raise UnitError(f"{value!r} is too large for {what}") from None
    elif math.isfinite(value):
        quantity = Decimal(value)
    else:
        raise UnitError(f"expected {what} like {example!r}, got {value!r}")
    if quantity < 0:
        raise UnitError(f"{what} must not be negative, got {value!r}")
    if quantity > _LARGEST:
        raise UnitError(f"{value!r} is too large for {what}")
    return quantity


def parse_bytes(value: object) -> int:
    """A size in bytes: 4096, "64GB", "61.2GiB", "512 MiB" (rounded to a whole byte)."""
    return round(_parse(value, _SIZE_UNITS, "a size", "64GB"))


def parse_rate(value: object) -> float:
    """A data rate in bytes/s: "1gbit", "2.5 Gbit/s", "10Gbps" (bits) or "120GB/s", "500 MiB/s" (bytes)."""
    return float(_parse(value, _RATE_UNITS, "a data rate", "1gbit", case_matters="B"))


def parse_duration(value: object) -> float:
    """A duration in seconds: 0.002, "100us", "1.5 ms", "2s"."""
    return float(_parse(value, _TIME_UNITS, "a duration", "100us"))


def parse_flops(value: object) -> float:
    """A compute rate in FLOP/s: 6e13, "30 TFLOPS", "500GFLOP/s"."""
    return float(_parse(value, _FLOP_UNITS, "a compute rate", "30TFLOPS"))


def _significant(x: Decimal, digits: int) -> str:
    """`x` rounded to `digits` significant digits, in plain notation without trailing zeros: "61.2", "100"."""
    rounded = x.quantize(Decimal(1).scaleb(x.adjusted() - digits + 1)) if x else x
    return f"{rounded.normalize():f}"


def _reads_back(parse, text: str, value: float) -> bool:
    try:
        return parse(text) == value
    except UnitError:  # beyond the range parsing accepts: printed as a bare number instead
        return False


def _format(value: float, families: list[list[tuple[str, int | Decimal]]], parse, digits: int | None) -> str:
    """The value in the largest unit it reaches, in whichever family of units reads shortest.

    With `digits` None the text is the shortest that `parse` reads back as exactly `value`; else it is rounded to
    `digits` significant digits (for tables), in the unit the exact text would use.
    """
    if not math.isfinite(value):  # a link too fast to measure has an infinite bandwidth: no unit fits
        return repr(value)
    best = None
    exact = Decimal(value)
    for family in families:
        name, factor = next(((n, f) for n, f in reversed(family) if exact >= f), family[0])
        scaled = exact / factor
        texts = (f"{_significant(scaled, shown)} {name}" for shown in range(1, 18))
        text = next((t for t in texts if _reads_back(parse, t, value)), None)
        if text is not None and (best is None or len(text) < len(best[0])):
            best = text, scaled, name
    if best is None:
        return repr(value)
    text, scaled, name = best
    return text if digits is None else f"{_significant(scaled, digits)} {name}"


_BYTE_FAMILIES = [[("B", 1), ("kB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12), ("PB", 10**15)],
                  [("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40), ("PiB", 2**50)]]
_BYTE_RATE = [[(n + "/s", f) for n, f in _BYTE_FAMILIES[0]]]
_BIT_RATE = [[("bit/s", Decimal(1) / 8)] + [(p + "bit/s", Decimal(f) / 8) for p, f in
                                            (("k", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12))]]
_TIME = [[("ns", Decimal("1e-9")), ("us", Decimal("1e-6")), ("ms", Decimal("1e-3")), ("s", 1)]]
_FLOPS = [[(p + "FLOP/s", f) for p, f in (("", 1), ("k", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12),
                                           ("P", 10**15))]]
_BINARY_UP_TO_GIB = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def binary_unit(n: float) -> tuple[str, int]:
    """The largest of B, KiB, MiB and GiB that `n` bytes reach (by magnitude), and its size in bytes: for sizes shown
    in one unit with fixed decimals (a plan's columns, the planner's messages). GiB at most, the unit nodes' memories
    are compared in: 1.5 TiB is "1536.00 GiB"."""
    return next(((name, size) for name, size in _BINARY_UP_TO_GIB if abs(n) >= size), ("B", 1))


def format_bytes(n: int, digits: int | None = None) -> str:
    """"61.2 GiB", "64 GB", "512 B": decimal or binary units, whichever is shorter."""
    return _format(n, _BYTE_FAMILIES, parse_bytes, digits)


def format_rate(bytes_per_s: float, bits: bool = False, digits: int | None = None) -> str:
    """"120 GB/s", or with `bits` (network links) "1 Gbit/s"."""
    return _format(bytes_per_s, _BIT_RATE if bits else _BYTE_RATE, parse_rate, digits)


def format_duration(seconds: float, digits: int | None = None) -> str:
    """"100 us", "4.5 ms", "2 s"."""
    return _format(seconds, _TIME, parse_duration, digits)


def format_flops(flops: float, digits: int | None = None) -> str:
    """"30 TFLOP/s"."""
    return _format(flops, _FLOPS, parse_flops, digits)
