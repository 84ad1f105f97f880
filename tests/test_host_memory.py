"""The memory this machine can still give, as the checks before loading read it."""

import re

import pytest

from cascadia.host_memory import MEMINFO, available_bytes, shortfall


@pytest.mark.skipif(not MEMINFO.is_file(), reason="needs Linux's /proc/meminfo")
def test_available_memory_is_read_and_within_the_machines_total():
    total = int(re.search(r"MemTotal:\s+(\d+) kB", MEMINFO.read_text()).group(1)) * 1024
    have, source = available_bytes()
    assert 0 < have <= total and source
    assert shortfall(have // 2) is None
    assert shortfall(total * 1000).startswith("but this machine has ") and f"({source})" in shortfall(total * 1000)
