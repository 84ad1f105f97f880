"""What speculative decoding buys on a pipeline: tokens/s with and without, and the simulator's prediction beside it.

Scenario: the spec's pipeline (default specs/tiny-local.yaml, its local nodes) serves closed-loop levels of
STREAMS clients, REQUESTS greedy requests of OUTPUT_TOKENS per phase, on sets of prompts, each run three ways:
without speculation, with prompt-lookup (n-gram) drafts, and with the replay of the first run's outputs as drafts
(every draft accepted: the ceiling). A random model's sets (the default) are repetitive prompts (a short phrase
repeated, so that prompt lookup has something to find), fresh ones (a prompt per request), and REPEATED of them over
and over, where the drafts come from the phrase table (the outputs of the requests that finished before). With `--text`
(a trained model, such as specs/tiny-chat.yaml) the sets are text of three kinds, fresh prompts each, encoded by the
checkpoint's tokenizer: prose, code, and a repeated structure (lines that follow one pattern), at TEXT_STREAMS; where
the checkpoint has a multi-token-prediction layer, a fourth way drafts with it (MTP_DRAFT a step; `--calibrate` then
measures the calibration with those drafts, so that it holds the layer's table). Every speculating run's tokens are
compared with the run without on the same prompts (the same in f32; bf16 rounding moves with a call's rows, so there
they may differ).
A run without speculation of each set first warms the machine up and gives the replay its outputs; then each of
ROUNDS rounds runs them all, one after another (every other round in reverse order), so that the machine's load
moves them alike; reported per level, medians over the rounds: decode tokens/s, the speed-up (each round's against
the same round's run without; and the range of the rounds' own: where no drafts were proposed, the machine's noise),
drafts accepted of proposed, mean accepted per verifying step, and, with a calibration (`cascadia calibrate`), the
simulator's decode tokens/s and speed-up for the same workload, its drafts accepted as the first round's run
accepted them (its acceptance trace: request by request, step by step; `--calibrate` measures one first with
`cascadia calibrate`), and its speed-up with drafts proposed and accepted at the rates fitted to that run's first
level alone (`cascadia.sim.drafts.fitted_rates`: one stream's acceptance predicting the others'). Not a test: it
prints ratios of one machine's runs. Then, for the paper's deployment (specs/inkling-975b-11pc.yaml, analytic),
the simulator's speed-up against the acceptance rate at 1, 4 and 11 streams. The tables go to
bench/results/speculate-SPEC.json (SPEC: the spec's file name).

    python bench/speculate.py [SPEC] [--calibration cal.json | --calibrate] [--max-draft 4] [--rounds 3] [--paper-only]
    python bench/speculate.py specs/tiny-chat.yaml --text --calibrate --rounds 3
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial
from pathlib import Path

import attrs
from record import ROOT, Table, calibrate, now, shown, spread, write

from cascadia.graph.planner import plan as make_plan
from cascadia.models import mtp_layers
from cascadia.pipeline.run import Pipeline
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import Calibration
from cascadia.sim.drafts import acceptance_trace, fitted_rates
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec
from cascadia.speculation import ReplayDrafter
from cascadia.tokenizer import load_tokenizer

STREAMS = (1, 4)
REQUESTS = 8
OUTPUT_TOKENS = 32
REPEATED = 4
PAPER_SPEC = ROOT / "specs" / "inkling-975b-11pc.yaml"
PAPER_STREAMS = (1, 4, 11)
PAPER_OUTPUT_TOKENS = 64
ACCEPTANCE = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


TEXT_STREAMS = (1, 4, 16)
TEXT_REQUESTS = 16
NOUNS = ("list", "dictionary", "string", "tuple", "set", "file", "module", "class", "function", "generator",
         "iterator", "socket", "thread", "queue", "method", "decorator")
# a few words of a kind, filled with each noun: fresh prompts of text such as the model was trained on
TEXT_KINDS = {
    "prose": ("The {} object is", "A {} can be used to", "When a {} is created, the", "In Python, a {} is",
              "This module provides a {} that", "Each {} has an attribute that"),
    "code": (">>> {0} = make_{0}()\n>>> {0}.", "def get_{0}(self):\n    return self.", "for {0} in {0}s:\n    print(",
             "import {0}\n\n{0}.", "class {0}Error(Exception):\n    pass\n\n", "if isinstance(x, {0}):\n    "),
    "repeated structure": ("x.{0}(1)\nx.{0}(2)\nx.",
                           "- {0}: a {0}\n- {0}s: the {0}s\n- {0}:", "{0}[0] = 0\n{0}[1] = 1\n{0}[",
                           ">>> {0}(1)\n1\n>>> {0}(2)\n2\n>>> {0}(", "a = {0}('a')\nb = {0}('b')\nc",
                           "The {0} is a {0}. The {0} is a {0}. The"),
}


def repetitive_prompts(vocab: int, n: int) -> list[tuple[int, ...]]:
    """A phrase of 3..5 tokens repeated to 16..23 tokens, a different phrase per prompt."""
    return [tuple(([(11 * i + 7 * j + 1) % vocab for j in range(3 + i % 3)] * 8)[:16 + i % 8]) for i in range(n)]


def text_prompts(spec, kind: str, n: int) -> list[tuple[int, ...]]:
    """`n` different prompts of a kind, each a template filled with a noun, encoded by the checkpoint's tokenizer
    after the model's BOS (as its training documents begin)."""
    tokenizer = load_tokenizer(spec.model.checkpoint)
    texts = [template.format(noun) for noun in NOUNS for template in TEXT_KINDS[kind]]
    if n > len(texts):
        raise SystemExit(f"{n} {kind} prompts asked for, {len(texts)} made")
    return [(spec.model.config.bos_token_id, *tokenizer.encode(text).ids) for text in texts[:n]]


