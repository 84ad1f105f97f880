"""Long context on the mid-size random Inkling: first-token time and decode time per token against context length.

Scenario: specs/mid's model (hidden 1024; 8 layers, three sliding (window 128) to one global, twice; K/V heads 4 of
64 dims; bias extent 256, log-scaling from position 64) in specs/mid-pinned.yaml's formats and precisions (experts
int4 g32, the rest int8; bf16 compute, f32 on a CPU without bf16; bf16 K/V, or --kv-precision's), one process on
every core this process may use, one stream. Its random checkpoint (bf16) is written once to CHECKPOINT.
  TTFT      seconds to prefill N prompt tokens (chunks of PREFILL_CHUNK rows) and take the first token's logits,
            N up to --ttft-max (default 16k; a 64k prefill takes long on a small machine)
  decode    ms per greedy decode step of the stream at context N: median of DECODE_STEPS steps after a warm-up.
            The context is real when it was prefilled for the TTFT column; beyond --ttft-max its keys and values
            are written with random values straight into the stage's stores (a step's time does not depend on the
            values: attention reads every key whatever its score)
  attention the share of a decode step spent in attention, and the bytes it must read (every global layer's keys
            and values of N positions, every sliding ring) over that time, as a fraction of a streaming read's
            bandwidth measured in the same run (the sum of a 1 GiB array, best of 3 on one thread and on every core)
  alone     one global layer's attention for one decode row at N, by itself (median of ATTENTION_REPEATS calls):
            on one thread and on the pool of every core, against the time to read its keys and values at that
            bandwidth
With --attention-only, just one global layer's attention at each N, without the model: for one decode row, the
engine's spans (bf16 and f32 K/V, one thread and every thread) against OpenVINO's ScaledDotProductAttention on the
same f32 keys and values passed in place ([1, kv, N, d]; the query heads of a K/V head as its query rows; the
bias as an additive mask), with the largest difference between their outputs; OpenVINO's PagedAttention (the CPU
kernel openvino-genai serves with, through its experimental Python binding; no bias, so timed against the spans
on the same keys without bias or log-scaling), with f32 and with bf16 K/V (the plugin runs bf16 K/V only in bf16
compute, its queries rounded to bf16), with its largest difference from the spans relative to their largest
output; for a prompt's chunk of
PREFILL_CHUNK rows at N (bf16 K/V, every thread), the spans alone against the engine's fused far keys (as
`runtime.fused_attention_from` asks), with their largest difference relative to the largest output.
With --streams 1,2,4,8 --calibration CAL (a calibration of specs/mid-long.yaml), decode steps of G streams together
at each N (their keys and values written straight into the stores, as beyond --ttft-max) against what the simulator
charges that frame (`StageCost` of the calibration's node: one stream's table at the frame's padded rows, and each
further stream's keys and values at the table's per-position slope): a check of that charge on many long streams.
--fused-attention-from sets runtime.fused_attention_from (default specs/mid-long.yaml's: a prompt's chunks read
their far keys fused). --kv-block sets the engine's positions per K/V block (runtime.kv_block; default
specs/mid-long.yaml's), and the alone column's; --kv-precision how the engine and the alone column store K/V
(runtime.kv_precision; default specs/mid-long.yaml's bf16; the runtime's own default and the paper spec's is f32).
Then the fits TTFT = a N + b N^2 and decode = c + d N (least squares over the measured N), their predictions at 64k
and 512k, and the paper's growth beside ours (paper, 11 PCs: decode 54 ms/token at 4k, 216 at 64k, 1,496 at 512k;
TTFT 22 s at 1k, 110 min at 64k); last, the decode target: decode at the longest context minus at the shortest, against
twice the time to read the longest's K/V at the run's streaming read. Not a test: it prints tables, and writes the
main mode's to bench/results/long_context.json.

    python bench/long_context.py [--quick] [--contexts 1024,4096,16384,65536] [--ttft-max 16384] [--kv-block 256]
                                 [--attention-only] [--streams 1,2,4,8 --calibration CAL]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import numpy as np
import openvino as ov
import openvino.opset13 as ops
from engine import memory_bandwidth
from random_model import FORMATS, QUICK_MID, random_checkpoint
from record import Table, now, write

import cascadia.engine.families.inkling as inkling
from cascadia.engine import attention
from cascadia.engine.attention import AttentionShape
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.kv_store import PagedKV
from cascadia.engine.state_format import StateFormat
from cascadia.graph.planner import plan as make_plan
from cascadia.models import read_config
from cascadia.models.inkling import InklingConfig
from cascadia.policy import padded_size
from cascadia.sim.calibration import Calibration, Extrapolations
from cascadia.sim.model import FrameShape, StageCost, stage_kinds
from cascadia.spec.load import load_spec
from cascadia.spec.types import RuntimeSpec
from cascadia.table import format_rows

CHECKPOINT = Path(__file__).parent.parent / "specs" / "mid-long-checkpoint"
CONTEXTS = (1024, 4096, 16384, 65536)
PREFILL_CHUNK = 256
# specs/mid-long.yaml's model: specs/mid's with max_position_embeddings 1M, so that no context asked rewrites the
# checkpoint, and `cascadia calibrate specs/mid-long.yaml` measures this bench's checkpoint
LONG_CONFIG = Path(__file__).parent.parent / "specs" / "mid-long" / "config.json"
LONG_SPEC = Path(__file__).parent.parent / "specs" / "mid-long.yaml"
ROW_BUCKETS = (1, 2, 8, 32, PREFILL_CHUNK)  # specs/mid-long.yaml's
DECODE_STEPS = 12
KV_BLOCK = RuntimeSpec().kv_block  # the runtime's default: the --attention-only stores'
ATTENTION_REPEATS = 9
SEED = 0
PAPER_DECODE_MS = {4096: 54, 65536: 216, 524288: 1496}
PAPER_TTFT_S = {1024: 22, 65536: 110 * 60}


class AttentionClock:
    """Seconds spent in `inkling.attend_rows` while it is on (the layers call it through the module)."""

    def __init__(self):
        self.seconds, self._attend = 0.0, inkling.attend_rows

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._attend(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        inkling.attend_rows = timed


def long_config(quick: bool) -> InklingConfig:
    config = read_config(LONG_CONFIG)
    return InklingConfig.from_hf_dict(config.to_hf_dict() | QUICK_MID) if quick else config


def fill_context(engine: Engine, slot: int, positions: int, rng: np.random.Generator) -> None:
    """Give a fresh stream `positions` positions of random keys and values (and leave its convolution states at
    zero), as if it had been prefilled."""
    stage = engine.stage
    engine.release(slot)
    stage.pool.grow({slot: positions})
    for state in stage.states:
        kv_heads, head_dim = state.kv.k.shape[1], state.kv.k.shape[3]
        kept = positions if isinstance(state.kv, PagedKV) else min(positions, state.kv.span)
        for start in range(positions - kept, positions, 4096):
            at = np.arange(start, min(positions, start + 4096))[None]
            k, v = (rng.standard_normal((1, at.shape[1], kv_heads, head_dim), dtype=np.float32) for _ in "kv")
            state.kv.write(np.array([slot]), at, k / np.sqrt(head_dim), v)
    stage.lengths[slot] = positions


def decode_ms(engine: Engine, clock: AttentionClock, slot: int, token: int) -> tuple[float, float]:
    """(ms per decode step, of which attention) over DECODE_STEPS steps after one untimed step."""
    engine.step([slot], [token])
    times, attention = [], []
    for _ in range(DECODE_STEPS):
        clock.seconds, start = 0.0, time.perf_counter()
        token = int(engine.step([slot], [token])[0].argmax())
        times.append(time.perf_counter() - start)
        attention.append(clock.seconds)
    return 1e3 * statistics.median(times), 1e3 * statistics.median(attention)


def kv_bytes_read(engine: Engine, positions: int) -> int:
    """Bytes of keys and values one decode row reads at `positions`: all of each global layer's, a sliding layer's
    ring (its filled entries)."""
    total = 0
    for state in engine.stage.states:
        per_position = 2 * state.kv.k.shape[1] * state.kv.k.shape[3] * state.kv.k.itemsize
        total += per_position * (positions if isinstance(state.kv, PagedKV) else min(positions, state.kv.span))
    return total


def random_store(shape: AttentionShape, positions: int, precision: str, rng: np.random.Generator,
                 block: int = KV_BLOCK) -> PagedKV:
    """A paged store of `block` positions a block holding `positions` + 1 positions of one stream, all but the
    last random."""
    store = PagedKV.alone(-(-(positions + 1) // block), block, 1, shape.kv_heads, shape.head_dim,
                          StateFormat(precision))
    store.pool.grow({0: positions + 1})
    for start in range(0, positions, 4096):
        at = np.arange(start, min(positions, start + 4096))[None]
        store.write(np.array([0]), at, *(rng.standard_normal((1, at.shape[1], shape.kv_heads, shape.head_dim),
                                                             dtype=np.float32) for _ in "kv"))
    return store


def decode_row(shape: AttentionShape, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """q, k, v, rel of one decode row."""
    q = rng.standard_normal((1, 1, shape.heads, shape.head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, 1, shape.kv_heads, shape.head_dim), dtype=np.float32) for _ in "kv")
    return q, k, v, rng.standard_normal((1, 1, shape.heads, shape.bias_extent), dtype=np.float32)


def spans_ms(shape: AttentionShape, store: PagedKV, positions: int, row: tuple[np.ndarray, ...], threads: int
             ) -> tuple[float, np.ndarray]:
    """ms of the engine's attention for one decode row at `positions` over `store` on `threads` threads, and its
    output."""
    default = attention._threads
    attention._threads = lambda: pool_of[threads]
    try:
        return timed_attend(shape, row, store, positions, ATTENTION_REPEATS)
    finally:
        attention._threads = default


def timed_attend(shape: AttentionShape, rows: tuple[np.ndarray, ...], store: PagedKV, positions: int, repeats: int
                 ) -> tuple[float, np.ndarray]:
    """The median ms of `repeats` calls of the engine's attention for `rows` (q, k, v, rel of one stream) at
    `positions` over `store`, and its output."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = attention.attend(shape, *rows, store, np.array([0]), np.array([positions]))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), out


