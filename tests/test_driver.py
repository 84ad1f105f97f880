import attrs
from sim_specs import tiny_spec

from cascadia.driver import PhaseDriver, Served, serve_workload
from cascadia.metrics import Recorder
from cascadia.policy import PREFILL, Finished, Policy, Request
from cascadia.workload import ClosedLoop

TOKEN = 7


def policy(n_groups: int = 2, context_budget: int = 64) -> Policy:
    return Policy(n_groups, max_streams=2, prefill_window=8, row_buckets=(1, 2, 4, 8), context_budget=context_budget)


def complete(driver: PhaseDriver, frame, now: float):
    return driver.complete(frame, [TOKEN] * len(frame.sampled_ids), now)


def test_follow_ups_are_sent_as_clients_finish_and_frames_come_for_idle_groups():
    requests = [Request(i, (1, 2, 3), max_new_tokens=2) for i in range(3)]
    recorder = Recorder(level=2, phase="measured")
    arrived, events = [], []
    driver = PhaseDriver(policy(), ClosedLoop([(r,) for r in requests], 2), len(requests), recorder,
                         on_arrived=lambda r: arrived.append((r.id, recorder.level)), on_events=events.extend)

    g0, g1 = driver.start(now=0.0)  # two clients: requests 0 and 1, one per group, prompt rows first
    assert arrived == [(0, 2), (1, 2)]
    assert [(f.group, f.sampled_ids, f.rows[0].kind) for f in (g0, g1)] == [(0, (0,), PREFILL), (1, (1,), PREFILL)]
    [g0] = complete(driver, g0, 1.0)  # request 0's first token; group 1 is still in flight, so no frame for it
    assert g0.group == 0 and g0.sampled_ids == (0,)
    [g1] = complete(driver, g1, 1.5)
    [g0] = complete(driver, g0, 2.0)  # request 0 finishes: its client sends request 2 at once, to the idle group 0
    assert arrived[-1] == (2, 2) and g0.sampled_ids == (2,) and g0.rows[0].kind == PREFILL
    assert complete(driver, g1, 2.5) == []  # request 1 finishes, nothing left to send; group 0 is in flight
    assert not driver.done
    [g0] = complete(driver, g0, 3.0)
    assert not driver.done
    assert complete(driver, g0, 4.0) == []
    assert driver.done

    records = recorder.records
    assert [(r.request_id, r.t_arrival, r.token_times) for r in records] == [
        (0, 0.0, (1.0, 2.0)), (1, 0.0, (1.5, 2.5)), (2, 2.0, (3.0, 4.0))]
    assert [e.request_id for e in events if isinstance(e, Finished)] == [0, 1, 2]


def test_a_rejected_request_lets_its_client_send_the_next_at_once():
    requests = [Request(0, (1,) * 10, max_new_tokens=1), Request(1, (1,), max_new_tokens=1)]
    recorder = Recorder(level=1, phase="warmup")
    driver = PhaseDriver(policy(context_budget=8), ClosedLoop([(r,) for r in requests], 1), len(requests), recorder)

    [frame] = driver.start(now=0.0)
    assert [r.request_id for r in recorder.rejected] == [0]
    assert frame.sampled_ids == (1,)
    assert not driver.done  # one of two requests is done
    assert complete(driver, frame, 1.0) == []
    assert driver.done
    assert [(r.request_id, r.t_arrival, r.t_finish) for r in recorder.records] == [(1, 0.0, 1.0)]


def test_a_phase_of_only_rejected_requests_is_done_at_the_start():
    requests = [Request(i, (1,) * 10, max_new_tokens=1) for i in range(3)]
    driver = PhaseDriver(policy(context_budget=8), ClosedLoop([(r,) for r in requests], 2), len(requests),
                         Recorder(level=2, phase="warmup"))
    assert driver.start(now=0.0) == []
    assert driver.done


def test_requests_stop_at_eos_only_when_the_workload_says_so():
    """`workload.stop_at_eos`: a request also ends when it samples the model's EOS; by default it makes all its
    output tokens (benchmarks keep their lengths)."""
    spec = tiny_spec()
    seen: dict[bool, set] = {}

    def run_phase(level, phase, recorder):
        seen[stop] = {request.stop_ids for [request] in phase.requests}
        return {}

    for stop in (False, True):
        workload = attrs.evolve(spec.workload, stop_at_eos=stop)
        served = serve_workload(spec, workload, None, run_phase, Served())
        assert len(served.levels) == len(workload.concurrency)
    assert seen == {False: {frozenset()}, True: {spec.model.config.eos_ids}} and spec.model.config.eos_ids


def test_a_stop_token_finishes_a_stream_early():
    requests = [Request(0, (1, 2), max_new_tokens=5, stop_ids={TOKEN})]
    driver = PhaseDriver(policy(), ClosedLoop([(r,) for r in requests], 1), 1,
                         recorder := Recorder(level=1, phase="measured"))
    [frame] = driver.start(now=0.0)
    assert complete(driver, frame, 1.0) == [] and driver.done
    [record] = recorder.records
    assert record.output_tokens == 1
