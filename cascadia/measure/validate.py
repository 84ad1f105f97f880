"""`cascadia validate`: one workload through the simulator and through the real pipeline, and how far apart they are.

Both backends serve the same requests (the workload's seeded prompts, or its prompts file) under the same policy
and plan, and write the same metrics schema. The real pipeline may serve the workload several times (`repeats`):
on a machine shared with other work its speed wanders by tens of percent from minute to minute, and the median of
a few runs is what it typically does. Per concurrency level and metric, error = (predicted - measured) / measured,
with the median over the runs as measured, and the runs' spread = (largest - smallest) / median: an error smaller
than the spread says little about the model. Per metric, the median of the absolute errors and of the spreads over
the levels. With timelines, per node the per-frame compute and link times of both (median and p95), over all the
runs, and each node's compute phase by phase of each run: to see where they part, and when. With replays, each run
is simulated again with its own frames' compute (`cascadia.sim.replay`): the error left is the model's, not the
machine's drift since calibrating. With intervals, each figure's predicted interval over the speeds the calibration's
rounds ran at (`cascadia.sim.interval`), and the share of the runs' values it holds: its coverage.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from cascadia.errors import NodeError
from cascadia.graph.plan import Plan
from cascadia.metrics import FIGURES, describe_level, figure, level_label, load_heading
from cascadia.pipeline.run import RunFailed, run
from cascadia.sim.calibration import Calibration
from cascadia.sim.drafts import DEFAULT_ACCEPTANCE, acceptance_trace
from cascadia.sim.interval import SAMPLES, simulate_interval, stratified_levels
from cascadia.sim.replay import ReplayTimes
from cascadia.sim.simulate import simulate
from cascadia.spec.types import Spec
from cascadia.table import format_rows
from cascadia.trace import FrameTiming, frame_times

SCHEMA = "cascadia.validation/2"


def _load(level: dict) -> tuple[int | None, float | None]:
    """A level's concurrency and arrival rate (one of them None)."""
    return level["concurrency"], level.get("rate")


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _spread(values: Sequence[float | None]) -> float | None:
    """(largest - smallest) / median of the known values; None for fewer than two, or a zero median."""
    known = [v for v in values if v is not None]
    middle = _median(known)
    return (max(known) - min(known)) / middle if len(known) > 1 and middle else None