def attention_alone_ms(layer: inkling.DecoderLayer, positions: int, threads: int, rng: np.random.Generator,
                       block: int, precision: str) -> float:
    """ms of `layer`'s attention for one decode row at `positions` (keys and values random, stored in `precision`,
    `block` positions a block), on a pool of `threads` threads."""
    store = random_store(layer.shape, positions, precision, rng, block)
    return spans_ms(layer.shape, store, positions, decode_row(layer.shape, rng), threads)[0]


def sdpa_ms(shape: AttentionShape, store: PagedKV, positions: int, row: tuple[np.ndarray, ...]
            ) -> tuple[float, np.ndarray]:
    """ms of OpenVINO's ScaledDotProductAttention for the decode row of `spans_ms` (store in f32), and its output
    [1, 1, h d]. Its keys and values are the store's, laid out [1, kv, N, d] once, outside the timing; the bias and
    log-scaling are applied as the engine applies them, the bias as an additive mask."""
    kv, group, d = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    n = positions + 1
    q, k, v, rel = row
    store.write(np.array([0]), np.array([[n - 1]]), k, v)
    keys, values = (np.ascontiguousarray(x[0].transpose(1, 0, 2, 3).reshape(kv, -1, d)[None, :, :n])
                    for x in store.read(np.array([0]), 0, n))  # whole blocks: the last may go past n
    tau = attention.log_scale(np.array([n - 1]), *shape.log_scaling) if shape.log_scaling else np.float32(1)
    mask = np.zeros((1, shape.heads, n), np.float32)
    mask[0, :, n - shape.bias_extent:] = (rel[0, 0] * tau)[:, ::-1]  # distance 0 is the last key
    inputs = {"q": (q[0, 0] * tau).reshape(1, kv, group, d), "k": keys, "v": values,
              "mask": mask.reshape(1, kv, group, n)}
    params = [ops.parameter([1, kv, group, d], ov.Type.f32, name="q"),
              *(ops.parameter([1, kv, -1, d], ov.Type.f32, name=name) for name in "kv"),
              ops.parameter([1, kv, group, -1], ov.Type.f32, name="mask")]
    out = ops.scaled_dot_product_attention(*params, ops.constant(np.float32(1 / d)), causal=False)
    request = ov.Core().compile_model(ov.Model([out], params), "CPU",
                                      {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    times = []
    for _ in range(ATTENTION_REPEATS + 1):
        start = time.perf_counter()
        request.infer(inputs, share_inputs=True)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:]), request.get_output_tensor(0).data.reshape(1, 1, -1)


