"""What each expert weight format costs on this CPU: time, memory and error of one MoE layer, fused and expert-grouped.

Scenario: a random one-layer Inkling of the benches' mid size (hidden 1024, 64 experts top-6 plus 2 shared of width
512), written once by `init_model` into CHECKPOINT (bf16); its MoE layer is built by the engine's own `build_layer`,
its routed and shared
experts stored in each of FORMATS, compiled at each of the PRECISIONS asked for. Each (format, precision) runs in fresh
processes: one builds the fused path only, SWEEPS others the fused and the expert-grouped paths (what the engine
holds when it runs both). Reported:
  stored      the layer's weight bytes (`cascadia.graph.costs`: values, scales, zero points), the experts in the
              format, the attention in bench/engine.py's (int8; 2.9 MiB of the layer)
  resident    the process's resident memory after building the layer, its warm-up and the timed calls, less what
              it held before (Python, numpy, OpenVINO loaded), over the stored bytes; with the grouped path too
              (median of the SWEEPS processes)
  ms          median seconds per call at 1 and at ROWS rows of unit RMS routed by the layer's router: REPEATS
              calls of each path in turn in the process that holds both (one layer called again and again; its
              weights are larger than this CPU's L3), the median of SWEEPS such processes, every sweep over all
              cases in a new order; grouped / fused: the median of each process's own ratio (other load on the
              machine moves whole processes)
  error       |output - exact| / |exact| (Euclidean norms) at ROWS rows, exact = the same layer with f32 weights
              at f32 compute (so it counts the format's rounding and the precision's together)
Not a test: it prints a table and writes it to bench/results/moe_formats.json.

    python bench/moe_formats.py [--quick] [--precisions bf16,f32]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import attrs
import numpy as np
from random_model import FORMATS as BENCH_FORMATS
from random_model import MID_SIZES, QUICK_SIZES, model_config, random_checkpoint
from record import Table, now, spread, write

from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock, compile_options, core, runs_as
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.families.inkling import build_layer
from cascadia.graph import costs
from cascadia.models.inkling import InklingConfig
from cascadia.spec.types import ModelSpec, WeightFormat, WeightFormats

FORMATS = {"int8 per row, symmetric": WeightFormat("int8"),
           "int8 per row, asymmetric": WeightFormat("int8", symmetric=False),
           **{f"int4 g{g}, {kind}": WeightFormat("int4", g, symmetric=kind == "symmetric")
              for g in (32, 64, 128) for kind in ("symmetric", "asymmetric")}}
ROWS = 32
REPEATS = 9
SWEEPS = 3
SEED = 0
MODEL = MID_SIZES | {"num_hidden_layers": 1, "layer_types": ["hybrid_sliding"], "mlp_layer_types": ["sparse"]}
CHECKPOINT = Path(tempfile.gettempdir()) / "cascadia-bench-moe-formats"


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def moe_layer_index(config: InklingConfig) -> int:
    return next(i for i in range(config.num_hidden_layers) if not config.is_dense(i))


def build(path: str, fmt: WeightFormat, precision: str, grouped: bool):
    """The first MoE layer with its experts in `fmt`, compiled at `precision`; with the grouped path too."""
    checkpoint = Checkpoint.open(path)
    config, options = checkpoint.config, compile_options(precision)
    index = moe_layer_index(config)
    buckets = (1, ROWS)
    layer = build_layer(config, index, checkpoint.layer(index), layer_formats(fmt),
                        lambda model: CompiledBlock(model, "CPU", options, buckets),
                        compile_grouped=(lambda model: GroupedBlock(model, "CPU", options, buckets)) if grouped
                        else None)
    for block in layer.blocks():
        block.warm_up()
    return layer


def layer_formats(fmt: WeightFormat) -> WeightFormats:
    """`fmt` for the experts, bench/engine.py's formats for the rest of the layer."""
    return attrs.evolve(BENCH_FORMATS, routed_experts=fmt, shared_experts=fmt)


def inputs(layer, rows: int):
    h = np.random.default_rng(SEED + rows).standard_normal((rows, layer.post_norm.shape[0]), dtype=np.float32)
    return layer.expert_inputs(h)


