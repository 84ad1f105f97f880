"""The race against the tools a user would pick instead: OpenVINO GenAI and llama.cpp on the same random weights.

Scenario: two random models a person could run on one PC, the same weights for every contestant: a Qwen3-MoE of
0.9B parameters (hidden 1024, 8 layers, 64 experts top-6 of width 512, vocabulary 32k) and a Llama of 0.25B
(hidden 1024, 12 layers, MLP width 4096). Cascadia's `init_model` writes each once (bf16, seeded); optimum-intel
exports it for OpenVINO GenAI as its users do, with data-free weight compression: `--weight-format int8` (per
channel, asymmetric) and `--weight-format int4 --group-size 32` (asymmetric; its embedding and head int8, NNCF's
backup precision). llama.cpp's own converter (convert_hf_to_gguf.py) writes it as a bf16 GGUF, which llama.cpp
quantises to Q8_0 and to Q4_0 (blocks of 32, symmetric), the embedding and head Q8_0 in both. Cascadia reads the
same checkpoint in the matching formats (int8 per row, asymmetric; int4 in groups of 32, asymmetric, embedding and
head int8). OpenVINO computes in bf16 where the CPU has it (f32 elsewhere); llama.cpp multiplies its quantised
weights by activations it quantises to 8 bits, with f16 K/V. Cascadia runs two ways: its engine layer by layer
(the default: three compiled blocks a layer, attention and norms on the host) and "Cascadia one graph"
(`runtime.stage_graph`: the stage's layers as one compiled graph). Every contestant on every core this process may
use, in one process.

agreement  Greedy tokens from one prompt, each peer and the one graph against Cascadia's engine layer by layer: at
           f32 (the models at --quick sizes, unquantised: the same model, so the same tokens) and at int8 and int4
           (each engine's own quantisation of the same weights: how far they agree). The count of leading tokens
           that agree, of AGREE_TOKENS.
decode     Decode tokens a second at 1, 8 and 32 streams, each stream a PROMPT_TOKENS prompt of its own: GenAI's
           LLMPipeline for one stream and its ContinuousBatchingPipeline for more, timed as (DECODE_TOKENS new tokens)
           minus (1 new token), so that prefill and the first token fall out; llama.cpp (every stream a sequence of
           one context, one batch a step) and Cascadia's engine (one process, the stage holding every layer, row
           buckets 1, 8 and 32) prefilling their streams and then timed over DECODE_TOKENS - 1 decode steps of all
           of them together. Rounds alternate between the contestants; each cell is the median (min-max) of ROUNDS,
           PAIR_ROUNDS for GenAI and the one graph (the pair the goal compares: this VM's speed moves a cell by
           10-25% from one run to the next). Each "over" column is the median (min-max) of the rounds' own ratios,
           the two measured within seconds of each other, so that the machine's drift between rounds falls out.
           Beside them the memory roofline (`bench/engine.py`'s: the weight bytes a step needs at the measured
           bandwidth) and each contestant's share of it.
first      The first token of a FIRST_TOKEN_PROMPT-token prompt, one stream: GenAI's LLMPipeline and llama.cpp (the
           prompt in one call), Cascadia's engine (in calls of PREFILL_ROWS rows); rounds alternating with the
           decode's.
memory     A fresh process for each contestant, model and format, loaded as a user would run it (GenAI's continuous
           batching alone), taking the first token of that prompt and then 32 streams' decode: its peak resident
           memory (VmHWM), beside the weights' files.

Not a test: it prints its tables and writes them to bench/results/peers.json. It runs in the race environment
(optimum-intel pins transformers < 5.6; torch only exports, and nothing of Cascadia imports it; llama-cpp-python
compiles llama.cpp for this CPU, about 10 minutes on 2 cores):

    python -m venv .venv-race
    .venv-race/bin/pip install torch==2.13.0 "transformers>=5.2,<5.6" "optimum==2.3.*" nncf requests \
        openvino-genai==2026.4.1 openvino-tokenizers==2026.4.1 llama-cpp-python==0.3.36 sentencepiece -e .
    .venv-race/bin/pip install --no-deps optimum-intel==2.2.0   # its torchvision pin would pull a CUDA torch
    .venv-race/bin/python bench/peers.py [--quick] [--folder DIR] [--rounds N] [--pair-rounds N]

The checkpoints, exports and GGUFs (about 8 GB) go to DIR (default the system's temporary folder), made on first
use, with llama.cpp's converter (from llama-cpp-python's source package of the installed version).
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import ctypes
import multiprocessing
import os
import runpy
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import openvino as ov
from engine import ExpertCounts, memory_bandwidth, step_bytes
from record import Table, now, spread, write

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import runs_as
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.engine.init_model import init_model
from cascadia.models import config_from_hf_dict, read_config
from cascadia.sampling import Sampling
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.run import Pipeline
from cascadia.spec.types import (ClusterSpec, LengthSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WeightFormat,
                                 WeightFormats, WorkloadSpec)

SEED = 7
PROMPT_TOKENS = 32
DECODE_TOKENS = 64
AGREE_TOKENS = 32
STREAMS = (1, 8, 32)
ROUNDS = 3
PAIR = ("GenAI", "Cascadia one graph")  # decoded in every one of PAIR_ROUNDS rounds, the others in ROUNDS
PAIR_ROUNDS = 7
WHO = ("GenAI", "llama.cpp", "Cascadia", "Cascadia one graph")
PEERS = WHO[:2]
CASCADIA = WHO[2:]  # layer by layer (the default) and each stage one graph (`runtime.stage_graph`)
AGAINST_LAYERS = tuple(who for who in WHO if who != "Cascadia")  # greedy tokens held against the layers'
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


class Format(NamedTuple):
    """One weight format as each contestant spells it."""
    optimum: list[str]  # optimum-cli's weight options
    gguf: tuple[str, str] | None  # llama.cpp's quantisation of the layers, of the embedding and head (None: f32)
    cascadia: WeightFormats


INT8 = WeightFormat("int8", symmetric=False)
FORMATS = {
    "f32": Format(["--weight-format", "fp32"], None, matching(WeightFormat("f32"), WeightFormat("f32"))),
    "int8": Format(["--weight-format", "int8"], ("Q8_0", "Q8_0"), matching(INT8, INT8)),
    "int4": Format(["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"], ("Q4_0", "Q8_0"),
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
                        str(source), "--task", "text-generation-with-past", *FORMATS[fmt].optimum, str(path)],
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


def converter(folder: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, of the llama.cpp that the installed llama-cpp-python was built from: its
    wheel leaves the script out, so it comes from the same version's source package (fetched from the package
    registry into `folder` on first use)."""
    import llama_cpp  # the race environment's alone

    name = f"llama_cpp_python-{llama_cpp.__version__}"
    source = folder / name / "vendor" / "llama.cpp"
    if not (source / "convert_hf_to_gguf.py").is_file():
        print(f"fetching llama.cpp's converter ({name}'s source package) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                        f"llama-cpp-python=={llama_cpp.__version__}", "-d", str(folder)], check=True)
        with tarfile.open(folder / f"{name}.tar.gz") as package:
            wanted = [f"{name}/vendor/llama.cpp/{part}" for part in ("convert_hf_to_gguf.py", "conversion", "gguf-py")]
            package.extractall(folder, [m for m in package.getmembers() if m.name.startswith(tuple(wanted))],
                               filter="data")
    return source / "convert_hf_to_gguf.py"


def convert_child(script: str, source: str, outtype: str, out: str) -> None:
    """In a fresh process: llama.cpp's converter on a checkpoint. It names a BPE tokenizer's pre-tokenizer by
    hashing what published tokenizers make of a test text; init_model's tokenizer (byte-level BPE, GPT-2's split)
    is published nowhere, so it is named for what it is. The models only ever see token ids here."""
    folder = Path(script).parent
    sys.path[:0] = [str(folder), str(folder / "gguf-py")]  # the converter's own gguf package, not PyPI's
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = [script, source, "--outtype", outtype, "--outfile", out]
    runpy.run_path(script, run_name="__main__")


def gguf(source: Path, fmt: str, folder: Path) -> Path:
    """`source` converted to GGUF for llama.cpp (f32, or bf16 quantised to `fmt`'s types), on first use. Each file
    is written under a temporary name and renamed when whole, so that an interrupted run leaves none half-written."""
    path = source.with_name(f"{source.name}-{fmt}.gguf")
    if path.is_file():
        return path
    types = FORMATS[fmt].gguf
    full = path if types is None else source.with_name(f"{source.name}-bf16.gguf")
    if not full.is_file():
        print(f"converting {source.name} to GGUF ({'f32' if types is None else 'bf16'}) ...", flush=True)
        child = multiprocessing.get_context("spawn").Process(
            target=convert_child, args=(str(converter(folder)), str(source), "f32" if types is None else "bf16",
                                        str(full.with_suffix(".part"))))
        child.start()
        child.join()
        if child.exitcode != 0:
            sys.exit(f"llama.cpp's converter failed on {source}")
        full.with_suffix(".part").rename(full)
    if types is not None:
        lc = llama_cpp()
        print(f"quantising {full.name} to {types[0]} (embedding and head {types[1]}) ...", flush=True)
        params = lc.llama_model_quantize_default_params()
        params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{types[0]}")
        params.token_embedding_type = params.output_tensor_type = getattr(lc, f"GGML_TYPE_{types[1]}")
        params.nthread = len(os.sched_getaffinity(0))
        part = path.with_suffix(".part")
        if lc.llama_model_quantize(str(full).encode(), str(part).encode(), ctypes.byref(params)) != 0:
            sys.exit(f"llama.cpp could not quantise {full} to {types[0]}")
        part.rename(path)
    return path


QUIET: list = []  # llama.cpp's log callback, kept for as long as the process lives: llama.cpp may call it any time


def llama_cpp():
    """llama-cpp-python (the race environment's alone), its backend started and its log silenced."""
    import llama_cpp as lc

    if not QUIET:
        QUIET.append(lc.llama_log_callback(lambda *_: None))
        lc.llama_log_set(QUIET[0], ctypes.c_void_p())
        lc.llama_backend_init()
    return lc


class LlamaCpp:
    """llama.cpp on a GGUF, through llama-cpp-python's bindings of its C API: every stream a sequence of one
    context, the streams' next tokens decoded together in one batch a step (as llama-server's continuous batching
    does), on every core this process may use; its defaults otherwise (f16 K/V, flash attention)."""

    def __init__(self, path: Path, exact: bool = False):
        """`exact`: f32 K/V and attention without llama.cpp's flash-attention kernel, which rounds its inputs to f16
        (so that an f32 model gives f32 results)."""
        self.lc = lc = llama_cpp()
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        params.n_ctx = max(max(STREAMS) * (PROMPT_TOKENS + DECODE_TOKENS), FIRST_TOKEN_PROMPT + 1)
        params.n_batch = max(FIRST_TOKEN_PROMPT, max(STREAMS) * PROMPT_TOKENS)
        params.n_seq_max, params.kv_unified = max(STREAMS), True
        params.n_threads = params.n_threads_batch = len(os.sched_getaffinity(0))
        if exact:
            params.type_k = params.type_v = lc.GGML_TYPE_F32
            params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.context = lc.llama_init_from_model(self.model, params)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def __del__(self):
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.context)
        self.lc.llama_model_free(self.model)

    def greedy(self, prompt: np.ndarray, tokens: int) -> list[int]:
        out = [int(self._prefill(prompt[None])[0])]
        while len(out) < tokens:
            out.append(int(self._decode([(0, len(prompt) + len(out) - 1, out[-1], True)])[0].argmax()))
        return out

    def first_token_seconds(self, prompt: np.ndarray) -> float:
        start = time.perf_counter()
        self._prefill(prompt[None])
        return time.perf_counter() - start

    def decode_seconds(self, prompts: np.ndarray) -> float:
        tokens = self._prefill(prompts)
        start = time.perf_counter()
        for position in range(prompts.shape[1], prompts.shape[1] + DECODE_TOKENS - 1):
            tokens = self._decode([(seq, position, int(token), True) for seq, token in enumerate(tokens)]).argmax(-1)
        return time.perf_counter() - start

    def _prefill(self, prompts: np.ndarray) -> np.ndarray:
        """Fresh sequences 0.. with these prompts, in one batch; their first tokens."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.context), True)
        last = prompts.shape[1] - 1
        return self._decode([(seq, position, int(token), position == last) for seq, prompt in enumerate(prompts)
                             for position, token in enumerate(prompt)]).argmax(-1)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of rows (sequence, position, token, whether its logits are wanted): the wanted logits."""
        batch = self.batch
        batch.n_tokens = len(rows)
        for i, (seq, position, token, wanted) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, wanted
            batch.seq_id[i][0] = seq
        if self.lc.llama_decode(self.context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.stack([np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.context, i), (self.vocab,))
                         for i, row in enumerate(rows) if row[3]])


