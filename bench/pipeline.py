"""Aggregate decode tokens/s of a 3-node local pipeline against 1 node, by concurrency, on a mid-size random model.

Scenario: a random Inkling of MODEL's sizes (written once by `init_model` into CHECKPOINT) is served by `cascadia run`
machinery twice: by one node holding every layer, then by three local node processes holding consecutive thirds, each
with THREADS_PER_NODE inference threads. Every level runs a warm-up and a measured phase of `concurrency` closed-loop
requests of PROMPT_TOKENS prompt and OUTPUT_TOKENS output tokens, greedy. Reported per level and setup:
  decode tok/s   the metrics' decode throughput (output tokens after the first, over the decoding time)
  ideal tok/s    the pipeline's ceiling set by its slowest stage: the phase's output tokens / the busiest node's busy
                 seconds (the throughput if that node never waited)
  of ideal       phase tok/s / ideal tok/s, which is the busiest node's busy fraction
  vs 1 node      decode tok/s of the 3-node pipeline / that of one node
Not a test: it prints ratios. On a machine with fewer cores than the nodes' threads, the nodes share cores, and a
node waiting for a core counts as busy: the ideal is then that of the shared machine, not of three machines.

    python bench/pipeline.py [--quick] [--concurrency 1,3,9,18]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import attrs

from cascadia.exec.init_model import init_model
from cascadia.exec.run import run
from cascadia.graph.planner import plan as make_plan
from cascadia.model_config import InklingConfig
from cascadia.spec.types import (ClusterSpec, LengthSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WeightFormat,
                                 WeightFormats, WorkloadSpec)

MODEL = {"hidden_size": 1024, "num_hidden_layers": 8, "n_routed_experts": 64, "num_experts_per_tok": 6,
         "n_shared_experts": 2, "moe_intermediate_size": 512, "intermediate_size": 2048, "vocab_size": 32000,
         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "swa_num_attention_heads": 16,
         "swa_num_key_value_heads": 4, "swa_head_dim": 64, "sliding_window_size": 128, "d_rel": 16,
         "rel_extent": 256, "log_scaling_n_floor": 64}
QUICK_MODEL = MODEL | {"hidden_size": 256, "n_routed_experts": 16, "moe_intermediate_size": 128,
                       "intermediate_size": 512, "vocab_size": 4096}
LAYER_TYPES = ("hybrid_sliding", "hybrid_sliding", "hybrid_sliding", "hybrid") * 2
MLP_TYPES = ("dense",) + ("sparse",) * 7
CHECKPOINT = Path("/tmp/cascadia-bench-pipeline")
FORMATS = WeightFormats(routed_experts=WeightFormat("int4", 32), shared_experts=WeightFormat("int4", 32),
                        attention=WeightFormat("int8"), dense_mlp=WeightFormat("int8"),
                        embedding=WeightFormat("int8"), head=WeightFormat("int8"))
CORES = 2  # this machine's
THREADS_PER_NODE = 1  # 3 nodes x 1 thread on CORES cores; the single node gets all CORES
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 32
SEED = 0


def model_config(quick: bool) -> InklingConfig:
    base = InklingConfig.from_file(Path(__file__).parent.parent / "specs" / "tiny" / "config.json").to_hf_dict()
    sizes = QUICK_MODEL if quick else MODEL
    return InklingConfig.from_hf_dict(base | sizes | {"layer_types": list(LAYER_TYPES),
                                                      "mlp_layer_types": list(MLP_TYPES)})


def spec(config: InklingConfig, checkpoint: Path, nodes: int, threads: int, max_streams: int) -> Spec:
    cluster = ClusterSpec(tuple(NodeSpec(f"node{i}", memory_bytes=8 * 2**30, host="localhost", threads=threads)
                                for i in range(nodes)), reserve_bytes=2**28)
    runtime = RuntimeSpec(context_budget=PROMPT_TOKENS + OUTPUT_TOKENS, max_streams=max_streams, precision="bf16",
                          row_buckets=(2, 4, 8, 16, 32), prefill_window=8)
    workload = WorkloadSpec(prompt_tokens=LengthSpec.fixed(PROMPT_TOKENS), output_tokens=OUTPUT_TOKENS, seed=SEED)
    return Spec(ModelSpec(config, FORMATS, checkpoint, name="bench-mid"), cluster, runtime, workload)


def measure(setup: Spec, levels: tuple[int, ...]) -> list[dict]:
    start = time.perf_counter()
    done = run(setup, make_plan(setup), attrs.evolve(setup.workload, concurrency=levels),
               on_message=lambda node, message: None)
    print(f"  {len(setup.cluster.nodes)} node(s): {time.perf_counter() - start:.0f} s including start-up", flush=True)
    return done.result["levels"]


def ideal(level: dict) -> float:
    """Output tokens / the busiest node's busy seconds in the phase."""
    busiest = max(level["busy"].values()) * level["wall_s"]
    return level["output_tokens"] / busiest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, to check the bench itself")
    parser.add_argument("--concurrency", default="1,3,9,18", help="levels, e.g. 1,3,9,18")
    args = parser.parse_args()
    levels = tuple(int(c) for c in args.concurrency.split(","))
    config = model_config(args.quick)
    checkpoint = CHECKPOINT.with_name(CHECKPOINT.name + ("-quick" if args.quick else ""))
    if not (checkpoint / "config.json").is_file() or InklingConfig.from_file(checkpoint / "config.json") != config:
        print(f"writing a random checkpoint to {checkpoint} ...", flush=True)
        init_model(config, checkpoint, seed=SEED, dtype="bf16")
    print(f"model: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.n_routed_experts} experts "
          f"top-{config.num_experts_per_tok} + {config.n_shared_experts} shared of width "
          f"{config.moe_intermediate_size}, vocab {config.vocab_size}; experts int4, the rest int8, bf16 compute; "
          f"{PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} output tokens per request", flush=True)
    one = measure(spec(config, checkpoint, 1, CORES, max(levels)), levels)
    three = measure(spec(config, checkpoint, 3, THREADS_PER_NODE, max(levels)), levels)
    header = ("streams", "1 node tok/s", "3 nodes tok/s", "vs 1 node", "3-node ideal tok/s", "of ideal",
              "busiest node")
    rows = [header]
    for a, b in zip(one, three):
        node, busy = max(b["busy"].items(), key=lambda item: item[1])
        rows.append((str(a["concurrency"]), f"{a['decode_tokens_per_s']:.1f}", f"{b['decode_tokens_per_s']:.1f}",
                     f"{b['decode_tokens_per_s'] / a['decode_tokens_per_s']:.2f}", f"{ideal(b):.1f}",
                     f"{b['phase_tokens_per_s'] / ideal(b):.0%}", f"{node} {busy:.0%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
