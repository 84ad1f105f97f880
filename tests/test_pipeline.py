"""The distributed pipeline end to end: real node processes on 127.0.0.1 serving the tiny model of
specs/tiny-local.yaml (3 stages), checked against the single-process engine, and its failures."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import numpy as np
import pytest
import zmq
from click.testing import CliRunner
from serving import processes_naming

from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.errors import CheckpointError, NodeError, RequestError
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.coordinator import PipelineError
from cascadia.pipeline.emulated_links import EmulatedLinks, LinkEmulationError, made_here, namespaces
from cascadia.pipeline.launch import LocalNodes
from cascadia.pipeline.run import Addresses, Pipeline, RunFailed, run
from cascadia.pipeline.settings import settings_digest
from cascadia.pipeline.stage import RowSampler, load_stage
from cascadia.pipeline.transport import (COORDINATOR, Transport, TransportError, free_port, generate_keys, send,
                                         tcp_address)
from cascadia.pipeline.wire import Frame as WireFrame
from cascadia.pipeline.wire import encode, node_sender
from cascadia.sampling import Sampling
from cascadia.spec.types import LinkSpec
from cascadia.workload import MEASURED, WARMUP
from tests.test_tiny_chat import words_share

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"
TIMEOUT_S = 20  # bound on any wait for a node; the tests never measure time


@pytest.fixture(scope="module")
def plan(spec):
    return make_plan(spec)


@pytest.fixture(scope="module")
def engine(spec, checkpoint):
    """The whole model in this process: the reference for every distributed result."""
    rt = spec.runtime
    return Engine(Checkpoint.open(checkpoint), rt, formats=spec.model.formats, threads=1)


@pytest.fixture(scope="module")
def pipeline(spec, plan, checkpoint):
    """Three greedy local nodes that also send logits back, shared by the module's tests."""
    with Pipeline.start(spec, plan, checkpoint=checkpoint, with_logits=True, node_timeout_s=TIMEOUT_S) as started:
        yield started
    assert [p.returncode for p in started.local.processes] == [0, 0, 0]  # each stopped on SHUTDOWN


def reference_tokens(engine: Engine, prompt, n: int, sampling: Sampling) -> list[int]:
    """One stream on the single-process engine: prefill, then decode, each token drawn by the last node's own
    sampler from rows that carry the stream's sampling as frames do."""
    sampler = RowSampler(slots=1)

    def draw(logits, positions, tokens) -> int:  # rows of slot 0, the last one sampled
        k = len(positions)
        frame = WireFrame(0, 0, [0] * k, positions, tokens, [False] * (k - 1) + [True],
                          temperature=[sampling.temperature] * k, top_p=[sampling.top_p] * k, seed=[sampling.seed] * k,
                          top_k=[sampling.top_k] * k, min_p=[sampling.min_p] * k)
        sampler.observe(frame)
        return int(sampler.sample(logits, frame)[0])

    engine.release(0)
    tokens = [draw(engine.prefill(0, prompt)[None], range(len(prompt)), prompt)]
    while len(tokens) < n:
        tokens.append(draw(engine.step([0], tokens[-1:]), [len(prompt) + len(tokens) - 1], tokens[-1:]))
    return tokens


def assert_outputs_match_engine(outputs: list[dict], engine: Engine, sampling: Sampling) -> None:
    for line in outputs:
        assert line["output_ids"] == reference_tokens(engine, line["prompt_ids"], len(line["output_ids"]), sampling), \
            f"request {line['request_id']} at concurrency {line['concurrency']}"


