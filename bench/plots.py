"""The documentation's plots, drawn from bench/results/*.json as its tables are (`bench/render.py` calls this).

`PLOTS` names, for a results file, which of its tables to plot: one column along x, some along y (a spread as its
median with a bar from lowest to highest). Each plot is an SVG in docs/plots/ that carries a digest of what it was
drawn from (the plot's definition and the cells it shows), so that `render.py --check` finds a plot out of date
without matplotlib, whatever version drew it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from attrs import frozen

from record import ROOT

PLOT_DIR = ROOT / "docs" / "plots"
DIGEST = re.compile(r"cascadia-plot-digest:([0-9a-f]{16})")


@frozen
class Plot:
    table: int  # which table of the results file
    x: str  # the column along x
    ys: tuple[str, ...]  # the columns along y, a line each
    y_label: str
    log_x: bool = False
    log_y: bool = False


PLOTS: dict[str, tuple[Plot, ...]] = {
    "engine": (Plot(0, "streams", ("engine tok/s", "reference tok/s", "roofline tok/s"), "decode tokens/s",
                    log_x=True, log_y=True),),
    "pipeline": (Plot(0, "streams", ("1 node tok/s", "3 nodes tok/s", "3-node ideal tok/s"), "decode tokens/s",
                      log_x=True),),
    "clients": (Plot(0, "streams", ("output tok/s", "run --url: output tok/s"), "output tokens/s", log_x=True),),
    "long_context": (Plot(0, "context", ("decode ms/token", "of which attention ms"), "ms a token", log_x=True),),
    "long_prompt_sim-inkling-975b-11pc": (
        Plot(0, "prompt tokens", ("TTFT s", "paper TTFT s"), "seconds to the first token", log_x=True, log_y=True),
        Plot(0, "prompt tokens", ("decode ms/token", "paper decode ms/token"), "ms a token", log_x=True)),
    "speculate-tiny-local": (Plot(1, "acceptance", ("1 streams", "4 streams", "11 streams"),
                                  "simulated decode speed-up"),),
}


def path(name: str, index: int) -> Path:
    return PLOT_DIR / f"{name}-{index}.svg"


def _column(table: dict, name: str) -> int:
    found = [i for i, column in enumerate(table["columns"]) if column == name]
    if len(found) != 1:
        raise ValueError(f"{table['title']}: {len(found)} columns named {name!r}")
    return found[0]


def series(result: dict, plot: Plot) -> dict[str, list[tuple[float, dict]]]:
    """Each y column's points (x, spread), leaving out cells that are not measured figures."""
    table = result["tables"][plot.table]
    x_at = _column(table, plot.x)
    lines = {}
    for y in plot.ys:
        y_at = _column(table, y)
        points = []
        for row in table["rows"]:
            x, value = row[x_at], row[y_at]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = {"median": value, "min": value, "max": value}
            if isinstance(x, (int, float)) and isinstance(value, dict):
                points.append((x, value))
        lines[y] = points
    return lines


def digest(result: dict, plot: Plot) -> str:
    """What a plot is drawn from: its definition, its table's title and its points."""
    drawn = {"plot": [plot.table, plot.x, list(plot.ys), plot.y_label, plot.log_x, plot.log_y],
             "title": result["tables"][plot.table]["title"], "series": series(result, plot)}
    return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()[:16]


def current(name: str, index: int, result: dict, plot: Plot) -> bool:
    """Whether the plot's file was drawn from these results."""
    file = path(name, index)
    found = DIGEST.search(file.read_text()) if file.is_file() else None
    return found is not None and found[1] == digest(result, plot)


def draw(name: str, index: int, result: dict, plot: Plot) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plt.rcParams["svg.hashsalt"] = name  # element ids the same at every drawing
    plt.rcParams["svg.fonttype"] = "none"  # text as text: smaller, and found by the site's search
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    for label, points in series(result, plot).items():
        xs = [x for x, _ in points]
        medians = [v["median"] for _, v in points]
        below = [v["median"] - v["min"] for _, v in points]
        above = [v["max"] - v["median"] for _, v in points]
        axes.errorbar(xs, medians, yerr=[below, above], marker="o", markersize=4, capsize=3, label=label)
    axes.set_xlabel(plot.x)
    axes.set_ylabel(plot.y_label)
    if plot.log_x:
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))  # 1,024, not 2^10
    if plot.log_y:
        axes.set_yscale("log")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    PLOT_DIR.mkdir(exist_ok=True)
    file = path(name, index)
    figure.savefig(file, format="svg", metadata={"Date": None, "Description":
                                                  f"cascadia-plot-digest:{digest(result, plot)}"})
    plt.close(figure)
    return file


def markdown(name: str, index: int, result: dict, plot: Plot) -> str:
    title = result["tables"][plot.table]["title"].replace("[", "(").replace("]", ")")
    return f"![{plot.y_label} by {plot.x}: {title}](plots/{path(name, index).name})"
