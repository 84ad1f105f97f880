"""What a stage as one compiled graph gives, measured before the engine is rebuilt around it (the race's next step).

Scenario: the race's two random models (bench/peers.py: a 0.9B Qwen3-MoE and a 0.25B Llama, the same checkpoints,
written on first use) in Cascadia's int8 and int4 formats at bf16 compute (f32 on a CPU without bf16), one process on
every core. Each round and stream count prefills fresh streams with the engine and then decodes DECODE_STEPS greedy
steps two ways, alternating:

engine      Cascadia's engine as it is: per layer three compiled blocks (norm and q|k|v; o; the MLP or experts),
            RoPE, attention over the paged K/V pool, routers, norms and residuals on the host between them.
one graph   The same weights, stored the same way, as one OpenVINO graph holding every layer and the head: norms,
            q|k|v, per-head q/k norms, RoPE (cos and sin of each row's position in), attention by OpenVINO's
            ScaledDotProductAttention (each stream's keys and values in, a cache of CACHE positions masked past the
            stream's end, the query heads of a K/V head as its query rows), the residuals, the router (softmax and
            top k over f32 weights) and the experts in the tiled form the CPU plugin fuses, the final norm and the
            head. A step is the embedding's call and this one; the host writes the step's new keys and values
            into the cache (f32) and takes the argmax.
check       Whether the graph computes the engine's model: at f32, on the models at --quick sizes, after a prompt the
            engine prefilled, DECODE_STEPS greedy steps each way from the same keys and values: tokens that agree
            and the largest logit difference over the largest logit.

What the graph leaves out, which the engine must keep: prompts (only decode steps of one row per stream), the paged
pool (a dense cache), K/V stored in bf16, speculation's rewinds, forks, Inkling's and DeepSeek-V3's layers, and the
FP32 restoration (the CPU's bf16 has f32's range; a GPU's f16 needs it).

Not a test: it prints its tables and writes them to bench/results/one_graph.json.

    python bench/one_graph.py [--quick] [--rounds 3]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import statistics
import time

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from peers import FORMATS, MODELS, SEED, STREAMS, Cascadia, arguments, checkpoint
from record import Table, now, spread, write

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import compile_options, runs_as
from cascadia.engine.ov_ops import const, ints, linear, rms_norm, swiglu, tiled_experts, weight
from cascadia.engine.rope import cos_sin_factor, inverse_frequencies
from cascadia.models import llama, qwen3_moe
from cascadia.models.names import FINAL_NORM, expert
from cascadia.spec.types import WeightFormats

PROMPT_TOKENS = 32
DECODE_STEPS = 32
CACHE = PROMPT_TOKENS + DECODE_STEPS + 1  # positions the one graph's cache holds
ROUNDS = 3
CHECK_TOLERANCE = 1e-4  # largest logit difference over the largest logit, f32


def _rope(z: ov.Output, cos: ov.Output, sin: ov.Output, half: int) -> ov.Output:
    """z [T, heads, 2 half] rotated as transformers' rotate_half does: z cos + rotate_half(z) sin over cat(f, f)."""
    first, second = ops.variadic_split(z, const(np.int64(-1)), ints(half, half)).outputs()
    return ops.concat([ops.subtract(ops.multiply(first, cos), ops.multiply(second, sin)),
                       ops.add(ops.multiply(second, cos), ops.multiply(first, sin))], -1).output(0)


