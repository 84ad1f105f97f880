"""The f32 engine against transformers' logits (tests/fixtures/<case>/reference.npz, made by
scripts/make_fixtures.py): prefill, cached decode, and batches mixing streams at different positions; Inkling's MoE
and Qwen3-MoE's and DeepSeek-V3's layers fused, and expert-grouped at every call size; Llamas of odd shapes (GQA,
head_dim, biases, a tied head, llama3 and linear RoPE); DeepSeek-V3 attending in the latent (YaRN, interleaved RoPE,
grouped routing, shared experts); the Llamas and Qwen3-MoEs with each stage as one graph (`runtime.stage_graph`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cascadia.engine import paged_attention
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.families import HOST_LAYERS
from cascadia.engine.rows import BatchError
from cascadia.models import FAMILIES
from cascadia.spec.types import PAGED_ATTENTION_BLOCK, STAGE_GRAPH_FAMILIES, RuntimeSpec

FIXTURES = Path(__file__).parent / "fixtures"
CASES = ("base", "sharded", "bf16_unpadded", "qwen3_odd", "qwen3_norm", "qwen3_stacked", "deepseek_odd",
         "deepseek_plain", "deepseek_fp8")
DENSE_CASES = ("llama_odd", "llama_plain")  # no experts: one path
# Largest |engine - reference| allowed, relative to the largest |reference logit|. Measured: below 1e-6.
TOLERANCE = 1e-4


def assert_close(logits: np.ndarray, reference: np.ndarray) -> None:
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    assert error <= TOLERANCE, f"relative error {error:.2e}"
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))  # identical greedy tokens


# runtime.moe_grouped_from of each MoE path; "graph": the stage as one graph (`runtime.stage_graph`), its experts
# fused in it, its attention over blocks of 8 gathered from the pool; "paged graph": over blocks of 32 read and
# written in place by OpenVINO's PagedAttention (`cascadia.engine.paged_attention`).
MOE_PATHS = {"fused": "never", "grouped": 1, "dense": "never", "graph": "never", "paged graph": "never"}
GRAPH_CASES = ("llama_odd", "llama_plain", "qwen3_odd", "qwen3_norm", "qwen3_stacked")
PARAMS = [(c, p) for c in CASES for p in ("fused", "grouped")] + [(c, "dense") for c in DENSE_CASES] + \
    [(c, p) for c in GRAPH_CASES for p in ("graph", "paged graph")]


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{p}" for c, p in PARAMS])
def case(request):
    name, moe_path = request.param
    path = FIXTURES / name
    # Blocks of 8 positions (32 paged): the global layers' keys of a stream lie in several blocks, and streams
    # interleave.
    runtime = RuntimeSpec(precision="f32", max_streams=12, context_budget=64, kv_block=32 if moe_path == "paged graph"
                          else 8, moe_grouped_from=MOE_PATHS[moe_path], stage_graph=moe_path.endswith("graph"))
    engine = Engine(Checkpoint.open(path), runtime)
    if runtime.stage_graph:
        assert engine.stage.graph is not None and not engine.stage.layers
        assert engine.stage.graph.paged == (moe_path == "paged graph")
        return engine, dict(np.load(path / "reference.npz"))
    moe_layers = [layer for layer in engine.stage.layers if layer.router is not None]
    assert bool(moe_layers) == (moe_path != "dense")
    assert all(layer.runs_grouped(b) == (moe_path == "grouped") for layer in moe_layers for b in runtime.row_buckets)
    return engine, dict(np.load(path / "reference.npz"))


def test_prefill_matches_reference(case):
    engine, ref = case
    assert engine.stage.precision == "f32"
    # 40 tokens: a chunk of 32 (the largest row bucket) then one of 8, past the window and the bias extent.
    assert_close(engine.score(ref["ids"]), ref["prefill_logits"])


def test_decode_matches_reference(case):
    engine, ref = case
    prefill = int(ref["prefill_len"])
    logits = engine.score(ref["ids"], prefill=prefill, slot=3)
    assert_close(logits[prefill:], ref["decode_logits"])
    assert_close(logits[:prefill], ref["prefill_logits"][:prefill])


def test_prefill_returns_last_row(case):
    engine, ref = case
    engine.release(1)
    assert_close(engine.prefill(1, ref["ids"][:17]), ref["prefill_logits"][16])


def test_mixed_batches_of_streams_at_different_positions(case):
    """Three streams in slots 7, 2 and 10 advance in random chunks (decode rows next to prefill chunks of other
    streams, in varying orders); every row must match its own stream's reference."""
    engine, ref = case
    streams = {7: (ref["ids"], ref["prefill_logits"]), 2: (ref["mixed_a_ids"], ref["mixed_a_logits"]),
               10: (ref["mixed_b_ids"], ref["mixed_b_logits"])}
    done = dict.fromkeys(streams, 0)
    for slot in streams:
        engine.release(slot)
    rng = np.random.default_rng(1)
    steps = 0
    while any(done[s] < len(streams[s][0]) for s in streams):
        slots, ids, expected = [], [], []
        for slot in rng.permutation(list(streams)):
            tokens, reference = streams[slot]
            n = min(int(rng.choice([1, 1, 2, 5, 9])), len(tokens) - done[slot])
            slots += [slot] * n
            ids += list(tokens[done[slot]: done[slot] + n])
            expected.append(reference[done[slot]: done[slot] + n])
            done[slot] += n
        assert_close(engine.step(slots, ids), np.concatenate(expected))
        steps += 1
    assert steps > 5


