"""guidellm, unmodified, against `cascadia serve`, beside `cascadia run --url` on the same load.

    pip install torch==2.13.0 && pip install -e '.[dev]'      # guidellm comes with the dev extra
    python bench/clients.py [--spec specs/tiny-serve.yaml] [--streams 1,4,16] [--rounds 2]

The quick start's server (the tiny model, its whole context) answers both load generators in turn: at each stream
count, guidellm's `concurrent` profile and `cascadia run --url`'s closed loop send /v1/completions with prompts of
--prompt-tokens tokens (guidellm's synthetic text, counted by the checkpoint's own tokenizer; random ids for
`run`) and --output-tokens each, past the end-of-sequence token; rounds alternate which goes first. Every request
must complete: the exit status is 1 when guidellm saw one fail. The figures of every round, and per level their
median and spread, go to bench/results/clients.json (command, machine, versions).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from record import ROOT, Table, now, shown, spread, write
from serve import Server

from cascadia.spec.load import load_spec


def command(args: list[str]) -> None:
    """Run a load generator to its end; one that fails stops the bench with its last words."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        said = (done.stdout + done.stderr)[-3000:]
        sys.exit(f"{' '.join(args[:3])} ... failed with status {done.returncode}:\n{said}")


def guidellm(executable: str, url: str, tokenizer: Path, streams: int, requests: int, prompt: int, output: int,
             out: Path) -> dict:
    """One guidellm run (its own CLI, as a user runs it); what it measured."""
    command([executable, "run", "--backend", f"kind=openai_http,target={url}/v1,model=tiny,"
                    "request_format=/v1/completions", "--profile", f"kind=concurrent,streams={streams}",
                    "--constraint", f"kind=max_requests,count={requests}",
                    "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
                    "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
                    "--disable-console-interactive"])
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]
    return {"requests": metrics["request_totals"],
            "output_tokens_per_s": metrics["output_token_count"]["successful"]["total_sum"] / benchmark["duration"],
            "ttft_p50_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
            "itl_p50_ms": metrics["inter_token_latency_ms"]["successful"]["median"]}


def run_url(spec: Path, url: str, streams: int, requests: int, prompt: int, output: int, out: Path) -> dict:
    """One `cascadia run --url` level (after its warm-up); what it measured."""
    command([sys.executable, "-m", "cascadia", "run", str(spec), "--url", url, "--concurrency", str(streams),
             "--requests", str(requests), "--prompt-tokens", str(prompt), "--max-new-tokens", str(output),
             "--json", str(out)])
    level = json.loads(out.read_text())["levels"][0]
    return {"requests": level["requests"], "rejected": level["rejected"],
            "output_tokens_per_s": level["phase_tokens_per_s"], "ttft_p50_ms": 1000 * level["ttft_s"]["p50"],
            "tpot_p50_ms": 1000 * level["tpot_s"]["p50"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "specs" / "tiny-serve.yaml")
    parser.add_argument("--streams", default="1,4,16", help="stream counts, e.g. 1,4,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--guidellm", default="guidellm", help="its executable")
    parser.add_argument("--out", type=Path, help="default bench/results/clients.json")
    args = parser.parse_args()
    started = now()
    if shutil.which(args.guidellm) is None:
        sys.exit(f"{args.guidellm}: not found; install the dev extra (pip install -e '.[dev]') or give --guidellm")
    spec = load_spec(args.spec)
    levels = [int(n) for n in args.streams.split(",")]
    rounds: dict[int, list[dict]] = {n: [] for n in levels}
    with tempfile.TemporaryDirectory(prefix="cascadia-clients-") as scratch:
        folder = Path(scratch)
        server = Server(args.spec, None, folder / "serve.log")
        try:
            for r in range(args.rounds):
                for i, n in enumerate(levels):
                    requests = max(8, 4 * n)
                    load = (n, requests, args.prompt_tokens, args.output_tokens)
                    tools = {"guidellm": lambda: guidellm(args.guidellm, server.url, spec.model.checkpoint, *load,
                                                          folder / f"guidellm-{r}-{n}.json"),
                             "cascadia_run_url": lambda: run_url(args.spec, server.url, *load,
                                                                 folder / f"run-{r}-{n}.json")}
                    order = list(tools) if (r + i) % 2 == 0 else list(tools)[::-1]
                    rounds[n].append({name: tools[name]() for name in order} | {"first": order[0]})
                    g, c = rounds[n][-1]["guidellm"], rounds[n][-1]["cascadia_run_url"]
                    print(f"round {r + 1}, {n} streams: guidellm {g['requests']['successful']}/"
                          f"{g['requests']['total']} requests, {g['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                          f"{g['ttft_p50_ms']:.0f} ms; run --url {c['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                          f"{c['ttft_p50_ms']:.0f} ms", flush=True)
        finally:
            server.stop()
    failed = sum(g["guidellm"]["requests"]["errored"] + g["guidellm"]["requests"]["incomplete"]
                 for runs in rounds.values() for g in runs)
    table = Table(f"{args.prompt_tokens}-token prompts, {args.output_tokens} tokens out, /v1/completions",
                  ["streams", "guidellm: requests done", "output tok/s", "TTFT p50 ms", "inter-token p50 ms",
                   "run --url: output tok/s", "TTFT p50 ms", "TPOT p50 ms"])
    for n in levels:
        g, c = [run["guidellm"] for run in rounds[n]], [run["cascadia_run_url"] for run in rounds[n]]
        done = sum(r["requests"]["successful"] for r in g)
        table.add(n, f"{done}/{sum(r['requests']['total'] for r in g)}",
                  *(spread(r[key] for r in g) for key in ("output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms")),
                  *(spread(r[key] for r in c) for key in ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")))
    print(table.text())
    guidellm_version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True,
                                      check=True).stdout.split()[-1]
    write("clients", "guidellm against `cascadia serve`, beside `cascadia run --url` on the same load", started,
          [table], args.out, guidellm=guidellm_version,
          spec=shown(args.spec),
          guidellm_requests_failed=failed,
          rounds=[{"streams": n, "requests": max(8, 4 * n), "rounds": rounds[n]} for n in levels])
    print(f"guidellm requests failed: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
