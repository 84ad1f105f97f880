"""The benches' results as data: every file in bench/results/ says how and where it was measured, and the
documentation shows exactly what those files hold (bench/render.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "bench"))

import record  # noqa: E402
import plots  # noqa: E402
import render  # noqa: E402

RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_each_result_names_its_command_machine_time_and_tables(path):
    result = json.loads(path.read_text())
    assert result["bench"] == path.stem
    script = result["command"].split()[1]
    assert result["command"].startswith("python bench/") and (ROOT / script).is_file()
    assert "/tmp" not in result["command"]
    assert set(result["machine"]) >= {"cpu", "cores", "memory_gib", "openvino", "cascadia", "python"}
    assert " with " in result["machine"]["cpu"]  # its instruction sets
    assert result["started"] <= result["finished"]
    assert result["tables"]
    for table in result["tables"]:
        assert table["rows"], table["title"]
        assert all(len(row) == len(table["columns"]) for row in table["rows"]), table["title"]


def test_every_bench_still_imports():
    """A bench is run by hand, months apart: a change to the code it imports must not leave it broken."""
    benches = sorted(path.stem for path in (ROOT / "bench").glob("*.py"))
    done = subprocess.run([sys.executable, "-c", "import importlib, sys\nfor name in sys.argv[1:]:\n"
                           "    importlib.import_module(name)", *benches], cwd=ROOT / "bench", capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_benches_models_still_read_their_configs():
    import engine
    import long_context
    import random_model

    assert random_model.mid_config(quick=False).hidden_size == 1024
    assert random_model.mid_config(quick=True).hidden_size == random_model.QUICK_SIZES["hidden_size"]
    assert random_model.model_config(engine.MODEL).n_routed_experts == 64
    assert random_model.model_config(engine.QUICK_MODEL).hidden_size == random_model.QUICK_SIZES["hidden_size"]
    assert long_context.long_config(quick=False).num_hidden_layers == 8


def test_the_documentation_shows_every_result_as_it_stands():
    done = subprocess.run([sys.executable, "bench/render.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_cells_read_as_figures_with_their_spread():
    assert [record.cell(v) for v in (1234.6, 49.43, 1.8079, 0.0062, 0, 16, None, "fused")] == [
        "1,235", "49.4", "1.81", "0.0062", "0", "16", "-", "fused"]
    assert record.cell(record.spread([110.3, 105.6, 115.9])) == "110.3 (105.6-115.9)"
    assert record.cell(record.spread([11.2, -5.86, 11.7])) == "11.2 (-5.86 to 11.7)"


def test_a_row_must_fill_its_columns():
    table = record.Table("Decode tokens/s", ["streams", "tok/s"])
    table.add(1, 49.4)
    with pytest.raises(ValueError, match="Decode tokens/s: a row of 3 cells under 2 columns"):
        table.add(8, 150.0, 3)


def test_a_result_renders_as_its_machine_line_and_markdown_tables():
    table = record.Table("Decode tokens/s", ["setup", "1 stream"], note="Greedy, 32-token prompts.")
    table.add("two | nodes", record.spread([1.0, 2.0, 3.0]))
    result = {"command": "python bench/shards.py --rounds 3", "started": "2026-12-05T21:40:00Z",
              "finished": "2026-12-05T21:52:30Z", "tables": [table.as_json()],
              "machine": {"cpu": "AMD EPYC with AVX2", "cores": 2, "memory_gib": 23.4, "openvino": "2026.4.1"}}
    assert render.render(result).splitlines() == [
        "Measured with `python bench/shards.py --rounds 3` on AMD EPYC with AVX2 (2 cores, 23.4 GiB), OpenVINO "
        "2026.4.1, 2026-12-05 21:40-21:52 UTC. A figure with a range is the median (lowest-highest) of 3 runs.",
        "",
        "**Decode tokens/s**",
        "",
        "| setup | 1 stream |",
        "| --- | --- |",
        "| two \\| nodes | 2.00 (1.00-3.00) |",
        "",
        "Greedy, 32-token prompts.",
    ]


def test_a_plot_shows_the_measured_figures_and_is_redrawn_when_they_change(tmp_path, monkeypatch):
    """A plot's points are its columns' figures (a spread's median and range; text left out), and its file says
    what it was drawn from, so `render.py --check` finds it out of date without drawing it."""
    monkeypatch.setattr(plots, "PLOT_DIR", tmp_path)
    table = record.Table("Decode", ["streams", "tok/s", "note"])
    table.add(1, record.spread([1.0, 2.0, 4.0]), "x")
    table.add(8, 9.5, "y")
    table.add(32, "-", "z")
    result = {"tables": [table.as_json()]}
    plot = plots.Plot(0, "streams", ("tok/s",), "tokens/s", log_x=True)
    assert plots.series(result, plot) == {"tok/s": [(1, {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}),
                                                   (8, {"median": 9.5, "min": 9.5, "max": 9.5})]}
    assert not plots.current("decode", 0, result, plot)
    drawn = plots.draw("decode", 0, result, plot)
    assert plots.current("decode", 0, result, plot) and "<svg" in drawn.read_text()
    table.rows[1][1] = 9.6  # measured again
    assert not plots.current("decode", 0, {"tables": [table.as_json()]}, plot)
    with pytest.raises(ValueError, match="0 columns named 'ms'"):
        plots.series(result, plots.Plot(0, "streams", ("ms",), "ms"))
