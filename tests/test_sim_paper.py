"""The paper's deployment (specs/inkling-975b-11pc.yaml, analytic): its predictions pinned, so that work on the
simulator's speed cannot change what it predicts, and the simulator's work per request bounded, in counts that no
other load on the machine can change (never its time)."""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import attrs
import pytest

from cascadia.driver import Served, serve_workload
from cascadia.graph.planner import plan
from cascadia.policy import Policy
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.model import PipelineModel
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec
from cascadia.spec.types import Spec

PAPER_SPEC = Path(__file__).parent.parent / "specs" / "inkling-975b-11pc.yaml"

# The figures `cascadia simulate specs/inkling-975b-11pc.yaml` printed before the simulator was made faster, as changed
# since by the model alone (the head charged at a frame's sampled rows, not its padded ones: TTFT 1-9% less; a table
# row read as one stream's rows, each further stream of a frame adding its own keys, padding rows none: within 1%; a
# frame's rows 12 bytes longer on the wire, for top-k and min-p, and 4 more for log-probabilities: within 1e-5):
# concurrency: (decode tok/s, phase tok/s, TTFT p50 s, TTFT p95 s, TPOT p50 s, TPOT p95 s, busy of pc10, wall s)
PINNED = {
    1: (4.2818273935865845, 3.468642475050552, 7.241811367436014, 7.241811367436014, 0.2335451451167373,
        0.2335451451167373, 0.12241870078341104, 36.90204479726165),
    8: (32.33139327270811, 26.482956800407244, 7.566723582390523, 7.859144575852548, 0.2440430929116772,
        0.2455931571321854, 0.9346622454543484, 38.666377312681846),
    15: (34.897012544496924, 31.037989646280476, 7.9203008904505054, 15.554582440628508, 0.41014750959207485,
         0.41307146540442746, 0.9300984921948116, 61.85967654094145),
    66: (56.93890835068283, 54.686377293046974, 31.223822342285416, 59.06229969230884, 0.9026154366501271,
         0.9816953995195936, 0.9946817855755792, 154.48088570083632),
    176: (66.83472096723757, 65.92774545333087, 90.57051788105923, 206.75128359392352, 1.6527405070240855,
          1.7364560231244905, 0.9975957137028663, 341.70742295362106),
}
PINNED_FINISH_SUM = 4163690.4075438697  # every request's t_finish (s), both phases of all 15 levels, added up

T = TypeVar("T")


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


def python_calls(run: Callable[[], T]) -> tuple[T, int]:
    """What `run()` returns, and how many Python functions and built-ins it called: a measure of the work it did that
    no other load on the machine can change, unlike its time."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        value = run()
    finally:
        sys.setprofile(None)
    return value, calls


def paper_simulator(concurrency: tuple[int, ...]) -> tuple[Spec, PipelineModel, Policy]:
    """The paper spec with levels at `concurrency`, and the simulator's model and policy for its plan."""
    spec = load_spec(PAPER_SPEC)
    spec = attrs.evolve(spec, workload=attrs.evolve(spec.workload, concurrency=concurrency))
    the_plan = plan(spec)
    policy = Policy.for_runtime(spec.runtime, len(the_plan.stages), the_plan.kv_pools)
    return spec, PipelineModel(spec, the_plan, analytic_calibration(spec)), policy


def serve_phases(spec: Spec, model: PipelineModel, policy: Policy,
                 run: Callable[[Callable[[], T]], T] = lambda serve: serve()) -> Served:
    """The spec's workload through the simulator, as `simulate` serves it; each phase is served by run(serve)."""
    return serve_workload(spec, spec.workload, None, lambda level, phase, recorder: run(
        lambda: model.run_phase(policy, level.arrivals(phase), phase.streams, recorder)), Served())


def test_a_frame_on_hosts_of_their_own_is_one_simpy_event():
    """No process per frame (three events each before the simulator was made faster), only its landing's timeout."""
    spec, model, policy = paper_simulator((1, 15))
    frames = events = 0
    next_frame, step = policy.next_frame, model.env.step

    def counted_next_frame(group: int):
        nonlocal frames
        frame = next_frame(group)
        frames += frame is not None
        return frame

    def counted_step() -> None:
        nonlocal events
        events += 1
        step()

    policy.next_frame, model.env.step = counted_next_frame, counted_step
    served = serve_phases(spec, model, policy)
    assert len(served.records) == 32 and frames > 32 * (128 + 64 // 8) / 2
    assert frames < events <= frames + 2 * 4  # and at most two per phase: its end, and SimPy's own resuming


def test_python_calls_per_simulated_request_stay_few():
    """The speed check of the simulator: 13,111 calls per simulated request before it was made faster, 4,308 after
    (Python 3.11, concurrency 8 and 44), 4,625 once speculation had landed, 3,591 after a second round; a ceiling a
    tenth above, which a return of what was removed would cross."""
    spec, model, policy = paper_simulator((8, 44))
    calls = 0

    def counted(serve: Callable[[], T]) -> T:
        nonlocal calls
        busy, phase_calls = python_calls(serve)
        calls += phase_calls
        return busy

    served = serve_phases(spec, model, policy, counted)
    assert len(served.records) == 104 and calls / len(served.records) < 3950
