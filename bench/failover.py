"""What losing a node costs a serving pipeline: detection, taking its stage back, replay, by stage.

Scenario: the spec's pipeline (default specs/tiny-local.yaml, its local nodes) serves STREAMS greedy requests of
PROMPT_TOKENS + OUTPUT_TOKENS through `PipelineService`, the engine of `cascadia serve`, without HTTP. Once every
stream has made KILL_AFTER tokens, one node is killed with SIGKILL (or frozen with SIGSTOP: --freeze); each stage
in turn, ROUNDS times. Reported per stage, medians over the rounds, from the moment of the loss:
  detected      the service knows the node is lost (its status says the stage is down)
  back          the node started in its place is READY (the status clears)
  first token   the first token after that: the replay (every stream prefilled again) is done
  slower by     the run's wall time against the same requests without a loss
With --spare the spec gets a spare node beside its own: it takes the lost stage (loading it, its process already
up), and the lost node, started again holding no stage, stands by for the next loss (the bench waits for it).
Every stream's tokens are checked against the run without a loss. Not a test: it prints times. With a calibration
(`cascadia calibrate`: it times each node's restart), the simulator's prediction of the same loss beside them: the
same requests through `PipelineModel`, the node lost when each stream has made KILL_AFTER tokens there, found after
the measured detection time (`--calibrate` measures one first). The table goes to bench/results/failover-SPEC.json
(SPEC: the spec's file name; then -freeze, -spare as asked).

    python bench/failover.py [SPEC] [--freeze] [--spare] [--rounds 3] [--calibration cal.json | --calibrate]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import attrs
from record import Table, calibrate, now, spread, write

from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.service import PipelineService
from cascadia.metrics import Recorder
from cascadia.policy import Finished, Policy, Request, Token
from cascadia.sim.calibration import Calibration
from cascadia.sim.loss import Loss, recovery
from cascadia.sim.model import PipelineModel
from cascadia.spec.load import load_spec
from cascadia.workload import ClosedLoop

STREAMS = 8
PROMPT_TOKENS = 8
OUTPUT_TOKENS = 40
KILL_AFTER = 10  # tokens every stream has made before the loss
POLL_S = 0.0005  # how often the status is read while recovering
KEYS = ("detected", "back", "first token")


def requests(first_id: int) -> list[Request]:
    return [Request(first_id + i, tuple(1 + (i * 7 + j) % 50 for j in range(PROMPT_TOKENS)), OUTPUT_TOKENS)
            for i in range(STREAMS)]


class Streams:
    """STREAMS requests submitted at once; each token's arrival time; done when all have finished."""

    def __init__(self, service: PipelineService, first_id: int) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.times: list[float] = []
        self.finished = threading.Event()
        self._open = STREAMS
        for request in requests(first_id):
            service.submit(request, self._on_event)

    def _on_event(self, event, t: float) -> None:
        if isinstance(event, Token):
            self.tokens.setdefault(event.request_id, []).append(event.token)
            self.times.append(time.monotonic())
        elif isinstance(event, Finished):
            self._open -= 1
            if not self._open:
                self.finished.set()

    def each_made(self, n: int) -> bool:
        return len(self.tokens) == STREAMS and min(map(len, self.tokens.values())) >= n

    def outputs(self) -> list[list[int]]:
        return [self.tokens[k] for k in sorted(self.tokens)]


