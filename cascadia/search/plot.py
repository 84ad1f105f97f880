"""The search's picture: price against capacity for every fleet simulated, the frontier joined and named."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from cascadia.search.search import Evaluated, frontier  # noqa: E402
from cascadia.search.slo import LatencySlo  # noqa: E402


def pareto(evaluated: Sequence[Evaluated], slo: LatencySlo, currency: str, path: str) -> str:
    """A PNG at `path` (returned): each simulated fleet that carries anything a point, by machine types; the
    frontier a line through its fleets, each labelled."""
    fig, axes = plt.subplots(figsize=(9, 5.5))
    carrying = [e for e in evaluated if e.rate > 0]
    for name in dict.fromkeys(e.candidate.types for e in carrying):
        mine = [e for e in carrying if e.candidate.types == name]
        axes.scatter([e.candidate.price for e in mine], [e.rate for e in mine], s=18, alpha=0.6, label=name)
    front = frontier(evaluated)
    axes.plot([e.candidate.price for e in front], [e.rate for e in front], color="black", lw=1.2, marker="o",
              mfc="none", ms=9, label="frontier")
    for e in front:
        axes.annotate(e.candidate.describe(), (e.candidate.price, e.rate), textcoords="offset points",
                      xytext=(6, -10), fontsize=7)
    axes.set(xlabel=f"price, {currency}", ylabel="requests/s within the objective",
             title=f"Fleets against {slo}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return path