def child_processes() -> set[int]:
    """Live processes whose parent is this one (node processes: the module's pipeline, and any a run left)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(parent) == os.getpid() and state != "Z":
            pids.add(int(stat.parent.name))
    return pids


# ---- exactness and metrics ---------------------------------------------------------------------------------------
def test_greedy_tokens_equal_the_single_process_engine_at_every_concurrency(spec, pipeline, engine):
    workload = attrs.evolve(spec.workload, concurrency=(1, 4), output_tokens=8)
    done = pipeline.run(workload)
    assert [(line["concurrency"], line["phase"]) for line in done.outputs].count((4, MEASURED)) == 4
    assert len(done.outputs) == 10 and all(line["finish_reason"] == "length" for line in done.outputs)
    assert_outputs_match_engine(done.outputs, engine, Sampling())

    levels = done.result["levels"]
    assert [(level["concurrency"], level["requests"], level["output_tokens"]) for level in levels] == \
        [(1, 1, 8), (4, 4, 32)]
    for level in levels:
        assert level["decode_tokens_per_s"] > 0 and level["ttft_s"]["p50"] > 0 and level["tpot_s"]["p95"] > 0
        assert set(level["busy"]) == {"node0", "node1", "node2"}
        assert all(0 < busy <= 1 for busy in level["busy"].values())
    assert done.result["source"] == "run" and len(done.result["requests"]) == 10
    json.dumps(done.result)


def test_open_loop_arrivals_on_the_pipeline_give_the_engines_tokens(spec, pipeline, engine):
    """Requests arriving at Poisson times (some while others decode) are admitted as they come, exactly."""
    workload = attrs.evolve(spec.workload, rate=(20.0,), requests=6, output_tokens=6)
    done = pipeline.run(workload)
    assert [line["rate"] for line in done.outputs] == [20.0] * 12 and len(done.outputs) == 12
    assert_outputs_match_engine(done.outputs, engine, Sampling())
    [level] = done.result["levels"]
    assert level["rate"] == 20.0 and level["concurrency"] is None and level["requests"] == 6
    arrivals = [r["t_arrival"] for r in done.result["requests"] if r["phase"] == MEASURED]
    assert max(arrivals) - min(arrivals) > 0  # they did not all come at once


def test_frames_wider_than_the_largest_row_bucket_are_split_exactly(spec, pipeline, engine):
    # One group holds all 8 streams: 8 decode rows plus a 4-row prefill window exceed the 8-row bucket.
    workload = attrs.evolve(spec.workload, concurrency=(8,), requests=10, output_tokens=5)
    done = pipeline.run(workload, groups=1)
    assert len(done.outputs) == 20
    assert_outputs_match_engine(done.outputs, engine, Sampling())


def test_frames_that_cannot_belong_to_the_run_are_dropped_and_it_goes_on(spec, pipeline, engine):
    """The probe's forgery: FRAMEs to node1's input claiming node0's sender id (1), frame 999999, numbered far
    ahead of node0's messages. Their rows fit no stream of node1 (a slot it lacks, a position no stream is at, the
    wrong width): node1 logs and counts each, and node0's frames, numbered lower, still go through exactly."""
    rejected = pipeline.coordinator.stats()["node1"].rejected
    hidden = spec.model.config.hidden_size
    forgeries = [WireFrame(999999, 0, [5], [63], [3], [True], np.zeros((1, hidden), np.float32)),
                 WireFrame(999999, 0, [99], [0], [3], [True], np.zeros((1, hidden), np.float32)),
                 WireFrame(999999, 0, [5], [0], [3], [True], np.zeros((1, hidden + 1), np.float32))]
    with Transport("stranger") as stranger:
        forger = stranger.connect(zmq.PUSH, pipeline.local.places[1].listen, "node1")
        for seq, forgery in enumerate(forgeries):
            send(forger, encode(forgery, node_sender(0), 2**62 + seq))
        deadline = time.monotonic() + TIMEOUT_S
        while pipeline.coordinator.stats()["node1"].rejected < rejected + len(forgeries):
            assert time.monotonic() < deadline, "node1 did not reject the forgeries"
            time.sleep(0.05)
    done = pipeline.run(attrs.evolve(spec.workload, concurrency=(2,), output_tokens=4))
    assert_outputs_match_engine(done.outputs, engine, Sampling())
    log = pipeline.local.logs[1].read_text()
    for reason in (r"slot 5 is at position \d+, but its rows start at 63",  # no stream here gets that far
                   r"slot 99 is not one of the stage's 0..15", rf"its residual rows are {hidden + 1} wide, the model's "
                                                               rf"{hidden}"):
        assert re.search(f"node1: rejected a message on its input socket: frame 999999 cannot belong to this run: "
                         f"{reason}", log), reason


def test_prompts_longer_than_the_context_are_named_in_the_result(spec, pipeline, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [3, 4, 5]}\n{"ids": [%s]}\n' % ",".join(["3"] * 61))  # 61 + 4 > 64
    done = pipeline.run(attrs.evolve(spec.workload, concurrency=(1,), requests=2, output_tokens=4,
                                     prompts_file=prompts))
    assert done.result["warnings"] == [f"{prompts}: 1 of its 2 prompts are rejected: prompt + output (4) tokens "
                                       "exceed runtime.context_budget (64)"]
    assert [line["finish_reason"] for line in done.outputs] == ["length", "rejected"] * 2