def test_release_starts_a_fresh_stream(case):
    engine, ref = case
    engine.release(4)
    engine.prefill(4, ref["mixed_a_ids"][:9])
    engine.release(4)
    assert_close(engine.prefill(4, ref["ids"][:12]), ref["prefill_logits"][11])


def test_sliding_rings_wrap_exactly():
    """150 positions: with rows of at most 32 per call, the window-8 layers keep a ring of at least 39 entries (in
    whole pool blocks: 64 here) that wraps; an engine allowed 160 rows per call sees the whole sequence in one
    unwrapped call. Same logits."""
    checkpoint = Checkpoint.open(FIXTURES / "base")
    ids = np.random.default_rng(2).integers(0, 256, 150)
    wrapped = Engine(checkpoint, RuntimeSpec(precision="f32", max_streams=1, context_budget=150))
    whole = Engine(checkpoint, RuntimeSpec(precision="f32", max_streams=1, context_budget=150, row_buckets=(8, 160)))
    assert 39 <= wrapped.stage.states[0].kv.span < 150 <= whole.stage.states[0].kv.span
    expected = whole.score(ids)
    np.testing.assert_allclose(wrapped.score(ids, prefill=50), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_rows_must_continue_their_streams(case):
    engine, ref = case
    stage = engine.stage
    engine.release(5)
    engine.prefill(5, ref["ids"][:4])
    hidden = stage.embed(ref["ids"][:2])
    with pytest.raises(BatchError, match="slot 5 is at position 4"):
        stage.forward(hidden, [5, 5], [3, 4])
    with pytest.raises(BatchError, match="consecutive positions"):
        stage.forward(hidden, [5, 5], [4, 6])
    with pytest.raises(BatchError, match="consecutive"):
        stage.forward(stage.embed(ref["ids"][:3]), [5, 6, 5], [4, 0, 5])
    with pytest.raises(BatchError, match=r"hidden rows must be \[2, "):
        stage.forward(hidden[:1], [5, 5], [4, 5])
    with pytest.raises(BatchError, match="33 rows cannot run padded to 64: one call runs at one of the row buckets"):
        stage.forward(np.zeros((33, engine.config.hidden_size), np.float32), [5] + [6] * 32, [4] + list(range(32)))
    with pytest.raises(BatchError, match="2 rows cannot run padded to 1"):
        stage.forward(hidden, [5, 5], [4, 5], bucket=1)
    with pytest.raises(BatchError, match="slot 6 would reach 65 positions, beyond the context budget"):
        engine.score(np.zeros(65, np.int64), slot=6)
    assert stage.lengths[5] == 4  # refused rows change nothing
    np.testing.assert_allclose(engine.step([5], ref["ids"][4:5])[0], ref["prefill_logits"][4], atol=1e-5)


def test_streams_take_pool_blocks_as_they_grow_and_give_them_back():
    """A pool of 18 blocks shared by 4 slots: a stream takes 6 for its two sliding layers' rings (39 entries each,
    16 a block) when it starts, and one more as it passes each multiple of 8 positions; rows the pool cannot hold
    are refused before any state changes, and a released stream's blocks serve the next (its logits those of a
    fresh engine)."""
    checkpoint = Checkpoint.open(FIXTURES / "base")
    ref = dict(np.load(FIXTURES / "base" / "reference.npz"))
    runtime = RuntimeSpec(precision="f32", max_streams=4, context_budget=64, kv_block=8)
    engine = Engine(checkpoint, runtime, kv_blocks=18)
    pool = engine.stage.pool
    assert (pool.layout.ring_blocks, pool.layout.ring_entries_per_block) == (6, 16)
    engine.prefill(0, ref["ids"][:17])  # 3 blocks and the rings
    engine.prefill(1, ref["mixed_a_ids"][:8])  # 1 block and the rings
    assert (pool.held(0), pool.held(1), pool.free) == (9, 7, 2)
    with pytest.raises(BatchError, match="the K/V pool has 2 free blocks of 8 positions, these rows need 9 more"):
        engine.step([2] * 17, ref["mixed_b_ids"][:17])
    assert engine.stage.lengths[2] == 0 and pool.free == 2
    engine.release(0)
    assert pool.free == 11
    assert_close(engine.prefill(2, ref["ids"][:25]), ref["prefill_logits"][24])  # 10 blocks, 9 of them slot 0's
    assert_close(engine.step([1], ref["mixed_a_ids"][8:9])[0], ref["mixed_a_logits"][8])  # its second block
    assert pool.free == 0


def test_a_llama_prompt_chunk_reads_its_far_keys_fused_as_the_spans_do():
    """A chunk of 72 rows after 128 positions reads its far keys through OpenVINO's fused attention, at a Llama's
    scale (d^-0.5, not Inkling's 1/d); calls of at most 32 rows read every key through the kernel's spans. Same
    logits."""
    checkpoint = Checkpoint.open(FIXTURES / "llama_plain")
    ids = np.random.default_rng(3).integers(0, 256, 200)
    spans = Engine(checkpoint, RuntimeSpec(precision="f32", max_streams=1, context_budget=200))
    fused = Engine(checkpoint, RuntimeSpec(precision="f32", max_streams=1, context_budget=200, row_buckets=(8, 128)))
    expected = spans.score(ids)
    np.testing.assert_allclose(fused.score(ids), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name, stage_graph, block", [("base", False, 8), ("llama_odd", False, 8),
                                                      ("qwen3_odd", False, 8), ("llama_odd", True, 8),
                                                      ("qwen3_odd", True, 8), ("llama_odd", True, 32),
                                                      ("qwen3_odd", True, 32)])
