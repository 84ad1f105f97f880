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
# frame's rows 12 bytes longer on the wire, for top-k and min-p, and 4 more for log-probabilities: within 1e-5; the
# header 8 bytes longer, counting its buffers' bytes: within 1e-5):
# concurrency: (decode tok/s, phase tok/s, TTFT p50 s, TTFT p95 s, TPOT p50 s, TPOT p95 s, busy of pc10, wall s)
PINNED = {
    1: (4.281814486458067, 3.4686335416997607, 7.241816999435855, 7.241816999435855, 0.23354584911669155,
        0.23354584911669155, 0.12241838549891418, 36.90213983725568),
    8: (32.33139327270811, 26.48295294299898, 7.566729214390989, 7.859150207853014, 0.2440430929116772,
        0.2455931571321854, 0.9346621093149478, 38.66638294468231),
    15: (34.897006243893074, 31.037984347818508, 7.920301594450564, 15.554588072628974, 0.41014754839522816,
         0.4130715042075807, 0.9300983334186942, 61.85968710094238),
    66: (56.93890835068283, 54.6863770438303, 31.223823046285474, 59.0623003963089, 0.9026154366501271,
         0.9816953995195936, 0.9946817810426168, 154.48088640483638),
    176: (66.83472096723757, 65.92774531750423, 90.57051858505702, 206.75128429792107, 1.6527405070240873,
          1.7364560231244943, 0.9975957116475848, 341.7074236576186),
}
PINNED_FINISH_SUM = 4163691.4643323445  # every request's t_finish (s), both phases of all 15 levels, added up

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