def test_score_gives_the_single_process_logits(pipeline, engine):
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 512, 30)]
    distributed = pipeline.score(ids, prefill=11)
    single = engine.score(ids, prefill=11)
    assert distributed.shape == single.shape == (30, 512)
    # f32 throughout; the same kernels on the same rows: agreement to rounding (here bit for bit).
    np.testing.assert_allclose(distributed, single, rtol=0, atol=1e-6 * np.abs(single).max())


@pytest.mark.parametrize("top_k, min_p", [(0, 0.0), (5, 0.05)], ids=["top-p", "top-k and min-p too"])
def test_sampled_tokens_depend_on_the_stream_only(spec, plan, checkpoint, engine, top_k, min_p):
    """With a temperature, each stream draws the same tokens alone or among others, as in one process (where top-k
    and min-p must reach the last node: without them its draws from this random model's flat logits would differ)."""
    sampling = Sampling(temperature=1.2, top_p=0.95, seed=7, top_k=top_k, min_p=min_p)
    workload = attrs.evolve(spec.workload, concurrency=(1, 3), requests=3, output_tokens=6, greedy=False,
                            temperature=1.2, top_p=0.95, seed=7, top_k=top_k, min_p=min_p)
    prompt = list(range(3, 15))
    done = run(spec, plan, workload, prompts=[tuple(prompt)], checkpoint=checkpoint, node_timeout_s=TIMEOUT_S)
    outputs = {tuple(line["output_ids"]) for line in done.outputs}
    assert len(done.outputs) == 12 and len(outputs) == 1
    assert_outputs_match_engine(done.outputs[:1], engine, sampling)
    assert outputs != {tuple(reference_tokens(engine, prompt, 6, Sampling()))}  # not greedy after all


def test_a_workloads_choices_fork_each_prompt_on_the_nodes_and_draw_as_requests_alone(spec, pipeline, engine):
    """`workload.choices: 3`: each client's prompt is computed once and forked on every node; choice c draws as a
    request of its own with the workload's seed + c (so the three differ), as in one process."""
    workload = attrs.evolve(spec.workload, concurrency=(2,), requests=2, output_tokens=6, choices=3, greedy=False,
                            temperature=1.2, top_p=0.95, seed=7)
    done = pipeline.run(workload)
    assert len(done.outputs) == 12 and [line["request_id"] for line in done.outputs] == list(range(12))
    for line in done.outputs:
        drawn = Sampling(temperature=1.2, top_p=0.95, seed=7 + line["request_id"] % 3)
        assert line["output_ids"] == reference_tokens(engine, line["prompt_ids"], 6, drawn), line["request_id"]
    assert len({tuple(line["output_ids"]) for line in done.outputs[:3]}) == 3
    assert len({tuple(line["prompt_ids"]) for line in done.outputs[:3]}) == 1


def test_nodes_keep_state_in_the_spec_kv_precision(spec, plan, checkpoint, engine):
    """`runtime.kv_precision: bf16` reaches every node: its logits are those of one process with bf16 state, not
    those of f32 state."""
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, kv_precision="bf16"))
    bf16_state = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    ids = [int(i) for i in np.random.default_rng(4).integers(0, 512, 30)]
    with Pipeline.start(spec, plan, checkpoint=checkpoint, with_logits=True, node_timeout_s=TIMEOUT_S) as started:
        distributed = started.score(ids, prefill=11)
    single = bf16_state.score(ids, prefill=11)
    scale = np.abs(single).max()
    np.testing.assert_allclose(distributed, single, rtol=0, atol=1e-6 * scale)
    assert np.abs(distributed - engine.score(ids, prefill=11)).max() > 1e-4 * scale


def test_generate_draws_what_the_pipeline_draws(engine):
    """`cascadia generate` samples as the last node does: the same seed and prompt give the same tokens."""
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=11)
    prompt = [5, 9, 3, 7, 1, 8]
    tokens = generate(engine, prompt, 12, sampling).ids
    assert list(tokens) == reference_tokens(engine, prompt, 12, sampling)
    assert tokens != generate(engine, prompt, 12, Sampling(temperature=1.0, top_p=0.9, seed=12)).ids