def node_pid(service: PipelineService, name: str) -> int:
    for pid in Path("/proc").iterdir():
        try:
            args = (pid / "cmdline").read_bytes().split(b"\0")
            stat = (pid / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == os.getpid() and b"--name" in args and args[args.index(b"--name") + 1] == name.encode():
            return int(pid.name)
    raise SystemExit(f"no process for node {name}")


def one_loss(service: PipelineService, stage: int, how: signal.Signals, first_id: int) -> dict[str, float]:
    streams = Streams(service, first_id)
    while not streams.each_made(KILL_AFTER):
        time.sleep(POLL_S)
    standing_by = service.status().standing_by
    lost_at = time.monotonic()
    os.kill(node_pid(service, service.plan.stages[stage].node), how)
    moments = {}
    while "back" not in moments:
        down = service.status().down
        if down and "detected" not in moments:
            moments["detected"] = time.monotonic()
        elif not down and "detected" in moments:
            moments["back"] = time.monotonic()
        time.sleep(POLL_S)
    streams.finished.wait()
    while len(service.status().standing_by) < len(standing_by):  # the lost node, standing by for the next loss
        time.sleep(0.1)
    moments["first token"] = min(t for t in streams.times if t > moments["back"])
    moments["outputs"] = streams.outputs()
    moments["wall"] = streams.times[-1] - streams.times[0]
    return {key: value - lost_at if isinstance(value, float) and key != "wall" else value
            for key, value in moments.items()}


def simulated(spec, plan, calibration: Calibration, loss: Loss | None, detect_s: float = 0.0):
    """The bench's requests through the simulator, all at once, with `loss` or without: (records, the loss's)."""
    model = PipelineModel(spec, plan, calibration)
    recorder = Recorder(STREAMS, "measured")
    how = (loss, recovery(loss, spec, plan.stages, calibration, detect_s)) if loss else None
    policy = Policy.for_runtime(spec.runtime, len(plan.stages), plan.kv_pools)
    model.run_phase(policy, ClosedLoop([(r,) for r in requests(0)], STREAMS), STREAMS, recorder, how)
    return recorder.records, model.losses


def predicted_loss(spec, plan, calibration: Calibration, node: str, detect_s: float) -> dict[str, float]:
    """The simulator's figures for losing `node` once every stream has made KILL_AFTER tokens."""
    clean, _ = simulated(spec, plan, calibration, None)
    at_s = max(record.token_times[KILL_AFTER - 1] for record in clean) - clean[0].t_arrival
    _, [loss] = simulated(spec, plan, calibration, Loss(node, at_s), detect_s)
    return {"detected": loss["detected_s"], "back": loss["back_s"], "first token": loss["first_token_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(Path(__file__).parent.parent / "specs" / "tiny-local.yaml"))
    parser.add_argument("--freeze", action="store_true", help="SIGSTOP the node instead of killing it")
    parser.add_argument("--spare", action="store_true", help="a spare node takes each lost stage")
    parser.add_argument("--rounds", type=int, default=3)
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--calibration", help="a calibration of this spec, for the simulator's prediction")
    given.add_argument("--calibrate", action="store_true", help="measure the spec's calibration first")
    parser.add_argument("--out", type=Path, help="default bench/results/failover-SPEC.json")
    args = parser.parse_args()
    started = now()
    spec = load_spec(args.spec)
    if args.spare:
        spare = attrs.evolve(spec.cluster.nodes[0], name="spare")
        spec = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, spares=(spare,)))
    plan = make_plan(spec)
    with tempfile.TemporaryDirectory(prefix="cascadia-failover-") as folder:
        calibration = (Calibration.load(calibrate(args.spec, Path(folder))) if args.calibrate else
                       Calibration.load(args.calibration) if args.calibration else None)
    service = PipelineService(spec, plan)
    try:
        while not service.status().ready:
            if service.status().error:
                raise SystemExit(service.status().error)
            time.sleep(0.1)
        clean = Streams(service, 0)
        clean.finished.wait()
        reference, clean_wall = clean.outputs(), clean.times[-1] - clean.times[0]
        how = signal.SIGSTOP if args.freeze else signal.SIGKILL
        table = Table(f"{spec.model.name}: {len(plan.stages)} local nodes{' and a spare' if args.spare else ''}, "
                      f"{STREAMS} streams of {PROMPT_TOKENS} + {OUTPUT_TOKENS} tokens, "
                      f"{'SIGSTOP' if args.freeze else 'SIGKILL'} after {KILL_AFTER} tokens each",
                      ["stage", "", "detected ms", "back ms", "first token ms", "wall time over a run without",
                       "tokens"], note="Times from the moment of the loss." + (
                          " Predicted: the simulator, told the measured detection time." if calibration else ""))
        next_id = STREAMS
        for index, stage in enumerate(plan.stages):
            losses = []
            for _ in range(args.rounds):
                losses.append(one_loss(service, index, how, next_id))
                next_id += STREAMS
            same = all(loss["outputs"] == reference for loss in losses)
            measured = {key: spread(loss[key] * 1e3 for loss in losses) for key in KEYS}
            table.add(index, "measured", *(measured[key] for key in KEYS),
                      spread(loss["wall"] / clean_wall for loss in losses), "identical" if same else "DIFFERENT")
            if calibration is not None:
                detected_s = measured["detected"]["median"] / 1e3
                predicted = predicted_loss(spec, plan, calibration, stage.node, detected_s)
                table.add(index, "predicted", None, *(predicted[key] * 1e3 for key in KEYS[1:]), None, None)
        print(table.text())
        variant = "".join(("-freeze" if args.freeze else "", "-spare" if args.spare else ""))
        write(f"failover-{Path(args.spec).stem}{variant}", "What losing a node costs a serving pipeline, by stage",
              started, [table], args.out,
              freeze=args.freeze, spare=args.spare)
    finally:
        service.close()


if __name__ == "__main__":
    main()
