"""Speculative decoding on the real engine: the tiny model in one process (a stage holding every layer, the
embedding and the head, driven by the policy as the last node is, frames completed in a seeded random order) gives
exactly the tokens it gives without speculation, greedy and sampled, with 1, 4 and 16 streams at once, whatever the
drafts: prompt lookup, drafts always wrong, or a replay of the run's own outputs (every draft accepted). And a
rewind keeps nothing of the rows it drops."""

import json
import random
from pathlib import Path

import attrs
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Served

from cascadia.engine.checkpoint import Checkpoint
from cascadia.grammar import json_grammar, vocabulary
from cascadia.engine.device import runs_as
from cascadia.engine.engine import Engine, StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.rows import BatchError
from cascadia.graph.costs import layer_costs, pool_layout
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.coordinator import Logprobs, frame_logprobs, wire_frame, with_logprobs
from cascadia.pipeline.node import ForeignFrame
from cascadia.pipeline.run import Pipeline
from cascadia.pipeline.stage import EngineStage, RowSampler
from cascadia.pipeline.wire import Frame as WireFrame
from cascadia.policy import DRAFT, Policy, Request, Token
from cascadia.sampling import LogitAdjustments, Sampling
from cascadia.spec.dump import write_spec
from cascadia.spec.types import PAPER_FORMATS, WeightFormat, WeightFormats
from cascadia.speculation import NgramDrafter, ReplayDrafter
from cascadia.tokenizer import load_tokenizer

VOCAB, EOS = 512, 2  # specs/tiny/config.json
SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


def whole_model(spec, checkpoint, speculate: str | None) -> EngineStage:
    runtime, cfg = attrs.evolve(spec.runtime, speculate=speculate), spec.model.config
    engine = StageEngine(Checkpoint.open(checkpoint), range(cfg.num_hidden_layers), embed=True, head=True,
                         runtime=runtime, formats=spec.model.formats, threads=1)
    return EngineStage(engine, RowSampler(runtime.max_streams, engine.rewind,
                                          lambda: vocabulary(checkpoint, cfg.output_vocab_size, cfg.eos_ids)))


@pytest.fixture(scope="module")
def plain(spec, checkpoint):
    return whole_model(spec, checkpoint, None)


@pytest.fixture(scope="module")
def speculative(spec, checkpoint):
    return whole_model(spec, checkpoint, "ngram:4")


def repetitive_requests(n: int, sampled: bool, long_every: int = 1) -> list[Request]:
    """Prompts that repeat a short phrase, so that prompt lookup finds drafts; lengths vary, and requests
    0, long_every, 2 long_every, ... make the most tokens."""
    requests = []
    for i in range(n):
        phrase = [(7 * i + 3 * j) % VOCAB for j in range(3 + i % 3)]
        prompt = (phrase * 6)[: 10 + i % 7]
        sampling = Sampling(0.8, 0.9, seed=i) if sampled else Sampling()
        requests.append(Request(i, prompt, 16 if i % long_every == 0 else 4 + i % 5, sampling=sampling))
    return requests


class WrongDrafter(ReplayDrafter):
    """The replay's tokens shifted by one: every draft rejected."""

    def propose(self, request_id, prompt, output, limit):
        return [(t + 1) % VOCAB for t in super().propose(request_id, prompt, output, limit)]


