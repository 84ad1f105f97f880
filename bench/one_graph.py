"""The engine with a stage as one compiled graph (`runtime.stage_graph`) against the engine layer by layer.

Scenario: the race's two random models (bench/peers.py: a 0.9B Qwen3-MoE and a 0.25B Llama, the same checkpoints,
written on first use) in Cascadia's int8 and int4 formats at bf16 compute (f32 on a CPU without bf16) and bf16 K/V,
one process on every core, both engines loaded side by side. Each round and stream count prefills fresh streams and
decodes DECODE_STEPS greedy steps each way, the ways alternating:

layers      `stage_graph: false`, the default: per layer three compiled blocks (norm and q|k|v; o; the MLP or
            experts), with RoPE, attention over the paged K/V pool, routers, norms and residuals on the host.
one graph   `stage_graph: true`: every layer of the stage in one OpenVINO graph (`cascadia.engine.stage_graph`), its
            attention OpenVINO's PagedAttention over the pool's blocks of 32 in place; a step is the embedding's
            call, the stage's and the head's.

check       The models at --quick sizes: one stream's prompt and DECODE_STEPS teacher-forced tokens scored each way
            (`Engine.score`: the prompt in one chunk, then a row a step), at f32 and at bf16, each against the
            layers at f32: the largest logit difference over the largest logit, and the rows whose greedy token
            agrees.
first token A 512-token prompt's, one stream, in chunks of 256 rows (median of the rounds).
memory      A fresh process for each way, model and format (`peers.peak_memory`): loaded, that first token, then 32
            streams' decode; its peak resident memory (VmHWM).

Not a test: it prints its tables and writes them to bench/results/one_graph.json.

    python bench/one_graph.py [--quick] [--rounds 3]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import statistics
import time

import numpy as np
from peers import (FIRST_TOKEN_PROMPT, FORMATS, MODELS, SEED, STREAMS, Cascadia, arguments, checkpoint,
                   peak_memory)
from record import Table, now, spread, write

from cascadia.engine.device import runs_as

PROMPT_TOKENS = 32
DECODE_STEPS = 32
ROUNDS = 3
WAYS = {"layers": False, "one graph": True}  # runtime.stage_graph of each


def decode(contestant: Cascadia, prompts: np.ndarray) -> tuple[float, list[list[int]]]:
    """Seconds a greedy decode step of these fresh streams takes, after their prompts, and each stream's tokens."""
    engine, slots = contestant.engine, list(range(len(prompts)))
    for slot in slots:
        engine.release(slot)
    tokens = [int(engine.prefill(slot, prompt).argmax()) for slot, prompt in zip(slots, prompts)]
    out = [tokens]
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        tokens = engine.step(slots, tokens).argmax(-1).tolist()
        out.append(tokens)
    return (time.perf_counter() - start) / DECODE_STEPS, [list(column) for column in zip(*out)]


def check(folder, rng: np.random.Generator, precision: str) -> Table:
    """On the --quick models: the one graph's logits against the layers' in f32, and each way's at `precision`
    against the layers' in f32."""
    table = Table(f"The one graph against the layers, the models at --quick sizes ({precision} against f32)",
                  ["model", "weights", "f32: rows that agree", "f32: largest difference",
                   f"{precision} layers: rows that agree", f"{precision} layers: largest difference",
                   f"{precision} one graph: rows that agree", f"{precision} one graph: largest difference"],
                  note=f"One stream's prompt of {PROMPT_TOKENS} and {DECODE_STEPS} teacher-forced tokens scored "
                       f"(the prompt in one chunk, then a row a step), each way against the layers in f32: the rows "
                       f"whose greedy token agrees, and the largest logit difference over the largest logit.")
    for model in MODELS:
        path = checkpoint(folder, model, quick=True)
        for fmt in ("int8", "int4"):
            ids = rng.integers(3, 4096, PROMPT_TOKENS + DECODE_STEPS)  # within the --quick vocabulary
            reference, *others = (Cascadia(path, FORMATS[fmt].cascadia, compute, graph).engine.score(
                ids, prefill=PROMPT_TOKENS) for compute, graph in (("f32", False), ("f32", True),
                                                                   (precision, False), (precision, True)))
            cells = []
            for logits in others:
                agree = int((logits.argmax(-1) == reference.argmax(-1)).sum())
                worst = float(np.abs(logits - reference).max() / np.abs(reference).max())
                cells += [f"{agree}/{len(reference)}", float(f"{worst:.2g}")]
            table.add(model, fmt, *cells)
    print(table.text(), "\n", flush=True)
    return table


