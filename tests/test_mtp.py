"""The multi-token-prediction layer of the trained tiny model (`cascadia.engine.mtp`): its logits against
scripts/train_mtp.py's reference module (tests/fixtures/tiny_chat/mtp_reference.npz, f32, teacher-forced), whole and
a row at a time; and the drafts it proposes from a frame's rows: a prompt cut into chunks, a rejected draft, chained
drafts, after all of which its state stands where the stream truly does."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import attrs
import numpy as np
import pytest
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint, CheckpointError
from cascadia.engine.engine import Engine, StageEngine
from cascadia.engine.init_model import init_model
from cascadia.engine.layers import rms_norm
from cascadia.errors import SpecError
from cascadia.graph.costs import embedding_cost, layer_costs, mtp_memory, pool_layout
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.coordinator import frame_drafts, wire_frame
from cascadia.pipeline.run import Pipeline
from cascadia.pipeline.stage import EngineStage, RowSampler
from cascadia.policy import Policy, Request, Token, Verified
from cascadia.sampling import Sampling
from cascadia.measure.tables import Grid, StageProbe
from cascadia.pipeline.stage import load_stage
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import Extrapolations
from cascadia.sim.model import FrameShape, StageCost, stage_kinds
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec
from cascadia.spec.types import RuntimeSpec
from cascadia.tokenizer import load_tokenizer
from tests.test_engine_exact import assert_close

CHECKPOINT = Path(__file__).parent.parent / "specs" / "tiny-chat"
REFERENCE = Path(__file__).parent / "fixtures" / "tiny_chat" / "mtp_reference.npz"
PIPELINE_SPEC = load_spec(CHECKPOINT.parent / "tiny-chat.yaml")
RUNTIME = RuntimeSpec(precision="f32", max_streams=2, context_budget=128, row_buckets=(1, 2, 8),
                      speculate="mtp:3")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REFERENCE))


@pytest.fixture
def stage():
    return Engine(Checkpoint.open(CHECKPOINT), RUNTIME).stage


def hidden_of(stage: StageEngine, ids: np.ndarray, slot: int = 0, start: int = 0) -> np.ndarray:
    """The model's final hidden states (before its norm) of `ids` at positions start.., in calls of 8 rows."""
    return np.concatenate([stage.forward(stage.embed(ids[at:at + 8]), np.full(len(ids[at:at + 8]), slot),
                                         np.arange(start + at, start + at + len(ids[at:at + 8])))
                           for at in range(0, len(ids), 8)])


def normed(stage: StageEngine, hidden: np.ndarray) -> np.ndarray:
    return rms_norm(hidden, stage.final_norm, stage.config.rms_norm_eps)


def test_its_logits_are_the_reference_modules(stage, reference):
    ids = reference["ids"]
    hidden = normed(stage, hidden_of(stage, ids))
    whole = stage.mtp.logits(stage.mtp.step(hidden[:-1], ids[1:], np.zeros(len(ids) - 1), np.arange(len(ids) - 1)))
    assert_close(whole, reference["mtp_logits"])
    one_by_one = [stage.mtp.logits(stage.mtp.step(hidden[i:i + 1], ids[i + 1:i + 2], [1], [i]))
                  for i in range(len(ids) - 1)]
    assert_close(np.concatenate(one_by_one), reference["mtp_logits"])


