"""Where a decode step of Cascadia's engine goes, on the race's models, and what a compiled call costs.

Scenario: the two random models of bench/peers.py (a 0.9B Qwen3-MoE and a 0.25B Llama, the same checkpoints, written
on first use) in Cascadia's int8 and int4 formats at bf16 compute (f32 on a CPU without bf16), one process on every
core, as in the race. Each round and stream count prefills fresh streams and times DECODE_STEPS greedy steps.

step parts  A step's wall time split into the compiled blocks it calls, by kind (a layer's attention input: norm and
            q|k|v projection; its output projection; its MLP or experts; the embedding and the head), and the rest:
            the host's work between the calls (attention over the K/V pool, RoPE, head norms, routers, residuals)
            with each call's own Python and binding costs. Median (min-max) of ROUNDS rounds.
calls       What a step's structure costs by itself: CHAIN projections of the models' width (hidden x hidden,
            int8 per row, asymmetric) applied in turn to 1 and 32 rows, as CHAIN compiled blocks called one after
            another (the engine's way: three calls a layer) against one compiled graph holding all of them (the
            one-graph stage's way), with OpenVINO's own threads on every core. Median (min-max) of ROUNDS rounds of
            CALL_REPEATS each.

Not a test: it prints its tables and writes them to bench/results/step_parts.json.

    python bench/step_parts.py [--quick] [--rounds 3]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import collections
import statistics
import time

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from peers import FORMATS, MODELS, SEED, STREAMS, Cascadia, arguments, checkpoint
from record import Table, now, spread, write

from cascadia.engine.device import CompiledBlock, compile_options, runs_as
from cascadia.engine.ov_ops import linear, weight
from cascadia.models import read_config
from cascadia.spec.types import WeightFormat

PROMPT_TOKENS = 32
DECODE_STEPS = 32
ROUNDS = 3
PARTS = ("attention input", "attention output", "MLP", "head", "embedding")
CHAIN = 16  # projections: about a layer's worth of compiled blocks for five layers
CALL_REPEATS = 50
CALL_ROWS = (1, 32)


class BlockClock:
    """Wall seconds spent inside each kind of compiled block while it is installed (CompiledBlock.__call__ wrapped
    for the time), and the calls."""

    def __init__(self, kinds: dict[int, str]):
        self.kinds = kinds  # id(block) -> its part
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls = 0

    def __enter__(self) -> BlockClock:
        call = self.call = CompiledBlock.__call__

        def timed(block: CompiledBlock, *inputs: np.ndarray, **options) -> list[np.ndarray]:
            start = time.perf_counter()
            out = call(block, *inputs, **options)
            self.seconds[self.kinds[id(block)]] += time.perf_counter() - start
            self.calls += 1
            return out

        CompiledBlock.__call__ = timed
        return self

    def __exit__(self, *exc) -> None:
        CompiledBlock.__call__ = self.call


def block_kinds(contestant: Cascadia) -> dict[int, str]:
    """Every compiled block of the engine's stage, by the part of a step it computes."""
    stage = contestant.engine.stage
    kinds = {id(stage.embedding): "embedding", id(stage.head): "head"}
    for layer in stage.layers:
        kinds |= {id(layer.qkv): "attention input", id(layer.o_proj): "attention output", id(layer.mlp): "MLP"}
    return kinds


def step_parts(contestant: Cascadia, prompts: np.ndarray) -> dict[str, float]:
    """Milliseconds a decode step of these streams spends in each part, the host's work and the whole, and its calls."""
    engine, slots = contestant.engine, list(range(len(prompts)))
    for slot in slots:
        engine.release(slot)
    tokens = [int(engine.prefill(slot, prompt).argmax()) for slot, prompt in zip(slots, prompts)]
    with BlockClock(block_kinds(contestant)) as clock:
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            tokens = engine.step(slots, tokens).argmax(-1).tolist()
        seconds = time.perf_counter() - start
    parts = {part: 1e3 * clock.seconds[part] / DECODE_STEPS for part in PARTS}
    return parts | {"host": 1e3 * seconds / DECODE_STEPS - sum(parts.values()), "step": 1e3 * seconds / DECODE_STEPS,
                    "calls": clock.calls / DECODE_STEPS}