def stage_graph(ckpt: Checkpoint, formats: WeightFormats) -> ov.Model:
    """Every layer of a Llama or Qwen3-MoE checkpoint, its final norm and head, as one graph for decode steps: in
    x [B, H] (one embedded row a stream), cos and sin [B, 1, d/2], mask [B, 1, 1, C + 1] (0 or -inf over the cache
    and the row itself), each layer's cached keys and values k{i}, v{i} [B, kv, C, d]; out the logits [B, V] and
    each layer's new key and value rows [B, kv, d]."""
    cfg = ckpt.config
    heads, kv_heads, d = cfg.heads(0)
    group, eps = heads // kv_heads, cfg.rms_norm_eps
    x = ops.parameter([-1, cfg.hidden_size], ov.Type.f32, name="x")
    cos, sin = (ops.parameter([-1, 1, d // 2], ov.Type.f32, name=name) for name in ("cos", "sin"))
    mask = ops.parameter([-1, 1, 1, -1], ov.Type.f32, name="mask")
    inputs, new_rows, h = [x, cos, sin, mask], [], x.output(0)
    for i in range(cfg.num_hidden_layers):
        t = ckpt.layer(i)
        cached = [ops.parameter([-1, kv_heads, -1, d], ov.Type.f32, name=f"{kind}{i}") for kind in "kv"]
        inputs += cached
        projections = [t[name] for name in (llama.Q_PROJ, llama.K_PROJ, llama.V_PROJ)]
        qkv = linear(rms_norm(h, t[llama.INPUT_NORM], eps), weight(np.concatenate(projections), formats.attention))
        q, k, v = ops.variadic_split(qkv, const(np.int64(-1)), ints(heads * d, kv_heads * d, kv_heads * d)).outputs()
        q, k, v = (ops.reshape(z, ints(0, n, d), True).output(0) for z, n in ((q, heads), (k, kv_heads),
                                                                               (v, kv_heads)))
        if qwen3_moe.Q_NORM in t:
            q, k = rms_norm(q, t[qwen3_moe.Q_NORM], eps), rms_norm(k, t[qwen3_moe.K_NORM], eps)
        q, k = _rope(q, cos, sin, d // 2), _rope(k, cos, sin, d // 2)
        new_rows += [k, v]
        keys, values = (ops.concat([c, ops.unsqueeze(z, ints(2))], 2) for c, z in zip(cached, (k, v)))
        queries = ops.reshape(q, ints(0, kv_heads, group, d), True)  # a K/V head's query heads as its rows
        attended = ops.scaled_dot_product_attention(queries, keys, values, mask, const(np.float32(d ** -0.5)),
                                                    causal=False)
        o = weight(t[llama.O_PROJ], formats.attention)
        h = ops.add(h, linear(ops.reshape(attended, ints(0, heads * d), True).output(0), o)).output(0)
        normed = rms_norm(h, t[llama.POST_NORM], eps)
        h = ops.add(h, _mlp(cfg, i, t, normed, formats)).output(0)
    head = weight(ckpt.tensor(ckpt.head_weight), formats.head)
    logits = linear(rms_norm(h, ckpt.tensor(FINAL_NORM), eps), head)
    return ov.Model([logits, *new_rows], inputs, "stage")


def _mlp(cfg, layer: int, t, normed: ov.Output, formats: WeightFormats) -> ov.Output:
    """A dense layer's SwiGLU, or a MoE layer's router (softmax over f32 logits, top k, normalised where the model
    says so) and its experts in the tiled form."""
    if not getattr(cfg, "is_sparse", lambda _: False)(layer):
        return swiglu(normed, *(weight(t[name], formats.dense_mlp) for name in (llama.GATE, llama.UP, llama.DOWN)))
    probabilities = ops.softmax(linear(normed, const(t[qwen3_moe.ROUTER].astype(np.float32))), -1)
    top = ops.topk(probabilities, const(np.int64(cfg.num_experts_per_tok)), -1, "max", "value", ov.Type.i32)
    chosen, index = top.output(0), top.output(1)
    if cfg.norm_topk_prob:
        chosen = ops.divide(chosen, ops.reduce_sum(chosen, ints(-1), True)).output(0)
    stacks = [weight(np.stack([t[expert(j, p)] for j in range(cfg.num_experts)]), formats.routed_experts)
              for p in ("gate", "up", "down")]
    return tiled_experts(normed, *stacks, cfg.num_experts, cfg.hidden_size, index, chosen)


class OneGraph:
    """The stage graph compiled, with a dense cache for up to `streams` streams, continuing streams the engine
    prefilled (their keys and values copied from its pool)."""

    def __init__(self, path, formats: WeightFormats, precision: str, engine, streams: int):
        ckpt = Checkpoint.open(path)
        cfg = self.config = ckpt.config
        self.request = ov.Core().compile_model(stage_graph(ckpt, formats), "CPU",
                                               compile_options(precision)).create_infer_request()
        self.engine = engine
        _, kv_heads, d = cfg.heads(0)
        self.caches = np.zeros((cfg.num_hidden_layers, 2, streams, kv_heads, CACHE, d), np.float32)
        self.lengths = np.zeros(streams, np.int64)
        self.inv_freq = inverse_frequencies(d, cfg.rope_theta, cfg.rope_scaling)
        self.factor = np.float32(cos_sin_factor(cfg.rope_scaling))

    def take(self, slots: list[int]) -> None:
        """Copy the engine's keys and values of `slots` (prefilled) into the cache rows of the same numbers."""
        stage = self.engine.stage
        for slot in slots:
            n = int(stage.lengths[slot])
            for layer, state in enumerate(stage.states):
                for kind, stored in enumerate(state.kv.read(np.array([slot]), 0, n)):
                    by_head = stored[0].transpose(1, 0, 2, 3).reshape(stored.shape[2], -1, stored.shape[-1])
                    self.caches[layer, kind, slot, :, :n] = by_head[:, :n]
            self.lengths[slot] = n

    def step(self, tokens: list[int]) -> np.ndarray:
        """One decode row for each of the first len(tokens) streams -> logits [B, V]."""
        b = len(tokens)
        positions = self.lengths[:b]
        angles = positions.astype(np.float32)[:, None, None] * self.inv_freq
        mask = np.where(np.arange(CACHE + 1) < positions[:, None], np.float32(0), np.float32(-np.inf))
        mask[:, -1] = 0  # the row itself
        feed = {"x": self.engine.stage.embed(np.asarray(tokens)), "cos": self.factor * np.cos(angles),
                "sin": self.factor * np.sin(angles), "mask": mask[:, None, None, :].astype(np.float32)}
        for layer in range(self.config.num_hidden_layers):
            feed[f"k{layer}"], feed[f"v{layer}"] = self.caches[layer, 0, :b], self.caches[layer, 1, :b]
        out = self.request.infer(feed, share_inputs=True)
        rows = np.arange(b)
        for layer in range(self.config.num_hidden_layers):
            for kind in range(2):
                self.caches[layer, kind, rows, :, positions] = out[1 + 2 * layer + kind]
        self.lengths[:b] += 1
        return out[0]


def decode(contestant: Cascadia, graph: OneGraph, prompts: np.ndarray, way: str) -> tuple[float, list[list[int]]]:
    """Seconds a greedy decode step of these streams takes `way` ("engine" or "one graph"), after the engine
    prefilled them, and each stream's tokens."""
    engine, slots = contestant.engine, list(range(len(prompts)))
    for slot in slots:
        engine.release(slot)
    tokens = [int(engine.prefill(slot, prompt).argmax()) for slot, prompt in zip(slots, prompts)]
    if way == "one graph":
        graph.take(slots)
    step = (lambda ids: engine.step(slots, ids)) if way == "engine" else graph.step
    out = [tokens]
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        tokens = step(tokens).argmax(-1).tolist()
        out.append(tokens)
    return (time.perf_counter() - start) / DECODE_STEPS, [list(column) for column in zip(*out)]


def check(folder, rng: np.random.Generator) -> Table:
    """At f32 on the --quick models: the graph's greedy tokens and logits against the engine's."""
    table = Table("The one graph against the engine, f32, the models at --quick sizes",
                  ["model", "weights", "greedy tokens that agree", "largest logit difference / largest logit"],
                  note=f"One stream, {DECODE_STEPS} greedy steps after a prompt of {PROMPT_TOKENS} the engine "
                       f"prefilled, each way from the same keys and values (the graph's fed the engine's tokens, so "
                       f"each step compares the same inputs). Tolerance: {CHECK_TOLERANCE:g}.")
    for model in MODELS:
        path = checkpoint(folder, model, quick=True)
        for fmt in ("int8", "int4"):
            contestant = Cascadia(path, FORMATS[fmt].cascadia, "f32")
            graph = OneGraph(path, FORMATS[fmt].cascadia, "f32", contestant.engine, 1)
            prompt = rng.integers(3, contestant.engine.config.vocab_size, PROMPT_TOKENS)
            engine = contestant.engine
            engine.release(0)
            token = int(engine.prefill(0, prompt).argmax())
            graph.take([0])
            agree, worst, same = 0, 0.0, True
            for _ in range(DECODE_STEPS):
                theirs, ours = engine.step([0], [token])[0], graph.step([token])[0]
                worst = max(worst, float(np.abs(theirs - ours).max() / np.abs(theirs).max()))
                same = same and int(theirs.argmax()) == int(ours.argmax())
                agree += same
                token = int(theirs.argmax())
            table.add(model, fmt, f"{agree}/{DECODE_STEPS}", float(f"{worst:.2g}"))
            print(table.text(), "\n", flush=True)
    return table


def main() -> None:
    args = arguments(__doc__, "one_graph", ROUNDS)
    started, rng = now(), np.random.default_rng(SEED)
    precision = runs_as("bf16", "CPU")
    checked = check(args.folder, rng)
    ways = ("engine", "one graph")
    speed = Table(f"A decode step, ms ({precision} compute): the engine against the stage as one graph",
                  ["model", "weights", "streams", *ways, "engine over one graph", "greedy tokens that agree"],
                  note=f"Median (min-max) of {args.rounds} rounds, the two ways alternating, of {DECODE_STEPS} greedy "
                       f"steps after prompts of {PROMPT_TOKENS} that the engine prefilled. Agree: the leading tokens "
                       f"each stream decodes the same both ways, summed over the streams, of the last round.")
    for model in MODELS:
        path = checkpoint(args.folder, model, args.quick)
        vocab = MODELS[model]["vocab_size"] if not args.quick else 4096
        prompts = rng.integers(3, vocab, (max(STREAMS), PROMPT_TOKENS))
        for fmt in ("int8", "int4"):
            contestant = Cascadia(path, FORMATS[fmt].cascadia, precision)
            graph = OneGraph(path, FORMATS[fmt].cascadia, precision, contestant.engine, max(STREAMS))
            for g in STREAMS:
                seconds = {way: [] for way in ways}
                for way in ways:
                    decode(contestant, graph, prompts[:g], way)  # warm-up: each count's first calls
                for _ in range(args.rounds):
                    tokens = {}
                    for way in ways:
                        taken, tokens[way] = decode(contestant, graph, prompts[:g], way)
                        seconds[way].append(1e3 * taken)
                agree = sum(_leading(a, b) for a, b in zip(*tokens.values()))
                medians = [statistics.median(seconds[way]) for way in ways]
                speed.add(model, fmt, g, *(spread(seconds[way]) for way in ways), round(medians[0] / medians[1], 2),
                          f"{agree}/{g * (DECODE_STEPS + 1)}")
            del contestant, graph
            print(speed.text(), "\n", flush=True)
    write("one_graph", "What a stage as one compiled graph gives, before the engine is rebuilt around it", started,
          [checked, speed], args.out, quick=args.quick)


def _leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


if __name__ == "__main__":
    main()