def serve(stage: EngineStage, runtime, requests, n_groups: int, drafter=None, seed: int = 0,
          reported: dict | None = None):
    """Every request at once (each a stream; a list: the choices of one prompt); frames of the groups in flight are
    computed in a random order. Each request's tokens, and the frames; into `reported`, each request's Logprobs,
    token by token."""
    policy = Policy.for_runtime(attrs.evolve(runtime, speculate="ngram:4" if drafter else None), n_groups,
                                 drafter=drafter)
    rng, outputs, frames, in_flight = random.Random(seed), {}, [], {}
    for request in requests:
        policy.add_choices(request) if isinstance(request, list) else policy.add_request(request)
    while not policy.done:
        for frame in policy.next_frames():
            in_flight[frame.group] = frame
        frame = in_flight.pop(rng.choice(sorted(in_flight)))
        frames.append(frame)
        tokens = stage.process(wire_frame(frame))
        events = policy.complete_frame(frame, tokens.token_ids.tolist())
        for event in with_logprobs(events, *frame_logprobs(frame, tokens)):
            if isinstance(event, Token):
                outputs.setdefault(event.request_id, []).append(event.token)
            elif isinstance(event, Logprobs) and reported is not None:
                reported.setdefault(event.request_id, []).append(event)
    return outputs, frames


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_speculation_gives_the_tokens_of_a_run_without_it(spec, plain, speculative, concurrency, sampled):
    # the first group's two streams run longest: once the other groups' have finished, frames mix their drafts
    n_groups = concurrency // 2 + 1 if concurrency > 1 else 3
    requests = repetitive_requests(concurrency, sampled, long_every=n_groups)
    expected, _ = serve(plain, spec.runtime, requests, n_groups)
    recorded = {r.prompt_ids: expected[r.id] for r in requests}
    for drafter in (NgramDrafter(), ReplayDrafter(recorded), WrongDrafter(recorded)):
        outputs, frames = serve(speculative, spec.runtime, requests, n_groups, drafter, seed=concurrency)
        assert outputs == expected, type(drafter).__name__
        if isinstance(drafter, NgramDrafter):  # it drafts what the model makes of its prompts: maybe nothing
            continue
        drafted = [f for f in frames if any(r.kind == DRAFT for r in f.rows)]
        assert drafted, "nothing was speculated"
        if concurrency > 1:  # some frame verifies drafts beside another stream's rows
            assert any(len({r.request_id for r in f.rows}) > 1 for f in drafted)