def main() -> None:
    args = arguments(__doc__, "one_graph", ROUNDS)
    started, rng = now(), np.random.default_rng(SEED)
    precision = runs_as("bf16", "CPU")
    checked = check(args.folder, rng, precision)
    speed = Table(f"A decode step, ms ({precision} compute): the engine layer by layer against one graph a stage",
                  ["model", "weights", "streams", *WAYS, "layers over one graph", "greedy tokens that agree"],
                  note=f"Median (min-max) of {args.rounds} rounds, the two ways alternating, of {DECODE_STEPS} greedy "
                       f"steps after prompts of {PROMPT_TOKENS}. Agree: the leading tokens each stream decodes the "
                       f"same both ways, summed over the streams, in the last round.")
    memory = Table("Peak memory of a process running the engine, MiB", ["model", "weights", *WAYS,
                                                                         "one graph over layers"],
                   note="A fresh process each: loaded, the first token of the 512-token prompt, 64 tokens of 32 "
                        "streams; its peak resident set (VmHWM).")
    first = Table(f"First token of a {FIRST_TOKEN_PROMPT}-token prompt, one stream, seconds ({precision} compute)",
                  ["model", "weights", *WAYS, "layers over one graph"],
                  note="Median (min-max) of the rounds, alternating with the decode's; the prompt in chunks of 256.")
    for model in MODELS:
        path = checkpoint(args.folder, model, args.quick)
        vocab = 4096 if args.quick else MODELS[model]["vocab_size"]
        prompts = rng.integers(3, vocab, (max(STREAMS), PROMPT_TOKENS))
        long_prompt = rng.integers(3, vocab, FIRST_TOKEN_PROMPT)
        for fmt in ("int8", "int4"):
            contestants = {way: Cascadia(path, FORMATS[fmt].cascadia, precision, graph)
                           for way, graph in WAYS.items()}
            for g in STREAMS:  # warm-up: each count's first calls prepare kernels
                for contestant in contestants.values():
                    decode(contestant, prompts[:g])
            seconds = {(way, g): [] for way in WAYS for g in (*STREAMS, "first")}
            tokens = {}
            for _ in range(args.rounds):
                for g in STREAMS:
                    for way, contestant in contestants.items():
                        taken, tokens[way, g] = decode(contestant, prompts[:g])
                        seconds[way, g].append(1e3 * taken)
                for way, contestant in contestants.items():
                    seconds[way, "first"].append(contestant.first_token_seconds(long_prompt))
            for g in STREAMS:
                medians = [statistics.median(seconds[way, g]) for way in WAYS]
                agree = sum(_leading(a, b) for a, b in zip(*(tokens[way, g] for way in WAYS)))
                speed.add(model, fmt, g, *(spread(seconds[way, g]) for way in WAYS),
                          round(medians[0] / medians[1], 2), f"{agree}/{g * (DECODE_STEPS + 1)}")
            medians = [statistics.median(seconds[way, "first"]) for way in WAYS]
            first.add(model, fmt, *(spread(seconds[way, "first"]) for way in WAYS), round(medians[0] / medians[1], 2))
            del contestants
            peaks = [peak_memory(who, path, fmt, precision, prompts, long_prompt) / 2**20
                     for who in ("Cascadia", "Cascadia one graph")]
            memory.add(model, fmt, *(round(peak) for peak in peaks), round(peaks[1] / peaks[0], 2))
            print(speed.text(), "\n", first.text(), "\n", memory.text(), "\n", flush=True)
    write("one_graph", "The engine with a stage as one compiled graph against the engine layer by layer", started,
          [checked, speed, first, memory], args.out, quick=args.quick)


def _leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


if __name__ == "__main__":
    main()
