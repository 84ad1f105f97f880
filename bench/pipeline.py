"""Aggregate decode tokens/s of a 3-node local pipeline against 1 node, by concurrency, on a mid-size random model.

Scenario: a random Inkling of specs/mid's config (written once by `init_model` into CHECKPOINT) is served by
`cascadia run` machinery twice: by one node holding every layer, then by three local node processes holding
consecutive thirds, each with THREADS_PER_NODE inference threads. Every level runs a warm-up and a measured phase of
`concurrency` closed-loop requests of PROMPT_TOKENS prompt and OUTPUT_TOKENS output tokens, greedy. Reported per
level and setup:
  decode tok/s   the metrics' decode throughput (output tokens after the first, over the decoding time)
  ideal tok/s    the pipeline's ceiling set by its slowest stage: the phase's output tokens / the busiest node's busy
                 seconds (the throughput if that node never waited)
  of ideal       phase tok/s / ideal tok/s, which is the busiest node's busy fraction
  vs 1 node      decode tok/s of the 3-node pipeline / that of one node
Not a test: it prints ratios and writes them to bench/results/pipeline.json. On a machine with fewer cores than the
nodes' threads, the nodes share cores, and a node waiting for a core counts as busy: the ideal is then that of the
shared machine, not of three machines.

    python bench/pipeline.py [--quick] [--concurrency 1,3,9,18]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import attrs
from random_model import FORMATS, mid_config, random_checkpoint
from record import Table, now, write

from cascadia.graph.planner import plan as make_plan
from cascadia.models.inkling import InklingConfig
from cascadia.pipeline.run import run
from cascadia.spec.types import ClusterSpec, LengthSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WorkloadSpec

CHECKPOINT = Path("/tmp/cascadia-bench-pipeline")
CORES = 2  # this machine's
THREADS_PER_NODE = 1  # 3 nodes x 1 thread on CORES cores; the single node gets all CORES
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 32
SEED = 0


def spec(config: InklingConfig, checkpoint: Path, nodes: int, threads: int, max_streams: int) -> Spec:
    cluster = ClusterSpec(tuple(NodeSpec(f"node{i}", memory_bytes=2 * 2**30, host="localhost", threads=threads)
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
    parser.add_argument("--out", type=Path, help="default bench/results/pipeline.json")
    args = parser.parse_args()
    started = now()
    levels = tuple(int(c) for c in args.concurrency.split(","))
    config = mid_config(args.quick)
    checkpoint = random_checkpoint(config, CHECKPOINT, args.quick, SEED)
    model = (f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.n_routed_experts} experts "
             f"top-{config.num_experts_per_tok} + {config.n_shared_experts} shared of width "
             f"{config.moe_intermediate_size}, vocab {config.vocab_size}; experts int4, the rest int8, bf16 compute")
    print(f"model: {model}; {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} output tokens per request", flush=True)
    one = measure(spec(config, checkpoint, 1, CORES, max(levels)), levels)
    three = measure(spec(config, checkpoint, 3, THREADS_PER_NODE, max(levels)), levels)
    table = Table(f"Decode tokens/s, {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} output tokens a request",
                  ["streams", "1 node tok/s", "3 nodes tok/s", "3 vs 1", "3-node ideal tok/s", "of ideal %",
                   "busiest node", "its busy %"],
                  note=f"1 node of {CORES} threads against 3 local nodes of {THREADS_PER_NODE}; ideal: the rate the "
                       "busiest node's busy time allows.")
    for a, b in zip(one, three):
        node, busy = max(b["busy"].items(), key=lambda item: item[1])
        table.add(a["concurrency"], a["decode_tokens_per_s"], b["decode_tokens_per_s"],
                  b["decode_tokens_per_s"] / a["decode_tokens_per_s"], ideal(b),
                  100 * b["phase_tokens_per_s"] / ideal(b), node, 100 * busy)
    print(table.text())
    write("pipeline", "A 3-node local pipeline against 1 node, by concurrency", started, [table], args.out,
          quick=args.quick, model=model)


if __name__ == "__main__":
    main()