class Cascadia:
    """Cascadia's engine in one process: one stage holding every layer. It counts the distinct experts each MoE
    layer's rows choose in a decode (for the roofline)."""

    def __init__(self, path: Path, formats: WeightFormats, precision: str, stage_graph: bool = False):
        runtime = RuntimeSpec(precision=precision, kv_precision=precision, max_streams=max(STREAMS),
                              context_budget=max(PROMPT_TOKENS + DECODE_TOKENS, FIRST_TOKEN_PROMPT + 1),
                              row_buckets=(*STREAMS, PREFILL_ROWS), stage_graph=stage_graph)
        self.engine = Engine(Checkpoint.open(path), runtime, formats=formats)
        self.experts = ExpertCounts(self.engine)
        self.distinct: dict[int, dict[int, float]] = {}  # by stream count: the last decode's mean, by MoE layer

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
        self.experts.clear()
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS - 1):
            tokens = self.engine.step(slots, tokens).argmax(-1).tolist()
        seconds = time.perf_counter() - start
        self.distinct[len(prompts)] = self.experts.means()
        return seconds


class CascadiaRun:
    """Cascadia as `cascadia run` deploys it, on this one machine: one local node process on every core, or two,
    each pinned to a core of its own with one inference thread, holding consecutive halves of the layers as the
    planner splits them; the coordinator in this process. Decode tokens a second are the run's own metric (output
    tokens after each request's first, over the time some stream was decoding) for a closed loop of as many
    requests at once as streams."""

    def __init__(self, path: Path, formats: WeightFormats, precision: str, nodes: int):
        cpus = sorted(os.sched_getaffinity(0))
        cluster = tuple(NodeSpec(f"node{i}", memory_bytes=4 * 2**30, host="localhost", threads=len(cpus) // nodes,
                                 cpus=(cpus[i],) if nodes > 1 else None) for i in range(nodes))
        runtime = RuntimeSpec(precision=precision, kv_precision=precision, max_streams=max(STREAMS),
                              context_budget=PROMPT_TOKENS + DECODE_TOKENS, row_buckets=(1, 4, 8, 16, 32))
        workload = WorkloadSpec(prompt_tokens=LengthSpec.fixed(PROMPT_TOKENS), output_tokens=DECODE_TOKENS,
                                concurrency=STREAMS)
        self.spec = Spec(ModelSpec(read_config(path), formats, path, name=path.name),
                         ClusterSpec(cluster, reserve_bytes=2**28), runtime, workload)
        self.pipeline = Pipeline.start(self.spec, make_plan(self.spec))

    def decode_rates(self, prompts: np.ndarray) -> dict[int, float]:
        """Decode tokens a second by stream count, every count in STREAMS (each after a warm-up of its own)."""
        done = self.pipeline.run(self.spec.workload, [tuple(int(t) for t in p) for p in prompts])
        return {level["concurrency"]: level["decode_tokens_per_s"] for level in done.result["levels"]}

    def close(self) -> None:
        self.pipeline.close()