def test_run_command_prints_the_table_and_writes_metrics_and_outputs(checkpoint, engine, tmp_path):
    metrics_path, outputs_path = tmp_path / "run.json", tmp_path / "outputs.jsonl"
    result = CliRunner().invoke(cli, ["run", str(SPEC), "--checkpoint", str(checkpoint), "--concurrency", "2",
                                      "--max-new-tokens", "4", "--prompt-tokens", "9", "--greedy", "--json",
                                      str(metrics_path), "--outputs", str(outputs_path)])
    assert result.exit_code == 0, result.output
    assert "node2: ready" in result.stderr and "concurrency 2, measured: 2 requests, 8 tokens" in result.stderr
    said = result.stdout.splitlines()
    assert said[0].startswith("closed loop at 2 streams; each level a warm-up, then as many measured requests")
    assert said[1].split()[:3] == ["streams", "requests", "tokens"] and said[2].split()[:3] == ["2", "2", "8"]
    assert said[3:] == [f"wrote {metrics_path}", f"wrote {outputs_path}"]
    levels = json.loads(metrics_path.read_text())["levels"]
    assert [(level["concurrency"], level["output_tokens"]) for level in levels] == [(2, 8)]
    outputs = [json.loads(line) for line in outputs_path.read_text().splitlines()]
    assert [(o["phase"], len(o["prompt_ids"])) for o in outputs] == [(WARMUP, 9)] * 2 + [(MEASURED, 9)] * 2
    assert_outputs_match_engine(outputs, engine, Sampling())


def test_score_command_on_the_pipeline_gives_the_single_process_logits(checkpoint, engine, tmp_path):
    ids = [int(i) for i in np.random.default_rng(4).integers(0, 512, 20)]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    result = CliRunner().invoke(cli, ["score", str(checkpoint), "--ids", str(tmp_path / "ids.json"), "--prefill", "12",
                                      "--out", str(tmp_path / "logits.npy"), "--spec", str(SPEC)])
    assert result.exit_code == 0, result.output
    single = engine.score(ids, prefill=12)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), single, rtol=0, atol=1e-6 * np.abs(single).max())


def test_a_failed_run_still_writes_what_finished_and_exits_non_zero(monkeypatch, tmp_path):
    """The command's side of a failure (the failure itself is tested below, with real processes)."""
    import cascadia.pipeline.run

    line = {"concurrency": 1, "phase": WARMUP, "request_id": 0, "prompt_ids": [1], "output_ids": [2],
            "finish_reason": "length"}

    def fail(*args, **kwargs):
        raise RunFailed("node1: the node process was killed by signal 9", {"levels": []}, [line])

    monkeypatch.setattr(cascadia.pipeline.run, "run", fail)
    metrics_path, outputs_path = tmp_path / "run.json", tmp_path / "outputs.jsonl"
    result = CliRunner().invoke(cli, ["run", str(SPEC), "--json", str(metrics_path), "--outputs", str(outputs_path)])
    assert result.exit_code == 1
    assert "Error: run failed: node1: the node process was killed by signal 9" in result.stderr
    assert json.loads(metrics_path.read_text()) == {"levels": []}
    assert [json.loads(text) for text in outputs_path.read_text().splitlines()] == [line]


@pytest.mark.parametrize("args, message", [
    (["--greedy", "--temperature", "0.5"], "give --greedy or --temperature/--top-p/--top-k/--min-p, not both"),
    (["--control", "tcp://127.0.0.1:5555"], "give both --control and --tokens, or neither"),
])
def test_run_command_refuses_contradictory_options(args, message):
    result = CliRunner().invoke(cli, ["run", str(SPEC), *args])
    assert result.exit_code == 2 and message in result.stderr


def test_demo_runs_the_trained_tiny_model_on_three_nodes_and_it_answers_in_words():
    result = CliRunner().invoke(cli, ["demo", "--concurrency", "1,3"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Inkling 975B on 11 PCs" in out and "pc10  60-65   layers+head" in out and "(analytic estimate)" in out
    tiny = out[out.index("specs/tiny-chat.yaml"):]
    assert "node2  4-5     layers+head" in tiny and "host localhost:" in tiny
    comparison = tiny[tiny.index("simulated and measured"):tiny.index("asked")].strip().splitlines()
    assert [line.split()[:2] for line in comparison if line.split()[1:3] == ["decode", "tok/s"]] == [
        ["1", "decode"], ["3", "decode"]]
    assert comparison[-1].startswith("median |error|: decode tok/s")
    answer = tiny[tiny.index("the model answers"):].split("\n", 1)[1]
    assert len(answer.split()) >= 5 and words_share(answer) >= 0.7, answer


# ---- nodes on other machines: started by hand, found by their spec addresses -----------------------------------
def remote_spec(spec, curve_keys: Path | None = None):
    """The tiny spec with every node at a tcp address (here all on 127.0.0.1)."""
    nodes = tuple(attrs.evolve(n, address=tcp_address("127.0.0.1", free_port())) for n in spec.cluster.nodes)
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes, curve_keys=curve_keys))