def test_speculation_reports_the_log_probabilities_of_a_run_without_it(spec, plain, speculative):
    """Each token's log-probability and its three likeliest alternatives, where drafted rows verified it (every
    draft accepted, or none): those of a run without speculation, to the rounding of rows computed in other
    calls."""
    requests = [attrs.evolve(r, sampling=attrs.evolve(r.sampling, logprobs=3 if r.id % 2 else 0))
                for r in repetitive_requests(4, sampled=True, long_every=3)]
    expected_reported: dict = {}
    expected, _ = serve(plain, spec.runtime, requests, 3, reported=expected_reported)
    recorded = {r.prompt_ids: expected[r.id] for r in requests}
    for drafter in (ReplayDrafter(recorded), WrongDrafter(recorded)):
        reported: dict = {}
        assert serve(speculative, spec.runtime, requests, 3, drafter, seed=4, reported=reported)[0] == expected
        for request in requests:
            mine, theirs = reported[request.id], expected_reported[request.id]
            assert len(mine) == len(theirs) == len(expected[request.id])
            assert [[i for i, _ in r.top] for r in mine] == [[i for i, _ in r.top] for r in theirs]
            assert [len(r.top) for r in mine] == [request.sampling.logprobs] * len(mine)
            np.testing.assert_allclose([r.logprob for r in mine], [r.logprob for r in theirs], rtol=0, atol=1e-5)
            np.testing.assert_allclose([v for r in mine for _, v in r.top], [v for r in theirs for _, v in r.top],
                                       rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_penalties_bias_and_min_tokens_stay_exact_through_speculation(spec, checkpoint, plain, speculative, sampled):
    """Logits changed by what each stream has made (every adjustment at once): the pipeline's last stage gives the
    tokens `cascadia generate` gives, and speculation (every draft accepted, or none) the tokens of a run without
    it, the stage's history of each stream cut back at each rewind."""
    def adjusted(request: Request) -> Request:
        adjust = LogitAdjustments(len(request.prompt_ids), min_tokens=3 + request.id % 3, stop_ids=(1, 2),
                                  logit_bias=((5, 3.0), (request.id + 20, -2.0)), repetition_penalty=1.3,
                                  frequency_penalty=0.4, presence_penalty=0.3)
        return attrs.evolve(request, sampling=attrs.evolve(request.sampling, adjust=adjust))

    requests = [adjusted(r) for r in repetitive_requests(4, sampled, long_every=3)]
    expected, _ = serve(plain, spec.runtime, requests, 3)
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    assert expected == {r.id: list(generate(engine, r.prompt_ids, r.max_new_tokens, r.sampling).ids)
                        for r in requests}
    unadjusted, _ = serve(plain, spec.runtime, [attrs.evolve(r, sampling=attrs.evolve(r.sampling, adjust=None))
                                                for r in requests], 3)
    assert unadjusted != expected  # the adjustments changed something
    recorded = {r.prompt_ids: expected[r.id] for r in requests}
    for drafter in (ReplayDrafter(recorded), WrongDrafter(recorded)):
        assert serve(speculative, spec.runtime, requests, 3, drafter, seed=4)[0] == expected, type(drafter).__name__


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_choices_of_a_prompt_forked_at_the_stage_are_its_requests_alone_speculating_or_not(spec, checkpoint, plain,
                                                                                          speculative, sampled):
    """Three choices of each of four prompts (every logit adjustment on, the seeds one after another): the stage
    computes each prompt once and forks its state, and each choice gets the tokens of its request served alone and
    of `cascadia generate`; speculating too (drafts of the first choice's tokens: all of its accepted, most of the
    others' rejected)."""
    families = []
    for r in repetitive_requests(4, sampled, long_every=3):
        adjust = LogitAdjustments(len(r.prompt_ids), min_tokens=2, stop_ids=(1, 2), logit_bias=((5, 3.0),),
                                  repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
        families.append([attrs.evolve(r, id=10 * r.id + c, sampling=attrs.evolve(r.sampling, adjust=adjust,
                                                                                  seed=r.sampling.seed + c))
                         for c in range(3)])
    alone, _ = serve(plain, spec.runtime, [r for family in families for r in family], 3)
    forked, frames = serve(plain, spec.runtime, families, 3)
    assert forked == alone
    assert sum(row.fork >= 0 for f in frames for row in f.rows) == 8
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    assert alone == {r.id: list(generate(engine, r.prompt_ids, r.max_new_tokens, r.sampling).ids)
                     for family in families for r in family}
    assert sampled == (alone[0] != alone[1])
    drafter = ReplayDrafter({family[0].prompt_ids: alone[family[0].id] for family in families})
    assert serve(speculative, spec.runtime, families, 3, drafter, seed=5)[0] == alone


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_grammar_holds_speculating_streams_to_the_tokens_of_a_plain_run(spec, checkpoint, plain, speculative,
                                                                          sampled):
    """Streams held to a JSON schema (and one to any JSON object): prompt lookup's drafts mostly leave the grammar
    (each dropped with the rows after it), a replay's are all kept, a wrong one's none; every stream gets the tokens
    of a run without speculation, which are JSON its schema allows, or a prefix of it where the stream ran out of
    tokens."""
    schemas = [None, {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
                      "required": ["ok", "n"], "additionalProperties": False}]
    requests = [attrs.evolve(r, max_new_tokens=24, stop_ids={EOS}, sampling=attrs.evolve(r.sampling, adjust=(
                    LogitAdjustments(len(r.prompt_ids), grammar=json_grammar(schemas[r.id % 2])))))
                for r in repetitive_requests(4, sampled, long_every=3)]
    expected, _ = serve(plain, spec.runtime, requests, 3)
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    tokens = vocabulary(checkpoint, spec.model.config.output_vocab_size, spec.model.config.eos_ids)
    assert expected == {r.id: list(generate(engine, r.prompt_ids, r.max_new_tokens, r.sampling, r.stop_ids,
                                            vocabulary=tokens).ids) for r in requests}  # the single process's
    tokenizer = load_tokenizer(checkpoint)
    finished = [json.loads(tokenizer.decode(ids[:-1])) for ids in expected.values() if ids[-1] == EOS]
    assert finished and all(isinstance(value, dict) for value in finished)
    recorded = {r.prompt_ids: expected[r.id] for r in requests}
    for drafter in (NgramDrafter(), ReplayDrafter(recorded), WrongDrafter(recorded)):
        assert serve(speculative, spec.runtime, requests, 3, drafter, seed=4)[0] == expected, type(drafter).__name__


@pytest.mark.parametrize("formats", [WeightFormats(**{field.name: WeightFormat("bf16")
                                                      for field in attrs.fields(WeightFormats)}), PAPER_FORMATS],
                         ids=["bf16", "paper-formats"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_at_bf16_speculation_gives_the_tokens_of_a_run_without_it(spec, checkpoint, sampled, formats):
    """The same at bf16 compute and K/V, the weights bf16 or in the paper's formats (int4 in groups of 32, int8),
    where verifying drafts computes a stream's rows as a chunk that a run without speculation computes one decode
    step at a time."""
    if runs_as("bf16", "CPU") != "bf16":
        pytest.skip(f"this CPU has no bf16 arithmetic: OpenVINO computes it in {runs_as('bf16', 'CPU')}")
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, precision="bf16", kv_precision="bf16"),
                        model=attrs.evolve(spec.model, formats=formats))
    n_groups, requests = 3, repetitive_requests(4, sampled, long_every=3)
    expected, _ = serve(whole_model(spec, checkpoint, None), spec.runtime, requests, n_groups)
    recorded = {r.prompt_ids: expected[r.id] for r in requests}
    speculative = whole_model(spec, checkpoint, "ngram:4")
    for drafter in (NgramDrafter(), ReplayDrafter(recorded), WrongDrafter(recorded)):
        outputs, _ = serve(speculative, spec.runtime, requests, n_groups, drafter, seed=4)
        assert outputs == expected, type(drafter).__name__


def test_a_replay_of_the_outputs_takes_fewer_frames(spec, plain, speculative):
    requests = repetitive_requests(1, sampled=True)
    expected, plain_frames = serve(plain, spec.runtime, requests, 3)
    replay = ReplayDrafter({r.prompt_ids: expected[r.id] for r in requests})
    outputs, frames = serve(speculative, spec.runtime, requests, 3, replay)
    assert outputs == expected and len(frames) < len(plain_frames) / 2


def test_a_rewound_stream_keeps_nothing_of_its_rejected_rows(spec, speculative):
    """After rows beyond the accepted position, what follows does not depend on what those rows held, bit for bit
    (K/V masked by position, convolution inputs rebuilt from those kept by position), and matches a stream that
    never went beyond (to rounding: its calls had other shapes)."""
    engine = speculative.engine
    prompt = list(range(20, 40))
    assert len(prompt) + 5 > spec.model.config.sliding_window_size + 8  # the sliding layers' rings wrap
    prompt_calls = [(0, prompt[:8]), (8, prompt[8:16]), (16, prompt[16:])]  # calls of at most the largest bucket

    def run(feeds):
        engine.release(0)
        for start, tokens in prompt_calls + feeds:
            hidden = engine.forward(engine.embed(np.array(tokens)), [0] * len(tokens),
                                    list(range(start, start + len(tokens))))
        return engine.logits(hidden[-1:])

    # five rows at 20..24 (a decode row and four drafts), only the first kept; then 21, 22 again from other tokens
    rewound = run([(20, [1, 9, 8, 7, 6]), (21, [2, 3])])
    np.testing.assert_array_equal(run([(20, [1, 5, 5, 5, 5]), (21, [2, 3])]), rewound)
    np.testing.assert_allclose(run([(20, [1]), (21, [2, 3])]), rewound, rtol=0, atol=1e-6)
    assert np.abs(run([(20, [1, 9, 8, 7, 6]), (25, [2, 3])]) - rewound).max() > 1e-3  # the drafts did count there
    # a rewind deeper than the last call allows is refused before anything changes
    run([(20, [1])])
    with pytest.raises(BatchError, match="rows start at 20"):
        engine.forward(engine.embed(np.array([5])), [0], [20])


# ---- the 3-node pipeline ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speculating_pipeline(spec, checkpoint):
    """The tiny spec's three local nodes, each keeping the state a rewind of up to four drafts needs."""
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, speculate="ngram:4"))
    with Pipeline.start(spec, make_plan(spec), checkpoint=checkpoint, node_timeout_s=20) as started:
        yield started
    assert [p.returncode for p in started.local.processes] == [0, 0, 0]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", ["ngram", "replay", "wrong"])