def test_a_forked_stream_goes_on_as_its_source_would_sharing_its_full_blocks(name, stage_graph, block):
    """Three choices of one prompt computed once: slots 1 and 2 fork slot 0 past its first full blocks (21 tokens
    with blocks of 8, 33 with blocks of 32: a stage graph's paged attention), sharing them and copying the one
    still filling (and Inkling's rings and convolution states). Slot 0 writes other tokens at the same positions
    between slot 1's steps (with blocks of 8, past the next block boundary), and is released, and a new stream
    takes the blocks it gave back; slot 1 still gives, bit for bit, the logits of a stream that computed the prompt
    itself (slot 3, same calls), and within tolerance the reference's."""
    path = FIXTURES / name
    ref = dict(np.load(path / "reference.npz"))
    runtime = RuntimeSpec(precision="f32", max_streams=5, context_budget=64, kv_block=block, stage_graph=stage_graph)
    engine = Engine(Checkpoint.open(path), runtime)
    assert not stage_graph or engine.stage.graph.paged == (block == 32)
    pool, ids = engine.stage.pool, ref["ids"]
    other = ids[::-1]  # tokens slot 0 goes on with
    rings = pool.layout.ring_blocks
    fork_at = 2 * block + 5 if block == 8 else block + 1
    between = (fork_at + len(ids)) // 2  # slot 0 steps beside slot 1 up to here, then slot 1 alone
    engine.prefill(0, ids[:fork_at])
    free = pool.free
    engine.fork(0, 1)
    engine.fork(0, 2)
    assert free - pool.free == 2 * (1 + rings)  # the block holding the last prompt positions, and the rings
    assert pool.held(1) == pool.held(0) == pool.blocks_for(fork_at) + rings
    forked = []
    for token, its_other in zip(ids[fork_at:between], other[fork_at:between]):  # slot 0 writes the same positions
        forked.append(engine.step([1], [token])[0])
        engine.step([0], [its_other])
    engine.release(0)
    engine.prefill(4, other[:between])  # takes the blocks slot 0 gave back: not those it shares with slots 1 and 2
    forked = np.stack(forked + [engine.step([1], [token])[0] for token in ids[between:]])
    fresh = engine.score(ids, prefill=fork_at, slot=3)[fork_at:]
    np.testing.assert_array_equal(forked, fresh)
    assert_close(forked, ref["prefill_logits"][fork_at:])
    engine.release(1)
    engine.release(2)
    engine.release(3)
    engine.release(4)
    assert pool.free == pool.blocks
    with pytest.raises(BatchError, match="into itself"):
        engine.fork(0, 0)