def _error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or the measured one is zero."""
    return (predicted - measured) / measured if measured and predicted is not None else None


def compare(runs: Sequence[dict], predicted: dict) -> dict:
    """Per level and metric the measured value (the median over the runs that have one), the runs' spread, the
    predicted value and the relative error (None when either is missing or the measured one is zero); per metric
    the median absolute error and the median spread over the levels that have one."""
    predicted_levels = {_load(level): level for level in predicted["levels"]}
    run_levels = [{_load(level): level for level in run["levels"]} for run in runs]
    levels = []
    errors: dict[str, list[float]] = {name: [] for name in FIGURES}
    spreads: dict[str, list[float]] = {name: [] for name in FIGURES}
    for load in run_levels[0]:
        if load not in predicted_levels:
            raise ValueError(f"the prediction has no level of {describe_level(run_levels[0][load])}")
        metrics = {}
        for name in FIGURES:
            values = [figure(by_level[load], name) for by_level in run_levels]
            real, spread = _median(values), _spread(values)
            model = figure(predicted_levels[load], name)
            error = _error(model, real)
            if error is not None:
                errors[name].append(abs(error))
            if spread is not None:
                spreads[name].append(spread)
            metrics[name] = {"measured": real, "spread": spread, "predicted": model, "error": error}
        levels.append({"concurrency": load[0], "rate": load[1], "metrics": metrics})
    return {"levels": levels,
            "median_abs_error": {name: statistics.median(e) if e else None for name, e in errors.items()},
            "median_spread": {name: statistics.median(s) if s else None for name, s in spreads.items()}}


def compare_replays(runs: Sequence[dict], replays: Sequence[dict]) -> dict:
    """Each run against its own replay (the same workload simulated with the run's compute, `cascadia.sim.replay`):
    per level and metric the median of the replayed values, its error against the measured median (as `compare`'s)
    and each run's error against its own replay; per metric the median absolute error over the levels."""
    per_run = [compare([run], replayed) for run, replayed in zip(runs, replays)]
    levels = []
    errors: dict[str, list[float]] = {name: [] for name in FIGURES}
    for i, level in enumerate(compare(runs, replays[0])["levels"]):
        metrics = {}
        for name in FIGURES:
            replayed = _median([one["levels"][i]["metrics"][name]["predicted"] for one in per_run])
            error = _error(replayed, level["metrics"][name]["measured"])
            if error is not None:
                errors[name].append(abs(error))
            metrics[name] = {"replayed": replayed, "error": error,
                             "run_errors": [one["levels"][i]["metrics"][name]["error"] for one in per_run]}
        levels.append({"concurrency": level["concurrency"], "rate": level["rate"], "metrics": metrics})
    return {"levels": levels,
            "median_abs_error": {name: statistics.median(e) if e else None for name, e in errors.items()}}


def compare_interval(runs: Sequence[dict], interval: dict) -> dict:
    """Each run's figures against the predicted intervals (`cascadia.sim.interval`): per level and figure, each run's
    value and whether the interval holds it; the share of all runs' values it holds ("coverage"), overall and per
    figure; and the intervals' median width, (high - low) / median."""
    run_levels = [{_load(level): level for level in run["levels"]} for run in runs]
    held: dict[str, list[bool]] = {name: [] for name in FIGURES}
    levels, widths = [], []
    for level in interval["levels"]:
        figures = {}
        for name, bounds in level["figures"].items():
            values = [figure(by_level[_load(level)], name) for by_level in run_levels]
            inside = [None if v is None or bounds is None else bounds["low"] <= v <= bounds["high"] for v in values]
            held[name] += [i for i in inside if i is not None]
            figures[name] = {**(bounds or {}), "measured": values, "inside": inside}
            if bounds and bounds["median"]:
                widths.append((bounds["high"] - bounds["low"]) / bounds["median"])
        levels.append({"concurrency": level["concurrency"], "rate": level["rate"], "figures": figures})
    every = [i for inside in held.values() for i in inside]
    return {**{key: interval[key] for key in ("percent", "samples", "machine_levels", "seconds")}, "levels": levels,
            "held": sum(every), "values": len(every), "coverage": sum(every) / len(every) if every else None,
            "coverage_by_figure": {name: sum(i) / len(i) if i else None for name, i in held.items()},
            "median_width": statistics.median(widths) if widths else None}


def compare_frame_times(measured: Sequence[FrameTiming], predicted: Sequence[FrameTiming],
                        nodes: Sequence[str]) -> dict:
    """Per node, for its compute, its link onward and its time between frames while it has work
    (`trace.frame_times`): how many frames each backend timed, and their time's median and p95, in seconds."""
    real, model = frame_times(measured, nodes), frame_times(predicted, nodes)

    def figures(times: np.ndarray) -> dict:
        if not len(times):
            return {"frames": 0, "p50": None, "p95": None}
        return {"frames": len(times), "p50": float(np.median(times)), "p95": float(np.percentile(times, 95))}

    return {node: {part: {"measured": figures(real[node][part]), "predicted": figures(model[node][part])}
                   for part in ("compute", "link", "between")} for node in nodes}


def frames_by_phase(frames: Sequence[FrameTiming], requests: Sequence[dict]) -> dict[tuple, list[FrameTiming]]:
    """A timeline's frames by the phase they were sent in, as (concurrency, rate, phase) in the order the phases ran:
    a phase spans its first request's arrival to its last one's finish (a backend's frames and requests share its
    clock). Phases run one after another: a frame sent as one ends and the next begins is the next one's. A phase
    none of whose requests finished (all rejected) has no span, and its frames none."""
    spans: dict[tuple, tuple[float, float]] = {}
    for r in requests:
        key = (r["level"], r["rate"], r["phase"])
        first, last = spans.get(key, (r["t_arrival"], r["t_finish"]))
        spans[key] = (min(first, r["t_arrival"]), max(last, r["t_finish"]))
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    starts = [start for _, (start, _) in ordered]
    grouped: dict[tuple, list[FrameTiming]] = {key: [] for key, _ in ordered}
    for frame in frames:
        i = bisect.bisect_right(starts, frame.sent) - 1
        if i >= 0 and frame.sent <= ordered[i][1][1]:
            grouped[ordered[i][0]].append(frame)
    return grouped


def compare_phase_frame_times(runs: Sequence[tuple[Sequence[FrameTiming], dict]], predicted: Sequence[FrameTiming],
                              predicted_result: dict, nodes: Sequence[str]) -> list[dict]:
    """`compare_frame_times` phase by phase of each run (its frames and result), against the same phase simulated:
    where a run's speed moved from one phase to the next, the phases say when."""
    simulated = frames_by_phase(predicted, predicted_result["requests"])
    return [{"run": i, "concurrency": key[0], "rate": key[1], "phase": key[2],
             "frame_times": compare_frame_times(measured, simulated.get(key, []), nodes)}
            for i, (frames, result) in enumerate(runs, 1)
            for key, measured in frames_by_phase(frames, result["requests"]).items()]


class ValidationFailed(NodeError):
    """A run failed; `result` holds the prediction and the runs so far, the failed one's partial result last."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def validate(spec: Spec, plan: Plan, calibration: Calibration, *, repeats: int = 1,
             checkpoint: Path | None = None, on_message: Callable = lambda node, message: None,
             on_phase: Callable = lambda level, phase, records: None, emulate_links: bool = False,
             timelines: dict | None = None, acceptance: float | None = None, replay: bool = False,
             interval: float | None = None, interval_samples: int = SAMPLES) -> dict:
    """Simulate, then run `repeats` times, the spec's workload on `plan`; the results and their comparison. With
    `emulate_links` the runs go over links shaped to the spec's bandwidths, and so does the simulation. `timelines`:
    a dict that takes each backend's timeline, as (frames, metrics result, clock errors) by name ("simulate", "run";
    "run-1".. with repeats); the comparison then holds each node's per-frame times (`compare_frame_times`), over
    all the runs and phase by phase of each (`compare_phase_frame_times`).
    With speculation, the simulated drafts are accepted at `acceptance`, or (None) as the first run's were, request
    by request and step by step (`cascadia.sim.drafts`). With `replay`, each run is simulated again replaying its
    own compute and drafts (`compare_replays`: "replay" in the result, the simulations in "replayed"); with
    timelines too, theirs ("replay", "replay-1"..) and each node's per-frame times against the runs'
    ("replay_frame_times"). With an `interval` (a percent), each figure's interval over `interval_samples` speeds of
    the calibration's rounds, and whether each run's value lies in it (`compare_interval`: "interval").

    The simulation goes first: a calibration that does not fit the plan, or has no rounds for an interval, fails
    before the pipeline starts (with the measured acceptance, it is simulated again after the runs)."""
    if emulate_links:
        calibration = _with_emulated_links(calibration, spec, plan)
    if interval is not None:
        stratified_levels(calibration, interval_samples)
    traced = timelines is not None
    predicted_frames: list[FrameTiming] | None = [] if traced else None
    drafts = _drafts(spec, acceptance)
    predicted = simulate(spec, calibration, plan, timings=predicted_frames, **drafts)
    runs, run_timelines, first_outputs, replays, replayed_frames = [], [], None, [], []
    nodes = [stage.node for stage in plan.stages]
    for i in range(repeats):
        try:
            done = run(spec, plan, spec.workload, checkpoint=checkpoint, on_message=on_message,
                       on_phase=on_phase, emulate_links=emulate_links, trace=traced or replay)
        except RunFailed as e:
            raise ValidationFailed(str(e), {"schema": SCHEMA, "failed": str(e), "measured": [*runs, e.result],
                                            "predicted": predicted}) from None
        runs.append(done.result)
        first_outputs = first_outputs or done.outputs
        if traced:
            run_timelines.append((done.frames, done.result))
            timelines[f"run-{i + 1}" if repeats > 1 else "run"] = (done.frames, done.result, done.clock_error_s)
        if replay:
            timings: list[FrameTiming] | None = [] if traced else None
            replays.append(simulate(spec, calibration, plan, timings=timings,
                                    replay=ReplayTimes(nodes, done.frames, f"run {i + 1}'s trace"),
                                    **_drafts(spec, acceptance, done.outputs, f"run {i + 1}'s outputs")))
            if traced:
                replayed_frames += timings
                timelines[f"replay-{i + 1}" if repeats > 1 else "replay"] = (timings, replays[-1], None)
    if spec.runtime.max_draft and acceptance is None:
        predicted_frames = [] if traced else None
        drafts = _drafts(spec, acceptance, first_outputs, "the first run's outputs")
        predicted = simulate(spec, calibration, plan, timings=predicted_frames, **drafts)
    result = {"schema": SCHEMA, **compare(runs, predicted), "measured": runs, "predicted": predicted}
    if interval is not None:
        result["interval"] = compare_interval(runs, simulate_interval(spec, calibration, plan, interval,
                                                                      interval_samples, **drafts))
    if replay:
        result |= {"replay": compare_replays(runs, replays), "replayed": replays}
    if traced:
        timelines["simulate"] = (predicted_frames, predicted, None)
        run_frames = [f for frames, _ in run_timelines for f in frames]
        result["frame_times"] = compare_frame_times(run_frames, predicted_frames, nodes)
        result["phase_frame_times"] = compare_phase_frame_times(run_timelines, predicted_frames, predicted, nodes)
        if replay:  # the same compute by construction: the links say where the model parts from the runs
            result["replay_frame_times"] = compare_frame_times(run_frames, replayed_frames, nodes)
    return result


def _drafts(spec: Spec, acceptance: float | None, outputs: list | None = None, where: str = "") -> dict:
    """How a simulation accepts drafts: at `acceptance` (the default one for None), or, speculating with None given,
    as a run's `outputs` did, request by request and step by step."""
    if spec.runtime.max_draft and acceptance is None and outputs is not None:
        return {"acceptance_trace": acceptance_trace(outputs, where)}
    return {"acceptance": DEFAULT_ACCEPTANCE if acceptance is None else acceptance}


def _with_emulated_links(calibration: Calibration, spec: Spec, plan: Plan) -> Calibration:
    """The calibration with each stage's link to the next at the spec's bandwidth, as emulated links are shaped;
    their latency stays the measured one (emulation adds none), and so does the unshaped return to the first."""
    shaped = {(a.node, b.node) for a, b in zip(plan.stages, plan.stages[1:])}
    links = {pair: attrs.evolve(link, bandwidth=spec.cluster.link(*pair).bandwidth) if pair in shaped else link
             for pair, link in calibration.links.items()}
    return attrs.evolve(calibration, links=links)


def _shown(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.2f}"


def _percent(value: float | None, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.1%}"


def format_frame_times(frame_times: dict, simulated: str = "predicted") -> str:
    """`compare_frame_times` as a table: per node, its compute, its link onward and its time between frames while
    it has work, ms per frame, measured and `simulated` ("predicted", or "replayed")."""
    onward = [*list(frame_times)[1:], "coordinator"]
    rows = [("node", "per frame", "frames", "measured p50", "p95", f"{simulated} p50", "p95", "error p50")]
    for i, (node, parts) in enumerate(frame_times.items()):
        for part, both in parts.items():
            real, model = both["measured"], both["predicted"]
            error = _error(model["p50"], real["p50"])
            what = {"compute": "compute", "link": f"link to {onward[i]}", "between": "between frames, busy"}[part]
            rows.append((node if part == "compute" else "", what, f"{real['frames']}/{model['frames']}",
                         _shown(real["p50"], 1e3), _shown(real["p95"], 1e3), _shown(model["p50"], 1e3),
                         _shown(model["p95"], 1e3), _percent(error, "+")))
    return f"per frame (ms; frames measured/{simulated})\n" + format_rows(rows, left={0, 1})


def format_phase_frame_times(phases: list[dict]) -> str:
    """`compare_phase_frame_times` as a table: per run and phase, each node's compute per frame, p50 in ms."""
    nodes = list(phases[0]["frame_times"]) if phases else []
    rows = [("run", load_heading(phases), "phase", "frames", *(f"{node} {what}" for node in nodes
                                                  for what in ("measured", "predicted", "error")))]
    for phase in phases:
        figures = []
        for node in nodes:
            real, model = (phase["frame_times"][node]["compute"][side] for side in ("measured", "predicted"))
            error = _error(model["p50"], real["p50"])
            figures += [_shown(real["p50"], 1e3), _shown(model["p50"], 1e3), _percent(error, "+")]
        counts = phase["frame_times"][nodes[0]]["compute"]
        rows.append((str(phase["run"]), level_label(phase), phase["phase"],
                     f"{counts['measured']['frames']}/{counts['predicted']['frames']}", *figures))
    return "compute per frame by phase (ms, p50; frames measured/predicted)\n" + format_rows(rows, left={2})


def format_comparison(comparison: dict) -> str:
    """Per level and metric: measured, the runs' spread, predicted, error (and, with replays, the replayed value and
    its error); then each metric's median spread (with several runs) and median absolute error."""
    replay, interval = comparison.get("replay"), comparison.get("interval")
    rows = [(load_heading(comparison["levels"]), "metric", "measured", "spread", "predicted", "error",
             *(("replayed", "replay error") if replay else ()),
             *((f"{interval['percent']:g}% interval", "runs in it") if interval else ()))]
    for j, level in enumerate(comparison["levels"]):
        for i, (name, (_, unit, scale)) in enumerate(FIGURES.items()):
            m = level["metrics"][name]
            replayed, bounds = (), ()
            if replay:
                r = replay["levels"][j]["metrics"][name]
                replayed = (_shown(r["replayed"], scale), _percent(r["error"], "+"))
            if interval:
                f = interval["levels"][j]["figures"][name]
                held = [inside for inside in f["inside"] if inside is not None]
                bounds = (f"{_shown(f['low'], scale)}-{_shown(f['high'], scale)}" if "low" in f else "-",
                          f"{sum(held)}/{len(held)}")
            rows.append((level_label(level) if i == 0 else "", f"{name} ({unit})" if unit == "ms" else name,
                         _shown(m["measured"], scale), _percent(m["spread"]), _shown(m["predicted"], scale),
                         _percent(m["error"], "+"), *replayed, *bounds))
    lines = [format_rows(rows, left={1})]
    if any(s is not None for s in comparison["median_spread"].values()):
        lines.append("median spread of the runs: " + ", ".join(f"{name} {_percent(s)}"
                                                               for name, s in comparison["median_spread"].items()))
    lines.append("median |error|: " + ", ".join(f"{name} {_percent(e)}"
                                                for name, e in comparison["median_abs_error"].items()))
    if replay:
        lines.append("median |error| replayed: " + ", ".join(f"{name} {_percent(e)}"
                                                             for name, e in replay["median_abs_error"].items()))
        counts = [r["replay"] for r in comparison["replayed"]]
        lines.append("replayed from each run's trace: " + ", ".join(
            f"run {i}: {c['replayed']} of {c['replayed'] + c['tabled']} frames" for i, c in enumerate(counts, 1)))
    if interval:
        speeds = interval["machine_levels"]
        lines.append(f"{interval['percent']:g}% intervals (over {interval['samples']} speeds, {speeds[0]:.2f}-"
                     f"{speeds[-1]:.2f}x the calibration's time over {interval['seconds']:.0f} s; median width "
                     f"{_percent(interval['median_width'])})"
                     f" held {interval['held']} of {interval['values']} measured values "
                     f"({_percent(interval['coverage'])}): " + ", ".join(
                         f"{name} {_percent(c)}" for name, c in interval["coverage_by_figure"].items()))
    if "frame_times" in comparison:
        lines.append("\n" + format_frame_times(comparison["frame_times"]))
    if comparison.get("phase_frame_times"):
        lines.append("\n" + format_phase_frame_times(comparison["phase_frame_times"]))
    if "replay_frame_times" in comparison:
        lines.append("\n" + format_frame_times(comparison["replay_frame_times"], "replayed"))
    return "\n".join(lines)