def test_drafts_follow_the_streams_path(stage, reference):
    """A 20-token prompt in chunks of 8 (the layer waits for each chunk's next token, and holds rows that no drafts
    wait on until they fill its largest call, 8 rows), its last row sampled: drafts from position 19. Then a decode
    row and two drafts, the second rejected: drafts from the accepted one's position. Each first draft is the
    reference's top token there; after the chained drafts (3 a step) the layer goes on as teacher-forced, exact."""
    ids, expected = reference["ids"], reference["mtp_logits"].argmax(axis=1)
    mtp = stage.mtp
    for at in range(0, 20, 8):
        chunk = ids[at:min(at + 8, 20)]
        positions = np.arange(at, at + len(chunk))
        hidden = stage.forward(stage.embed(chunk), np.zeros(len(chunk)), positions)
        sampled = positions == 19
        drafts = mtp.advance(np.zeros(len(chunk)), positions, chunk, hidden, sampled, ids[20:20 + sampled.sum()],
                             propose=sampled)
        assert list(drafts) == ([] if at < 16 else [3])  # by the row's index in the frame
        assert mtp.lengths[0] == {0: 0, 8: 15, 16: 20}[at]  # 7 rows held; 15 run; the rest, as drafts follow
    assert len(drafts[3]) == 3 and drafts[3][0] == expected[19]
    wrong = (ids[22] + 1) % stage.config.vocab_size
    rows = np.array([ids[20], ids[21], wrong])  # the decode row, an accepted draft, a rejected one
    hidden = stage.forward(stage.embed(rows), np.zeros(3), [20, 21, 22])
    drafts = mtp.advance(np.zeros(3), [20, 21, 22], rows, hidden, np.ones(3, bool), ids[21:24], np.ones(3, bool))
    assert list(drafts) == [1] and drafts[1][0] == expected[21] and mtp.lengths[0] == 22
    rest = normed(stage, hidden_of(stage, ids[22:], start=22))[:-1]  # the model rewinds past the rejected row
    assert_close(mtp.logits(mtp.step(rest, ids[23:], np.zeros(len(rest)), np.arange(22, 22 + len(rest)))),
                 reference["mtp_logits"][22:])


def test_a_fork_drafts_as_its_source(stage, reference):
    ids, expected = reference["ids"], reference["mtp_logits"].argmax(axis=1)
    hidden = stage.forward(stage.embed(ids[:7]), np.zeros(7), np.arange(7))
    stage.mtp.advance(np.zeros(7), np.arange(7), ids[:7], hidden, np.zeros(7, bool), [])
    stage.fork(0, 1)  # before the prompt's last row, as a policy forks a prompt's choices
    for slot in (0, 1):
        hidden = stage.forward(stage.embed(ids[7:8]), [slot], [7])
        assert stage.mtp.advance([slot], [7], ids[7:8], hidden, np.ones(1, bool), ids[8:9], [True])[0][0] \
            == expected[7]


def test_rows_held_while_no_drafts_are_wanted_give_the_same_drafts(stage, reference):
    """Decode rows of frames that propose no drafts wait (a full call's worth at most) until one does: then they
    run, and the drafts are those of a layer that ran every row."""
    ids, expected, mtp = reference["ids"], reference["mtp_logits"].argmax(axis=1), stage.mtp
    hidden = stage.forward(stage.embed(ids[:4]), np.zeros(4), np.arange(4))
    assert mtp.advance(np.zeros(4), np.arange(4), ids[:4], hidden, np.arange(4) == 3, ids[4:5]) == {}
    assert mtp.lengths[0] == 0
    for position in range(4, 30):
        row = ids[position:position + 1]
        hidden = stage.forward(stage.embed(row), [0], [position])
        proposes = position in (13, 29)
        drafts = mtp.advance([0], [position], row, hidden, [True], ids[position + 1:position + 2], [proposes])
        assert list(drafts) == ([0] if proposes else [])
        if proposes:
            assert drafts[0][0] == expected[position] and mtp.lengths[0] == position + 1
        assert 0 <= position + 1 - mtp.lengths[0] <= RUNTIME.row_buckets[-1]  # rows held: a call's worth at most