def chained(weights: list[np.ndarray], fmt: WeightFormat, options: dict) -> CompiledBlock:
    """x [T, H] through every projection in turn, as one compiled graph."""
    x = ops.parameter([-1, weights[0].shape[1]], ov.Type.f32, name="x")
    h = x.output(0)
    for w in weights:
        h = linear(h, weight(w, fmt))
    return CompiledBlock(ov.Model([h], [x], "chain"), "CPU", options, CALL_ROWS)


def call_costs(hidden: int, precision: str, rounds: int) -> Table:
    """CHAIN projections as CHAIN calls against one graph, at each of CALL_ROWS rows."""
    rng = np.random.default_rng(SEED)
    fmt, options = WeightFormat("int8", symmetric=False), compile_options(precision)
    weights = [rng.standard_normal((hidden, hidden)).astype(np.float32) * hidden ** -0.5 for _ in range(CHAIN)]
    separate = [chained([w], fmt, options) for w in weights]
    together = chained(weights, fmt, options)

    def one_by_one(x: np.ndarray) -> None:
        for block in separate:
            x = block(x)[0]

    ways = {"one call each": one_by_one, "one graph": lambda x: together(x)}
    table = Table(f"{CHAIN} projections of {hidden} x {hidden} (int8, {precision}): one call each against one graph",
                  ["rows", *(f"{way}, us" for way in ways), "one call each over one graph",
                   "cost of a call beyond its work, us"],
                  note=f"Median (min-max) of {rounds} rounds of {CALL_REPEATS} passes, the two ways alternating, "
                       f"after a warm-up. The cost of a call: (one call each - one graph) / {CHAIN}.")
    for rows in CALL_ROWS:
        x = rng.standard_normal((rows, hidden)).astype(np.float32)
        micros = {way: [] for way in ways}
        for way in ways.values():
            way(x)
        for _ in range(rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                for _ in range(CALL_REPEATS):
                    way(x)
                micros[name].append(1e6 * (time.perf_counter() - start) / CALL_REPEATS)
        medians = [statistics.median(micros[way]) for way in ways]
        table.add(rows, *(spread(micros[way]) for way in ways), round(medians[0] / medians[1], 2),
                  round((medians[0] - medians[1]) / CHAIN, 1))
    return table


def main() -> None:
    args = arguments(__doc__, "step_parts", ROUNDS)
    started, rng = now(), np.random.default_rng(SEED)
    precision = runs_as("bf16", "CPU")
    parts = Table(f"A decode step of Cascadia's engine by part, ms ({precision} compute)",
                  ["model", "weights", "streams", "step", *PARTS, "host", "calls a step"],
                  note=f"Median (min-max) of {args.rounds} rounds of {DECODE_STEPS} greedy steps after prompts of "
                       f"{PROMPT_TOKENS}. A part: the wall time of its compiled blocks' calls. Host: the step less "
                       f"every call: the work between them (attention, RoPE, head norms, routers, residuals).")
    hidden = 0
    for model in MODELS:
        path = checkpoint(args.folder, model, args.quick)
        config = read_config(path)
        hidden = config.hidden_size
        prompts = rng.integers(3, config.vocab_size, (max(STREAMS), PROMPT_TOKENS))
        for fmt in ("int8", "int4"):
            contestant = Cascadia(path, FORMATS[fmt].cascadia, precision)
            for g in STREAMS:
                step_parts(contestant, prompts[:g])  # warm-up: each count's first calls prepare kernels
            rounds = [{g: step_parts(contestant, prompts[:g]) for g in STREAMS} for _ in range(args.rounds)]
            del contestant
            for g in STREAMS:
                parts.add(model, fmt, g, *(spread(r[g][part] for r in rounds) for part in ("step", *PARTS, "host")),
                          round(statistics.median(r[g]["calls"] for r in rounds)))
            print(parts.text(), "\n", flush=True)
    calls = call_costs(hidden, precision, args.rounds)
    print(calls.text(), "\n")
    write("step_parts", "Where a decode step of Cascadia's engine goes, and what a compiled call costs", started,
          [parts, calls], args.out, quick=args.quick)


if __name__ == "__main__":
    main()
