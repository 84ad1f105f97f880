"""What moves a row: whether a row's result depends on the call it is computed in, step by step and op by op, at
each precision a spec offers.

A request should get the same tokens whatever else the server computes beside it. That holds when every op computes
a row the same way whatever the call holds: its bucket (the rows it is padded to) and the other rows in it. This
bench measures where that fails, on the benches' random mid-size Inkling (specs/mid; `--quick`: a small one), in
four variants: f32; bf16 compute, weights and K/V; int8 weights; the paper's formats (int4 experts, int8 the rest),
the last two computing in bf16 with bf16 K/V. On a CPU without bf16 arithmetic OpenVINO computes those in f32, and
the tables say so.

step   Stream 0's next decode step, its prompt prefilled alone (the same calls every time, so the same state):
       alone; alone but padded to each bucket; and beside B-1 other streams (their own prompts) in a call of B
       rows. The largest |difference| of its logits from alone, whether its greedy token changes, and the first
       layer whose output row differs (none: the layers agree, and only the head moved it).
ops    Every compiled block of the model (each layer's attention input and output projection, its dense MLP or MoE,
       fused and expert-grouped, and the embedding and head), called directly with the rows one real step of the
       largest bucket gave it: row 0 alone, against row 0 padded to each bucket (the expert-grouped block computes
       only real rows: no padding) and row 0 inside the first B of those rows; the MoE's two paths on the same
       row (a call of GROUPED_FROM rows or more runs grouped, a smaller one fused); and the router on the host,
       row 0 of the experts' input alone against inside B rows. An op that moves nothing is row-invariant; where
       layers move and no op does, the host's other parts (norms, attention, convolutions) moved them.
replay A stream's prompt and the tokens it went on with, taken in again in one call (as a replay after a node's
       loss takes them, or a prefill) against the prompt then one decode step a token, the MoE fused throughout
       (as `moe_grouped_from: never` runs it, so that its two paths do not mix in): the largest |difference| of
       the last logits, and whether the greedy token after them changes.

Not a test: it prints what moves on this machine's kernels. The tables go to bench/results/row_invariance.json.

    python bench/row_invariance.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
from random_model import FORMATS, mid_config, random_checkpoint
from record import Table, now, write

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock
from cascadia.engine.engine import Engine
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.spec.types import RuntimeSpec, WeightFormat, WeightFormats

CHECKPOINT = Path(tempfile.gettempdir()) / "cascadia-bench-mid"
SEED = 3
BUCKETS = (1, 2, 8, 16, 24, 32)  # the runtime's default row buckets
GROUPED_FROM = 16  # MoE calls of 16 rows and more run expert-grouped, as a spec may choose
PROMPT_TOKENS = 12
REPLAYED = (1, 4, 16)  # tokens generated before the replay


def every(fmt: WeightFormat) -> WeightFormats:
    return WeightFormats(**{field.name: fmt for field in attrs.fields(WeightFormats)})


@attrs.frozen
class Variant:
    name: str
    precision: str
    kv_precision: str
    formats: WeightFormats


VARIANTS = (Variant("f32", "f32", "f32", every(WeightFormat("f32"))),
            Variant("bf16", "bf16", "bf16", every(WeightFormat("bf16"))),
            Variant("int8 weights", "bf16", "bf16", every(WeightFormat("int8"))),
            Variant("int4 experts, int8 the rest", "bf16", "bf16", FORMATS))


def largest_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


class Decoder:
    """The model in one process, the output row of stream 0 after each layer recorded on every call."""

    def __init__(self, checkpoint: Path, variant: Variant, prompts: list[np.ndarray]):
        runtime = RuntimeSpec(context_budget=PROMPT_TOKENS + max(REPLAYED) + 1, max_streams=BUCKETS[-1],
                              precision=variant.precision, kv_precision=variant.kv_precision, row_buckets=BUCKETS,
                              moe_grouped_from=GROUPED_FROM)
        self.engine = Engine(Checkpoint.open(checkpoint), runtime, formats=variant.formats)
        self.prompts = prompts
        self.layer_rows: list[np.ndarray] = []
        for layer in self.engine.stage.layers:  # layers take methods wrapped, as calibration times them
            layer.forward = self._recorded(layer.forward)

    def _recorded(self, forward):
        def recorded(x, rows, state):
            out = forward(x, rows, state)
            self.layer_rows.append(out[0].copy())
            return out
        return recorded

    def step(self, streams: int, bucket: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Stream 0's logits in one decode call of `streams` streams padded to `bucket` rows, each stream's prompt
        prefilled alone first; and stream 0's row after each layer in that call."""
        engine, stage = self.engine, self.engine.stage
        for slot in range(len(self.prompts)):
            engine.release(slot)
        for slot in range(streams):
            engine.prefill(slot, self.prompts[slot])
        slots = np.arange(streams)
        ids = np.array([prompt[0] for prompt in self.prompts[:streams]])  # each stream repeats its first token
        self.layer_rows = []
        hidden = stage.forward(stage.embed(ids), slots, stage.lengths[slots], bucket)
        return stage.logits(hidden)[0], self.layer_rows

    @property
    def precision(self) -> str:
        return self.engine.stage.precision