def test_the_pipeline_speculates_exactly_at_every_concurrency(spec, plain, speculating_pipeline, drafts, sampled):
    workload = attrs.evolve(spec.workload, concurrency=(1, 4, 16), output_tokens=10, greedy=not sampled,
                            temperature=0.8, top_p=0.9, seed=3, top_k=40, min_p=0.01)
    prompts = [r.prompt_ids for r in repetitive_requests(16, sampled)]
    sampling = Sampling.of(workload)
    # each stream's tokens depend on its prompt and sampling only: the single-process engine, without speculation
    expected, _ = serve(plain, spec.runtime, [Request(i, p, 10, sampling=sampling) for i, p in enumerate(prompts)],
                        n_groups=1)
    recorded = {prompt: expected[i] for i, prompt in enumerate(prompts)}
    drafter = {"ngram": None, "replay": ReplayDrafter(recorded), "wrong": WrongDrafter(recorded)}[drafts]
    done = speculating_pipeline.run(workload, prompts=prompts, drafter=drafter)
    assert len(done.outputs) == 2 * (1 + 4 + 16)
    for line in done.outputs:
        assert line["output_ids"] == recorded[tuple(line["prompt_ids"])], f"request {line['request_id']}"
    speculation = [level["speculation"] for level in done.result["levels"]]
    # a lone stream leaves two stages idle: after its first token, 4 drafts all accepted, then the 3 it has left;
    # or, all rejected, 4, then 1 a step (the draft length adapts) for the next 7 tokens, none for the last
    if drafts != "ngram":  # at 4 and 16 streams too, once groups fall idle as the phase's requests run out
        assert all(s["proposed"] > 0 for s in speculation)
    if drafts == "replay":
        assert speculation[0] == {"proposed": 7, "accepted": 7, "mean_accepted_per_step": 3.5}
        assert all(s["accepted"] == s["proposed"] for s in speculation)
    if drafts == "wrong":
        assert speculation[0] == {"proposed": 4 + 7, "accepted": 0, "mean_accepted_per_step": 0}
        assert all(s["accepted"] == 0 for s in speculation)
    # each request's acceptance trace adds up to its level's counts (the measured phases'; warm-ups count apart)
    for level, counted in zip(workload.concurrency, speculation):
        steps = [step for line in done.outputs if line["concurrency"] == level and line["phase"] == "measured"
                 for step in line["drafts"]]
        assert (sum(p for p, _ in steps), sum(a for _, a in steps)) == (counted["proposed"], counted["accepted"])


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_serve_speculates_with_the_same_replies(tmp_path, spec, checkpoint, precision):
    """`cascadia serve --speculate`: the prompt's own phrase drafts for the first reply (rejected: the random model
    does not go on with it), the phrase table (the first reply's tokens) for the same prompt asked again, which
    greedy decoding and a seeded draw both make again; every reply is the one without speculation, at the tiny
    spec's f32 and at bf16 compute, weights and K/V."""
    if runs_as(precision, "CPU") != precision:
        pytest.skip(f"this CPU has no {precision} arithmetic: OpenVINO computes it in {runs_as(precision, 'CPU')}")
    path = SPEC
    if precision != "f32":
        formats = WeightFormats(**{field.name: WeightFormat(precision) for field in attrs.fields(WeightFormats)})
        spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, precision=precision, kv_precision=precision),
                            model=attrs.evolve(spec.model, formats=formats))
        path = write_spec(spec, tmp_path / "spec.yaml")
    engine = Engine(Checkpoint.open(checkpoint), spec.runtime, formats=spec.model.formats, threads=1)
    tokenizer = load_tokenizer(checkpoint)
    served = Served(tmp_path, path, checkpoint, "--speculate", "ngram:4")
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = [5, 9, 3, 5, 9, 3, 5, 9]
        for sampling in (Sampling(), Sampling(0.9, 0.95, seed=4)):
            expected = tokenizer.decode(list(generate(engine, prompt, 12, sampling).ids), skip_special_tokens=True)
            for _ in range(2):
                reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                                  temperature=sampling.temperature, top_p=sampling.top_p,
                                                  seed=sampling.seed, extra_body={"ignore_eos": True})
                assert reply.choices[0].text == expected
        metrics = {sample.name: sample.value for family in text_string_to_metric_families(
            httpx.get(f"{served.url}/metrics", timeout=10).text) for sample in family.samples}
        proposed, accepted = metrics["cascadia_draft_tokens_proposed_total"], \
            metrics["cascadia_draft_tokens_accepted_total"]
        assert 0 < accepted <= proposed  # a second ask drafts the first reply's tokens, which it makes again
    finally:
        assert served.stop() == 0


