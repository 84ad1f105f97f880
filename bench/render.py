"""The documentation's measured tables and plots, rendered from bench/results/*.json.

    python bench/render.py [--check]

A page shows a bench's results where it holds the markers

    <!-- results: NAME -->
    <!-- end of results -->

and this script writes between them what bench/results/NAME.json holds: the command, the machine and the time of
the run, then each table with its note, then the plots `bench/plots.py` draws from them (SVGs in docs/plots/).
`--check` changes nothing and exits 1 naming every page or plot out of date, every marker without its results and
every results file no page shows (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import plots
from record import RESULTS, ROOT, cell

DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end of results -->)", re.DOTALL)


def markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render(result: dict, name: str = "") -> str:
    """One results file (bench/results/NAME.json) as Markdown: where and how it was measured, its tables, its
    plots."""
    m = result["machine"]
    day, start = result["started"][:10], result["started"][11:16]
    end = result["finished"][11:16]
    lines = [f"Measured with `{result['command']}` on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), "
             f"OpenVINO {m['openvino']}, {day} {start}-{end} UTC.", ""]
    runs = {c["n"] for t in result["tables"] for row in t["rows"] for c in row if isinstance(c, dict)}
    if runs:
        counted = f" of {runs.pop()} runs" if len(runs) == 1 else ""
        lines[0] += f" A figure with a range is the median (lowest-highest){counted}."
    for table in result["tables"]:
        lines += [f"**{table['title']}**", "", markdown_row(table["columns"]),
                  markdown_row(["---"] * len(table["columns"])),
                  *(markdown_row([cell(c) for c in row]) for row in table["rows"]), ""]
        if table["note"]:
            lines += [table["note"], ""]
    for index, plot in enumerate(plots.PLOTS.get(name, ())):
        lines += [plots.markdown(name, index, result, plot), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page is out of date")
    args = parser.parse_args()
    results = {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}
    problems, shown = [], set()
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()

        def fill(match: re.Match) -> str:
            name = match["name"]
            if name not in results:
                problems.append(f"{page.relative_to(ROOT)}: no bench/results/{name}.json")
                return match[0]
            shown.add(name)
            return match[1] + "\n" + render(results[name], name) + "\n" + match[4]

        rendered = BLOCK.sub(fill, text)
        if rendered != text:
            if args.check:
                problems.append(f"{page.relative_to(ROOT)}: out of date (python bench/render.py)")
            else:
                page.write_text(rendered)
                print(f"rendered {page.relative_to(ROOT)}")
    problems += [f"bench/results/{name}.json: no page shows it" for name in sorted(set(results) - shown)]
    problems += draw_plots(results, args.check)
    if problems:
        sys.exit("\n".join(problems))


def draw_plots(results: dict[str, dict], check: bool) -> list[str]:
    """Draw each plot whose file was not drawn from its results (with `check`, name it); the problems found."""
    problems, drawn = [], set()
    for name, chosen in sorted(plots.PLOTS.items()):
        if name not in results:
            problems.append(f"bench/plots.py: no bench/results/{name}.json to plot")
            continue
        for index, plot in enumerate(chosen):
            drawn.add(plots.path(name, index))
            if plots.current(name, index, results[name], plot):
                continue
            if check:
                problems.append(f"{plots.path(name, index).relative_to(ROOT)}: out of date (python bench/render.py)")
            else:
                print(f"drew {plots.draw(name, index, results[name], plot).relative_to(ROOT)}")
    stray = sorted(set(plots.PLOT_DIR.glob("*.svg")) - drawn) if plots.PLOT_DIR.is_dir() else []
    return problems + [f"{file.relative_to(ROOT)}: no plot of bench/plots.py draws it" for file in stray]


if __name__ == "__main__":
    main()
