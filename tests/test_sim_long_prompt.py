"""One stream at a long prompt on the paper's deployment (analytic): a grid that reaches the prompt, and first-token
and decode times that are finite and grow with the context. Fast: a few thousand simulated frames."""

import math
from pathlib import Path

import pytest

from cascadia.models.base import LayerKind
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.long_prompt import one_stream, simulate_long_prompt
from cascadia.spec.load import load_spec

PAPER_SPEC = Path(__file__).parent.parent / "specs" / "inkling-975b-11pc.yaml"


@pytest.fixture(scope="module")
def paper():
    return load_spec(PAPER_SPEC)


def test_one_stream_holds_the_prompt_and_raises_the_model_limit_only_when_needed(paper):
    alone, notes = one_stream(paper, 4096, 8)
    assert (alone.runtime.max_streams, alone.runtime.context_budget) == (1, 4104) and notes == []
    assert alone.workload.concurrency == (1,) and alone.workload.requests == 1
    assert (alone.workload.prompt_tokens.low, alone.workload.prompt_tokens.high) == (4096, 4096)
    longest, notes = one_stream(paper, 524288, 8)
    assert longest.model.config.max_position_embeddings == 524296
    assert notes == ["max_position_embeddings raised from 131,072 to 524,296"]


def test_the_analytic_grid_reaches_the_budget_and_reads_a_lone_stream_kv_once(paper):
    alone, _ = one_stream(paper, 65536, 8)
    calibration = analytic_calibration(alone)
    table = calibration.nodes["pc1"].tables[LayerKind.GLOBAL]
    assert table.points[-1] == 65544 and table.lookup(8, 65544)[1] is False
    assert calibration.nodes["pc1"].tables[LayerKind.SLIDING].points[-1] == paper.model.config.sliding_window_size
    # 32k more positions: a window of 8 rows of one stream reads them once, as 2 rows do (a table row is one stream's
    # rows; the simulator charges rows of distinct streams each their own)

    def growth(rows):
        return table.lookup(rows, 65536)[0] - table.lookup(rows, 32768)[0]

    assert growth(8) == pytest.approx(growth(2)) and growth(2) > 0


def test_first_token_and_decode_times_grow_with_the_prompt(paper):
    short, long = (simulate_long_prompt(paper, None, n) for n in (2048, 16384))
    for predicted in (short, long):
        assert math.isfinite(predicted.ttft_s) and math.isfinite(predicted.decode_s) and predicted.notes == ()
    assert long.ttft_s > 8 * short.ttft_s  # every window attends more keys than the last
    assert long.decode_s > short.decode_s