def test_the_state_the_engine_allocates_is_the_state_the_plan_counts(spec, plain, speculative):
    for stage, speculate in ((plain, None), (speculative, "ngram:4")):
        runtime = attrs.evolve(spec.runtime, speculate=speculate)
        costs = layer_costs(spec.model, runtime)  # the stage holds every layer
        slots = runtime.max_streams * sum(c.conv_state_bytes for c in costs)
        pool = stage.engine.pool.blocks * pool_layout(costs, runtime).block_bytes
        assert slots + pool == stage.engine.state_bytes


def test_a_frame_stepping_back_further_than_its_state_allows_is_foreign(speculative):
    """The last stage refuses, before anything changes, rows that start further back than the drafts of the
    slot's last call (or MAX_DRAFT) reach."""
    def frame(seq, positions, tokens):
        n = len(positions)
        return WireFrame(seq, 0, [5] * n, positions, tokens, [True] * n, temperature=[0.0] * n, top_p=[1.0] * n,
                         seed=[0] * n)

    engine = speculative.engine
    speculative.process(frame(0, range(8), [3] * 8))  # a prompt of 8 rows: the next may start up to 4 back
    speculative.process(frame(1, range(6, 9), [3, 4, 5]))  # 2 back, 3 rows
    before = engine.lengths.copy(), engine.reach.copy(), [s.conv_kv.copy() for s in engine.states]
    with pytest.raises(ForeignFrame, match="is at position 9 .or up to 2 before., but its rows start at 6"):
        speculative.process(frame(2, [6], [1]))
    assert np.array_equal(engine.lengths, before[0]) and np.array_equal(engine.reach, before[1])
    assert all(np.array_equal(s.conv_kv, kept) for s, kept in zip(engine.states, before[2]))
    speculative.process(frame(3, [7], [1]))  # 2 back: taken
    engine.release(5)