def start_node(spec_path: Path, plan_path: Path, name: str, listen: str, addresses: Addresses, checkpoint: Path,
               last: bool, log: Path, *options: str) -> subprocess.Popen:
    successor = ["--successor", addresses.tokens] if last else []
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "cascadia", "node", "--spec", str(spec_path), "--plan",
                                 str(plan_path), "--name", name, "--listen", listen, "--control", addresses.control,
                                 "--checkpoint", str(checkpoint), "--parent-pid", str(os.getpid()), *successor,
                                 *options], stdout=out, stderr=subprocess.STDOUT)


def write_spec_and_plan(spec, plan, folder: Path) -> tuple[Path, Path]:
    import yaml

    from cascadia.spec.dump import dump_spec

    spec_path, plan_path = folder / "spec.yaml", folder / "plan.json"
    spec_path.write_text(yaml.safe_dump(dump_spec(spec)))
    plan.save(plan_path)
    return spec_path, plan_path


def stop_all(processes) -> None:
    for process in processes:
        try:
            process.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_nodes_started_by_hand_serve_a_run_over_curve(spec, plan, checkpoint, engine, tmp_path):
    generate_keys(tmp_path / "keys", ["node0", "node1", "node2", COORDINATOR])
    remote = remote_spec(spec, tmp_path / "keys")
    spec_path, plan_path = write_spec_and_plan(remote, plan, tmp_path)
    addresses = Addresses.local()
    processes = [start_node(spec_path, plan_path, n.name, n.address, addresses, checkpoint, i == 2,
                            tmp_path / f"{n.name}.log") for i, n in enumerate(remote.cluster.nodes)]
    try:
        workload = attrs.evolve(spec.workload, concurrency=(2,), output_tokens=4)
        with Pipeline.start(remote, plan, addresses=addresses, node_timeout_s=TIMEOUT_S) as pipeline:
            done = pipeline.run(workload)
    finally:
        stop_all(processes)
    assert [p.returncode for p in processes] == [0, 0, 0]
    assert_outputs_match_engine(done.outputs, engine, Sampling())


def test_keep_serving_nodes_serve_one_run_after_another(spec, plan, checkpoint, engine, tmp_path):
    """Nodes started by hand, before the coordinator, load once and serve two `cascadia run`s in turn."""
    remote = remote_spec(spec)
    spec_path, plan_path = write_spec_and_plan(remote, plan, tmp_path)
    addresses = Addresses.local()
    processes = [start_node(spec_path, plan_path, n.name, n.address, addresses, checkpoint, i == 2,
                            tmp_path / f"{n.name}.log", "--keep-serving") for i, n in enumerate(remote.cluster.nodes)]
    try:
        for concurrency in (1, 3):
            workload = attrs.evolve(spec.workload, concurrency=(concurrency,), output_tokens=4)
            with Pipeline.start(remote, plan, addresses=addresses, node_timeout_s=TIMEOUT_S) as pipeline:
                done = pipeline.run(workload)
            assert_outputs_match_engine(done.outputs, engine, Sampling())
        assert all(p.poll() is None for p in processes)
    finally:
        for process in processes:
            process.terminate()
        stop_all(processes)
    for n in remote.cluster.nodes:
        log = (tmp_path / f"{n.name}.log").read_text()
        assert log.count("ready on") == 2 and log.count("run ended (shutdown requested)") == 2, log


@contextlib.contextmanager
def listening(address: str):
    """Another socket listening on `address` meanwhile."""
    with Transport("squatter") as squatter:
        sock = squatter.bind(zmq.PULL, address, [])
        yield
        sock.close()


def test_a_node_whose_port_is_taken_is_a_clear_error(spec, plan, checkpoint, tmp_path):
    remote = remote_spec(spec)
    spec_path, plan_path = write_spec_and_plan(remote, plan, tmp_path)
    addresses = Addresses.local()
    taken = remote.cluster.nodes[0].address
    with listening(taken):
        node0 = start_node(spec_path, plan_path, "node0", taken, addresses, checkpoint, False, tmp_path / "n0.log")
        try:
            with pytest.raises(PipelineError, match=f"node0: TransportError: cannot listen on {taken}: address "
                                                    "already in use"):
                Pipeline.start(remote, plan, addresses=addresses, node_timeout_s=TIMEOUT_S)
        finally:
            stop_all([node0])
    assert node0.returncode == 1