def test_rows_off_its_path_lose_the_stream_until_it_starts_afresh(stage, reference):
    """Teacher-forced rows (scoring, calibration's probes): every row sampled, the next frame going on after the
    last whatever was sampled. The layer stops at the first row whose token was not the one after it; rows that
    then do not continue where it stands are not its stream's any more: no drafts, no error, until the slot starts
    afresh."""
    ids, expected, mtp = reference["ids"], reference["mtp_logits"].argmax(axis=1), stage.mtp
    vocab = stage.config.vocab_size
    hidden = stage.forward(stage.embed(ids[:8]), np.zeros(8), np.arange(8))
    assert list(mtp.advance(np.zeros(8), np.arange(8), ids[:8], hidden, np.ones(8, bool), (ids[1:9] + 1) % vocab,
                            np.ones(8, bool))) == [0]
    hidden = stage.forward(stage.embed(ids[8:12]), np.zeros(4), np.arange(8, 12))
    assert mtp.advance(np.zeros(4), np.arange(8, 12), ids[8:12], hidden, np.ones(4, bool), ids[9:13],
                       np.ones(4, bool)) == {}
    stage.release(0)
    hidden = stage.forward(stage.embed(ids[:8]), np.zeros(8), np.arange(8))
    sampled = np.arange(8) == 7
    assert mtp.advance(np.zeros(8), np.arange(8), ids[:8], hidden, sampled, ids[8:9], sampled)[7][0] == expected[7]


def test_a_checkpoint_without_the_layer_is_named(tmp_path):
    init_model(attrs.evolve(Checkpoint.open(CHECKPOINT).config, num_mtp_layers=None), tmp_path, seed=0)
    checkpoint = Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="no multi-token-prediction layer 0 .*num_mtp_layers"):
        StageEngine(checkpoint, range(0), embed=False, head=True, runtime=RUNTIME, warm_up=False)


# ---- speculating with the layer's drafts --------------------------------------------------------------------------
PROMPTS = ["The for statement in Python differs a bit from what you may be used to in C or Pascal.",
           "A generator is a function that returns an iterator.", "def fib(n):\n    a, b = 0, 1\n",
           "Lists are mutable sequences, typically used to store collections of homogeneous items.",
           "The with statement is used to wrap the execution of a block"]


@functools.cache
def whole_model(speculate: str | None) -> EngineStage:
    """tiny-chat.yaml's runtime with `speculate`, every layer in one stage, as the last node runs it."""
    runtime = attrs.evolve(PIPELINE_SPEC.runtime, speculate=speculate)
    engine = StageEngine(Checkpoint.open(CHECKPOINT), range(PIPELINE_SPEC.model.config.num_hidden_layers),
                         embed=True, head=True, runtime=runtime, threads=1)
    return EngineStage(engine, RowSampler(runtime.max_streams, engine.rewind))


def chat_requests(n: int, sampled: bool) -> list[Request]:
    tokenizer = load_tokenizer(CHECKPOINT)
    return [Request(i, tuple(tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids[:8 + i % 9]), 12 + i % 5,
                    sampling=Sampling(0.8, 0.9, seed=i) if sampled else Sampling()) for i in range(n)]


def serve(speculate: str | None, requests: list[Request], n_groups: int, seed: int = 0) -> tuple[dict, list]:
    """Every request at once, frames of the groups in flight computed in a seeded random order, the last stage's
    drafts offered as the pipeline's coordinator offers them; each request's tokens, and the verifications."""
    stage = whole_model(speculate)
    policy = Policy.for_runtime(attrs.evolve(PIPELINE_SPEC.runtime, speculate=speculate), n_groups)
    rng, outputs, verified, in_flight = random.Random(seed), {}, [], {}
    for request in requests:
        policy.add_request(request)
    while not policy.done:
        for frame in policy.next_frames():
            in_flight[frame.group] = frame
        frame = in_flight.pop(rng.choice(sorted(in_flight)))
        tokens = stage.process(wire_frame(frame))
        for event in policy.complete_frame(frame, tokens.token_ids.tolist(), frame_drafts(frame, tokens)):
            if isinstance(event, Token):
                outputs.setdefault(event.request_id, []).append(event.token)
            elif isinstance(event, Verified):
                verified.append(event)
    return outputs, verified


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_its_drafts_give_the_tokens_of_a_run_without_them(concurrency, sampled):
    """The stage drafting with its MTP layer (chains of 3, then prompt lookup's drafts first) gives the tokens it
    gives without speculation; at one stream the layer's drafts are accepted."""
    n_groups = concurrency // 2 + 1 if concurrency > 1 else 3
    requests = chat_requests(concurrency, sampled)
    expected, _ = serve(None, requests, n_groups)
    for speculate in ("mtp:3", "ngram+mtp:3"):
        outputs, verified = serve(speculate, requests, n_groups, seed=concurrency)
        assert outputs == expected, speculate
        assert sum(v.proposed for v in verified) > 0
        if concurrency == 1 and not sampled:
            assert sum(v.accepted for v in verified) > 0


