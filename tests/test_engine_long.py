"""The f32 engine against transformers at long positions (tests/fixtures/long, made by scripts/make_fixtures.py):
a 6,080-token prompt in chunked prefill, then 64 greedy tokens, on a model whose sliding rings wrap hundreds of times
and whose global layers are log-scaled (tau 2.8 at the end); and on a DeepSeek-V3 attending in its latents, mostly
beyond its YaRN-scaled trained context (tests/fixtures/long_deepseek). The checkpoints are rewritten from the
fixtures' configs and seeds; only some positions' logits are stored."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from cascadia.engine import attention
from cascadia.engine.attention import FUSED_KEYS, SPAN_KEYS, AttentionShape
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.init_model import init_model
from cascadia.engine.kv_store import PagedKV
from cascadia.engine.state_format import StateFormat
from cascadia.graph.planner import plan as make_plan
from cascadia.models import config_from_hf_dict
from cascadia.models.inkling import InklingConfig
from cascadia.pipeline.run import Pipeline
from cascadia.spec.types import RuntimeSpec

FIXTURE = Path(__file__).parent / "fixtures" / "long"
TOLERANCE = 1e-4  # largest |engine - reference| relative to the largest |reference logit|


def assert_close(logits: np.ndarray, reference: np.ndarray) -> None:
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    assert error <= TOLERANCE, f"relative error {error:.2e}"
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURE / "reference.npz"))


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, reference):
    config = InklingConfig.from_hf_dict(json.loads((FIXTURE / "config.json").read_text()))
    folder = tmp_path_factory.mktemp("long-checkpoint")
    init_model(config, folder, seed=int(reference["seed"]))
    return folder


def long_runtime(**changes) -> RuntimeSpec:
    return RuntimeSpec(**{"precision": "f32", "max_streams": 2, "context_budget": 6144} | changes)


def greedy_continuation(engine: Engine, prompt: np.ndarray, n: int, slot: int = 0) -> tuple[list[int], np.ndarray]:
    engine.release(slot)
    row = engine.prefill(slot, prompt)
    tokens, rows = [], []
    for _ in range(n):
        rows.append(row)
        tokens.append(int(row.argmax()))
        row = engine.step([slot], [tokens[-1]])[0]
    return tokens, np.stack(rows)


@pytest.mark.parametrize("row_buckets, fused_from, span_keys, fused_keys",
                         [((1, 2, 8, 16, 24, 32), 64, SPAN_KEYS, FUSED_KEYS),
                          ((1, 8, 256), "never", SPAN_KEYS, FUSED_KEYS), ((1, 8, 256), 64, SPAN_KEYS, FUSED_KEYS),
                          ((1, 8, 256), 64, 192, 128)],
                         ids=["chunks-32", "chunks-256", "chunks-256-fused", "chunks-256-spans-192-fused-128"])
def test_chunked_prefill_and_greedy_decode_match_transformers(long_checkpoint, reference, row_buckets, fused_from,
                                                              span_keys, fused_keys, monkeypatch):
    """Chunks of 32 rows attend in spans alone, and so do chunks of 256 by default; with `fused_attention_from: 64`
    chunks of 256 read their far keys fused (in one piece; in pieces of 128 keys, 2 blocks, each folding the ones
    before into its sink). Spans of SPAN_KEYS (two spans at the end) and of 192 keys (32 spans, 3 blocks each,
    combined on the thread pool)."""
    monkeypatch.setattr(attention, "SPAN_KEYS", span_keys)
    monkeypatch.setattr(attention, "FUSED_KEYS", fused_keys)
    fused_calls = []
    fused = attention._fused
    monkeypatch.setattr(attention, "_fused", lambda *args: fused_calls.append(args[4]) or fused(*args))
    runtime = long_runtime(row_buckets=row_buckets, fused_attention_from=fused_from)
    engine = Engine(Checkpoint.open(long_checkpoint), runtime, threads=1)
    prompt = reference["prompt_ids"]
    assert_close(engine.score(prompt)[reference["positions"]], reference["prompt_logits"])
    tokens, logits = greedy_continuation(engine, prompt, len(reference["greedy_ids"]), slot=1)
    assert tokens == reference["greedy_ids"].tolist()
    assert_close(logits, reference["greedy_logits"])
    if fused_from == "never" or max(row_buckets) < fused_from:
        assert not fused_calls
    else:  # every chunk after the first has far keys, in both global layers, in both prefills (score, then slot 1)
        chunks = -(-len(prompt) // max(row_buckets))
        assert len(fused_calls) == 2 * 2 * (chunks - 1)
        assert (max(fused_calls) > fused_keys) == (fused_keys < FUSED_KEYS)  # several pieces only when asked


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """tests/fixtures/long_deepseek's reference, and its checkpoint rewritten from its config and seed."""
    reference = dict(np.load(FIXTURE.with_name("long_deepseek") / "reference.npz"))
    config = config_from_hf_dict(json.loads((FIXTURE.with_name("long_deepseek") / "config.json").read_text()))
    folder = tmp_path_factory.mktemp("long-deepseek")
    init_model(config, folder, seed=int(reference["seed"]))
    return reference, folder


