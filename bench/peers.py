"""The race against the tool a user would pick instead: OpenVINO GenAI decoding the same random weights.

Scenario: two random models a person could run on one PC, the same weights for every contestant: a Qwen3-MoE of
0.9B parameters (hidden 1024, 8 layers, 64 experts top-6 of width 512, vocabulary 32k) and a Llama of 0.25B
(hidden 1024, 12 layers, MLP width 4096). Cascadia's `init_model` writes each once (bf16, seeded); optimum-intel
exports it for OpenVINO GenAI as its users do, with data-free weight compression: `--weight-format int8` (per
channel, asymmetric) and `--weight-format int4 --group-size 32` (asymmetric; its embedding and head int8, NNCF's
backup precision). Cascadia reads the same checkpoint in the matching formats (int8 per row, asymmetric; int4 in
groups of 32, asymmetric, embedding and head int8). Both compute in bf16 where the CPU has it (f32 elsewhere), on
every core this process may use, in one process.

agreement  Greedy tokens from one prompt: Cascadia's single-process engine against GenAI's LLMPipeline, at f32
           (the models at --quick sizes, exported unquantised: the same model, so the same tokens) and at int8 and
           int4 (each engine's own quantisation of the same weights: how far they agree). The count of leading
           tokens that agree, of AGREE_TOKENS.
decode     Decode tokens a second at 1, 8 and 32 streams, each stream a PROMPT_TOKENS prompt of its own: GenAI's
           LLMPipeline for one stream and its ContinuousBatchingPipeline for more, timed as (DECODE_TOKENS new tokens)
           minus (1 new token), so that prefill and the first token fall out; Cascadia's engine (one process, the
           stage holding every layer, row buckets 1, 8 and 32) prefilling its streams and then timed over
           DECODE_TOKENS - 1 decode steps of all of them together. Rounds alternate between the contestants;
           each cell is the median (min-max) of ROUNDS.
first      The first token of a FIRST_TOKEN_PROMPT-token prompt, one stream: GenAI's LLMPipeline (the prompt in one
           call), Cascadia's engine (in calls of PREFILL_ROWS rows); rounds alternating with the decode's.
memory     A fresh process for each contestant, model and format, loaded as a user would run it (GenAI's continuous
           batching alone), taking the first token of that prompt and then 32 streams' decode: its peak resident
           memory (VmHWM), beside the export's weight bytes.

Not a test: it prints its tables and writes them to bench/results/peers.json. It runs in the race environment
(optimum-intel pins transformers < 5.6; torch only exports, and nothing of Cascadia imports it):

    python -m venv .venv-race
    .venv-race/bin/pip install torch==2.13.0 "transformers>=5.2,<5.6" "optimum==2.3.*" nncf requests \
        openvino-genai==2026.4.1 openvino-tokenizers==2026.4.1 -e .
    .venv-race/bin/pip install --no-deps optimum-intel==2.2.0   # its torchvision pin would pull a CUDA torch
    .venv-race/bin/python bench/peers.py [--quick] [--folder DIR] [--rounds N]

The checkpoints and exports (about 6 GB) go to DIR (default the system's temporary folder), made on first use.
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openvino as ov
from record import Table, now, spread, write

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import runs_as
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.engine.init_model import init_model
from cascadia.models import config_from_hf_dict, read_config
from cascadia.sampling import Sampling
from cascadia.spec.types import RuntimeSpec, WeightFormat, WeightFormats

SEED = 7
PROMPT_TOKENS = 32
DECODE_TOKENS = 64
AGREE_TOKENS = 32
STREAMS = (1, 8, 32)
ROUNDS = 3
WHO = ("GenAI", "Cascadia")
FIRST_TOKEN_PROMPT = 512  # tokens of the prompt whose first token is timed
PREFILL_ROWS = 256  # Cascadia's largest row bucket: a 512-token prompt in two calls
COMMON = {"vocab_size": 32000, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
          "head_dim": 64, "max_position_embeddings": 4096, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
MODELS = {
    "qwen3_moe": COMMON | {"model_type": "qwen3_moe", "num_hidden_layers": 8, "num_experts": 64,
                           "num_experts_per_tok": 6, "moe_intermediate_size": 512, "intermediate_size": 2048,
                           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "llama": COMMON | {"model_type": "llama", "num_hidden_layers": 12, "intermediate_size": 4096},
}
QUICK = {"vocab_size": 4096, "hidden_size": 256, "num_experts": 16, "moe_intermediate_size": 128,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


def matching(fmt: WeightFormat, embedding: WeightFormat) -> WeightFormats:
    """Cascadia's formats for an export: `fmt` for every layer's matrices, `embedding` for the embedding and head."""
    return WeightFormats(routed_experts=fmt, shared_experts=fmt, attention=fmt, dense_mlp=fmt,
                         embedding=embedding, head=embedding)


INT8 = WeightFormat("int8", symmetric=False)
# name: (optimum-cli's weight options, Cascadia's formats)
FORMATS = {
    "f32": (["--weight-format", "fp32"], matching(WeightFormat("f32"), WeightFormat("f32"))),
    "int8": (["--weight-format", "int8"], matching(INT8, INT8)),
    "int4": (["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],
             matching(WeightFormat("int4", 32, symmetric=False), INT8)),
}


def checkpoint(folder: Path, model: str, quick: bool) -> Path:
    """The random bf16 checkpoint of `model`, written on first use."""
    config = config_from_hf_dict(MODELS[model] | (QUICK if quick else {}))
    path = folder / (model + ("-quick" if quick else ""))
    if not (path / "config.json").is_file() or read_config(path) != config:
        print(f"writing a random checkpoint to {path} ...", flush=True)
        init_model(config, path, seed=SEED, dtype="bf16")
    return path


def exported(source: Path, fmt: str) -> Path:
    """`source` exported by optimum-intel for OpenVINO GenAI in `fmt`, on first use."""
    path = source.with_name(f"{source.name}-ov-{fmt}")
    if not (path / "openvino_model.xml").is_file():
        print(f"exporting {source.name} for OpenVINO GenAI ({fmt}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model",
                        str(source), "--task", "text-generation-with-past", *FORMATS[fmt][0], str(path)],
                       check=True)
    return path


class GenAI:
    """OpenVINO GenAI on an export: its LLMPipeline for one stream, its continuous batching for more."""

    def __init__(self, path: Path, precision: str, single: bool = True):
        """`single`: with the LLMPipeline for one stream (else the continuous batching serves every count)."""
        import openvino_genai as genai  # the race environment's alone

        self.genai = genai
        properties = {"INFERENCE_PRECISION_HINT": precision}
        self.single = genai.LLMPipeline(str(path), "CPU", **properties) if single else None
        scheduler = genai.SchedulerConfig()
        scheduler.max_num_seqs = max(STREAMS)
        scheduler.cache_size = 1  # GB of K/V: 32 streams of 96 positions need a few MB
        self.batched = genai.ContinuousBatchingPipeline(str(path), scheduler, "CPU", properties)

    def greedy_config(self, tokens: int):
        return self.genai.GenerationConfig(max_new_tokens=tokens, do_sample=False, ignore_eos=True)

    def greedy(self, prompt: np.ndarray, tokens: int) -> list[int]:
        return list(self.single.generate(ov.Tensor(prompt[None]), self.greedy_config(tokens)).tokens[0])

    def decode_seconds(self, prompts: np.ndarray) -> float:
        """Seconds of DECODE_TOKENS - 1 decode steps of these streams: a run to DECODE_TOKENS new tokens, less a run
        to one (prefill and the first token)."""
        return self._run(prompts, DECODE_TOKENS) - self._run(prompts, 1)

    def first_token_seconds(self, prompt: np.ndarray) -> float:
        return self._run(prompt[None], 1)

    def _run(self, prompts: np.ndarray, tokens: int) -> float:
        start = time.perf_counter()
        if len(prompts) == 1 and self.single is not None:
            self.single.generate(ov.Tensor(prompts), self.greedy_config(tokens))
        else:
            self.batched.generate([ov.Tensor(p[None]) for p in prompts], [self.greedy_config(tokens)] * len(prompts))
        return time.perf_counter() - start


class Cascadia:
    """Cascadia's engine in one process: one stage holding every layer."""

    def __init__(self, path: Path, formats: WeightFormats, precision: str):
        runtime = RuntimeSpec(precision=precision, kv_precision=precision, max_streams=max(STREAMS),
                              context_budget=max(PROMPT_TOKENS + DECODE_TOKENS, FIRST_TOKEN_PROMPT + 1),
                              row_buckets=(*STREAMS, PREFILL_ROWS))
        self.engine = Engine(Checkpoint.open(path), runtime, formats=formats)

    def greedy(self, prompt: np.ndarray, tokens: int) -> list[int]:
        return list(generate(self.engine, prompt, tokens, Sampling()).ids)

    def first_token_seconds(self, prompt: np.ndarray) -> float:
        self.engine.release(0)
        start = time.perf_counter()
        self.engine.prefill(0, prompt).argmax()
        return time.perf_counter() - start

    def decode_seconds(self, prompts: np.ndarray) -> float:
        slots = list(range(len(prompts)))
        for slot in slots:
            self.engine.release(slot)
        tokens = [int(self.engine.prefill(slot, prompt).argmax()) for slot, prompt in zip(slots, prompts)]
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS - 1):
            tokens = self.engine.step(slots, tokens).argmax(-1).tolist()
        return time.perf_counter() - start


