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
  MoE block   one MoE layer: the fused graph (GatherMatmul: an expert's weights read again for every row that
              chose it) against the expert-grouped one (a FullyConnected per touched expert over all its rows), on
              new rows routed by the layer's router in every call, and the path the engine chose at start-up; the
              bound of the MoE target: 1.5 x (the distinct routed and the shared experts' bytes at the
              measured bandwidth + the fused 1-row call); the tokens/s that the MoE layers alone would allow at the
              faster path's time per call, a bound on the decode targets that no change elsewhere passes
  dense MLP   the dense layer's MLP as one SwiGLU against the same cut into DENSE_SLICES all-active experts
  attention input  a layer's input norm, q|k|v|r projection and q's head norm: the norms on the host around a
              plain projection block against all three in one block (`graphs.attention_input`, what the engine runs)
  memory      peak resident memory (VmHWM) of a fresh process that builds the engine and decodes 32 streams,
              against the formats' weight bytes plus the engine's state (K/V rings, convolution states)
and whether the engine's targets are met: at 1 stream >= 50% of the roofline and >= 5x the reference; at 32 streams
>= 35% of the roofline and >= 5x the reference; the MoE at 32 rows within its bound; peak memory <= 1.3 x (weights
+ state). Not a test: it prints tables and writes them to bench/results/engine.json.

    python bench/engine.py [--quick] [--repeats 5] [--moe-grouped-from never|auto|ROWS]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import numpy as np
import openvino as ov
from random_model import FORMATS, MID_SIZES, QUICK_SIZES, model_config, random_checkpoint
from record import Table, now, spread, write

from cascadia.models import inkling as names
from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import Compiled, CompiledBlock, compile_options, core, device_precision, runs_as
from cascadia.engine.engine import Engine
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.families.inkling import Router, build_layer
from cascadia.engine.layers import head_rms_norm, rms_norm
from cascadia.engine.moe_choice import paths_text
from cascadia.graph import costs
from cascadia.models.inkling import InklingConfig
from cascadia.spec.types import ModelSpec, RuntimeSpec, WeightFormat

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
# The targets: fraction of the roofline and multiple of the reference by streams; MoE time at the most rows
# over its bound; peak memory over weights + state.
ROOFLINE_TARGETS, REFERENCE_TARGET = {1: 0.5, 32: 0.35}, 5.0
MOE_TARGET, MEMORY_TARGET = 1.5, 1.3


def prompts(config: InklingConfig) -> np.ndarray:
    """[max streams, PROMPT_TOKENS] token ids, the same every run."""
    return np.random.default_rng(SEED).integers(3, config.vocab_size, (max(STREAMS), PROMPT_TOKENS))


def memory_bandwidth(data: np.ndarray, every_core: bool = True) -> float:
    """Bytes/s of a streaming read: the sum of `data` on one thread and (`every_core`) split over every core, best of
    3 each."""
    cores = os.cpu_count() or 1
    chunks = np.array_split(data, cores)
    with ThreadPoolExecutor(cores) as pool:
        readers = (lambda: data.sum(), lambda: list(pool.map(np.sum, chunks)))[:2 if every_core else 1]
        best = min(wall_seconds(read) for read in readers for _ in range(3))
    return data.nbytes / best


def step_bytes(model: ModelSpec, rows: int, distinct: dict[int, float]) -> float:
    """Weight bytes one decode step of `rows` rows reads: every weight of each layer once, except routed experts
    (the `distinct[layer]` experts the rows chose), one embedding row per row, the whole head."""
    total = rows * costs.embedding_cost(model).bytes_per_row + costs.head_cost(model).bytes_per_row
    for layer in range(model.config.num_hidden_layers):
        ops = costs.layer_ops(model, layer)
        total += sum(op.bytes_per_row for kind, op in ops.items() if kind != "routed_experts")
        if "routed_experts" in ops:
            total += distinct[layer] * ops["routed_experts"].weight_bytes / model.config.routed_experts[0]
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


class ExpertCounts:
    """Every MoE layer's router of an engine wrapped in a CountingRouter: the distinct experts its calls chose."""

    def __init__(self, engine: Engine):
        self.routers: dict[int, CountingRouter] = {}  # by MoE layer
        for i, layer in zip(engine.stage.layer_ids, engine.stage.layers):
            if layer.router is not None:
                layer.router = self.routers[i] = CountingRouter(layer.router)

    def clear(self) -> None:
        for router in self.routers.values():
            router.distinct.clear()

    def means(self) -> dict[int, float]:
        """Mean distinct routed experts per call since the last `clear`, by MoE layer."""
        return {i: float(np.mean(router.distinct)) for i, router in self.routers.items()}