def paged_attention_ms(shape: AttentionShape, store: PagedKV, positions: int, row: tuple[np.ndarray, ...]
                       ) -> tuple[float, np.ndarray]:
    """ms of OpenVINO's PagedAttention for the decode row of `spans_ms` over `store`'s keys and values (in its
    precision), copied once into the cache layout the plugin asks for, and its output [1, 1, h d]. No bias and no
    log-scaling: it has neither (only ALiBi slopes)."""
    from openvino._pyopenvino.op import _PagedAttentionExtension  # experimental: no compatibility promised

    kv, d, bf16 = shape.kv_heads, shape.head_dim, store.fmt.precision == "bf16"
    q, k, v, _ = row
    cache_type = ov.Type.bf16 if bf16 else ov.Type.f32

    def parameter(shape_, type_, name):
        return ops.parameter(shape_, type_, name=name)

    def constant(value, dtype):
        return ops.constant(np.array(value, dtype))

    inputs = [parameter([-1, shape.heads * d], ov.Type.f32, "q"), parameter([-1, kv * d], ov.Type.f32, "k"),
              parameter([-1, kv * d], ov.Type.f32, "v"),
              *(parameter([-1, kv, -1, d], cache_type, name) for name in ("key_cache", "value_cache")),
              *(parameter([-1], ov.Type.i32, name) for name in ("past", "begins", "blocks", "block_begins")),
              constant(1 / d, np.float32), constant(0, np.int32), constant([], np.float32),  # scale, window, alibi
              parameter([], ov.Type.i32, "max_context"), constant(0, np.int32),  # score aggregation
              constant([], np.int32), constant([], np.int32), constant([], np.float32),  # rotation
              constant([], np.float32), constant(64, np.int32), constant(8, np.int32),  # xattention
              constant([], np.float32), constant(0, np.int32),  # sinks, adaptive r-kv
              *(constant([], np.int32) for _ in range(4)), constant([], np.uint8), constant([], np.int32)]
    node = _PagedAttentionExtension([x.output(0) for x in inputs])
    for key, value in (("k_head_size", d), ("num_k_heads", kv), ("v_head_size", d), ("num_v_heads", kv)):
        node.get_rt_info()[key] = value
    params = [x for x in inputs if x.get_type_name() == "Parameter"]
    compiled = ov.Core().compile_model(ov.Model([node.output(0)], params), "CPU", {
        "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32", "KV_CACHE_PRECISION": "bf16" if bf16 else "f32"})
    block = compiled.input("key_cache").get_partial_shape()[2]
    block = block.get_length() if block.is_static else 32  # left open (f32 on a CPU without bf16): its default
    blocks = positions // block + 1  # the decode row's own key and value go into the last
    request, caches = compiled.create_infer_request(), []  # a bf16 Tensor over a uint16 array does not keep it alive
    for name, stored in (("key_cache", store.k), ("value_cache", store.v)):  # [blocks, kv, B, d] by position
        by_position = stored.transpose(0, 2, 1, 3).reshape(-1, kv, d)[:positions]
        cache = np.zeros((blocks * block, kv, d), stored.dtype)
        cache[:positions] = by_position
        cache = np.ascontiguousarray(cache.reshape(blocks, block, kv, d).transpose(0, 2, 1, 3))
        caches.append(cache)
        request.set_tensor(name, ov.Tensor(cache, list(cache.shape), cache_type))
    feed = {"q": q.reshape(1, -1), "k": k.reshape(1, -1), "v": v.reshape(1, -1),
            "past": np.array([positions], np.int32), "begins": np.array([0, 1], np.int32),
            "blocks": np.arange(blocks, dtype=np.int32), "block_begins": np.array([0, blocks], np.int32),
            "max_context": np.array(positions + 1, np.int32)}
    times = []
    for _ in range(ATTENTION_REPEATS + 1):
        start = time.perf_counter()
        request.infer(feed)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:]), request.get_output_tensor(0).data.reshape(1, 1, -1).copy()