def served(spec, prompts, drafter=None, speculate: str | None = None):
    """(levels, outputs by prompt, output lines) of the spec's workload on its pipeline, speculating as `speculate`
    says."""
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, speculate=speculate))
    with Pipeline.start(spec, make_plan(spec)) as pipeline:
        done = pipeline.run(spec.workload, prompts=prompts, drafter=drafter)
    return (done.result["levels"], {(tuple(line["prompt_ids"]), line["phase"], line["request_id"]): line["output_ids"]
                                    for line in done.outputs}, done.outputs)


def by_prompt(outputs: dict) -> dict[tuple[int, ...], list[int]]:
    return {prompt: tokens for (prompt, _, _), tokens in outputs.items()}


def one_round(spec, sets: dict, speculate: str, expected: dict, reverse: bool, mtp: str | None) -> dict:
    """Each run of the scenario once, in reverse order when `reverse` (so that a drift of the machine's speed within
    a round does not favour one side). `sets`: label -> (prompts, whether the replay runs on them); the replay
    proposes `expected`; `mtp`: the speculate setting of a run drafting with the MTP layer (None: none).
    Returns name -> (levels, outputs by prompt, output lines, the run without's name)."""
    runs = {}
    for label, (prompts, replayed) in sets.items():
        runs[f"none{label}"] = (partial(served, spec, prompts), f"none{label}")
        runs[f"n-gram{label}"] = (partial(served, spec, prompts, None, speculate), f"none{label}")
        if mtp:
            runs[f"MTP{label}"] = (partial(served, spec, prompts, None, mtp), f"none{label}")
        if replayed:
            runs[f"replay{label}"] = (partial(served, spec, prompts, ReplayDrafter(expected), speculate),
                                      f"none{label}")
    done = {name: runs[name][0]() for name in (reversed(runs) if reverse else runs)}
    return {name: (*done[name], base) for name, (_, base) in runs.items()}