class EngineDecoder:
    def __init__(self, checkpoint: Checkpoint, prompt_ids: np.ndarray, moe_grouped_from: int | str = "never"):
        runtime = RuntimeSpec(precision=PRECISION, max_streams=max(STREAMS), moe_grouped_from=moe_grouped_from,
                              context_budget=PROMPT_TOKENS + DECODE_STEPS, row_buckets=STREAMS)
        self.engine = Engine(checkpoint, runtime, formats=FORMATS)
        self.prompts = prompt_ids
        self.experts = ExpertCounts(self.engine)

    def decode_seconds(self, streams: int) -> float:
        """Prefill `streams` fresh streams, then time DECODE_STEPS greedy steps of all of them together."""
        tokens = self._prefill(streams)
        return wall_seconds(lambda: self._decode(tokens))

    def blocks_alone_seconds(self, streams: int) -> float:
        """The compiled blocks of DECODE_STEPS decode steps of `streams` streams, replayed back to back with the
        inputs they had: what the steps would cost with no host work between the calls (the most any change on
        the host side could reach)."""
        tokens = self._prefill(streams)
        calls: list[tuple[Compiled, tuple[np.ndarray, ...], dict[str, int | None]]] = []
        runs = {cls: cls.__call__ for cls in (CompiledBlock, GroupedBlock)}

        def recorder(run):
            def record(block: Compiled, *inputs: np.ndarray, **options) -> list[np.ndarray]:
                calls.append((block, tuple(x.copy() for x in inputs), options))
                return run(block, *inputs, **options)
            return record

        for cls, run in runs.items():
            cls.__call__ = recorder(run)
        try:
            self._decode(tokens)
        finally:
            for cls, run in runs.items():
                cls.__call__ = run
        return wall_seconds(lambda: [block(*inputs, **options) for block, inputs, options in calls])

    def _prefill(self, streams: int) -> np.ndarray:
        """Fresh streams in slots 0.. with their prompts; their first tokens."""
        for slot in range(streams):
            self.engine.release(slot)
        return np.array([self.engine.prefill(slot, self.prompts[slot]).argmax() for slot in range(streams)])

    def _decode(self, tokens: np.ndarray) -> None:
        self.experts.clear()
        slots = np.arange(len(tokens))
        for _ in range(DECODE_STEPS):
            tokens = self.engine.step(slots, tokens).argmax(axis=1)

    def distinct_experts(self) -> dict[int, float]:
        """Mean distinct routed experts per step of the last decode, by MoE layer."""
        return self.experts.means()


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


