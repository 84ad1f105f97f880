"""Predictions as intervals: the figures a run may show at the speeds its machine had while it was calibrated.

A shared or throttled PC does not hold one speed: the same frame can take twice as long a few seconds later. A
measured calibration keeps each of its rounds' levels (`Calibration.spread`: a round's seconds over the median
round's); a later run meets the machine at one of those speeds as likely as another. So the workload is simulated
again at `samples` levels, the spread's quantiles at the middles of `samples` equal strata (a stratified draw, the
same every time), each scaling every CPU time of the model: each node's layer tables and its message handling (per
frame, row and stream). The wires, the policy and the workload stay as they are. Each figure's interval is the
middle `percent` of its simulated values, read at the same strata (linear between them), with their median.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from cascadia.errors import CalibrationError
from cascadia.graph.plan import Plan
from cascadia.metrics import FIGURES, figure, level_label, load_heading
from cascadia.sim.calibration import Calibration
from cascadia.sim.simulate import simulate
from cascadia.spec.types import Spec
from cascadia.table import format_rows

SAMPLES = 11  # levels simulated for an interval


def scaled(calibration: Calibration, level: float) -> Calibration:
    """The calibration on a machine `level` times as slow: every node's tables and handling, and the
    coordinator's work, times `level`."""
    nodes = {name: attrs.evolve(node, frame_s=node.frame_s * level, row_s=node.row_s * level,
                                stream_s=node.stream_s * level,
                                tables={kind: table.scaled(level) for kind, table in node.tables.items()})
             for name, node in calibration.nodes.items()}
    coordinator = calibration.coordinator and attrs.evolve(calibration.coordinator,
                                                           frame_s=calibration.coordinator.frame_s * level,
                                                           row_s=calibration.coordinator.row_s * level)
    return attrs.evolve(calibration, nodes=nodes, coordinator=coordinator)


def strata(count: int) -> np.ndarray:
    """The middles of `count` equal strata of [0, 1]."""
    return (np.arange(count) + 0.5) / count


def stratified_levels(calibration: Calibration, samples: int) -> list[float]:
    """The spread's levels at the middles of `samples` strata (linear between its sorted rounds)."""
    if calibration.spread is None or not calibration.spread.levels():
        where = calibration.source or "the calibration"
        why = "an analytic estimate measured nothing" if calibration.is_analytic else \
            "it was measured before calibrations kept their rounds: calibrate again"
        raise CalibrationError(f"{where}: has no spread of its rounds to draw an interval from ({why})")
    levels = calibration.spread.levels()
    return np.interp(strata(samples), strata(len(levels)), levels).tolist()


def middle(values: Sequence[float], percent: float) -> tuple[float, float, float]:
    """(low, median, high) of stratified values: the middle `percent` of them, read at their strata."""
    at = strata(len(values))
    ordered = sorted(values)
    tail = (1 - percent / 100) / 2
    low, median, high = np.interp([tail, 0.5, 1 - tail], at, ordered)
    return float(low), float(median), float(high)


def simulate_interval(spec: Spec, calibration: Calibration, plan: Plan, percent: float, samples: int = SAMPLES,
                      **simulate_args) -> dict:
    """Each level's FIGURES as (low, median, high) over `samples` levels of the calibration's spread (see the
    module's text); `simulate_args` go to each simulation."""
    levels = stratified_levels(calibration, samples)
    results = [simulate(spec, scaled(calibration, level), plan, **simulate_args) for level in levels]
    out = []
    for i, level in enumerate(results[0]["levels"]):
        figures = {}
        for name in FIGURES:
            values = [figure(result["levels"][i], name) for result in results]
            known = [v for v in values if v is not None]
            figures[name] = dict(zip(("low", "median", "high"), middle(known, percent))) if known else None
        out.append({"concurrency": level["concurrency"], "rate": level.get("rate"), "figures": figures})
    return {"percent": percent, "samples": samples, "machine_levels": levels, "seconds": calibration.spread.seconds,
            "levels": out}


def format_interval(interval: dict) -> str:
    """Each level's figures as "median (low-high)" in their units."""
    levels = interval["levels"]
    rows = [(load_heading(levels), *(f"{name} ({unit})" if unit == "ms" else name
                                     for name, (_, unit, _) in FIGURES.items()))]
    for level in levels:
        cells = []
        for name, (_, _, scale) in FIGURES.items():
            f = level["figures"][name]
            cells.append("-" if f is None else
                         f"{f['median'] * scale:.2f} ({f['low'] * scale:.2f}-{f['high'] * scale:.2f})")
        rows.append((level_label(level), *cells))
    speeds = interval["machine_levels"]
    return (f"{interval['percent']:g}% intervals: median (low-high) over {interval['samples']} speeds, "
            f"{speeds[0]:.2f}-{speeds[-1]:.2f}x the calibration's time (its rounds over {interval['seconds']:.0f} s)"
            "\n" + format_rows(rows))