def peak_memory_child(who: str, path: str, fmt: str, precision: str, prompts: np.ndarray, long_prompt: np.ndarray,
                      results) -> None:
    """In a fresh process: one contestant loaded as a user would run it (GenAI's continuous batching alone), the
    first token of the long prompt and a decode of every stream; the process's peak resident bytes."""
    contestant = GenAI(Path(path), precision, single=False) if who == "GenAI" else \
        Cascadia(Path(path), FORMATS[fmt][1], precision)
    contestant.first_token_seconds(long_prompt)
    contestant.decode_seconds(prompts)
    with open("/proc/self/status") as status:
        results.put(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")))


def peak_memory(who: str, path: Path, fmt: str, precision: str, prompts: np.ndarray, long_prompt: np.ndarray) -> int:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    child = spawn.Process(target=peak_memory_child,
                          args=(who, str(path), fmt, precision, prompts, long_prompt, results))
    child.start()
    peak = results.get()
    child.join()
    return peak


def agreeing(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the models at small sizes (checks the bench)")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cascadia-peers",
                        help="where the checkpoints and exports go")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--out", type=Path, help="default bench/results/peers.json")
    args = parser.parse_args()
    started, rng = now(), np.random.default_rng(SEED)
    precision = runs_as("bf16", "CPU")
    print(f"computing in {precision} (OpenVINO's CPU plugin on this CPU)\n")
    agreement = Table("Greedy tokens that agree: Cascadia against OpenVINO GenAI, the same weights",
                      ["model", "weights", "leading tokens the same"],
                      note=f"Of {AGREE_TOKENS} greedy tokens after one prompt of {PROMPT_TOKENS}; f32 at --quick "
                           f"sizes, computed in f32; int8 and int4 each engine's own quantisation, in {precision}.")
    decode = Table(f"Decode tokens a second ({precision} compute), OpenVINO GenAI against Cascadia, the same weights",
                   ["model", "weights", *(f"{who}, {g} stream{'s' * (g > 1)}" for g in STREAMS for who in WHO),
                    *(f"ratio at {g}" for g in STREAMS)],
                   note=f"Median (min-max) of {args.rounds} alternating rounds; {DECODE_TOKENS - 1} decode steps "
                        f"after prompts of {PROMPT_TOKENS}. Ratio: Cascadia over GenAI, of the medians.")
    first = Table(f"First token of a {FIRST_TOKEN_PROMPT}-token prompt, one stream, seconds",
                  ["model", "weights", *WHO, "GenAI over Cascadia"],
                  note=f"Median (min-max) of {args.rounds} rounds alternating with the decode's. GenAI's LLMPipeline "
                       f"takes the prompt in one call, Cascadia's engine in calls of {PREFILL_ROWS} rows.")
    memory = Table("Peak memory of a process running one contestant, MiB",
                   ["model", "weights", "the export's weights", *WHO, "Cascadia over GenAI"],
                   note=f"A fresh process each (GenAI's continuous batching alone): loaded, the first token of the "
                        f"{FIRST_TOKEN_PROMPT}-token prompt, {DECODE_TOKENS} tokens of {max(STREAMS)} streams; its "
                        f"peak resident set (VmHWM). The export's weights: optimum-intel's openvino_model.bin.")
    for model in MODELS:
        small = checkpoint(args.folder, model, quick=True)
        prompt = rng.integers(3, read_config(small).vocab_size, PROMPT_TOKENS)
        peer, ours = GenAI(exported(small, "f32"), "f32"), Cascadia(small, FORMATS["f32"][1], "f32")
        agreement.add(model, "f32", agreeing(peer.greedy(prompt, AGREE_TOKENS), ours.greedy(prompt, AGREE_TOKENS)))
        del peer, ours
        path = checkpoint(args.folder, model, args.quick)
        vocab = read_config(path).vocab_size
        prompts = rng.integers(3, vocab, (max(STREAMS), PROMPT_TOKENS))
        long_prompt = rng.integers(3, vocab, FIRST_TOKEN_PROMPT)
        for fmt in ("int8", "int4"):
            export = exported(path, fmt)
            contestants = {"GenAI": GenAI(export, precision), "Cascadia": Cascadia(path, FORMATS[fmt][1], precision)}
            if not args.quick:
                agreement.add(model, fmt, agreeing(*(c.greedy(prompts[0], AGREE_TOKENS)
                                                     for c in contestants.values())))
            rates = {(who, g): [] for who in WHO for g in STREAMS}
            seconds = {who: [] for who in WHO}
            for _ in range(args.rounds):
                for who, contestant in contestants.items():
                    seconds[who].append(contestant.first_token_seconds(long_prompt))
                for g in STREAMS:
                    for who, contestant in contestants.items():
                        rates[who, g].append(g * (DECODE_TOKENS - 1) / contestant.decode_seconds(prompts[:g]))
            del contestants
            medians = {key: statistics.median(values) for key, values in rates.items()}
            decode.add(model, fmt, *(spread(rates[who, g]) for g in STREAMS for who in WHO),
                       *(round(medians["Cascadia", g] / medians["GenAI", g], 2) for g in STREAMS))
            first.add(model, fmt, *(spread(seconds[who]) for who in WHO),
                      round(statistics.median(seconds["GenAI"]) / statistics.median(seconds["Cascadia"]), 2))
            peaks = {who: peak_memory(who, export if who == "GenAI" else path, fmt, precision, prompts, long_prompt)
                     for who in WHO}
            memory.add(model, fmt, round((export / "openvino_model.bin").stat().st_size / 2**20),
                       *(round(peaks[who] / 2**20) for who in WHO), round(peaks["Cascadia"] / peaks["GenAI"], 2))
            for table in (decode, first, memory):
                print(table.text(), "\n", flush=True)
    print(agreement.text(), "\n")
    write("peers", "Cascadia against OpenVINO GenAI on the same weights", started, [agreement, decode, first, memory],
          args.out, quick=args.quick)


if __name__ == "__main__":
    main()