def prompt_chunk(shape: AttentionShape, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """q, k, v, rel of a chunk of PREFILL_CHUNK prompt rows."""
    q = rng.standard_normal((1, PREFILL_CHUNK, shape.heads, shape.head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, PREFILL_CHUNK, shape.kv_heads, shape.head_dim), dtype=np.float32) for _ in "kv")
    return q, k, v, rng.standard_normal((1, PREFILL_CHUNK, shape.heads, shape.bias_extent), dtype=np.float32)


def chunk_ms(shape: AttentionShape, store: PagedKV, positions: int, chunk: tuple[np.ndarray, ...], fused: bool
             ) -> tuple[float, np.ndarray]:
    """ms of the engine's attention for `chunk` at `positions` over `store` (median of 3), its far keys fused or
    in spans alone, and its output."""
    store.fused_from = PREFILL_CHUNK if fused else None
    return timed_attend(shape, chunk, store, positions, 3)


def attention_only(config: InklingConfig, contexts: list[int], rng: np.random.Generator) -> None:
    layer = next(i for i in range(config.num_hidden_layers) if not config.is_sliding(i))
    heads, kv_heads, head_dim = config.heads(layer)
    scaling = (config.log_scaling_n_floor, config.log_scaling_alpha) if config.log_scaling_n_floor else None
    shape = AttentionShape(heads, kv_heads, head_dim, None, config.rel_extent, scaling, scale=1 / head_dim)
    cores = len(os.sched_getaffinity(0))
    plain = attrs.evolve(shape, bias_extent=1, log_scaling=None)  # with a zero bias: what PagedAttention computes
    rows, kernel_rows = [], []
    for n in contexts:
        q, k, v, rel = decode_row(plain, rng)
        plain_row = q, k, v, np.zeros_like(rel)
        kernel_row = [f"{n:,}"]
        for precision in ("f32", "bf16"):
            store = random_store(plain, n, precision, rng)
            paged, paged_out = paged_attention_ms(plain, store, n, plain_row)
            spans, spans_out = spans_ms(plain, store, n, plain_row, cores)
            kernel_row += [f"{spans:.2f}", f"{paged:.2f}",
                           f"{np.abs(paged_out - spans_out).max() / np.abs(spans_out).max():.1e}"]
        kernel_rows.append(kernel_row)
        row = decode_row(shape, rng)
        bf16 = [spans_ms(shape, random_store(shape, n, "bf16", rng), n, row, t)[0] for t in sorted(pool_of)]
        f32_store = random_store(shape, n, "f32", rng)
        f32 = [spans_ms(shape, f32_store, n, row, t) for t in sorted(pool_of)]
        openvino_ms, openvino_out = sdpa_ms(shape, f32_store, n, row)
        chunk_store = random_store(shape, n + PREFILL_CHUNK - 1, "bf16", rng)
        chunk = prompt_chunk(shape, rng)
        (spans, spans_out), (fused, fused_out) = (chunk_ms(shape, chunk_store, n, chunk, f) for f in (False, True))
        rows.append((f"{n:,}", *(f"{t:.2f}" for t in bf16), *(f"{t:.2f}" for t, _ in f32), f"{openvino_ms:.2f}",
                     f"{np.abs(openvino_out - f32[0][1]).max():.1e}", f"{spans:.0f}", f"{fused:.0f}",
                     f"{spans / fused:.2f}", f"{np.abs(fused_out - spans_out).max() / np.abs(spans_out).max():.1e}"))
    threads = [f"{t} thread{'s' * (t > 1)}" for t in sorted(pool_of)]
    print(format_rows([("context", *(f"decode row: spans bf16, {t} ms" for t in threads),
                        *(f"spans f32, {t} ms" for t in threads), f"OpenVINO SDPA f32 ({cores} cores) ms",
                        "max |difference|", f"chunk of {PREFILL_CHUNK}: spans ms", "fused ms", "spans / fused",
                        "relative difference"), *rows]))
    print(f"\nOne decode row without bias or log-scaling, {cores} cores: the engine's spans against OpenVINO's "
          "PagedAttention (experimental binding), and their relative difference")
    print(format_rows([("context", *(f"{label} {p} K/V" for p in ("f32", "bf16")
                                     for label in ("spans ms,", "PagedAttention ms,", "difference,"))),
                       *kernel_rows]))


