"""Does a run's frame cost what the calibration's frames cost, on the same machine at the same minute?

Scenario: a spec's local pipeline (default specs/tiny-pinned.yaml), started once. ROUNDS times, alternately: the
calibration's frames alone (`cascadia.measure.pipeline_probe`: 8 one-row decode frames one after the other, 5
passes, each node's busy seconds per frame, median of the passes), then a run of the spec's workload at concurrency
1 (REQUESTS requests, traced: each node's compute per one-row frame, median). Alternating puts the machine's drift
on both alike: where the two columns agree within a round, a validation's error at one stream is the machine moving
between the calibration and the run, not the model. Not a test: it prints a table and writes it to
bench/results/alone_vs_run-SPEC.json (SPEC: the spec's file name).

    python bench/alone_vs_run.py [SPEC] [--rounds 4] [--requests 8]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import attrs
from record import Table, now, shown, write

from cascadia.graph.planner import plan as make_plan
from cascadia.measure.pipeline_probe import PASSES, PipelineProbe, decode_rows
from cascadia.pipeline.run import Pipeline
from cascadia.spec.load import load_spec

FRAMES = 8  # one-row frames alone per pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(Path(__file__).parent.parent / "specs" / "tiny-pinned.yaml"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, help="default bench/results/alone_vs_run-SPEC.json")
    args = parser.parse_args()
    started = now()
    spec = load_spec(args.spec)
    plan = make_plan(spec)
    nodes = [stage.node for stage in plan.stages]
    workload = attrs.evolve(spec.workload, concurrency=(1,), requests=args.requests, rate=())
    table = Table(f"{shown(args.spec)}: ms a one-row frame, alone (median of {PASSES} passes of {FRAMES}) and in a "
                  f"run at 1 stream ({args.requests} requests, median)",
                  ["round", *(f"{node} alone ms" for node in nodes), *(f"{node} in the run ms" for node in nodes)])
    with Pipeline.start(spec, plan, checkpoint=spec.model.checkpoint) as pipeline:
        probe = PipelineProbe(pipeline, spec)
        probe.alone([decode_rows(1, step) for step in range(FRAMES)])  # the first frames pay for first use
        for round_ in range(args.rounds):
            passes = [probe.alone([decode_rows(1, step) for step in range(FRAMES)]) for _ in range(PASSES)]
            alone = [statistics.median(p.busy[i] for p in passes) / FRAMES for i in range(len(nodes))]
            frames = [f for f in pipeline.run(workload, trace=True).frames if f.rows == 1]
            in_run = [statistics.median(f.stages[i].end - f.stages[i].start for f in frames) for i in range(len(nodes))]
            table.add(round_ + 1, *(s * 1e3 for s in (*alone, *in_run)))
    print(table.text())
    write(f"alone_vs_run-{Path(args.spec).stem}",
          "A run's frame against the calibration's frames, alternating on one machine", started,
          [table], args.out)


if __name__ == "__main__":
    main()