def replay_table(decoder: Decoder, variant: Variant) -> Table:
    engine = decoder.engine
    table = Table(f"{variant.name} (computing in {decoder.precision}): a stream taken in again, as a replay does",
                  ["tokens after the prompt", "logits max |diff|", "greedy token the same"])
    prompt = decoder.prompts[0]
    for layer in engine.stage.layers:
        layer.grouped_from = None  # fused at every bucket
    for generated in REPLAYED:
        engine.release(0)
        logits = engine.prefill(0, prompt)
        ids = []
        for _ in range(generated):
            ids.append(int(np.argmax(logits)))
            logits = engine.step([0], [ids[-1]])[0]
        engine.release(0)
        replayed = engine.prefill(0, np.concatenate([prompt, ids]))
        table.add(generated, largest_difference(replayed, logits),
                  "yes" if np.argmax(replayed) == np.argmax(logits) else "NO")
    return table


def step_table(decoder: Decoder, variant: Variant) -> Table:
    alone, alone_layers = decoder.step(1, 1)
    table = Table(f"{variant.name} (computing in {decoder.precision}): stream 0's decode step",
                  ["bucket", "padded alone: logits max |diff|", "beside B-1 streams: logits max |diff|",
                   "greedy token the same", "first layer that moves"])
    for bucket in BUCKETS[1:]:
        padded, _ = decoder.step(1, bucket)
        beside, layers = decoder.step(bucket, bucket)
        moved = [i for i, (a, b) in enumerate(zip(alone_layers, layers)) if not np.array_equal(a, b)]
        table.add(bucket, largest_difference(padded, alone), largest_difference(beside, alone),
                  "yes" if np.argmax(beside) == np.argmax(alone) else "NO", moved[0] if moved else "none")
    return table


@contextlib.contextmanager
def recorded_calls(calls: list) -> Iterator[None]:
    """Every block call meanwhile, as (block, its inputs)."""
    originals = {kind: kind.__call__ for kind in (CompiledBlock, GroupedBlock)}

    def recording(call):
        def recorded(block, *inputs, **options):
            calls.append((block, tuple(np.array(x, copy=True) for x in inputs)))
            return call(block, *inputs, **options)
        return recorded

    for kind, call in originals.items():
        kind.__call__ = recording(call)
    try:
        yield
    finally:
        for kind, call in originals.items():
            kind.__call__ = call


def block_names(engine: Engine) -> dict[int, str]:
    stage = engine.stage
    names = {id(stage.embedding): "embedding", id(stage.head): "head"}
    for layer in stage.layers:
        for block in layer.blocks():
            kind = "moe grouped" if isinstance(block, GroupedBlock) else block.compiled.get_runtime_model() \
                .get_friendly_name()
            names[id(block)] = kind
    return names