def test_a_fork_of_a_stream_not_where_it_stands_is_foreign(plain):
    """A row that forks slot 5 at a position other than its length, or with logit adjustments when the stage keeps
    no tokens of slot 5, is refused before anything changes."""
    def frame(seq, slots, positions, forks=None, adjustments=None):
        n = len(slots)
        return WireFrame(seq, 0, slots, positions, [3] * n, [True] * n, forks=forks, adjustments=adjustments or {})

    engine = plain.engine
    plain.process(frame(0, [5] * 6, range(6)))
    before = engine.lengths.copy(), engine.pool.free
    with pytest.raises(ForeignFrame, match="slot 6 forks slot 5 at position 5, where that stream stands at 6"):
        plain.process(frame(1, [6], [5], forks=[5]))
    with pytest.raises(ForeignFrame, match="slot 6 forks slot 5, whose tokens this stage does not keep"):
        plain.process(frame(1, [6], [6], forks=[5], adjustments={6: LogitAdjustments(6, min_tokens=2)}))
    assert np.array_equal(engine.lengths, before[0]) and engine.pool.free == before[1]
    plain.process(frame(1, [5, 6], [6, 6], forks=[-1, 5]))
    assert engine.lengths[5] == engine.lengths[6] == 7
    engine.release(5)
    engine.release(6)