pool_of = {n: ThreadPoolExecutor(n) for n in {1, len(os.sched_getaffinity(0))}}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def fit(xs: list[float], ys: list[float], columns) -> np.ndarray:
    """Least-squares coefficients of ys over the given functions of xs."""
    return np.linalg.lstsq(np.array([[f(x) for f in columns] for x in xs]), np.array(ys), rcond=None)[0]


def streams_against_simulator(checkpoint: Checkpoint, contexts: list[int], counts: list[int], calibration: Path,
                               rng: np.random.Generator) -> None:
    config = checkpoint.config
    spec = load_spec(LONG_SPEC)
    stage = make_plan(spec).stages[0]
    calibrated = Calibration.load(calibration)
    cost = StageCost(stage.node, stage_kinds(stage, config), calibrated.nodes[stage.node], config, calibrated,
                     Extrapolations(), ROW_BUCKETS)
    runtime = RuntimeSpec(precision="bf16", kv_precision="bf16", max_streams=max(counts),
                          context_budget=max(contexts) + 2 * DECODE_STEPS, row_buckets=ROW_BUCKETS,
                          kv_block=spec.runtime.kv_block)
    engine = Engine(checkpoint, runtime, formats=FORMATS)
    rows = []
    for n in contexts:
        for slot in range(max(counts)):
            fill_context(engine, slot, n, rng)
        for g in counts:
            slots = list(range(g))
            engine.step(slots, [3] * g)  # untimed
            times = []
            for _ in range(DECODE_STEPS // 2):
                start = time.perf_counter()
                engine.step(slots, [3] * g)
                times.append(time.perf_counter() - start)
            for slot in slots:  # back to N positions for the next count
                engine.stage.lengths[slot] = n
            measured = statistics.median(times)
            window = config.sliding_window_size
            predicted = cost(FrameShape(padded_size(g, ROW_BUCKETS), g, float(min(n + 1, window)), float(n + 1), g, g))
            rows.append((f"{n:,}", str(g), f"{1e3 * measured:.1f}", f"{1e3 * predicted:.1f}",
                         f"{100 * (predicted / measured - 1):+.0f}%"))
    print(format_rows([("context", "streams", "decode step ms", "simulator's frame ms", "error"), *rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model (hidden 256, 16 experts)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--ttft-max", type=int, default=16384, help="prefill for real up to this many tokens")
    parser.add_argument("--attention-only", action="store_true", help="one global layer's attention, no model")
    parser.add_argument("--kv-block", type=int, default=load_spec(LONG_SPEC).runtime.kv_block,
                        help="positions a K/V block (runtime.kv_block; default specs/mid-long.yaml's)")
    parser.add_argument("--kv-precision", choices=("bf16", "f16", "f32"), default="bf16",
                        help="how the engine stores K/V (runtime.kv_precision; default specs/mid-long.yaml's)")
    parser.add_argument("--fused-attention-from", default=load_spec(LONG_SPEC).runtime.fused_attention_from,
                        type=lambda text: text if text == "never" else int(text),
                        help="runtime.fused_attention_from: a row count or never (default specs/mid-long.yaml's)")
    parser.add_argument("--streams", help="decode steps of these many streams against the simulator's frame cost")
    parser.add_argument("--calibration", type=Path, help="with --streams: a calibration of specs/mid-long.yaml")
    parser.add_argument("--out", type=Path, help="default bench/results/long_context.json (the main table only)")
    args = parser.parse_args()
    started = now()
    contexts = sorted(int(n) for n in args.contexts.split(","))
    if args.attention_only:
        print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores\n")
        attention_only(long_config(args.quick), contexts, np.random.default_rng(SEED))
        return
    if args.streams:
        if args.calibration is None or args.quick:
            parser.error("--streams needs --calibration (of specs/mid-long.yaml, whose model --quick is not)")
        print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores\n")
        checkpoint = Checkpoint.open(random_checkpoint(long_config(False), CHECKPOINT, False, SEED))
        streams_against_simulator(checkpoint, contexts, sorted(int(g) for g in args.streams.split(",")),
                                  args.calibration, np.random.default_rng(SEED))
        return
    budget = contexts[-1] + DECODE_STEPS + 2
    config = long_config(args.quick)
    checkpoint = Checkpoint.open(random_checkpoint(config, CHECKPOINT, args.quick, SEED))
    runtime = RuntimeSpec(precision="bf16", kv_precision=args.kv_precision, max_streams=1, context_budget=budget,
                          row_buckets=ROW_BUCKETS, kv_block=args.kv_block,
                          fused_attention_from=args.fused_attention_from)
    engine = Engine(checkpoint, runtime, formats=FORMATS)
    clock, rng = AttentionClock(), np.random.default_rng(SEED)
    bandwidth = memory_bandwidth(np.ones(2**27, np.int64))
    cores = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_name()}, {cores} cores; compute {engine.stage.precision}, {args.kv_precision} K/V; "
          f"streaming read {bandwidth / 1e9:.1f} GB/s\n")

    threads = " / ".join(f"{n} thread{'s' * (n > 1)}" for n in sorted(pool_of))
    fused = args.fused_attention_from
    far_keys = "a chunk's far keys in spans" if fused == "never" else f"far keys fused from {fused} rows"
    contexts_table = Table(f"One stream at each context: {engine.stage.precision} compute, {args.kv_precision} K/V, "
                           f"blocks of {args.kv_block}, {far_keys}", [
                               "context", "TTFT s", "decode ms/token", "of which attention ms", "K/V read MiB",
                               "attention at % of bandwidth", f"one layer alone ms, {threads}", "its K/V read ms"],
                           note=f"Streaming read {bandwidth / 1e9:.1f} GB/s; TTFT measured (a real prefill) up to "
                                f"{args.ttft_max:,} tokens.")
    ttft, decode = {}, {}
    for n in contexts:
        prompt = rng.integers(3, config.vocab_size, n)
        if n <= args.ttft_max:
            engine.release(0)
            start = time.perf_counter()
            token = int(engine.prefill(0, prompt).argmax())
            ttft[n] = time.perf_counter() - start
        else:
            fill_context(engine, 0, n, rng)
            token = int(prompt[-1])
        decode[n], attention_ms = decode_ms(engine, clock, 0, token)
        fraction = kv_bytes_read(engine, n) / (attention_ms / 1e3) / bandwidth
        global_layer = next(layer for layer in engine.stage.layers if layer.shape.window is None)
        alone = [attention_alone_ms(global_layer, n, threads, rng, args.kv_block, args.kv_precision)
                 for threads in sorted(pool_of)]
        stored = StateFormat(args.kv_precision).dtype.itemsize  # bytes a K/V element
        read_ms = 1e3 * n * 2 * global_layer.shape.kv_heads * global_layer.shape.head_dim * stored / bandwidth
        contexts_table.add(n, ttft.get(n), decode[n], attention_ms, kv_bytes_read(engine, n) / 2**20,
                           100 * fraction, " / ".join(f"{t:.2f}" for t in alone), read_ms)
    print(contexts_table.text() + "\n")

    c, d = fit(list(decode), list(decode.values()), (lambda x: 1.0, lambda x: x))
    fits = [f"decode = c + d N: c = {c:.2f} ms, d = {d * 1e3:.4f} ms per 1k positions"]
    if len(ttft) >= 2:
        a, b = fit(list(ttft), list(ttft.values()), (lambda x: x, lambda x: x * x))
        fits.append(f"TTFT = a N + b N^2: a = {a * 1e3:.3f} ms per token, b = {b * 1e9:.3f} s per 1e9 token pairs")
    growth = Table("Growth with the context, against the paper's", ["figure", "here", "the paper's"],
                   note="; ".join(fits) + ". (fit): from the fit, not measured.")
    for n in (1024, 4096, 65536, 524288):
        ours_decode = f"{decode[n]:.1f} ms" if n in decode else f"{c + d * n:.1f} ms (fit)"
        ours_ttft = (f"{ttft[n]:.1f} s" if n in ttft else f"{a * n + b * n * n:,.0f} s (fit)") if len(ttft) >= 2 \
            else None
        growth.add(f"decode at {n:,}", ours_decode, f"{PAPER_DECODE_MS[n]:,} ms" if n in PAPER_DECODE_MS else None)
        growth.add(f"TTFT at {n:,}", ours_ttft, f"{PAPER_TTFT_S[n]:,} s" if n in PAPER_TTFT_S else None)
    first, last = min(decode), max(decode)
    growth.add(f"decode at {last:,} / at {first:,}", f"{decode[last] / decode[first]:.2f}x",
               f"{PAPER_DECODE_MS[65536] / PAPER_DECODE_MS[4096]:.1f}x (64k / 4k)")
    tables = [contexts_table, growth]
    if last > first:
        longest = kv_bytes_read(engine, last)
        bound = 2 * 1e3 * longest / bandwidth
        growth_ms = decode[last] - decode[first]
        target = Table("The decode target: the growth at most twice the time to read the longest context's K/V",
                       ["contexts", "decode growth ms", "K/V MiB", "bound ms", "growth / bound", "met"])
        target.add(f"{first:,} to {last:,}", growth_ms, longest / 2**20, bound, growth_ms / bound,
                   "met" if growth_ms <= bound else "NOT met")
        tables.append(target)
    for table in tables[1:]:
        print(table.text() + "\n")
    write("long_context", "One long stream of the mid-size model: first-token and decode time by context", started,
          tables, args.out, quick=args.quick, cpu_name=cpu_name())


if __name__ == "__main__":
    main()