def test_the_families_whose_stages_run_as_one_graph_are_those_a_spec_may_ask_it_of():
    built = {model_type for model_type, module in FAMILIES.items() if hasattr(HOST_LAYERS[module], "graph_layer")}
    assert built == set(STAGE_GRAPH_FAMILIES)


@pytest.mark.parametrize("precision, kv_precision, block", [
    ("f32", "f32", 32), ("f32", "f16", 32), ("bf16", "bf16", 32), ("f32", "bf16", 32), ("bf16", "f32", 32),
    ("f32", "f32", 16)])
def test_a_stage_graph_attends_by_paged_attention_where_the_plugin_takes_the_pool(precision, kv_precision, block):
    """OpenVINO's PagedAttention reads and writes the pool in place where it stores what the pool holds: blocks of
    32, f32 or f16 under f32 compute, bf16 under bf16 (the precision the engine runs: f32 for a bf16 request on a
    CPU without bf16); elsewhere the graph gathers the blocks. The exactness tests above hold both ways to the
    reference."""
    runtime = RuntimeSpec(precision=precision, kv_precision=kv_precision, kv_block=block, stage_graph=True)
    engine = Engine(Checkpoint.open(FIXTURES / "llama_odd"), runtime)
    stored = {"f32": ("f32", "f16"), "bf16": ("bf16",)}[engine.stage.precision]
    paged = block == 32 and kv_precision in stored
    assert engine.stage.graph.paged == paged
    assert ("PagedAttention" in engine.stage.graph.compiled.op_types()) == paged


def test_a_stage_graph_tells_the_plugin_of_longer_contexts_a_quarter_at_a_time(monkeypatch):
    """Past the warm-up's reach, the context the PagedAttention kernel is told of grows by a quarter whenever a stream
    passes it (each growth rebuilds the kernel's buffers and brgemm kernels: 10-15 ms on the race's models), not by
    a block every 32 steps; the logits are those of a graph told each call's exact context."""
    monkeypatch.setattr(paged_attention, "WARM_REACH", 40)
    runtime = RuntimeSpec(precision="f32", max_streams=2, context_budget=160, stage_graph=True)
    logits, told = {}, {}
    for growth in (1.0, paged_attention.REACH_GROWTH):
        monkeypatch.setattr(paged_attention, "REACH_GROWTH", growth)
        engine = Engine(Checkpoint.open(FIXTURES / "llama_odd"), runtime)
        assert engine.stage.graph.paged and engine.stage.graph.reach_told == 40  # the warm-up's, capped
        ids = np.arange(130) % engine.config.vocab_size
        rows, told[growth] = [engine.prefill(0, ids[:30])], []
        for token in ids[30:]:
            rows.append(engine.step([0], [token])[0])
            told[growth].append(engine.stage.graph.reach_told)
        logits[growth] = np.stack(rows)
    assert told[1.0] == [40] * 10 + list(range(41, 131))  # past 40, every call its own context
    assert sorted(set(told[1.25])) == [40, 50, 62, 77, 96, 120, 150]
    np.testing.assert_array_equal(logits[1.25], logits[1.0])


def test_a_stage_graph_is_paged_by_default():
    assert RuntimeSpec(stage_graph=True).kv_block == PAGED_ATTENTION_BLOCK
    assert RuntimeSpec().kv_block == 64


@pytest.mark.parametrize("name", ["llama_odd", "qwen3_norm"])
def test_a_stage_graph_rotates_by_the_plugins_rope_kernel(name):
    """The graph's RoPE is in the form the CPU plugin fuses into one kernel (one node, not a split, four products
    and a concat per q and k of every layer)."""
    engine = Engine(Checkpoint.open(FIXTURES / name), RuntimeSpec(precision="f32", stage_graph=True))
    assert "RoPE" in engine.stage.graph.compiled.op_types()
