"""The paper's deployment (specs/inkling-975b-11pc.yaml, analytic): its predictions pinned, so that work on the
simulator's speed cannot change what it predicts."""

from pathlib import Path

import pytest

from cascadia.graph.planner import plan
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec

PAPER_SPEC = Path(__file__).parent.parent / "specs" / "inkling-975b-11pc.yaml"

# The figures `cascadia simulate specs/inkling-975b-11pc.yaml` printed before the simulator was made faster:
# concurrency: (decode tok/s, phase tok/s, TTFT p50 s, TTFT p95 s, TPOT p50 s, TPOT p95 s, busy of pc10, wall s)
PINNED = {
    1: (4.262553168729414, 3.447972717117919, 7.328913816919531, 7.328913816919531, 0.23460117925005988,
        0.23460117925005988, 0.12399839053178895, 37.123263581677136),
    8: (32.2286666568543, 26.355314749335378, 7.655079143410205, 7.948627937252189, 0.2448179629174535,
        0.24637334998315855, 0.9478081408973459, 38.853643363368406),
    15: (34.81191606618338, 30.57418481239896, 8.727765839435335, 16.398084417722163, 0.4110851066260618,
         0.4140223056485996, 0.9307531193523793, 62.798076605508356),
    66: (56.729458729061676, 54.21314809862164, 32.13367193179772, 60.072802093955545, 0.9057110371498733,
         0.9847546691366535, 0.9947287832990209, 155.8293568311483),
    176: (66.59390376871343, 65.54138169748826, 91.67276701483752, 208.301724625396, 1.6585029191171472,
          1.7417875680360868, 0.9976102465135083, 343.7217741911495),
}
PINNED_FINISH_SUM = 4202151.792323908  # every request's t_finish (s), both phases of all 15 levels, added up


@pytest.fixture(scope="module")
def paper_result():
    spec = load_spec(PAPER_SPEC)
    return simulate(spec, analytic_calibration(spec), plan(spec))


def test_paper_spec_predictions_are_pinned(paper_result):
    levels = {level["concurrency"]: level for level in paper_result["levels"]}
    for concurrency, pinned in PINNED.items():
        level = levels[concurrency]
        figures = (level["decode_tokens_per_s"], level["phase_tokens_per_s"], level["ttft_s"]["p50"],
                   level["ttft_s"]["p95"], level["tpot_s"]["p50"], level["tpot_s"]["p95"], level["busy"]["pc10"],
                   level["wall_s"])
        assert figures == pytest.approx(pinned, rel=1e-9, abs=0), f"concurrency {concurrency}"
    assert len(paper_result["requests"]) == 1732 and paper_result["warnings"] == []
    assert sum(r["t_finish"] for r in paper_result["requests"]) == pytest.approx(PINNED_FINISH_SUM, rel=1e-9, abs=0)