@pytest.fixture(scope="module")
def mtp_pipeline():
    """tiny-chat.yaml's three local nodes, the last drafting with the MTP layer (chains of 2)."""
    spec = attrs.evolve(PIPELINE_SPEC, runtime=attrs.evolve(PIPELINE_SPEC.runtime, speculate="mtp:2"))
    with Pipeline.start(spec, make_plan(spec), node_timeout_s=20) as started:
        yield started
    assert [p.returncode for p in started.local.processes] == [0, 0, 0]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_pipeline_drafts_with_it_exactly(mtp_pipeline, sampled):
    """Through the three nodes (the drafts travel back with the last node's tokens), every stream gets the tokens of
    the single-process engine without speculation, at 1 and 4 streams, and drafts are accepted."""
    workload = attrs.evolve(PIPELINE_SPEC.workload, concurrency=(1, 4), output_tokens=12, greedy=not sampled,
                            temperature=0.8, top_p=0.9, seed=3, top_k=40, min_p=0.01)
    prompts = [r.prompt_ids for r in chat_requests(8, sampled=False)]
    expected, _ = serve(None, [Request(i, p, 12, sampling=Sampling.of(workload)) for i, p in enumerate(prompts)], 1)
    done = mtp_pipeline.run(workload, prompts=prompts)
    assert len(done.outputs) == 2 * (1 + 4)
    for line in done.outputs:
        assert line["output_ids"] == expected[prompts.index(tuple(line["prompt_ids"]))], line["request_id"]
    speculation = [level["speculation"] for level in done.result["levels"]]
    assert speculation[0]["proposed"] > 0 and sum(s["accepted"] for s in speculation) > 0


def with_bandwidth(spec, speculate: str | None):
    """The spec drafting as `speculate` says, its nodes given a memory bandwidth (for an analytic calibration)."""
    nodes = tuple(attrs.evolve(node, memory_bandwidth=20e9) for node in spec.cluster.nodes)
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes),
                        runtime=attrs.evolve(spec.runtime, speculate=speculate))


def test_the_simulator_charges_the_layer_at_the_head_stage():
    """At the last stage only: in a frame that proposes drafts, every row through the layer, and for each of its
    streams the rest of a chain of 3 through it and the head for each draft; in one that does not, the rows' share
    of a call of the largest bucket. Drafts that are never accepted cost time, drafts that always are make decode
    faster."""
    spec = with_bandwidth(PIPELINE_SPEC, "mtp:3")
    calibration, config, buckets = analytic_calibration(spec), spec.model.config, spec.runtime.row_buckets
    shape = FrameShape(padded_rows=8, rows=6, sliding_context=20.0, global_context=30.0, streams=3, sampled=6,
                       proposes=True)
    busy = attrs.evolve(shape, proposes=False)
    for stage in make_plan(spec).stages:
        node = calibration.nodes[stage.node]
        drafting = StageCost(stage.node, stage_kinds(stage, config, spec.runtime), node, config, calibration,
                             Extrapolations(), buckets, max_draft=3)
        plain = StageCost(stage.node, stage_kinds(stage, config), node, config, calibration, Extrapolations(), buckets)
        mtp, head = node.tables["mtp"], node.tables["head"]
        added = mtp.lookup(8, 30.0)[0] + 2 * mtp.lookup(4, 30.0)[0] + 3 * head.lookup(4)[0] if stage.roles[-1] == \
            "head" else 0.0
        assert drafting(shape) - plain(shape) == pytest.approx(added, rel=1e-9)
        held = 6 / buckets[-1] * mtp.lookup(buckets[-1], 30.0)[0] if stage.roles[-1] == "head" else 0.0
        assert drafting(busy) - plain(busy) == pytest.approx(held, rel=1e-9)
    assert 0 < held < added
    decode = {acceptance: simulate(spec, calibration, acceptance=acceptance)["levels"][0]["decode_tokens_per_s"]
              for acceptance in (0.0, 1.0)}
    off = simulate(with_bandwidth(PIPELINE_SPEC, None), calibration)["levels"][0]["decode_tokens_per_s"]
    assert decode[0.0] < off < decode[1.0]


