"""The pipeline-shards paper's headline, measured here: a Llama on two pinned nodes against one, beside the simulator.

    python bench/shards.py [--rounds 3] [--out bench/results/shards.json]

The paper ran Llama-3.1-8B INT4 on two AI PCs, two users at 43.97 tokens/s: 1.79x one PC serving one stream. Here
a random Llama of the same shape, smaller (hidden 1024, 8 layers, GQA 4:1, llama3 RoPE; written once by
`cascadia init-model`), in the same formats (int4 matrices in groups of 128, embedding and head int8), runs as
a user would run it with `cascadia run`: on one node pinned to CPU 0, and on two nodes pinned to CPUs 0 and 1 (two
processes that behave like two PCs: each node's one thread on its own core), at 1 and 2 closed-loop streams of
PROMPT_TOKENS and OUTPUT_TOKENS, greedy; rounds alternate which setup goes first. Beside it, the simulator's
prediction for the same plans, from a calibration `cascadia calibrate --layers-only` measures on the same nodes.
Printed and written to bench/results/shards.json (command, machine, every round, medians and spread): decode
tokens/s per setup and stream count, and the ratios two nodes at 2 streams over one node at 1 (the paper's) and at 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from record import Table, now, spread, write
CHECKPOINT = Path("/tmp/cascadia-bench-shards")
CONFIG = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 3584,
          "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}
PROMPT_TOKENS, OUTPUT_TOKENS, STREAMS = 32, 64, (1, 2)
PAPER_RATIO = 1.79  # two PCs at 2 users over one PC at one
SPEC = """\
model:
  name: shards
  hf_config: {checkpoint}/config.json
  checkpoint: {checkpoint}
  formats: {{attention: {{dtype: int4, group_size: 128, symmetric: false}},
            dense_mlp: {{dtype: int4, group_size: 128, symmetric: false}},
            head: {{dtype: int8, symmetric: false}}, embedding: {{dtype: int8, symmetric: false}}}}
cluster:
  reserve: 256MiB
  nodes: [{nodes}]
  links: {{default: {{bandwidth: 1gbit, latency: 100us}}}}
runtime: {{context_budget: {context}, max_streams: 2, precision: bf16, kv_precision: f32, row_buckets: [1, 2, 8],
          prefill_window: 8}}
workload: {{concurrency: [1, 2], prompt_tokens: {prompt}, output_tokens: {output}, greedy: true, seed: 0}}
"""
SETUPS = {"one node": ["{name: node0, memory: 4GiB, cpus: [0]}"],
          "two nodes": ["{name: node0, memory: 4GiB, cpus: [0]}", "{name: node1, memory: 4GiB, cpus: [1]}"]}


def cascadia(*args: str) -> None:
    """A cascadia command, as a user runs it; one that fails stops the bench with its last words."""
    done = subprocess.run([sys.executable, "-m", "cascadia", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"cascadia {' '.join(args[:2])} ... failed with status {done.returncode}:\n"
                 f"{(done.stdout + done.stderr)[-3000:]}")


def decode_rates(metrics: Path) -> dict[int, float]:
    """Decode tokens/s by stream count, from a run's or a simulation's metrics JSON."""
    return {level["concurrency"]: level["decode_tokens_per_s"] for level in json.loads(metrics.read_text())["levels"]}


def ratios(rates: dict[str, dict[int, float]]) -> dict:
    two, one = rates["two nodes"], rates["one node"]
    return {"two nodes at 2 / one node at 1": two[2] / one[1], "two nodes at 2 / one node at 2": two[2] / one[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="default bench/results/shards.json")
    args = parser.parse_args()
    started = now()
    if not (CHECKPOINT / "config.json").is_file():
        with tempfile.NamedTemporaryFile("w", suffix=".json") as config:
            json.dump(CONFIG, config)
            config.flush()
            cascadia("init-model", config.name, str(CHECKPOINT), "--force")
    with tempfile.TemporaryDirectory(prefix="cascadia-shards-") as work:
        tables, details = measure(Path(work), args.rounds)
    write("shards", "A Llama split in pipeline shards: two pinned nodes against one, beside the simulator", started,
          tables, args.out, **details)


def measure(work: Path, rounds: int) -> tuple[list[Table], dict]:
    """Every round's runs, then each setup's calibration and simulation, in `work`: the tables, and the raw rounds
    and the setting beside them."""
    specs = {}
    for setup, nodes in SETUPS.items():
        specs[setup] = work / f"{setup.replace(' ', '-')}.yaml"
        specs[setup].write_text(SPEC.format(checkpoint=CHECKPOINT, nodes=", ".join(nodes), prompt=PROMPT_TOKENS,
                                            output=OUTPUT_TOKENS, context=PROMPT_TOKENS + OUTPUT_TOKENS))

    measured: dict[str, list[dict[int, float]]] = {setup: [] for setup in SETUPS}
    for round_ in range(rounds):
        for setup in (list(SETUPS) if round_ % 2 == 0 else list(reversed(SETUPS))):
            out = work / f"run-{round_}-{setup.replace(' ', '-')}.json"
            cascadia("run", str(specs[setup]), "--json", str(out))
            measured[setup].append(decode_rates(out))
            print(f"round {round_ + 1}, {setup}: {measured[setup][-1]}", flush=True)
    predicted = {}
    for setup in SETUPS:
        name = setup.replace(" ", "-")
        calibration, out = work / f"calibration-{name}.json", work / f"sim-{name}.json"
        cascadia("calibrate", str(specs[setup]), "--layers-only", "--rounds", "3", "-o", str(calibration))
        cascadia("simulate", str(specs[setup]), "--calibration", str(calibration), "--json", str(out))
        predicted[setup] = decode_rates(out)

    rates = Table("Decode tokens/s", ["setup", "measured, 1 stream", "2 streams", "predicted, 1 stream",
                                      "2 streams"])
    for setup, runs in measured.items():
        rates.add(setup, *(spread(r[n] for r in runs) for n in STREAMS), *(predicted[setup][n] for n in STREAMS))
    round_ratios = [ratios({setup: measured[setup][i] for setup in SETUPS}) for i in range(rounds)]
    predicted_ratios = ratios(predicted)
    gains = Table("Speed-up", ["ratio of decode tokens/s", "measured", "predicted", "the paper's"],
                  note="The paper's: Llama-3.1-8B INT4 on two AI PCs at 2 users, 43.97 tokens/s, over one PC's "
                       "one stream.")
    for name in predicted_ratios:
        gains.add(name, spread(r[name] for r in round_ratios), predicted_ratios[name],
                  PAPER_RATIO if name == "two nodes at 2 / one node at 1" else None)
    for table in (rates, gains):
        print(table.text())
    return [rates, gains], {
        "model": CONFIG, "formats": "int4 g128 asymmetric matrices, int8 embedding and head", "precision": "bf16",
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
        "rounds": {setup: [{str(n): r[n] for n in STREAMS} for r in runs] for setup, runs in measured.items()},
    }


if __name__ == "__main__":
    main()