@pytest.mark.parametrize("fused_from, span_keys, fused_keys", [("never", SPAN_KEYS, FUSED_KEYS), (64, 192, 128)],
                         ids=["spans", "spans-192-fused-128"])
def test_deepseek_v3s_latents_at_long_positions_match_transformers(deepseek, fused_from, span_keys, fused_keys,
                                                                   monkeypatch):
    """DeepSeek-V3 (tests/fixtures/long_deepseek) to position 6,143, most of it beyond its YaRN-scaled trained
    context of 512: each position's latent is its key and its value, read in spans (two of 4,096, or 32 of 192
    combined on the thread pool) and, from chunks of 64 rows, fused (the far latents in pieces of 128)."""
    reference, checkpoint = deepseek
    monkeypatch.setattr(attention, "SPAN_KEYS", span_keys)
    monkeypatch.setattr(attention, "FUSED_KEYS", fused_keys)
    fused_calls = []
    fused = attention._fused
    monkeypatch.setattr(attention, "_fused", lambda *args: fused_calls.append(args[4]) or fused(*args))
    engine = Engine(Checkpoint.open(checkpoint), long_runtime(row_buckets=(1, 8, 256), fused_attention_from=fused_from),
                    threads=1)
    prompt = reference["prompt_ids"]
    assert_close(engine.score(prompt)[reference["positions"]], reference["prompt_logits"])
    tokens, logits = greedy_continuation(engine, prompt, len(reference["greedy_ids"]), slot=1)
    assert tokens == reference["greedy_ids"].tolist()
    assert_close(logits, reference["greedy_logits"])
    assert bool(fused_calls) == (fused_from != "never")


@pytest.mark.parametrize("model", ["inkling", "deepseek_v3"])
def test_the_pipeline_matches_transformers_at_long_positions(spec, long_checkpoint, reference, deepseek, model):
    """The long models on the tiny spec's three local nodes: prompt in frames of 64 rows, then the greedy tokens
    one frame each (teacher-forced: each row's logits are those greedy decoding takes its token from)."""
    reference, checkpoint = (reference, long_checkpoint) if model == "inkling" else deepseek
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, config=Checkpoint.open(checkpoint).config,
                                                 checkpoint=checkpoint),
                        runtime=long_runtime(row_buckets=(1, 8, 64)),
                        workload=attrs.evolve(spec.workload, concurrency=(1,)))
    prompt, greedy = reference["prompt_ids"], reference["greedy_ids"]
    with Pipeline.start(spec, make_plan(spec), checkpoint=checkpoint, with_logits=True,
                        node_timeout_s=60) as pipeline:
        logits = pipeline.score(np.r_[prompt, greedy[:-1]], prefill=len(prompt))
    assert_close(logits[reference["positions"]], reference["prompt_logits"])
    assert_close(logits[len(prompt) - 1:], reference["greedy_logits"])


SHAPE = AttentionShape(8, 2, 32, None, 48, (64, 0.4), scale=1 / 32)