def measured(spec, calibration: Calibration | None, max_draft: int, rounds: int, text: bool,
             mtp_draft: int) -> Table:
    streams, requests = (TEXT_STREAMS, TEXT_REQUESTS) if text else (STREAMS, REQUESTS)
    workload = attrs.evolve(spec.workload, concurrency=streams, requests=requests, output_tokens=OUTPUT_TOKENS,
                            greedy=True, prompts_file=None)
    spec = attrs.evolve(spec, workload=workload)
    fresh = 2 * len(streams) * requests  # every request of every phase its own prompt
    if text:
        sets = {f", {kind}": (text_prompts(spec, kind, fresh), True) for kind in TEXT_KINDS}
    else:
        vocab = spec.model.config.output_vocab_size
        sets = {"": (repetitive_prompts(vocab, fresh), True),
                ", repeated prompts": (repetitive_prompts(vocab, REPEATED), False)}
    speculate = f"ngram:{max_draft}"
    expected = {}  # the replay's drafts; the runs that make them also warm the machine up before the first round
    for prompts, replayed in sets.values():
        if replayed:
            expected |= by_prompt(served(spec, prompts)[1])
    mtp = mtp_setting(spec, text, mtp_draft)
    runs = [one_round(spec, sets, speculate, expected, bool(i % 2), mtp) for i in range(rounds)]
    first = runs[0]
    differ = {name: sum(outputs[key] != first[base][1][key] for key in outputs)
              for name, (_, outputs, _, base) in first.items() if name != base}
    predicted_plain = simulate(spec, calibration)["levels"] if calibration else None
    prompts = "text prompts of three kinds" if text else "repetitive prompts"
    table = Table(f"{shown(spec.source)}: {requests} requests of {OUTPUT_TOKENS} greedy tokens a phase, {prompts}, "
                  f"up to {max_draft} drafts" + (f" ({mtp_draft} from the MTP layer)" if mtp else "")
                  + f", {spec.runtime.precision} compute",
                  ["drafts", "streams", "decode tok/s", "speed-up", "accepted/proposed", "accepted a step",
                   "simulated tok/s", "simulated speed-up", f"modelled from {streams[0]} stream"])
    for name, (levels, _, lines, base) in first.items():
        traced = modelled = None  # the simulator's levels: with the run's trace; with rates fitted at one level
        if calibration and name != base:
            sped = attrs.evolve(spec, runtime=attrs.evolve(
                spec.runtime, speculate=mtp if name.startswith("MTP") else speculate))
            traced = simulate(sped, calibration, acceptance_trace=acceptance_trace(lines, f"the {name} run"))
            fitted = fitted_rates(acceptance_trace([line for line in lines if line["concurrency"] == streams[0]],
                                                   f"the {name} run at {streams[0]} streams"))
            modelled = simulate(sped, calibration, acceptance=fitted[0], proposing=fitted[1])
        for i, level in enumerate(levels):
            rates = [run[name][0][i]["decode_tokens_per_s"] for run in runs]
            speed_ups = [run[name][0][i]["decode_tokens_per_s"] / run[base][0][i]["decode_tokens_per_s"]
                         for run in runs]
            drafts, sim = level["speculation"], (None, None, None)
            if traced:
                plain = predicted_plain[i]["decode_tokens_per_s"]
                rate = traced["levels"][i]["decode_tokens_per_s"]
                sim = rate, rate / plain, modelled["levels"][i]["decode_tokens_per_s"] / plain
            elif calibration:
                sim = predicted_plain[i]["decode_tokens_per_s"], 1.0, 1.0
            table.add(name, level["concurrency"], spread(rates), spread(speed_ups),
                      None if name == base else f"{drafts['accepted']}/{drafts['proposed']}",
                      drafts["mean_accepted_per_step"], *sim)
    table.note = ("The same tokens with and without speculation." if not any(differ.values()) else
                  "Requests whose tokens differ from the run without: "
                  + ", ".join(f"{name} {n}" for name, n in differ.items()) + ".")
    table.note += " Speed-up: each round's against the same round's run without; where no drafts were proposed, the " \
                  "spread is the machine's noise."
    print(table.text())
    return table


def mtp_setting(spec, text: bool, mtp_draft: int) -> str | None:
    """The speculate setting of the runs drafting with the MTP layer (None: no such runs)."""
    return f"mtp:{mtp_draft}" if text and mtp_layers(spec.model.config) else None


def paper(max_draft: int) -> Table:
    spec = load_spec(PAPER_SPEC)
    spec = attrs.evolve(spec, workload=attrs.evolve(spec.workload, concurrency=PAPER_STREAMS,
                                                    output_tokens=PAPER_OUTPUT_TOKENS))
    calibration = analytic_calibration(spec)
    plain = [level["decode_tokens_per_s"] for level in simulate(spec, calibration)["levels"]]
    sped = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, speculate=f"ngram:{max_draft}"))
    table = Table(f"{PAPER_SPEC.name}, simulated (analytic): decode speed-up with up to {max_draft} drafts a step, "
                  "by acceptance rate", ["acceptance", *(f"{n} streams" for n in PAPER_STREAMS)],
                  note="Decode tokens/s without speculation: " + ", ".join(f"{rate:.2f}" for rate in plain) + ".")
    for acceptance in ACCEPTANCE:
        levels = simulate(sped, calibration, acceptance=acceptance)["levels"]
        table.add(acceptance, *(level["decode_tokens_per_s"] / base for level, base in zip(levels, plain)))
    print(table.text())
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(ROOT / "specs" / "tiny-local.yaml"))
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--calibration", help="the spec's measured calibration, for the simulator's prediction")
    given.add_argument("--calibrate", action="store_true", help="measure the spec's calibration first")
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--mtp-draft", type=int, default=1, help="with --text: drafts a step from the MTP layer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paper-only", action="store_true", help="only the paper deployment's simulated table")
    parser.add_argument("--text", action="store_true", help="text prompts of three kinds (a trained model's spec)")
    parser.add_argument("--out", type=Path, help="default bench/results/speculate-SPEC.json")
    args = parser.parse_args()
    started, tables = now(), []
    if not args.paper_only:
        mtp = mtp_setting(load_spec(args.spec), args.text, args.mtp_draft)
        with tempfile.TemporaryDirectory(prefix="cascadia-speculate-") as folder:
            options = ("--speculate", mtp) if mtp else ()
            calibration = (Calibration.load(calibrate(args.spec, Path(folder), *options)) if args.calibrate else
                           Calibration.load(args.calibration) if args.calibration else None)
        tables.append(measured(load_spec(args.spec), calibration, args.max_draft, args.rounds, args.text,
                               args.mtp_draft))
    tables.append(paper(args.max_draft))
    write(f"speculate-{Path(args.spec).stem}", "What speculative decoding buys on a pipeline, measured and simulated",
          started, tables, args.out, quick=args.paper_only)


if __name__ == "__main__":
    main()
