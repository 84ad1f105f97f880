"""Decode speed and memory of the resident engine (`cascadia.engine.engine.Engine`) on a mid-size random Inkling.

Scenario: a random Inkling of MODEL's sizes (hidden 1024; 8 layers, five sliding to one global as in the real model,
the first dense, the others 64 experts top-6 plus 2 shared of width 512; vocabulary 32k) is written once by
`init_model` into CHECKPOINT (bf16) and served in the paper's formats (experts int4 g32, the rest int8) at bf16
compute, on all of this machine's cores. Each of up to 32 streams gets PROMPT_TOKENS deterministic prompt tokens,
then DECODE_STEPS greedy steps; only the decode steps are timed. Each figure is the median of REPEATS rounds after
an untimed warm-up round, and each round measures every column back to back, so that ratios hold on a machine
shared with other work.
Reported:
  engine      decode tokens/s with 1, 8 and 32 streams (one row per stream per step)
  reference   the same for transformers' InklingForCausalLM on the same checkpoint (bf16, its default experts
              implementation); skipped when torch or transformers is missing
  roofline    tokens/s if a step cost only reading its weights once at the measured memory bandwidth: weight bytes
              a step touches (`cascadia.graph.costs`; routed experts: the distinct experts the step's rows chose,
              counted from the engine's own routing) over the bandwidth of a streaming read (the sum of a 1 GiB
              array, best of 3 on one thread and on every core), measured in every round
  blocks alone  the compiled blocks of the same decode steps replayed back to back with the inputs they had: the
              speed with no host work between OpenVINO calls, the ceiling for any change on the host side
  MoE block   one MoE layer: the fused graph (GatherMatmul, selected experts only) against all experts dense
              (every expert on every row, one wide matmul over the same compressed weights)
  dense MLP   the dense layer's MLP as one SwiGLU against the same cut into DENSE_SLICES all-active experts
  memory      peak resident memory (VmHWM) of a fresh process that builds the engine and decodes 32 streams,
              against the formats' weight bytes plus the engine's state (K/V rings, convolution states)
and whether the issue's targets are met: at 1 stream >= 50% of the roofline and >= 5x the reference; peak memory
<= 1.3 x (weights + state). Not a test: it prints tables.

    python bench/engine.py [--quick] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import attrs
import numpy as np
import openvino as ov
import openvino.opset16 as ops
from random_model import FORMATS, MID_SIZES, QUICK_SIZES, model_config, random_checkpoint

import cascadia  # noqa: F401  before numpy, as in every cascadia command: numpy's BLAS keeps to one thread
from cascadia import tensors as names
from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock, compile_options, device_precision
from cascadia.engine.engine import Engine
from cascadia.engine.inkling import DecoderLayer, Router
from cascadia.engine.layer_build import build_layer
from cascadia.engine.ov_ops import linear, swish, weight
from cascadia.graph import costs
from cascadia.model_config import InklingConfig
from cascadia.spec.types import ModelSpec, RuntimeSpec, WeightFormat
from cascadia.table import format_rows

# Five sliding layers to one global, as in the real model; a dense MLP of width 4096.
MODEL = MID_SIZES | {"intermediate_size": 4096,
                     "layer_types": ["hybrid_sliding"] * 5 + ["hybrid", "hybrid_sliding", "hybrid"]}
QUICK_MODEL = MODEL | QUICK_SIZES | {"intermediate_size": 1024}
PRECISION = "bf16"
STREAMS = (1, 8, 32)  # also the engine's row buckets: no call is padded
PROMPT_TOKENS = 16
DECODE_STEPS = 16
DENSE_SLICES = 8
REPEATS = 5
BLOCK_CALLS = 5  # calls of a block per timing
CHECKPOINT = Path(tempfile.gettempdir()) / "cascadia-bench-engine"
SEED = 0
# The targets.
ROOFLINE_TARGET, REFERENCE_TARGET, MEMORY_TARGET = 0.5, 5.0, 1.3


def prompts(config: InklingConfig) -> np.ndarray:
    """[max streams, PROMPT_TOKENS] token ids, the same every run."""
    return np.random.default_rng(SEED).integers(3, config.vocab_size, (max(STREAMS), PROMPT_TOKENS))


def memory_bandwidth(data: np.ndarray) -> float:
    """Bytes/s of a streaming read: the sum of `data` on one thread and split over every core, best of 3 each."""
    cores = os.cpu_count() or 1
    chunks = np.array_split(data, cores)
    with ThreadPoolExecutor(cores) as pool:
        readers = (lambda: data.sum(), lambda: list(pool.map(np.sum, chunks)))
        best = min(_seconds(read) for read in readers for _ in range(3))
    return data.nbytes / best


def step_bytes(model: ModelSpec, rows: int, distinct: dict[int, float]) -> float:
    """Weight bytes one decode step of `rows` rows reads: every weight of each layer once, except routed experts
    (the `distinct[layer]` experts the rows chose), one embedding row per row, the whole head."""
    total = rows * costs.embedding_cost(model).bytes_per_row + costs.head_cost(model).bytes_per_row
    for layer in range(model.config.num_hidden_layers):
        ops = costs.layer_ops(model, layer)
        total += sum(op.bytes_per_row for kind, op in ops.items() if kind != "routed_experts")
        if "routed_experts" in ops:
            total += distinct[layer] * ops["routed_experts"].weight_bytes / model.config.n_routed_experts
    return total


class CountingRouter:
    """A layer's router that also records how many distinct experts each call's rows chose (np.unique of a few
    dozen ids: microseconds against a step's milliseconds)."""

    def __init__(self, router: Router):
        self.router, self.distinct = router, []

    def __call__(self, h: np.ndarray):
        routing = self.router(h)
        self.distinct.append(len(np.unique(routing.index)))
        return routing


class EngineDecoder:
    def __init__(self, checkpoint: Checkpoint, prompt_ids: np.ndarray):
        runtime = RuntimeSpec(precision=PRECISION, max_streams=max(STREAMS),
                              context_budget=PROMPT_TOKENS + DECODE_STEPS, row_buckets=STREAMS)
        self.engine = Engine(checkpoint, runtime, formats=FORMATS)
        self.prompts = prompt_ids
        self.routers: dict[int, CountingRouter] = {}  # by MoE layer
        for i, layer in zip(self.engine.stage.layer_ids, self.engine.stage.layers):
            if layer.router is not None:
                layer.router = self.routers[i] = CountingRouter(layer.router)

    def decode_seconds(self, streams: int) -> float:
        """Prefill `streams` fresh streams, then time DECODE_STEPS greedy steps of all of them together."""
        tokens = self._prefill(streams)
        return _seconds(lambda: self._decode(tokens))

    def blocks_alone_seconds(self, streams: int) -> float:
        """The compiled blocks of DECODE_STEPS decode steps of `streams` streams, replayed back to back with the
        inputs they had: what the steps would cost with no host work between the calls (the most any change on
        the host side could reach)."""
        tokens = self._prefill(streams)
        calls: list[tuple[CompiledBlock, tuple[np.ndarray, ...], int | None]] = []
        run = CompiledBlock.__call__

        def record(block: CompiledBlock, *inputs: np.ndarray, bucket: int | None = None) -> list[np.ndarray]:
            calls.append((block, tuple(x.copy() for x in inputs), bucket))
            return run(block, *inputs, bucket=bucket)

        CompiledBlock.__call__ = record
        try:
            self._decode(tokens)
        finally:
            CompiledBlock.__call__ = run
        return _seconds(lambda: [block(*inputs, bucket=bucket) for block, inputs, bucket in calls])

    def _prefill(self, streams: int) -> np.ndarray:
        """Fresh streams in slots 0.. with their prompts; their first tokens."""
        for slot in range(streams):
            self.engine.release(slot)
        return np.array([self.engine.prefill(slot, self.prompts[slot]).argmax() for slot in range(streams)])

    def _decode(self, tokens: np.ndarray) -> None:
        for router in self.routers.values():
            router.distinct.clear()
        slots = np.arange(len(tokens))
        for _ in range(DECODE_STEPS):
            tokens = self.engine.step(slots, tokens).argmax(axis=1)

    def distinct_experts(self) -> dict[int, float]:
        """Mean distinct routed experts per step of the last decode, by MoE layer."""
        return {i: float(np.mean(router.distinct)) for i, router in self.routers.items()}


class ReferenceDecoder:
    """transformers' model on the same checkpoint, decoding the same prompts the same way."""

    def __init__(self, path: Path, prompt_ids: np.ndarray):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()  # its notes on missing optional kernels
        transformers.logging.disable_progress_bar()
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch, self.new_cache = torch, transformers.DynamicCache
        self.model = transformers.InklingForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.prompts = prompt_ids

    def decode_seconds(self, streams: int) -> float:
        with self.torch.no_grad():
            cache = self.new_cache(config=self.model.config)
            ids = self.torch.from_numpy(self.prompts[:streams])
            logits = self.model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            start = time.perf_counter()
            for _ in range(DECODE_STEPS):
                logits = self.model(logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            return time.perf_counter() - start


def all_experts_dense(layer: DecoderLayer, tensors: dict[str, np.ndarray], fmt: WeightFormat) -> ov.Model:
    """A MoE layer's routed and shared experts computed for every row, as one wide SwiGLU over the same
    compressed weights (scaled as the engine scales them): x [T, H], each expert's weight [T, E + S] (zero for
    experts a row did not choose) -> [T, H]."""
    gate_up, down = tensors[names.EXPERTS_GATE_UP], tensors[names.EXPERTS_DOWN]
    width = down.shape[2]
    gate = np.concatenate([gate_up[:, :width], tensors[names.SHARED_GATE]])
    up = np.concatenate([gate_up[:, width:], tensors[names.SHARED_UP]]) / np.float32(layer.up_divisor)
    down = np.concatenate([down, tensors[names.SHARED_DOWN]])
    n, hidden = gate.shape[0], gate.shape[2]
    x = ops.parameter([-1, hidden], ov.Type.f32, name="x")
    expert_weights = ops.parameter([-1, n], ov.Type.f32, name="expert_weights")
    h = ops.multiply(swish(linear(x.output(0), weight(gate.reshape(n * width, hidden), fmt))),
                     linear(x.output(0), weight(up.reshape(n * width, hidden), fmt)))  # [T, n * I]
    h = ops.multiply(ops.reshape(h, [0, n, width], True), ops.unsqueeze(expert_weights, -1))  # each expert weighted
    flat_down = np.ascontiguousarray(down.transpose(1, 0, 2)).reshape(hidden, n * width)
    out = linear(ops.reshape(h, [0, n * width], True).output(0), weight(flat_down, fmt))
    return ov.Model([out], [x, expert_weights], "all_experts_dense")


class BlockComparison:
    """Per-call time of a MoE layer's fused block against all experts dense, and of the dense layer's MLP as one
    SwiGLU against expert slices, on the engine's own layers and routing."""

    def __init__(self, engine: Engine, checkpoint: Checkpoint):
        stage, cfg = engine.stage, engine.config
        options = compile_options(device_precision(PRECISION, stage.device))

        def compile_block(model: ov.Model) -> CompiledBlock:
            return CompiledBlock(model, stage.device, options, STREAMS)

        moe = next(i for i in stage.layer_ids if not cfg.is_dense(i))
        dense = next(i for i in stage.layer_ids if cfg.is_dense(i))
        self.moe_layer, self.dense_layer = stage.layers[moe], stage.layers[dense]
        self.all_dense = compile_block(all_experts_dense(self.moe_layer, checkpoint.layer(moe),
                                                         FORMATS.routed_experts))
        self.sliced = build_layer(cfg, dense, checkpoint.layer(dense), FORMATS, compile_block, DENSE_SLICES)
        self.hidden, self.experts = cfg.hidden_size, cfg.n_routed_experts + cfg.n_shared_experts

    def inputs(self, rows: int):
        """Rows of unit RMS, their routing as the fused block takes it and as dense expert weights."""
        h = np.random.default_rng(rows).standard_normal((rows, self.hidden), dtype=np.float32)
        routing = self.moe_layer.router(h)
        fused = (h, routing.index, routing.weights, routing.shared_weights)
        expert_weights = np.zeros((rows, self.experts), np.float32)
        np.put_along_axis(expert_weights, routing.index, routing.weights, axis=1)
        expert_weights[:, -routing.shared_weights.shape[1]:] = routing.shared_weights
        return fused, (h, expert_weights)

    def agreement(self) -> float:
        """Largest difference of the two MoE forms over the largest output, at the most rows (checks the bench)."""
        fused, dense = self.inputs(max(STREAMS))
        a, b = self.moe_layer.mlp(*fused)[0], self.all_dense(*dense)[0]
        return float(np.abs(a - b).max() / np.abs(a).max())

    def seconds(self, rows: int) -> dict[str, float]:
        fused, dense = self.inputs(rows)
        h = fused[0]
        return {"fused": _per_call(lambda: self.moe_layer.mlp(*fused)),
                "all dense": _per_call(lambda: self.all_dense(*dense)),
                "swiglu": _per_call(lambda: self.dense_layer.feed_forward(h)),
                "slices": _per_call(lambda: self.sliced.feed_forward(h))}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _per_call(fn) -> float:
    return _seconds(lambda: [fn() for _ in range(BLOCK_CALLS)]) / BLOCK_CALLS


def _process_memory() -> dict[str, int]:
    """Peak and current resident bytes of this process, the current split into anonymous and file pages."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                values[key] = int(value.split()[0]) * 1024
    return values


def memory_child(path: str, results) -> None:
    """In a fresh process: the runtime's own footprint (OpenVINO's CPU plugin loaded by a tiny graph), then the
    bench's engine built and decoding its most streams."""
    tiny = CompiledBlock(graphs.projection([np.ones((8, 8), np.float32)], WeightFormat()), "CPU",
                         compile_options("f32"), (1,))
    tiny.warm_up()
    baseline = _process_memory()["VmRSS"]
    checkpoint = Checkpoint.open(path)
    decoder = EngineDecoder(checkpoint, prompts(checkpoint.config))
    decoder.decode_seconds(max(STREAMS))
    state = decoder.engine.stage.state_bytes
    results.put(_process_memory() | {"baseline": baseline, "state": state})


def measure_memory(path: Path) -> dict[str, int]:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    child = spawn.Process(target=memory_child, args=(str(path), results))
    child.start()
    out = results.get()
    child.join()
    return out


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    print(format_rows([header, *rows]))
    print()


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


@attrs.define
class Rounds:
    """Every round's figures, by stream (or row) count."""

    engine: dict[int, list[float]]  # tokens/s
    alone: dict[int, list[float]]  # tokens/s of the compiled blocks alone (EngineDecoder.blocks_alone_seconds)
    reference: dict[int, list[float]]  # tokens/s; empty lists without a reference
    blocks: dict[int, list[dict[str, float]]]  # seconds per call, by block form
    bandwidth: list[float]  # bytes/s
    distinct: dict[int, dict[int, float]] = attrs.Factory(dict)  # distinct experts per step, by MoE layer


def run_rounds(engine: EngineDecoder, reference: ReferenceDecoder | None, blocks: BlockComparison,
               repeats: int) -> Rounds:
    print("warm-up round (each stream count's first calls prepare kernels) ...", flush=True)
    for n in STREAMS:
        engine.decode_seconds(n)
        if reference:
            reference.decode_seconds(n)
    stream = np.ones(2**27, np.int64)  # 1 GiB to read for the bandwidth
    rounds = Rounds(*({n: [] for n in STREAMS} for _ in range(4)), [])
    for round_ in range(repeats):
        print(f"round {round_ + 1}/{repeats} ...", flush=True)
        rounds.bandwidth.append(memory_bandwidth(stream))
        for n in STREAMS:
            rounds.engine[n].append(n * DECODE_STEPS / engine.decode_seconds(n))
            rounds.distinct[n] = engine.distinct_experts()
            rounds.alone[n].append(n * DECODE_STEPS / engine.blocks_alone_seconds(n))
            if reference:
                rounds.reference[n].append(n * DECODE_STEPS / reference.decode_seconds(n))
            rounds.blocks[n].append(blocks.seconds(n))
    return rounds


def decode_table(model: ModelSpec, rounds: Rounds) -> dict[str, float | None]:
    """Print the decode table; returns the 1-stream fractions of the roofline and of the reference (or None)."""
    bandwidth = statistics.median(rounds.bandwidth)
    rows, at_one = [], {}
    for n in STREAMS:
        tok_s = statistics.median(rounds.engine[n])
        roofline = n * bandwidth / step_bytes(model, n, rounds.distinct[n])
        pairs = list(zip(rounds.engine[n], rounds.reference[n]))
        ratio = statistics.median(e / r for e, r in pairs) if pairs else None
        alone = statistics.median(rounds.alone[n])
        rows.append((str(n), f"{tok_s:.1f}", f"{statistics.median(rounds.reference[n]):.1f}" if pairs else "-",
                     f"{ratio:.1f}x" if pairs else "-", f"{roofline:.1f}", f"{tok_s / roofline:.0%}",
                     f"{alone:.1f}", f"{alone / roofline:.0%}", f"{statistics.mean(rounds.distinct[n].values()):.1f}"))
        if n == 1:
            at_one = {"roofline": tok_s / roofline, "reference": ratio}
    table(("streams", "engine tok/s", "reference tok/s", "vs reference", "roofline tok/s", "of roofline",
           "blocks alone tok/s", "of roofline", "distinct experts/layer"), rows)
    return at_one


def block_table(rounds: Rounds) -> None:
    def ms(n: int, form: str) -> float:
        return statistics.median(t[form] for t in rounds.blocks[n]) * 1e3

    table(("rows", "MoE fused ms", "all experts dense ms", "dense / fused", "dense MLP ms",
           f"as {DENSE_SLICES} expert slices ms", "slices / MLP"),
          [(str(n), f"{ms(n, 'fused'):.2f}", f"{ms(n, 'all dense'):.2f}", f"{ms(n, 'all dense') / ms(n, 'fused'):.2f}",
            f"{ms(n, 'swiglu'):.2f}", f"{ms(n, 'slices'):.2f}", f"{ms(n, 'slices') / ms(n, 'swiglu'):.2f}")
           for n in STREAMS])


def memory_report(model: ModelSpec, memory: dict[str, int]) -> float:
    """Print the memory line; returns the peak over (weights + state)."""
    weights = (sum(c.weight_bytes for c in costs.layer_costs(model)) + costs.embedding_cost(model).weight_bytes
               + costs.head_cost(model).weight_bytes)
    budget = weights + memory["state"]
    gib = 2**30
    print(f"memory: weights {weights / gib:.3f} GiB + state {memory['state'] / gib:.3f} GiB; process peak "
          f"{memory['VmHWM'] / gib:.3f} GiB = {memory['VmHWM'] / budget:.2f}x; resident after decoding "
          f"{memory['VmRSS'] / gib:.3f} GiB = {memory['VmRSS'] / budget:.2f}x (anonymous "
          f"{memory['RssAnon'] / gib:.3f}, file {memory['RssFile'] / gib:.3f}), of which the runtime's own "
          f"(Python, numpy, OpenVINO loaded) {memory['baseline'] / gib:.3f} GiB\n")
    return memory["VmHWM"] / budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, to check the bench itself")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="rounds; every figure is their median")
    args = parser.parse_args()
    config = model_config(QUICK_MODEL if args.quick else MODEL)
    path = random_checkpoint(config, CHECKPOINT, args.quick, SEED)
    load_before = os.getloadavg()
    print("measuring memory in a fresh process ...", flush=True)
    memory = measure_memory(path)
    checkpoint = Checkpoint.open(path)
    engine = EngineDecoder(checkpoint, prompts(config))
    blocks = BlockComparison(engine.engine, checkpoint)
    try:
        reference = ReferenceDecoder(path, prompts(config))
    except ImportError as e:
        print(f"no reference column: {e}")
        reference = None
    rounds = run_rounds(engine, reference, blocks, args.repeats)
    load_after = os.getloadavg()

    print(f"\n{date.today()}: {'quick ' if args.quick else ''}model hidden {config.hidden_size}, "
          f"{config.num_hidden_layers} layers, {config.n_routed_experts} experts top-{config.num_experts_per_tok} + "
          f"{config.n_shared_experts} shared of width {config.moe_intermediate_size}, vocab {config.vocab_size}; "
          f"experts int4 g32, the rest int8, {PRECISION} compute; {os.cpu_count()} cores; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; memory bandwidth "
          f"{statistics.median(rounds.bandwidth) / 1e9:.1f} GB/s; medians of {args.repeats} rounds of "
          f"{DECODE_STEPS} decode steps after {PROMPT_TOKENS} prompt tokens\n")
    model = ModelSpec(config, FORMATS)
    at_one = decode_table(model, rounds)
    block_table(rounds)
    print(f"(the two MoE forms agree within {blocks.agreement():.1e} of the largest output)")
    peak = memory_report(model, memory)

    print(f"target: 1 stream >= {ROOFLINE_TARGET:.0%} of the roofline: "
          f"{verdict(at_one['roofline'] >= ROOFLINE_TARGET)} ({at_one['roofline']:.0%})")
    if at_one["reference"] is not None:
        print(f"target: 1 stream >= {REFERENCE_TARGET:.0f}x the reference: "
              f"{verdict(at_one['reference'] >= REFERENCE_TARGET)} ({at_one['reference']:.1f}x)")
    print(f"target: peak memory <= {MEMORY_TARGET}x (weights + state): {verdict(peak <= MEMORY_TARGET)} "
          f"({peak:.2f}x)")


if __name__ == "__main__":
    main()