class BlockComparison:
    """Per-call time of a MoE layer's fused block against its expert-grouped one, and of the dense layer's MLP as
    one SwiGLU against expert slices, on the engine's own layers (built again here with both MoE paths, whatever
    the engine chose) and routing."""

    def __init__(self, engine: Engine, checkpoint: Checkpoint):
        stage, cfg = engine.stage, engine.config
        options = compile_options(device_precision(PRECISION, stage.device))

        def compile_block(model: ov.Model) -> CompiledBlock:
            return CompiledBlock(model, stage.device, options, STREAMS)

        def compile_grouped(model: ov.Model) -> GroupedBlock:
            return GroupedBlock(model, stage.device, options, STREAMS)

        moe = next(i for i in stage.layer_ids if not cfg.is_dense(i))
        dense = next(i for i in stage.layer_ids if cfg.is_dense(i))
        self.moe_layer = build_layer(cfg, moe, checkpoint.layer(moe), FORMATS, compile_block,
                                     compile_grouped=compile_grouped)
        self.moe_layer.grouped.warm_up()
        self.dense_layer = stage.layers[dense]
        self.sliced = build_layer(cfg, dense, checkpoint.layer(dense), FORMATS, compile_block, DENSE_SLICES)
        self.hidden = cfg.hidden_size
        t = checkpoint.layer(moe)
        qkvr = [t[name] for name in (names.Q_PROJ, names.K_PROJ, names.V_PROJ, names.R_PROJ)]
        self.projection = compile_block(graphs.projection(qkvr, FORMATS.attention))
        self.norms, self.q_width, self.eps = (t[names.INPUT_NORM], t[names.Q_NORM]), qkvr[0].shape[0], cfg.rms_norm_eps

    def norms_on_host(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attention input as the engine computed it before `graphs.attention_input`."""
        projected = self.projection(rms_norm(x, self.norms[0], self.eps))[0]
        return head_rms_norm(projected[:, :self.q_width], self.norms[1], self.eps), projected[:, self.q_width:]

    def inputs(self, rows: int, seed: int = 0) -> tuple[np.ndarray, ...]:
        """Rows of unit RMS and their routing as both MoE blocks take it."""
        h = np.random.default_rng([rows, seed]).standard_normal((rows, self.hidden), dtype=np.float32)
        return self.moe_layer.expert_inputs(h)[0]

    def distinct(self, rows: int) -> float:
        """Mean distinct experts of the rows `seconds` times."""
        return statistics.mean(len(np.unique(self.inputs(rows, seed)[1])) for seed in range(BLOCK_CALLS))

    def agreement(self) -> float:
        """Largest difference of the two MoE paths over the largest output, at the most rows (checks the bench)."""
        inputs = self.inputs(max(STREAMS))
        a, b = self.moe_layer.mlp(*inputs)[0], self.moe_layer.grouped(*inputs)
        return float(np.abs(a - b).max() / np.abs(a).max())

    def seconds(self, rows: int) -> dict[str, float]:
        """Seconds per call, BLOCK_CALLS calls each on new rows (so a new routing, as decode steps have)."""
        inputs = [self.inputs(rows, seed) for seed in range(BLOCK_CALLS)]

        def per_call(call) -> float:
            return wall_seconds(lambda: [call(x) for x in inputs]) / BLOCK_CALLS

        return {"fused": per_call(lambda x: self.moe_layer.mlp(*x)),
                "grouped": per_call(lambda x: self.moe_layer.grouped(*x)),
                "swiglu": per_call(lambda x: self.dense_layer.feed_forward(x[0])),
                "slices": per_call(lambda x: self.sliced.feed_forward(x[0])),
                "norms on host": per_call(lambda x: self.norms_on_host(x[0])),
                "attention input": per_call(lambda x: self.moe_layer.qkvr(x[0]))}


def wall_seconds(fn) -> float:
    """Wall seconds `fn()` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _process_memory() -> dict[str, int]:
    """Peak and current resident bytes of this process, the current split into anonymous and file pages."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                values[key] = int(value.split()[0]) * 1024
    return values


def memory_child(path: str, moe_grouped_from: int | str, results) -> None:
    """In a fresh process: the runtime's own footprint (OpenVINO's CPU plugin loaded by a tiny graph), then the
    bench's engine built and decoding its most streams."""
    tiny = CompiledBlock(graphs.projection([np.ones((8, 8), np.float32)], WeightFormat()), "CPU",
                         compile_options("f32"), (1,))
    tiny.warm_up()
    baseline = _process_memory()["VmRSS"]
    checkpoint = Checkpoint.open(path)
    decoder = EngineDecoder(checkpoint, prompts(checkpoint.config), moe_grouped_from)
    decoder.decode_seconds(max(STREAMS))
    state = decoder.engine.stage.state_bytes
    results.put(_process_memory() | {"baseline": baseline, "state": state})


def measure_memory(path: Path, moe_grouped_from: int | str) -> dict[str, int]:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    child = spawn.Process(target=memory_child, args=(str(path), moe_grouped_from, results))
    child.start()
    out = results.get()
    child.join()
    return out


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


def decode_table(model: ModelSpec, rounds: Rounds) -> tuple[Table, dict[int, dict[str, float | None]]]:
    """The decode table, and by stream count the fraction of the roofline and the multiple of the reference (or
    None)."""
    bandwidth = statistics.median(rounds.bandwidth)
    table = Table("Decode", ["streams", "engine tok/s", "reference tok/s", "vs reference", "roofline tok/s",
                             "of roofline %", "blocks alone tok/s", "of roofline %", "distinct experts a layer"],
                  note="Roofline: the step's weight bytes (routed experts: the distinct ones its rows chose) at the "
                       "measured memory bandwidth. Blocks alone: the same steps' compiled blocks replayed back to "
                       "back, with no host work between them.")
    fractions = {}
    for n in STREAMS:
        tok_s = statistics.median(rounds.engine[n])
        roofline = n * bandwidth / step_bytes(model, n, rounds.distinct[n])
        pairs = list(zip(rounds.engine[n], rounds.reference[n]))
        ratios = spread(e / r for e, r in pairs) if pairs else None
        alone = statistics.median(rounds.alone[n])
        table.add(n, spread(rounds.engine[n]), spread(rounds.reference[n]) if pairs else None, ratios, roofline,
                  100 * tok_s / roofline, spread(rounds.alone[n]), 100 * alone / roofline,
                  statistics.mean(rounds.distinct[n].values()))
        fractions[n] = {"roofline": tok_s / roofline, "reference": ratios and ratios["median"],
                        "roofline tok/s": roofline}
    return table, fractions


