"""The engine's choice of MoE path per call size: the crossover rule, what each `runtime.moe_grouped_from` builds (the
grouped graph alone when it runs every call), and that a layer's calls run the path the choice names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock
from cascadia.engine.engine import Engine
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.moe_choice import MARGIN, crossover
from cascadia.spec.types import RuntimeSpec

FIXTURES = Path(__file__).parent / "fixtures"
BUCKETS = (1, 2, 8)


def moe_layers(engine: Engine):
    return [layer for layer in engine.stage.layers if layer.router is not None]


def engine_with(moe_grouped_from) -> Engine:
    runtime = RuntimeSpec(precision="f32", row_buckets=BUCKETS, moe_grouped_from=moe_grouped_from)
    return Engine(Checkpoint.open(FIXTURES / "base"), runtime)


@pytest.mark.parametrize("seconds, expected", [
    ({1: (1.0, 2.0), 8: (2.0, 1.5), 32: (4.0, 2.0)}, 8),
    ({1: (1.0, 0.5), 8: (2.0, 1.0)}, 1),
    ({1: (1.0, 2.0), 8: (2.0, 3.0)}, None),
    ({1: (1.0, 0.5), 8: (2.0, 3.0), 32: (4.0, 1.0)}, 32),  # a win below a loss does not count
    ({1: (1.0, 2.0), 32: (1.0, 1.0 - MARGIN / 2)}, None),  # within the margin: a tie stays fused
])
def test_crossover_is_where_grouped_wins_from_there_up(seconds, expected):
    assert crossover(seconds) == expected


def test_never_builds_no_grouped_block():
    engine = engine_with("never")
    assert engine.stage.moe_grouped_from is None
    assert all(layer.grouped is None and not layer.runs_grouped(8) for layer in moe_layers(engine))


def test_a_row_count_above_the_largest_bucket_builds_no_grouped_block():
    engine = engine_with(16)
    assert engine.stage.moe_grouped_from is None and all(layer.grouped is None for layer in moe_layers(engine))


def test_a_row_count_at_the_smallest_bucket_builds_the_grouped_block_alone():
    engine = engine_with(BUCKETS[0])
    for layer in moe_layers(engine):
        assert layer.mlp is None and layer.grouped in layer.blocks()
        assert all(layer.runs_grouped(b) for b in BUCKETS)
    assert engine.stage.moe_grouped_from == BUCKETS[0]


def test_a_row_count_sends_calls_of_that_many_rows_and_more_to_the_grouped_block(monkeypatch):
    engine = engine_with(2)
    layer = moe_layers(engine)[0]
    assert [layer.runs_grouped(b) for b in BUCKETS] == [False, True, True]
    calls = []
    for cls, name in ((CompiledBlock, "mlp"), (GroupedBlock, "grouped")):
        call = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda self, *inputs, call=call, name=name, **options:
                            calls.append(name) or call(self, *inputs, **options))
    h = np.random.default_rng(0).standard_normal((2, engine.config.hidden_size), dtype=np.float32)
    both = [layer.feed_forward(h[:1], bucket=1), layer.feed_forward(h[:1], bucket=2), layer.feed_forward(h)]
    assert calls == ["mlp", "grouped", "grouped"]
    np.testing.assert_allclose(both[0], both[1], rtol=0, atol=1e-5 * np.abs(both[0]).max())  # same experts


def test_auto_settles_one_choice_for_every_moe_layer():
    engine = engine_with("auto")
    chosen = engine.stage.moe_grouped_from
    assert chosen is None or chosen in BUCKETS
    for layer in moe_layers(engine):
        assert (layer.grouped is None) == (chosen is None) and layer.grouped_from == chosen