def test_a_node_started_with_other_settings_is_refused(spec, plan, checkpoint, tmp_path):
    remote = remote_spec(spec)
    spec_path, plan_path = write_spec_and_plan(remote, plan, tmp_path)
    addresses = Addresses.local()
    node0 = start_node(spec_path, plan_path, "node0", remote.cluster.nodes[0].address, addresses, checkpoint, False,
                       tmp_path / "n0.log", "--logits")  # the run does not score
    try:
        with pytest.raises(PipelineError, match="node0: started with other settings than this run .* same spec and "
                                                "plan as `cascadia run`"):
            Pipeline.start(remote, plan, addresses=addresses, node_timeout_s=TIMEOUT_S)
    finally:
        stop_all([node0])


def test_settings_digest_ignores_what_may_differ_between_machines(spec, plan):
    digest = settings_digest(spec, plan, False)
    sampled = attrs.evolve(spec, workload=attrs.evolve(spec.workload, greedy=False, temperature=0.7))
    assert settings_digest(remote_spec(sampled), plan, False) == digest  # sampling travels with each row
    assert settings_digest(spec, plan, True) != digest
    other_runtime = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, max_streams=4))
    assert settings_digest(other_runtime, plan, False) != digest


def test_the_coordinators_port_taken_is_a_clear_error(spec, plan):
    before = child_processes()
    address = tcp_address("127.0.0.1", free_port())
    with listening(address):
        with pytest.raises(TransportError, match=f"cannot listen on {address}: address already in use"):
            Pipeline.start(spec, plan, addresses=Addresses(address, tcp_address("127.0.0.1", free_port())))
    assert child_processes() == before


def test_nodes_that_never_come_up_are_named_after_the_timeout(spec, plan):
    with pytest.raises(PipelineError, match="node0, node1, node2: no word within 0.5 s while starting"):
        Pipeline.start(remote_spec(spec), plan, addresses=Addresses.local(), node_timeout_s=0.5)


# ---- failures of local nodes ---------------------------------------------------------------------------------------
def test_bad_prompts_and_a_missing_checkpoint_fail_before_any_node_starts(spec, plan, checkpoint, tmp_path,
                                                                         monkeypatch):
    def no_nodes(*args, **kwargs):
        raise AssertionError("nodes started")

    monkeypatch.setattr(LocalNodes, "start", no_nodes)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [1]}\n{"ids": [2\n')
    with pytest.raises(RequestError, match="prompts.jsonl:2: not valid JSON"):
        run(spec, plan, attrs.evolve(spec.workload, prompts_file=prompts), checkpoint=checkpoint)
    prompts.write_text('{"ids": [1]}\n{"ids": [5, 12345678901234567890]}\n')
    with pytest.raises(RequestError, match=r"prompts.jsonl:2: token id 12345678901234567890 lies outside the model's "
                                           r"vocabulary \(0..511\)"):
        run(spec, plan, attrs.evolve(spec.workload, prompts_file=prompts), checkpoint=checkpoint)
    prompts.write_text('{"ids": [%s]}\n' % ",".join(["1"] * 60))  # 60 + 16 output tokens: beyond 64 positions
    with pytest.raises(RequestError, match=r"prompts.jsonl: none of its 1 prompts fits: prompt \+ output \(16\) "
                                           r"tokens exceed runtime.context_budget \(64\)"):
        run(spec, plan, attrs.evolve(spec.workload, prompts_file=prompts), checkpoint=checkpoint)
    with pytest.raises(CheckpointError, match="nowhere: no such checkpoint folder"):
        run(spec, plan, checkpoint=tmp_path / "nowhere")


def huge_state_spec(spec):
    """Nodes that claim 100 TB each, and 2 * 10^7 streams of the model's 1,024 positions: on every node what the
    slots leave as the K/V pool (the streams' rings among it), which the planner places (each node claims room for
    it) but no machine running these tests has."""
    nodes = tuple(attrs.evolve(n, memory_bytes=100 * 10**12) for n in spec.cluster.nodes)
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes),
                        runtime=attrs.evolve(spec.runtime, max_streams=2 * 10**7, context_budget=1024))