def scattered_streams(precision: str, first: np.ndarray, slots: np.ndarray, n: int):
    """A paged store (blocks of 64) holding streams of `first` positions at `slots`, written a hundred positions at a
    time in turn so that no stream's blocks lie in a row, with blocks for n more; and the q, k, v, rel of n rows
    of each (SHAPE: log-scaled, a bias bank of 48)."""
    store = PagedKV.alone(64, 64, 3, SHAPE.kv_heads, SHAPE.head_dim, StateFormat(precision))
    rng = np.random.default_rng(0)
    for start in range(0, int(first.max()), 100):
        for slot, length in zip(slots, first):
            if start < length:
                at = np.arange(start, min(start + 100, length))[None]
                store.pool.grow({int(slot): int(at.max()) + 1})
                store.write(np.array([slot]), at, *rng.standard_normal((2, 1, at.shape[1], 2, 32), np.float32))
    store.pool.grow({int(slot): int(length) + n for slot, length in zip(slots, first)})
    q = rng.standard_normal((len(slots), n, 8, 32), np.float32) * 3
    k, v = rng.standard_normal((2, len(slots), n, 2, 32), np.float32)
    return store, q, k, v, rng.standard_normal((len(slots), n, 8, 48), np.float32)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_spans_of_parts_of_a_calls_streams_agree_with_one_span(precision, monkeypatch):
    """Decode rows of three streams at 300, 1,000 and 2,600 positions: spans of one block (SPAN_KEYS 64), as if on
    64 CPUs: each span a task for the first stream and one for the other two, against one span of every entry
    in one task."""
    first, slots = np.array([300, 1000, 2600]), np.array([1, 2, 0])
    store, q, k, v, rel = scattered_streams(precision, first, slots, 1)
    tasks = []
    span = attention.paged_kernel.span
    monkeypatch.setattr(attention.paged_kernel, "span",
                        lambda q, *args: tasks.append((args[3], len(q))) or span(q, *args))
    monkeypatch.setattr(attention, "_width", lambda: 64)
    monkeypatch.setattr(attention, "SPAN_KEYS", 64)
    monkeypatch.setattr(attention, "TASK_KEYS", 64)
    parted = attention.attend(SHAPE, q, k, v, rel, store, slots, first)
    assert sorted(tasks) == sorted((start, part) for start in range(0, 2601, 64) for part in (2, 1))
    monkeypatch.setattr(attention, "SPAN_KEYS", 3 * 4096)
    monkeypatch.setattr(attention, "_width", lambda: 1)
    whole = attention.attend(SHAPE, q, k, v, rel, store, slots, first)
    assert tasks[-1] == (0, 3)
    assert np.abs(parted - whole).max() <= 1e-6 * np.abs(whole).max()


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_fused_far_keys_agree_with_spans_for_streams_at_different_positions(precision, monkeypatch):
    """Two streams' chunks of 64 rows in one call, at positions 1,000 and 2,600 of a paged store (non-consecutive
    blocks), log-scaled with a bias bank: fused (in pieces of 512 keys) against the spans alone."""
    first, slots, n = np.array([1000, 2600]), np.array([2, 0]), 64
    store, q, k, v, rel = scattered_streams(precision, first, slots, n)
    monkeypatch.setattr(attention, "FUSED_KEYS", 512)
    store.fused_from = n
    fused = attention.attend(SHAPE, q, k, v, rel, store, slots, first)
    store.fused_from = None
    spans = attention.attend(SHAPE, q, k, v, rel, store, slots, first)
    assert np.abs(fused - spans).max() <= 2e-6 * np.abs(spans).max()  # f32 rounding: 2-6e-7 measured (AVX-512)


def test_gathering_a_few_blocks_of_a_large_pool_copies_only_them():
    """A global layer's keys and values are a strided view of the pool (every block holds every layer's part), and
    np.take copies a strided source whole before it gathers: scattered blocks are gathered from one contiguous array
    of all the parts, so reading 4 blocks of a 256 MiB pool allocates about them, never the pool."""
    import tracemalloc

    store = PagedKV.alone(2048, 64, 2, 4, 64, StateFormat("f32"))  # 2048 blocks of 128 KiB
    assert not store.k.flags.c_contiguous
    store.pool.grow({0: 64})
    store.pool.grow({1: 64})
    store.pool.grow({0: 128, 1: 128})  # each slot's two blocks apart
    rng = np.random.default_rng(0)
    for slot in (0, 1):
        store.write(np.array([slot]), np.arange(128)[None], *rng.standard_normal((2, 1, 128, 4, 64), np.float32))
    tracemalloc.start()
    keys, values = store.read(np.array([0, 1]), 0, 128)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert keys.shape == (2, 2, 4, 64, 64) and peak < 4 * 2**20
    table = store.pool.table(np.array([1]), 2)[0]
    np.testing.assert_array_equal(keys[1], store.k[table])