def row0(block, inputs: tuple[np.ndarray, ...], rows: int, bucket: int | None) -> np.ndarray:
    """Row 0 of the block's output for the first `rows` rows of `inputs`, padded to `bucket` (grouped: unpadded)."""
    first = [x[:rows] for x in inputs]
    out = block(*first) if isinstance(block, GroupedBlock) else block(*first, bucket=bucket)[0]
    return out[0]


def ops_table(decoder: Decoder, variant: Variant) -> Table:
    calls = []
    with recorded_calls(calls):
        decoder.step(BUCKETS[-1], BUCKETS[-1])
    names = block_names(decoder.engine)
    moe_layers = {id(block): layer for layer in decoder.engine.stage.layers if layer.router is not None
                  for block in (layer.mlp, layer.grouped) if block is not None}
    padded, inside = Moves(), Moves()
    for block, inputs in calls:
        if id(block) not in names or len(inputs[0]) < BUCKETS[-1]:  # a prefill's call, or the head's of row 0
            continue
        ops = [(names[id(block)], block)]
        layer = moe_layers.get(id(block))
        if layer is not None and layer.mlp is not None and block is layer.grouped:  # the fused MoE on the same rows
            ops.append(("moe", layer.mlp))
            switched = largest_difference(row0(layer.grouped, inputs, 1, None), row0(layer.mlp, inputs, 1, 1))
            for bucket in BUCKETS[1:]:
                inside.add("moe: grouped (from its bucket) against fused", bucket,
                           switched if bucket >= GROUPED_FROM else 0.0)
        for name, op in ops:
            alone = row0(op, inputs, 1, 1)
            for bucket in BUCKETS[1:]:
                if not isinstance(op, GroupedBlock):
                    padded.add(name, bucket, largest_difference(row0(op, inputs, 1, bucket), alone))
                inside.add(name, bucket, largest_difference(row0(op, inputs, bucket, bucket), alone))
        if layer is not None:  # the router, on the host, from the rows the experts were given (the normed input)
            alone = layer.router(inputs[0][:1]).weights[0]
            for bucket in BUCKETS[1:]:
                inside.add("router (host)", bucket, largest_difference(layer.router(inputs[0][:bucket]).weights[0],
                                                                       alone))
    table = Table(f"{variant.name} (computing in {decoder.precision}): each op's row 0, alone against padded and "
                  "inside the call's rows (max |diff| over the op's calls in a step)",
                  ["op", "padded: max |diff|", "buckets that move it", "inside B rows: max |diff|",
                   "buckets that move it"])
    for name in inside.by_op:
        pad = padded.by_op.get(name)
        table.add(name, max(pad.values()) if pad else None, moving(pad) if pad else "-",
                  max(inside.by_op[name].values()), moving(inside.by_op[name]))
    return table


class Moves:
    """The largest |difference| seen for each op at each bucket."""

    def __init__(self) -> None:
        self.by_op: dict[str, dict[int, float]] = {}

    def add(self, op: str, bucket: int, difference: float) -> None:
        at = self.by_op.setdefault(op, {})
        at[bucket] = max(at.get(bucket, 0.0), difference)


def moving(by_bucket: dict[int, float]) -> str:
    moved = [str(bucket) for bucket, difference in by_bucket.items() if difference > 0]
    return ", ".join(moved) if moved else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, to check the bench")
    parser.add_argument("--out", type=Path, help="write the results here (default: bench/results/)")
    args = parser.parse_args()
    started = now()
    config = mid_config(args.quick)
    checkpoint = random_checkpoint(config, CHECKPOINT, args.quick, SEED)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, config.vocab_size, PROMPT_TOKENS) for _ in range(BUCKETS[-1])]
    tables = []
    for variant in VARIANTS:
        decoder = Decoder(checkpoint, variant, prompts)
        for table in (step_table(decoder, variant), ops_table(decoder, variant), replay_table(decoder, variant)):
            print(table.text(), "\n", flush=True)
            tables.append(table)
        del decoder
    write("row_invariance", "What moves a row", started, tables, args.out, args.quick)


if __name__ == "__main__":
    main()