def case_child(path: str, fmt: WeightFormat, precision: str, grouped: bool, results) -> None:
    """In a fresh process: the resident bytes that building, warming up and calling the layer add; with `grouped`,
    the median seconds per call of both paths at 1 and ROWS rows (called in turn) and their outputs at ROWS."""
    CompiledBlock(graphs.projection([np.ones((8, 8), np.float32)], WeightFormat()), "CPU", compile_options("f32"),
                  (1,)).warm_up()
    before = resident_bytes()
    layer = build(path, fmt, precision, grouped)
    paths = {"fused": lambda *x: layer.mlp(*x)[0]} | ({"grouped": layer.grouped} if grouped else {})
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rows in (1, ROWS):
        x, _ = inputs(layer, rows)
        for _ in range(REPEATS):
            for name, call in paths.items():
                start = time.perf_counter()
                call(*x)
                samples[name, rows].append(time.perf_counter() - start)
    x, factor = inputs(layer, ROWS)
    outputs = {name: call(*x) * factor * np.float32(layer.up_divisor) for name, call in paths.items()}
    results.put((resident_bytes() - before, {key: statistics.median(s) for key, s in samples.items()}, outputs))


def in_child(target, *args):
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    child = spawn.Process(target=target, args=(*args, results))
    child.start()
    out = results.get()
    child.join()
    return out


def exact_output(path: str) -> np.ndarray:
    layer = build(path, WeightFormat(), "f32", grouped=False)
    x, factor = inputs(layer, ROWS)
    return layer.mlp(*x)[0] * factor * np.float32(layer.up_divisor)


def relative_error(output: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(output - exact) / np.linalg.norm(exact))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, to check the bench itself")
    parser.add_argument("--precisions", default="bf16,f32", help="compute precisions, comma-separated")
    parser.add_argument("--out", type=Path, help="default bench/results/moe_formats.json")
    args = parser.parse_args()
    started = now()
    config = model_config(MODEL | QUICK_SIZES if args.quick else MODEL)
    path = str(random_checkpoint(config, CHECKPOINT, args.quick, SEED))
    exact = exact_output(path)
    load_before = os.getloadavg()
    precisions = args.precisions.split(",")
    cases = [(precision, name) for precision in precisions for name in FORMATS]
    fused_only = {case: in_child(case_child, path, FORMATS[case[1]], case[0], False)[0] for case in cases}
    measured: dict[tuple[str, str], list] = defaultdict(list)
    rng = np.random.default_rng(SEED)
    for sweep in range(SWEEPS):
        for i in rng.permutation(len(cases)):
            precision, name = cases[i]
            print(f"sweep {sweep + 1}/{SWEEPS}: {precision}, {name} ...", flush=True)
            measured[cases[i]].append(in_child(case_child, path, FORMATS[name], precision, True))
    table = Table("One MoE layer by expert format", [
        "runs as", "experts", "stored MiB", "resident / stored", "with grouped", "fused 1 row ms", "grouped 1 row ms",
        f"fused {ROWS} rows ms", f"grouped {ROWS} rows ms", "grouped / fused, 1 row", f"grouped / fused, {ROWS} rows",
        "fused error", "grouped error"])
    for precision, name in cases:
        runs = measured[precision, name]
        both = statistics.median(resident for resident, _, _ in runs)
        ratios = {n: spread(times["grouped", n] / times["fused", n] for _, times, _ in runs) for n in (1, ROWS)}
        ops = costs.layer_ops(ModelSpec(config, layer_formats(FORMATS[name])), moe_layer_index(config))
        stored = sum(op.weight_bytes for op in ops.values())
        table.add(runs_as(precision, "CPU"), name, stored / 2**20, fused_only[precision, name] / stored,
                  both / stored, *(spread(times[p, n] * 1e3 for _, times, _ in runs)
                                   for n in (1, ROWS) for p in ("fused", "grouped")),
                  ratios[1], ratios[ROWS], *(relative_error(runs[0][2][p], exact) for p in ("fused", "grouped")))
    load_after = os.getloadavg()
    layer_text = (f"MoE layer hidden {config.hidden_size}, {config.n_routed_experts} experts "
                  f"top-{config.num_experts_per_tok} + {config.n_shared_experts} shared of width "
                  f"{config.moe_intermediate_size}")
    table.note = (f"{layer_text}; ms: per call, over {SWEEPS} fresh processes; error: against f32 weights at f32 "
                  f"compute, at {ROWS} rows. bench/engine.py's experts: {BENCH_FORMATS.routed_experts}.")
    print(f"\n{core().get_property('CPU', 'FULL_DEVICE_NAME')}; {'quick ' if args.quick else ''}{layer_text}; load "
          f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print(table.text())
    write("moe_formats", "What each expert weight format costs: time, memory and error of one MoE layer", started,
          [table], args.out, quick=args.quick, load_average=[load_before[0], load_after[0]])


if __name__ == "__main__":
    main()