def test_the_stage_probe_times_the_layer():
    """Calibration measures the layer at the last stage, on the grid of the analytic one, where the runtime drafts
    with it."""
    spec = attrs.evolve(PIPELINE_SPEC, runtime=attrs.evolve(PIPELINE_SPEC.runtime, speculate="mtp:2"))
    stage = make_plan(spec).stages[-1]
    kinds = stage_kinds(stage, spec.model.config, spec.runtime)
    assert "mtp" in kinds and "mtp" not in stage_kinds(stage, spec.model.config, PIPELINE_SPEC.runtime)
    probe = StageProbe(load_stage(spec, stage, CHECKPOINT, 1, False, lambda done, total: None), kinds)
    grid = attrs.evolve(Grid.of(spec), rounds=1)
    table = probe.tables(grid, lambda text: None)[0]["mtp"]
    assert table.rows == grid.rows and table.points == grid.points["mtp"] == (1, 2, 4, 8, 16, 32, 64)
    assert all(t > 0 for line in table.time_s for t in line)


def test_a_model_without_the_layer_cannot_draft_with_it(tmp_path):
    """In a spec (the line named) and on the command line: one message, exit status 2, before anything runs."""
    tiny = CHECKPOINT.parent / "tiny-local.yaml"
    text = tiny.read_text().replace("runtime:\n", "runtime:\n  speculate: mtp:2\n")
    (tmp_path / "spec.yaml").write_text(text.replace("hf_config: tiny/", f"hf_config: {tiny.parent}/tiny/"))
    with pytest.raises(SpecError, match=r"runtime\.speculate.*mtp:2 drafts with the model's multi-token-prediction"):
        load_spec(tmp_path / "spec.yaml")
    result = CliRunner().invoke(cli, ["run", str(tiny), "--speculate", "mtp"])
    assert result.exit_code == 2 and "--speculate mtp drafts with the model's multi-token-prediction layer, and " \
        "Cascadia runs none of its config's (num_mtp_layers: None" in result.output and "Traceback" not in result.output


def test_the_plan_counts_what_the_layer_holds():
    """At the last of three stages: the state the layer allocates, and its weights (f32 here: the checkpoint's own
    bytes, with the embedding table it reads), are what the plan adds to that stage beside prompt lookup's plan."""
    spec = attrs.evolve(PIPELINE_SPEC, runtime=attrs.evolve(PIPELINE_SPEC.runtime, speculate="mtp:3"))
    checkpoint = Checkpoint.open(CHECKPOINT)
    last = StageEngine(checkpoint, range(4, 6), embed=False, head=True, runtime=spec.runtime,
                       formats=spec.model.formats, warm_up=False)
    weights, state = mtp_memory(spec.model, spec.runtime, embed=False)
    assert state == last.mtp.state_bytes
    stored = sum(4 * checkpoint.tensor(name).size for name in checkpoint.mtp_names())
    assert weights == stored + embedding_cost(spec.model).weight_bytes
    planned = make_plan(spec).stages[-1]
    ngram = make_plan(attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, speculate="ngram:3"))).stages[-1]
    assert planned.weight_bytes - ngram.weight_bytes == weights
    layout = pool_layout(layer_costs(spec.model, spec.runtime)[4:6], spec.runtime)
    assert ngram.kv_blocks - planned.kv_blocks == -(-(weights + state) // layout.block_bytes) or \
        ngram.kv_blocks - planned.kv_blocks == (weights + state) // layout.block_bytes