def contestant(who: str, path: Path, fmt: str, precision: str) -> GenAI | LlamaCpp | Cascadia:
    """One contestant on its form of the model (an export, a GGUF or the checkpoint) as a user would run it: GenAI's
    continuous batching alone; Cascadia's engine layer by layer, or ("Cascadia one graph") each stage one graph."""
    if who == "GenAI":
        return GenAI(path, precision, single=False)
    if who == "llama.cpp":
        return LlamaCpp(path)
    return Cascadia(path, FORMATS[fmt].cascadia, precision, stage_graph=who == "Cascadia one graph")


def peak_memory_child(who: str, path: str, fmt: str, precision: str, prompts: np.ndarray, long_prompt: np.ndarray,
                      results) -> None:
    """In a fresh process: one contestant, the first token of the long prompt and a decode of every stream; the
    process's peak resident bytes."""
    loaded = contestant(who, Path(path), fmt, precision)
    loaded.first_token_seconds(long_prompt)
    loaded.decode_seconds(prompts)
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


def paired(ours: list[float], theirs: list[float]) -> dict:
    """The spread of round-by-round ratios ours / theirs over the rounds both ran (each list from round 0 on)."""
    return spread(round(a / b, 3) for a, b in zip(ours, theirs))


def agreeing(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tables(precision: str, rounds: int, pair_rounds: int) -> tuple[Table, Table, Table, Table, Table]:
    """The empty tables: agreement, decode, deployed, first token, memory."""
    agreement = Table("Greedy tokens that agree with Cascadia's, the same weights",
                      ["model", "weights", *AGAINST_LAYERS],
                      note=f"Leading tokens of {AGREE_TOKENS} greedy ones after one prompt of {PROMPT_TOKENS} that "
                           f"each shares with Cascadia's engine layer by layer. f32: the models at --quick sizes, "
                           f"computed in f32 (llama.cpp with f32 K/V and without its flash attention, which rounds to "
                           f"f16); int8 and int4: each engine's own quantisation, in {precision}, llama.cpp as for the "
                           f"race.")
    decode = Table(f"Decode tokens a second ({precision} compute) on the same weights",
                   ["model", "weights", "streams", *WHO, *(f"{c} over {peer}" for c in CASCADIA for peer in PEERS),
                    "roofline", *(f"{who} % of roofline" for who in WHO)],
                   note=f"Median (min-max) of {rounds} alternating rounds, {pair_rounds} for {' and '.join(PAIR)}; "
                        f"{DECODE_TOKENS - 1} decode steps after prompts of {PROMPT_TOKENS}. Ratios: the median "
                        f"(min-max) of each round's ratio, over the rounds both ran. Roofline: the tokens a second "
                        f"if a step cost only reading once, at the memory bandwidth measured in each round (a "
                        f"streaming read of 1 GiB), the weight bytes it needs in Cascadia's formats (routed experts: "
                        f"the distinct ones its rows chose in Cascadia's run).")
    deployed = Table(f"Decode tokens a second ({precision} compute): Cascadia deployed by `cascadia run` here",
                     ["model", "weights", "streams", "engine alone", "1 node", "2 pinned nodes", "2 nodes over 1",
                      "2 nodes over GenAI"],
                     note=f"Median (min-max) of {rounds} rounds alternating with the decode table's. Engine alone: "
                          f"that table's. 1 node: a node process on both cores; 2 pinned nodes: two node processes, "
                          f"one core and one thread each, holding half the layers each; the coordinator in the "
                          f"bench's process; the run's decode rate for {DECODE_TOKENS}-token requests as many at once "
                          f"as streams, each count after a warm-up.")
    first = Table(f"First token of a {FIRST_TOKEN_PROMPT}-token prompt, one stream, seconds",
                  ["model", "weights", *WHO, *(f"{peer} over {c}" for c in CASCADIA for peer in PEERS)],
                  note=f"Median (min-max) of {rounds} rounds alternating with the decode's. GenAI and llama.cpp "
                       f"take the prompt in one call, Cascadia's engine (both ways) in calls of {PREFILL_ROWS} rows.")
    memory = Table("Peak memory of a process running one contestant, MiB",
                   ["model", "weights", "OpenVINO export", "GGUF", *WHO,
                    *(f"{c} over {peer}" for c in CASCADIA for peer in PEERS)],
                   note=f"A fresh process each (GenAI's continuous batching alone): loaded, the first token of the "
                        f"{FIRST_TOKEN_PROMPT}-token prompt, {DECODE_TOKENS} tokens of {max(STREAMS)} streams; its "
                        f"peak resident set (VmHWM). Beside them the weights' files: optimum-intel's "
                        f"openvino_model.bin and the GGUF.")
    return agreement, decode, deployed, first, memory


def arguments(doc: str, results: str, rounds: int = ROUNDS, pair_rounds: int | None = None) -> argparse.Namespace:
    """The options of the race's benches (this one and bench/step_parts.py), read from the command line."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the models at small sizes (checks the bench)")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cascadia-peers",
                        help="where the checkpoints, exports and GGUFs are, made on first use")
    parser.add_argument("--rounds", type=int, default=rounds)
    if pair_rounds:
        parser.add_argument("--pair-rounds", type=int, default=pair_rounds,
                            help=f"rounds of {' and '.join(PAIR)} (at least --rounds)")
    parser.add_argument("--out", type=Path, help=f"default bench/results/{results}.json")
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__, "peers", ROUNDS, PAIR_ROUNDS)
    started, rng = now(), np.random.default_rng(SEED)
    precision = runs_as("bf16", "CPU")
    print(f"computing in {precision} (OpenVINO's CPU plugin on this CPU)\n")
    pair_rounds = max(args.rounds, args.pair_rounds)
    agreement, decode, deployed, first, memory = tables(precision, args.rounds, pair_rounds)
    stream = np.ones(2**27, np.int64)  # 1 GiB to read for the bandwidth
    for model in MODELS:
        small = checkpoint(args.folder, model, quick=True)
        prompt = rng.integers(3, read_config(small).vocab_size, PROMPT_TOKENS)
        tokens = {"GenAI": GenAI(exported(small, "f32"), "f32").greedy(prompt, AGREE_TOKENS),
                  "llama.cpp": LlamaCpp(gguf(small, "f32", args.folder), exact=True).greedy(prompt, AGREE_TOKENS),
                  **{c: Cascadia(small, FORMATS["f32"].cascadia, "f32", stage_graph=c == "Cascadia one graph")
                     .greedy(prompt, AGREE_TOKENS) for c in CASCADIA}}
        agreement.add(model, "f32", *(agreeing(tokens[who], tokens["Cascadia"]) for who in AGAINST_LAYERS))
        path = checkpoint(args.folder, model, args.quick)
        vocab = read_config(path).vocab_size
        prompts = rng.integers(3, vocab, (max(STREAMS), PROMPT_TOKENS))
        long_prompt = rng.integers(3, vocab, FIRST_TOKEN_PROMPT)
        for fmt in ("int8", "int4"):
            files = {"GenAI": exported(path, fmt), "llama.cpp": gguf(path, fmt, args.folder), "Cascadia": path}
            files["Cascadia one graph"] = path
            contestants = {"GenAI": GenAI(files["GenAI"], precision), "llama.cpp": LlamaCpp(files["llama.cpp"]),
                           **{c: Cascadia(path, FORMATS[fmt].cascadia, precision,
                                          stage_graph=c == "Cascadia one graph") for c in CASCADIA}}
            runs = {nodes: CascadiaRun(path, FORMATS[fmt].cascadia, precision, nodes) for nodes in (1, 2)}
            if not args.quick:
                tokens = {who: c.greedy(prompts[0], AGREE_TOKENS) for who, c in contestants.items()}
                agreement.add(model, fmt, *(agreeing(tokens[who], tokens["Cascadia"]) for who in AGAINST_LAYERS))
            rates = {(who, g): [] for who in WHO for g in STREAMS}
            run_rates = {(nodes, g): [] for nodes in runs for g in STREAMS}
            seconds, bandwidth = {who: [] for who in WHO}, []
            for round_ in range(pair_rounds):
                everyone = round_ < args.rounds  # then the pair alone
                bandwidth.append(memory_bandwidth(stream))
                for who, c in contestants.items():
                    if everyone:
                        seconds[who].append(c.first_token_seconds(long_prompt))
                for g in STREAMS:
                    for who, c in contestants.items():
                        if everyone or who in PAIR:
                            rates[who, g].append(g * (DECODE_TOKENS - 1) / c.decode_seconds(prompts[:g]))
                for nodes, deployment in runs.items():
                    for g, rate in (deployment.decode_rates(prompts) if everyone else {}).items():
                        run_rates[nodes, g].append(rate)
            distinct = contestants["Cascadia"].distinct
            del contestants
            for deployment in runs.values():
                deployment.close()
            spec = ModelSpec(read_config(path), FORMATS[fmt].cascadia)
            for g in STREAMS:
                medians = {who: statistics.median(rates[who, g]) for who in WHO}
                roofline = g * statistics.median(bandwidth) / step_bytes(spec, g, distinct[g])
                decode.add(model, fmt, g, *(spread(rates[who, g]) for who in WHO),
                           *(paired(rates[c, g], rates[peer, g]) for c in CASCADIA for peer in PEERS),
                           round(roofline),
                           *(round(100 * medians[who] / roofline, 1) for who in WHO))
                deployed_medians = {nodes: statistics.median(run_rates[nodes, g]) for nodes in runs}
                deployed.add(model, fmt, g, spread(rates["Cascadia", g]), *(spread(run_rates[n, g]) for n in runs),
                             round(deployed_medians[2] / deployed_medians[1], 2),
                             round(deployed_medians[2] / medians["GenAI"], 2))
            medians = {who: statistics.median(seconds[who]) for who in WHO}
            first.add(model, fmt, *(spread(seconds[who]) for who in WHO),
                      *(round(medians[peer] / medians[c], 2) for c in CASCADIA for peer in PEERS))
            peaks = {who: peak_memory(who, files[who], fmt, precision, prompts, long_prompt) for who in WHO}
            memory.add(model, fmt, round((files["GenAI"] / "openvino_model.bin").stat().st_size / 2**20),
                       round(files["llama.cpp"].stat().st_size / 2**20), *(round(peaks[who] / 2**20) for who in WHO),
                       *(round(peaks[c] / peaks[peer], 2) for c in CASCADIA for peer in PEERS))
            for table in (decode, deployed, first, memory):
                print(table.text(), "\n", flush=True)
            # after each model and format, so that a failure later loses nothing measured
            write("peers", "Cascadia against OpenVINO GenAI and llama.cpp on the same weights", started,
                  [agreement, decode, deployed, first, memory], args.out, quick=args.quick)
    print(agreement.text(), "\n")


if __name__ == "__main__":
    main()