def block_tables(model: ModelSpec, rounds: Rounds, blocks: BlockComparison,
                 grouped_from: int | None) -> tuple[list[Table], float, dict[int, float]]:
    """The block tables; the MoE's best time at the most rows over its bound (see the module's text), and the best
    path's seconds per MoE call by rows."""
    def ms(n: int, form: str) -> float:
        return statistics.median(t[form] for t in rounds.blocks[n]) * 1e3

    def ms_spread(n: int, form: str) -> dict:
        return spread(t[form] * 1e3 for t in rounds.blocks[n])

    layer = next(ops for i in range(model.config.num_hidden_layers)
                 if "routed_experts" in (ops := costs.layer_ops(model, i)))
    expert_bytes = layer["routed_experts"].weight_bytes / model.config.routed_experts[0]
    bandwidth = statistics.median(rounds.bandwidth)
    moe = Table("One MoE layer and the dense MLP, ms a call",
                ["rows", "distinct experts", "MoE fused ms", "MoE grouped ms", "grouped / fused", "engine runs",
                 "experts' bytes ms", "bound ms", "best / bound", "dense MLP ms", f"as {DENSE_SLICES} expert slices ms",
                 "slices / MLP"],
                note=f"Bound: {MOE_TARGET} x (the distinct routed and the shared experts' bytes at the measured "
                     "bandwidth + the fused 1-row call).")
    over, best_s = 0.0, {}
    for n in STREAMS:
        distinct = blocks.distinct(n)
        read_ms = (distinct * expert_bytes + layer["shared_experts"].weight_bytes) / bandwidth * 1e3
        bound = MOE_TARGET * (read_ms + ms(1, "fused"))
        chosen = "grouped" if grouped_from is not None and n >= grouped_from else "fused"
        best = min(ms(n, "fused"), ms(n, "grouped"))
        over, best_s[n] = best / bound, best / 1e3
        moe.add(n, distinct, ms_spread(n, "fused"), ms_spread(n, "grouped"), ms(n, "grouped") / ms(n, "fused"),
                chosen, read_ms, bound, best / bound, ms_spread(n, "swiglu"), ms_spread(n, "slices"),
                ms(n, "slices") / ms(n, "swiglu"))
    norms = Table("A layer's input norms and q|k|v|r projection, ms a call",
                  ["rows", "norms on the host ms", "all in one block ms", "one block / host"])
    for n in STREAMS:
        norms.add(n, ms_spread(n, "norms on host"), ms_spread(n, "attention input"),
                  ms(n, "attention input") / ms(n, "norms on host"))
    return [moe, norms], over, best_s