def test_local_nodes_beyond_this_machines_memory_are_refused_before_any_starts(spec, checkpoint):
    before = child_processes()
    huge = huge_state_spec(spec)
    with pytest.raises(PipelineError, match=r"^the plan's 3 local nodes need 300 TB together \(node0 90.9 TiB, node1 "
                                            r"100 TB, node2 100 TB: weights, 20000000 streams' slots and the K/V "
                                            r"pools\) but this machine has .+ available \(.+\)$"):
        Pipeline.start(huge, make_plan(huge), checkpoint=checkpoint, node_timeout_s=TIMEOUT_S)
    assert child_processes() == before


def test_a_node_checks_its_own_machines_memory_before_it_loads(spec, tmp_path):
    """What a node on another machine does: it refuses with numbers, before it opens the checkpoint."""
    huge = huge_state_spec(spec)
    stage = make_plan(huge).stages[1]
    with pytest.raises(NodeError, match=r"^node1: its stage needs 100 TB \(weights 611 kB, state 100 TB: 20000000 "
                                        r"streams' slots and a K/V pool of 6,097,886,491 blocks of 64 positions \(1 a "
                                        r"stream's rings\)\) "
                                        r"but this machine has .+ available"):
        load_stage(huge, stage, tmp_path / "nowhere", 1, False, lambda done, total: None)


def test_a_checkpoint_a_node_cannot_read_is_a_clear_error(spec, plan, checkpoint, tmp_path):
    before = child_processes()
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(PipelineError, match=f"node[0-2]: CheckpointError: {weights}: tensor .* the file is truncated"):
        Pipeline.start(spec, plan, checkpoint=broken, node_timeout_s=TIMEOUT_S)
    assert child_processes() == before


def test_a_node_killed_mid_run_stops_the_run_and_keeps_what_finished(spec, plan, checkpoint):
    before = child_processes()
    workload = attrs.evolve(spec.workload, concurrency=(2,), output_tokens=6)
    pipeline = Pipeline.start(spec, plan, checkpoint=checkpoint, node_timeout_s=TIMEOUT_S)
    phases_done, measured_frames = [], []
    send_frame = pipeline.coordinator.send_frame

    def send_then_kill(frame):
        """Kill node1 with the measured phase's third frame on its way."""
        send_frame(frame)
        if phases_done:
            measured_frames.append(frame.frame_id)
            if len(measured_frames) == 3:
                pipeline.local.processes[1].kill()

    pipeline.coordinator.send_frame = send_then_kill
    try:
        with pytest.raises(RunFailed, match="node1: the node process was killed by signal 9") as failed:
            pipeline.run(workload, on_phase=lambda level, phase, records: phases_done.append(phase))
    finally:
        pipeline.close(timeout_s=2)
    assert pipeline.local.processes[1].returncode == -9 and all(p.returncode is not None
                                                                  for p in pipeline.local.processes)
    assert child_processes() == before
    result, outputs = failed.value.result, failed.value.outputs
    assert [(r["phase"], r["output_tokens"]) for r in result["requests"]] == [(WARMUP, 6)] * 2
    assert [(o["phase"], len(o["output_ids"])) for o in outputs] == [(WARMUP, 6)] * 2
    assert result["levels"] == [] and "the run stopped early: node1: " in result["warnings"][0]


def test_ctrl_c_shuts_every_node_down_and_keeps_what_finished(spec, plan, checkpoint):
    """What finished before the Ctrl-C (here the warm-up phase) comes back in RunFailed, for the command to write."""
    before = child_processes()

    def interrupt_after_warmup(level, phase, records):
        raise KeyboardInterrupt

    with pytest.raises(RunFailed, match="^interrupted$") as failed:
        run(spec, plan, attrs.evolve(spec.workload, concurrency=(2,), output_tokens=3), checkpoint=checkpoint,
            node_timeout_s=TIMEOUT_S, on_phase=interrupt_after_warmup)
    assert child_processes() == before
    assert [(r["phase"], r["output_tokens"]) for r in failed.value.result["requests"]] == [(WARMUP, 3)] * 2
    assert [o["finish_reason"] for o in failed.value.outputs] == ["length"] * 2
    assert failed.value.result["warnings"] == ["the run was interrupted"]


