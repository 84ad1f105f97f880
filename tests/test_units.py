import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cascadia.units import (UnitError, binary_unit, format_bytes, format_duration, format_flops, format_rate,
                            parse_bytes, parse_duration, parse_flops, parse_rate)


@pytest.mark.parametrize("text, expected", [
    ("64GB", 64 * 10**9), ("64 gb", 64 * 10**9), ("61.2GiB", 65712999629), ("512 MiB", 512 * 2**20),
    ("1.5kB", 1500), ("2TiB", 2 * 2**40), ("4096", 4096), (4096, 4096), ("0", 0), ("1e3 B", 1000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("1gbit", 125e6), ("1 Gbit/s", 125e6), ("10Gbps", 1.25e9), ("2.5 Gb/s", 312.5e6), ("100mbit", 12.5e6),
    ("120GB/s", 120e9), ("500 MiB/s", 500 * 2**20), ("1GBps", 1e9), (125e6, 125e6),
])
def test_parse_rate_tells_bits_from_bytes(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("100us", 1e-4), ("100 µs", 1e-4), ("1.5ms", 1.5e-3), ("2s", 2.0), ("250ns", 2.5e-7), (0.002, 0.002),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text, expected", [("30TFLOPS", 30e12), ("500 GFLOP/s", 5e11), ("6e13", 6e13)])
def test_parse_flops(text, expected):
    assert parse_flops(text) == expected


@pytest.mark.parametrize("parse, value, needle", [
    (parse_bytes, "-5GB", "must not be negative"),
    (parse_bytes, -1, "must not be negative"),
    (parse_bytes, "64 Gbit", "expected a size like '64GB'"),
    (parse_bytes, "64 furlongs", "expected a size"),
    (parse_bytes, True, "expected a size"),
    (parse_bytes, None, "expected a size"),
    (parse_bytes, [64], "expected a size"),
    (parse_bytes, math.nan, "expected a size"),
    (parse_bytes, "1e999999999GB", "too large"),
    (parse_bytes, 10**40, "too large"),
    (parse_rate, "120GBit", "expected a data rate"),
    (parse_rate, "1g", "expected a data rate"),
    (parse_duration, "5 min", "expected a duration"),
    (parse_duration, math.inf, "expected a duration"),
    (parse_flops, "30 TOPS", "expected a compute rate"),
])
def test_parse_rejects_with_a_reason(parse, value, needle):
    with pytest.raises(UnitError, match=needle):
        parse(value)


@pytest.mark.parametrize("text, expected", [
    (format_bytes(65712999629), "61.2 GiB"), (format_bytes(64 * 10**9), "64 GB"), (format_bytes(2 * 2**30), "2 GiB"),
    (format_bytes(0), "0 B"), (format_bytes(65712999629, digits=2), "61 GiB"),
    (format_rate(125e6, bits=True), "1 Gbit/s"), (format_rate(120e9), "120 GB/s"),
    (format_duration(1e-4), "100 us"), (format_duration(1 / 3, digits=3), "333 ms"),
    (format_flops(30e12), "30 TFLOP/s"),
])
def test_format_picks_the_natural_unit(text, expected):
    assert text == expected


def test_an_infinite_quantity_is_printed_bare():
    assert format_rate(math.inf, bits=True, digits=3) == "inf"


@pytest.mark.parametrize("n, unit", [
    (0, ("B", 1)), (1023, ("B", 1)), (1024, ("KiB", 2**10)), (-5 * 2**20, ("MiB", 2**20)),
    (61.2 * 2**30, ("GiB", 2**30)), (3 * 2**40, ("GiB", 2**30)),
])
def test_binary_unit_is_the_largest_reached_up_to_gib(n, unit):
    assert binary_unit(n) == unit


@given(st.integers(0, 2**60))
def test_bytes_round_trip(n):
    assert parse_bytes(format_bytes(n)) == n


@given(st.floats(1e-3, 1e15, allow_nan=False))
def test_rates_round_trip_in_both_families(x):
    assert parse_rate(format_rate(x)) == x
    assert parse_rate(format_rate(x, bits=True)) == x


@given(st.floats(1e-10, 1e5, allow_nan=False))
def test_durations_and_flops_round_trip(x):
    assert parse_duration(format_duration(x)) == x
    assert parse_flops(format_flops(x * 1e9)) == x * 1e9


@given(st.text(max_size=30) | st.integers() | st.floats() | st.booleans() | st.none())
def test_parsers_raise_only_unit_error(value):
    for parse in (parse_bytes, parse_rate, parse_duration, parse_flops):
        try:
            parse(value)
        except UnitError:
            pass