def memory_table(model: ModelSpec, memory: dict[str, int]) -> tuple[Table, float]:
    """The memory table, and the peak over (weights + state)."""
    weights = (sum(c.weight_bytes for c in costs.layer_costs(model)) + costs.embedding_cost(model).weight_bytes
               + costs.head_cost(model).weight_bytes)
    budget, gib = weights + memory["state"], 2**30
    table = Table("Memory of a fresh process that builds the engine and decodes 32 streams",
                  ["what", "GiB", "over weights + state"])
    table.add("weights", weights / gib, None)
    table.add("state (K/V rings, convolution states)", memory["state"] / gib, None)
    table.add("process peak (VmHWM)", memory["VmHWM"] / gib, memory["VmHWM"] / budget)
    table.add("resident after decoding (VmRSS)", memory["VmRSS"] / gib, memory["VmRSS"] / budget)
    table.add("of which anonymous", memory["RssAnon"] / gib, None)
    table.add("of which file-backed", memory["RssFile"] / gib, None)
    table.add("the runtime's own (Python, numpy, OpenVINO loaded)", memory["baseline"] / gib, None)
    return table, memory["VmHWM"] / budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, to check the bench itself")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="rounds; every figure is their median")
    parser.add_argument("--moe-grouped-from", default="never", type=lambda text: int(text) if text.isdigit() else text,
                        help="the engine's runtime.moe_grouped_from (default never: the fused MoE at every call size; "
                             "1: the expert-grouped one alone)")
    parser.add_argument("--out", type=Path, help="default bench/results/engine.json")
    args = parser.parse_args()
    started = now()
    config = model_config(QUICK_MODEL if args.quick else MODEL)
    path = random_checkpoint(config, CHECKPOINT, args.quick, SEED)
    load_before = os.getloadavg()
    print("measuring memory in a fresh process ...", flush=True)
    memory = measure_memory(path, args.moe_grouped_from)
    checkpoint = Checkpoint.open(path)
    engine = EngineDecoder(checkpoint, prompts(config), args.moe_grouped_from)
    blocks = BlockComparison(engine.engine, checkpoint)
    try:
        reference = ReferenceDecoder(path, prompts(config))
    except ImportError as e:
        print(f"no reference column: {e}")
        reference = None
    rounds = run_rounds(engine, reference, blocks, args.repeats)
    load_after = os.getloadavg()

    model_text = (f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.n_routed_experts} "
                  f"experts top-{config.num_experts_per_tok} + {config.n_shared_experts} shared of width "
                  f"{config.moe_intermediate_size}, vocab {config.vocab_size}; experts int4 g32, the rest int8, "
                  f"{PRECISION} compute (runs as {runs_as(PRECISION, 'CPU')})")
    print(f"\n{'quick ' if args.quick else ''}model {model_text}; {core().get_property('CPU', 'FULL_DEVICE_NAME')}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; memory bandwidth "
          f"{statistics.median(rounds.bandwidth) / 1e9:.1f} GB/s; medians of {args.repeats} rounds of "
          f"{DECODE_STEPS} decode steps after {PROMPT_TOKENS} prompt tokens\n")
    model = ModelSpec(config, FORMATS)
    decode, fractions = decode_table(model, rounds)
    grouped_from = engine.engine.stage.moe_grouped_from
    blocks_tables, moe_over, moe_s = block_tables(model, rounds, blocks, grouped_from)
    blocks_tables[0].note += (f" The two MoE paths agree within {blocks.agreement():.1e} of the largest output; "
                              f"the engine runs {paths_text(grouped_from, STREAMS)}.")
    memory_t, peak = memory_table(model, memory)

    targets = Table("The targets", ["target", "measured", "met"])
    moe_layers = sum(not config.is_dense(i) for i in range(config.num_hidden_layers))
    for n, fraction in ROOFLINE_TARGETS.items():
        measured = fractions[n]
        moe_alone = n / (moe_layers * moe_s[n])
        targets.add(f"{n} stream(s): at least {fraction:.0%} of the roofline", f"{measured['roofline']:.0%}",
                    verdict(measured["roofline"] >= fraction))
        targets.add(f"{n} stream(s), bound: the {moe_layers} MoE layers alone at the faster path's time per call",
                    f"{moe_alone / measured['roofline tok/s']:.0%}", "-")
        if measured["reference"] is not None:
            targets.add(f"{n} stream(s): at least {REFERENCE_TARGET:.0f}x the reference",
                        f"{measured['reference']:.1f}x", verdict(measured["reference"] >= REFERENCE_TARGET))
    targets.add(f"MoE at {max(STREAMS)} rows within its bound", f"{moe_over:.2f}x the bound", verdict(moe_over <= 1))
    targets.add(f"peak memory at most {MEMORY_TARGET}x (weights + state)", f"{peak:.2f}x",
                verdict(peak <= MEMORY_TARGET))
    tables = [decode, *blocks_tables, memory_t, targets]
    for table in tables:
        print(table.text() + "\n")
    write("engine", "The resident engine on a mid-size random Inkling: decode speed, blocks and memory", started,
          tables, args.out, quick=args.quick, model=model_text, reference=reference is not None,
          bandwidth_gb_s=spread(b / 1e9 for b in rounds.bandwidth), load_average=[load_before[0], load_after[0]],
          rounds={"engine": rounds.engine, "alone": rounds.alone, "reference": rounds.reference})


if __name__ == "__main__":
    main()