def test_sigterm_stops_a_run_as_ctrl_c_does(checkpoint, tmp_path):
    """`timeout`, systemd and containers stop with SIGTERM: the run still writes what finished, says why, exits
    non-zero, removes its temporary folder and leaves no node behind."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    metrics_path, outputs_path = tmp_path / "run.json", tmp_path / "outputs.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "cascadia", "run", str(SPEC), "--checkpoint", str(checkpoint),
                            "--concurrency", "1,2", "--requests", "4", "--max-new-tokens", "30", "--json",
                            str(metrics_path), "--outputs", str(outputs_path)],
                           env=os.environ | {"TMPDIR": str(temporary)}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        said = []
        for line in run.stderr:  # the measured phase of level 1 and all of level 2 are still to come
            said.append(line)
            if line.startswith("concurrency 1, warmup: 4 requests"):
                break
        assert processes_naming(str(temporary)), "no node is running"
        run.send_signal(signal.SIGTERM)
        said.append(run.communicate(timeout=TIMEOUT_S)[1])
    finally:
        if run.poll() is None:
            run.kill()
    said = "".join(said)
    assert run.returncode == 1, said
    assert said.endswith("Error: run failed: terminated by SIGTERM\n"), said
    result = json.loads(metrics_path.read_text())
    assert result["warnings"] == ["the run was terminated by SIGTERM"]
    assert [r["phase"] for r in result["requests"]][:4] == [WARMUP] * 4
    outputs = [json.loads(line) for line in outputs_path.read_text().splitlines()]
    assert [o["phase"] for o in outputs][:4] == [WARMUP] * 4 and all(len(o["output_ids"]) == 30 for o in outputs)
    assert list(temporary.iterdir()) == []  # the run's folder (spec, plan, node logs) is gone
    assert processes_naming(str(temporary)) == []


@pytest.mark.parametrize("command", [
    ["node", "--spec", str(SPEC), "--plan", "{plan}", "--name", "node0", "--listen", "http://x", "--control",
     "tcp://127.0.0.1:5555"],
    ["node", "--spec", str(SPEC), "--plan", "{plan}", "--name", "node0", "--listen", "tcp://*:5601", "--control",
     "tcp://*:5555"],
    ["run", str(SPEC), "--control", "tcp://0.0.0.0:0", "--tokens", "tcp://0.0.0.0:5556"],
])
def test_a_malformed_address_is_refused_before_anything_starts(plan, tmp_path, command):
    plan.save(tmp_path / "plan.json")
    result = CliRunner().invoke(cli, [arg.format(plan=tmp_path / "plan.json") for arg in command])
    assert result.exit_code == 2 and "is not an address like tcp://10.0.0.1:5555 (port 1-65535)" in result.output


# ---- emulated links (root and iproute2: skipped where namespaces cannot be made) -----------------------------------
def _can_emulate_links() -> bool:
    try:
        EmulatedLinks([1e6], free_port(), free_port()).close()
    except (LinkEmulationError, OSError):
        return False
    return True


needs_link_emulation = pytest.mark.skipif(not _can_emulate_links(), reason="needs root and network namespaces")


@needs_link_emulation
def test_emulated_links_shape_each_stage_to_the_next_and_leave_nothing_behind():
    before = made_here()
    with EmulatedLinks([1e6, 2.5e5], 5555, 5556) as links:
        made = [place.prefix[-1] for place in links.places]
        assert len(made) == 3 and set(made) == made_here() - before
        shaping = [subprocess.run(["tc", "-n", ns, "qdisc", "show"], capture_output=True, text=True).stdout
                   for ns in made]
        assert "tbf" in shaping[0] and "rate 8Mbit" in shaping[0] and "rate 2Mbit" in shaping[1]
        assert "tbf" not in shaping[2]  # the last node sends only tokens, to the coordinator
        assert [place.control.rsplit(":", 1)[1] for place in links.places] == ["5555"] * 3
    assert made_here() == before


@needs_link_emulation
def test_a_run_over_emulated_links_gives_the_engines_tokens(spec, plan, checkpoint, engine):
    """At 20 kB/s a stage's rows wait for the link; the tokens are the single-process engine's all the same."""
    before, processes = made_here(), child_processes()
    slow = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, default_link=LinkSpec(2e4, 1e-4)))
    done = run(slow, plan, attrs.evolve(spec.workload, concurrency=(2,), output_tokens=4), checkpoint=checkpoint,
               node_timeout_s=TIMEOUT_S, emulate_links=True)
    assert_outputs_match_engine(done.outputs, engine, Sampling())
    assert made_here() == before and child_processes() == processes


@needs_link_emulation
def test_namespaces_of_a_run_that_was_killed_are_removed_by_the_next():
    ended = subprocess.Popen(["true"])
    ended.wait()
    stale = f"cascadia-{ended.pid}-0-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with EmulatedLinks([1e6], 5555, 5556):
        assert stale not in namespaces()
