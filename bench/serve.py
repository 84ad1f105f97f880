"""What the HTTP path costs: decode tokens/s through `cascadia serve` (timed by its client) against `cascadia run`.

Scenario: the benches' mid-size random Inkling (specs/mid's config, written once into CHECKPOINT) on NODES local
node processes of THREADS_PER_NODE threads, one plan. Each round measures every concurrency level twice, back to
back: first `cascadia run` (the coordinator drives the pipeline in this process), then the same workload (levels,
prompts, warm-up and measured phases) sent by `cascadia run --url`'s load generator to a `cascadia serve` process
holding the same plan, as streamed `/v1/completions` requests through the `openai` client, each token timed when its
chunk arrives. Reported per level, the median and range over the rounds:
  run tok/s      decode tokens/s of `cascadia run` (output tokens after the first, over the decoding time)
  serve tok/s    the same, measured on the client side of the server
  HTTP cost      1 - serve / run of each round: the share of throughput the HTTP path takes (negative: within the
                 noise)
Not a test: it prints ratios and writes them to bench/results/serve.json. The server, its client and the nodes share
this machine's cores, so the HTTP cost includes the CPU the server and client take from the nodes.

With `--schema`, what holding replies to a JSON schema costs instead (bench/results/serve_schema.json): each round
sends every level's requests twice to the same server, `level` clients at a time, streamed `/v1/completions`
without and with a `response_format` JSON schema (in turn first), and reports per level
  plain tok/s    decode tokens/s: the output tokens after each request's first, over the time from the level's first
                 token to its last, as the client sees them
  schema tok/s   the same, every reply held to the schema (a list of strings: random tokens fill the strings; a reply
                 the schema has closed goes on with the end token alone, still masked)
  schema cost %  1 - schema / plain of each round
(A schema's compile time and a row's mask alone: bench/structured.py.)

    python bench/serve.py [--quick] [--concurrency 1,4,8] [--rounds 3]
    python bench/serve.py --schema [--concurrency 1,32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import numpy as np
import openai
from random_model import FORMATS, mid_config, random_checkpoint
from record import Table, now, spread, write

from cascadia.graph.planner import plan as make_plan
from cascadia.models.inkling import InklingConfig
from cascadia.pipeline.run import run
from cascadia.pipeline.transport import free_port
from cascadia.serve.load import Target, run_url
from cascadia.spec.dump import write_spec
from cascadia.spec.types import ClusterSpec, LengthSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WorkloadSpec

CHECKPOINT = Path("/tmp/cascadia-bench-pipeline")  # bench/pipeline.py's: the same model
NODES = 2
THREADS_PER_NODE = 1  # 2 nodes x 1 thread on this machine's 2 cores
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 32
SEED = 0
START_S = 600  # loading the nodes on a busy machine
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"], "additionalProperties": False}


def spec(config: InklingConfig, checkpoint: Path, max_streams: int) -> Spec:
    cluster = ClusterSpec(tuple(NodeSpec(f"node{i}", memory_bytes=8 * 2**30, host="localhost",
                                         threads=THREADS_PER_NODE) for i in range(NODES)), reserve_bytes=2**28)
    runtime = RuntimeSpec(context_budget=PROMPT_TOKENS + OUTPUT_TOKENS, max_streams=max_streams, precision="bf16",
                          row_buckets=(2, 4, 8, 16, 32), prefill_window=8)
    workload = WorkloadSpec(prompt_tokens=LengthSpec.fixed(PROMPT_TOKENS), output_tokens=OUTPUT_TOKENS, seed=SEED)
    return Spec(ModelSpec(config, FORMATS, checkpoint, name="bench-mid"), cluster, runtime, workload)


class Server:
    """`cascadia serve` on 127.0.0.1 with the given spec (and plan file, or one planned now), until `stop`."""

    def __init__(self, spec_path: Path, plan_path: Path | None, log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        plan = [] if plan_path is None else ["--plan", str(plan_path)]
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cascadia", "serve", str(spec_path), *plan, "--port",
                 self.url.rsplit(":", 1)[1]], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"the server did not start; its log:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@contextlib.contextmanager
def serving(setup: Spec, plan) -> Iterator[Server]:
    """`cascadia serve` holding `plan` of `setup`, until the block ends."""
    with tempfile.TemporaryDirectory(prefix="cascadia-bench-serve-") as tmp:
        folder = Path(tmp)
        spec_path, plan_path = write_spec(setup, folder / "spec.yaml"), folder / "plan.json"
        plan.save(plan_path)
        server = Server(spec_path, plan_path, folder / "serve.log")
        try:
            yield server
        finally:
            server.stop()


async def level_rate(url: str, level: int, requests: int, schema: dict | None, seed: int) -> float:
    """Decode tokens/s of `requests` streamed completions sent by `level` clients, each sending its next when its
    last is done (see the module's text)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=START_S)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 200, PROMPT_TOKENS).tolist() for _ in range(requests)]
    extra = {"ignore_eos": True} | ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "notes", "schema": schema}}} if schema else {})
    firsts, lasts, decoded = [], [], 0

    async def one(prompt: list[int]) -> None:
        nonlocal decoded
        times = []
        stream = await client.completions.create(model="bench-mid", prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                                 temperature=0, stream=True, extra_body=extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                times.append(time.perf_counter())
        firsts.append(times[0])
        lasts.append(times[-1])
        decoded += len(times) - 1

    async def client_loop(mine: list[list[int]]) -> None:
        for prompt in mine:
            await one(prompt)

    async with client:
        await asyncio.gather(*(client_loop(prompts[i::level]) for i in range(level)))
    return decoded / (max(lasts) - min(firsts))


def schema_cost(args, setup: Spec, plan, levels: tuple[int, ...], setting: str, started: str) -> None:
    """`--schema`: decode tokens/s without and with a schema, alternating, on one server."""
    plain: list[list[float]] = [[] for _ in levels]
    held: list[list[float]] = [[] for _ in levels]
    with serving(setup, plan) as server:
        asyncio.run(level_rate(server.url, 1, 2, SCHEMA, SEED))  # warm: the grammar's vocabulary is built once
        for round_ in range(args.rounds):
            for index, level in enumerate(levels):
                requests = max(level, 4)
                order = (None, SCHEMA) if round_ % 2 == 0 else (SCHEMA, None)
                for schema in order:
                    rate = asyncio.run(level_rate(server.url, level, requests, schema, SEED + round_))
                    (held if schema else plain)[index].append(rate)
            print(f"  round {round_ + 1} of {args.rounds} done", flush=True)
    table = Table("Decode tokens/s through `cascadia serve`, replies free or held to a JSON schema",
                  ["streams", "plain tok/s", "schema tok/s", "schema cost %"],
                  note=f"The mid-size random Inkling: {setting}; greedy; the schema: an object holding a list of "
                       "strings.")
    for level, a, b in zip(levels, plain, held):
        table.add(level, spread(a), spread(b), spread(100 * (1 - y / x) for x, y in zip(a, b)))
    print(table.text())
    write("serve_schema", "What holding replies to a JSON schema costs through `cascadia serve`", started, [table],
          args.out, quick=args.quick, rounds={"plain": plain, "schema": held})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, to check the bench itself")
    parser.add_argument("--concurrency", help="levels, e.g. 1,4,8 (default; with --schema 1,32)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each path per level")
    parser.add_argument("--schema", action="store_true", help="the cost of a JSON schema instead (see above)")
    parser.add_argument("--out", type=Path, help="default bench/results/serve.json (serve_schema.json)")
    args = parser.parse_args()
    started = now()
    levels = tuple(int(c) for c in (args.concurrency or ("1,32" if args.schema else "1,4,8")).split(","))
    config = mid_config(args.quick)
    setup = spec(config, random_checkpoint(config, CHECKPOINT, args.quick, SEED), max(levels))
    workload = attrs.evolve(setup.workload, concurrency=levels)
    plan = make_plan(setup)
    setting = (f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.n_routed_experts} experts; "
               f"{NODES} local nodes of {THREADS_PER_NODE} thread(s); {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} "
               f"output tokens per request")
    print(f"model: {setting}", flush=True)
    if args.schema:
        return schema_cost(args, setup, plan, levels, setting, started)
    runs: list[list[float]] = [[] for _ in levels]
    serves: list[list[float]] = [[] for _ in levels]
    with serving(setup, plan) as server:
        for round_ in range(args.rounds):
            local = run(setup, plan, workload, on_message=lambda node, message: None).result["levels"]
            served = run_url(setup, workload, Target(server.url), None)["levels"]
            for index, (a, b) in enumerate(zip(local, served)):
                runs[index].append(a["decode_tokens_per_s"])
                serves[index].append(b["decode_tokens_per_s"])
            print(f"  round {round_ + 1} of {args.rounds} done", flush=True)
    table = Table("Decode tokens/s, `cascadia run` against `cascadia serve` (streamed /v1/completions)",
                  ["streams", "run tok/s", "serve tok/s", "HTTP cost %"],
                  note=f"The mid-size random Inkling: {setting}.")
    for level, a, b in zip(levels, runs, serves):
        table.add(level, spread(a), spread(b), spread(100 * (1 - y / x) for x, y in zip(a, b)))
    print(table.text())
    write("serve", "What the HTTP path costs: `cascadia serve` against `cascadia run` on one plan", started, [table],
          args.out, quick=args.quick, rounds={"run": runs, "serve": serves})


if __name__ == "__main__":
    main()
