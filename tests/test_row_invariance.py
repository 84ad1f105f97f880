"""A row's result does not depend on the call it is computed in: neither on the bucket its call is padded to nor on
the other streams' rows beside it, at f32 and, where the CPU computes it, bf16, with float or compressed weights
(bench/row_invariance.py measures op by op where it would move); so a bf16 pipeline gives a request the tokens of
the single-process engine at any concurrency."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest
from test_pipeline import TIMEOUT_S, assert_outputs_match_engine

from cascadia.engine.attention import SPAN_KEYS, AttentionShape, attend
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import runs_as
from cascadia.engine.engine import Engine
from cascadia.engine.families.inkling import short_conv
from cascadia.engine.kv_store import PagedKV
from cascadia.engine.layers import router_logits
from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.run import run
from cascadia.sampling import Sampling
from cascadia.spec.types import RuntimeSpec, WeightFormat, WeightFormats

FIXTURES = Path(__file__).parent / "fixtures"
BUCKETS = (1, 2, 4, 8)
COMPRESSED = WeightFormats(routed_experts=WeightFormat("int4", 32), shared_experts=WeightFormat("int4", 32),
                           attention=WeightFormat("int8"), head=WeightFormat("int8"))


def every(fmt: WeightFormat) -> WeightFormats:
    return WeightFormats(**{field.name: fmt for field in attrs.fields(WeightFormats)})


def test_a_routers_logits_for_a_row_are_the_same_in_any_call():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((32, 512)).astype(np.float32)
    weight = rng.standard_normal((66, 512)).astype(np.float32)
    alone = router_logits(h[:1], weight)[0]
    assert all(np.array_equal(router_logits(h[:rows], weight)[0], alone) for rows in range(2, 33))
    np.testing.assert_allclose(router_logits(h, weight), h @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16"])
def test_a_convolution_over_a_chunk_is_the_one_over_its_rows_one_call_each(precision):
    """A stream's rows in one call (a prompt's chunk, a replay) against one call a row (decode steps): the same
    outputs and the same state, bit for bit, the earlier inputs taken as the state stores them either way."""
    fmt, kernel, channels, rows = StateFormat(precision), 4, 16, 6
    rng = np.random.default_rng(2)
    taps = rng.standard_normal((kernel, channels)).astype(np.float32)
    y = rng.standard_normal((rows, channels)).astype(np.float32)

    def convolve(calls: list[range]) -> tuple[np.ndarray, np.ndarray]:
        states, lengths, out = fmt.zeros((1, kernel - 1, channels)), np.zeros(1, np.int64), []
        for call in calls:
            built = Rows.build(np.zeros(len(call)), np.array(call), lengths, kernel, (1, 8), 8)
            out.append(short_conv(y[call.start:call.stop], taps, states, built, fmt))
            lengths[0] = call.stop
        return np.concatenate(out), states

    chunk, chunk_state = convolve([range(rows)])
    steps, step_state = convolve([range(i, i + 1) for i in range(rows)])
    assert np.array_equal(chunk, steps) and np.array_equal(chunk_state, step_state)


@pytest.mark.parametrize("model", ["inkling", "qwen3_odd", "llama_plain", "deepseek_odd"])
@pytest.mark.parametrize("precision, formats", [("f32", WeightFormats()), ("bf16", WeightFormats()),
                                                ("bf16", COMPRESSED)], ids=["f32", "bf16", "bf16-compressed"])
def test_a_streams_decode_step_is_the_same_alone_padded_or_beside_others(checkpoint, model, precision, formats):
    """Stream 0's logits for its next token, its prompt prefilled alone each time (the same state): alone, padded
    to every bucket, and in a call with every other stream, bit for bit; for each family (the tiny Inkling, the
    fixtures' Qwen3-MoE, Llama and DeepSeek-V3)."""
    if runs_as(precision, "CPU") != precision:
        pytest.skip(f"this CPU has no {precision} arithmetic: OpenVINO computes it in {runs_as(precision, 'CPU')}")
    if model == "deepseek_odd" and formats.attention.is_integer:
        pytest.skip("deepseek_odd's q_b_proj has 24 input columns: OpenVINO's bf16 matmul of int8 weights with fewer "
                    "than 32 (int4: 64) computes a row differently beyond 2 rows (a released model's have 1,536)")
    runtime = RuntimeSpec(context_budget=32, max_streams=BUCKETS[-1], precision=precision, kv_precision=precision,
                          row_buckets=BUCKETS)
    engine = Engine(Checkpoint.open(checkpoint if model == "inkling" else FIXTURES / model), runtime, formats=formats)
    stage = engine.stage
    prompts = np.random.default_rng(1).integers(0, engine.config.vocab_size, (BUCKETS[-1], 6))

    def step(streams: int, bucket: int) -> np.ndarray:
        for slot in range(BUCKETS[-1]):
            engine.release(slot)
        for slot in range(streams):
            engine.prefill(slot, prompts[slot])
        slots = np.arange(streams)
        hidden = stage.forward(stage.embed(prompts[:streams, 0]), slots, stage.lengths[slots], bucket)
        return stage.logits(hidden)[0]

    alone = step(1, 1)
    for bucket in BUCKETS[1:]:
        assert np.array_equal(step(1, bucket), alone), f"padded to {bucket} rows"
        assert np.array_equal(step(bucket, bucket), alone), f"beside {bucket - 1} other streams"


@pytest.mark.parametrize("model", ["inkling", "qwen3_odd", "llama_plain", "deepseek_odd"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_a_stream_taken_in_again_gives_the_logits_of_its_decode_steps(checkpoint, model, precision):
    """A prompt and the tokens a stream went on with, taken in again in one call (as a replay after a node's loss
    does), against the prompt then one decode step a token: the same last logits, bit for bit."""
    if runs_as(precision, "CPU") != precision:
        pytest.skip(f"this CPU has no {precision} arithmetic: OpenVINO computes it in {runs_as(precision, 'CPU')}")
    runtime = RuntimeSpec(context_budget=32, max_streams=1, precision=precision, kv_precision=precision,
                          row_buckets=(1, 2, 8, 16))
    engine = Engine(Checkpoint.open(checkpoint if model == "inkling" else FIXTURES / model), runtime)
    assert_taken_in_again_as_decoded(engine, 9)


def assert_taken_in_again_as_decoded(engine: Engine, tokens: int) -> None:
    """A 6-token prompt and `tokens` greedy tokens decoded a step at a time, then the stream released and its
    prompt and tokens prefilled again (in calls of the largest bucket): the same last logits, bit for bit."""
    prompt = np.random.default_rng(3).integers(0, engine.config.vocab_size, 6)
    logits, ids = engine.prefill(0, prompt), []
    for _ in range(tokens):
        ids.append(int(np.argmax(logits)))
        logits = engine.step([0], [ids[-1]])[0]
    engine.release(0)
    assert np.array_equal(engine.prefill(0, np.concatenate([prompt, ids])), logits)


@pytest.mark.parametrize("model", ["qwen3_odd", "llama_plain", "deepseek_odd"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_a_long_stream_taken_in_again_in_chunks_gives_the_logits_of_its_decode_steps(model, precision):
    """A prompt of 6 and 140 tokens decoded a step at a time, taken in again in chunks of 64 rows (the second and
    third with keys far behind them, as a replay of a long stream has): the same last logits, bit for bit, every
    row read by the spans a decode step takes (`fused_attention_from: never`, the default)."""
    if runs_as(precision, "CPU") != precision:
        pytest.skip(f"this CPU has no {precision} arithmetic: OpenVINO computes it in {runs_as(precision, 'CPU')}")
    runtime = RuntimeSpec(context_budget=160, max_streams=1, precision=precision, kv_precision=precision,
                          row_buckets=(1, 64), kv_block=16)
    assert_taken_in_again_as_decoded(Engine(Checkpoint.open(FIXTURES / model), runtime), 140)


@pytest.mark.parametrize("formats", [every(WeightFormat("bf16")), every(WeightFormat("int8")), COMPRESSED],
                         ids=["bf16", "int8", "int4-experts"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_bf16_pipeline_gives_each_request_the_single_process_engines_tokens(spec, checkpoint, formats, sampling):
    """The tiny spec at bf16 compute and K/V, its weights bf16, int8, or int4 experts and int8 the rest, on three
    nodes at concurrency 1 and 4 (the prompts prefilled in frames shared with other streams' rows): every request's
    tokens as the engine in one process makes them alone. Before the router took each row alone and the
    convolutions rounded a chunk's own inputs as the state does, 2 of 10 greedy requests matched here."""
    if runs_as("bf16", "CPU") != "bf16":
        pytest.skip(f"this CPU has no bf16 arithmetic: OpenVINO computes it in {runs_as('bf16', 'CPU')}")
    runtime = attrs.evolve(spec.runtime, precision="bf16", kv_precision="bf16", context_budget=128)
    bf16 = attrs.evolve(spec, runtime=runtime, model=attrs.evolve(spec.model, formats=formats))
    workload = attrs.evolve(spec.workload, concurrency=(1, 4), output_tokens=32, greedy=sampling.temperature == 0,
                            temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
    done = run(bf16, make_plan(bf16), workload, checkpoint=checkpoint, node_timeout_s=TIMEOUT_S)
    assert len(done.outputs) == 10
    assert_outputs_match_engine(done.outputs, Engine(Checkpoint.open(checkpoint), runtime, formats=formats,
                                                     threads=1), sampling)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_a_long_streams_attention_is_the_same_alone_or_beside_others(precision):
    """Stream 0's decode row at 9,000 positions (three spans of SPAN_KEYS), alone and in calls beside 1, 3 and 7
    other streams shorter and longer than it, bit for bit: its spans are cut at the same entries in every call,
    however the call's streams are split among tasks, and a span it does not reach adds nothing to it."""
    lengths = np.array([9000, 300, 12000, 4096, 100, 9000, 5000, 2])
    shape = AttentionShape(8, 2, 32, None, 48, (64, 0.4), scale=1 / 32)
    store = PagedKV.alone(int(sum(-(-(n + 1) // 256) for n in lengths)), 256, len(lengths), shape.kv_heads,
                          shape.head_dim, StateFormat(precision))
    rng = np.random.default_rng(4)
    for slot, n in enumerate(lengths.tolist()):
        store.pool.grow({slot: n + 1})
        store.write(np.array([slot]), np.arange(n)[None], *rng.standard_normal((2, 1, n, 2, 32), np.float32))
    q = rng.standard_normal((len(lengths), 1, 8, 32), np.float32) * 3
    k, v = rng.standard_normal((2, len(lengths), 1, 2, 32), np.float32)
    rel = rng.standard_normal((len(lengths), 1, 8, 48), np.float32)

    def row_0(streams: int) -> np.ndarray:
        return attend(shape, q[:streams], k[:streams], v[:streams], rel[:streams], store, np.arange(streams),
                      lengths[:streams])[0]
    alone = row_0(1)
    assert lengths[0] > 2 * SPAN_KEYS
    assert all(np.array_equal(row_0(streams), alone) for streams in (2, 4, 8))
