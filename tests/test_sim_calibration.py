import copy
import itertools
import json

import attrs
import pytest
from sim_specs import calibration, tiny_spec

from cascadia import host_cpus
from cascadia.sim.calibration import (Calibration, CalibrationError, CoordinatorCalibration, Extrapolations, Spread,
                                      Table, interpolate, relative_levels, uniform_distinct_experts)
from cascadia.spec.types import WeightFormat, WeightFormats


def test_interpolate_inside_on_the_edges_and_outside():
    grid, values = (1, 3, 7), (10.0, 30.0, 50.0)
    assert interpolate(grid, values, 2) == (20.0, False)
    assert interpolate(grid, values, 5) == (40.0, False)
    assert interpolate(grid, values, 7) == (50.0, False)
    assert interpolate(grid, values, 0) == (0.0, True)  # extrapolated from the first segment
    assert interpolate(grid, values, 9) == (60.0, True)  # ... and from the last
    assert interpolate((4,), (2.5,), 100) == (2.5, False)  # one point: independent of that axis


def test_bilinear_lookup_is_exact_for_bilinear_times():
    def f(r, c):
        return 1e-3 + 2e-4 * r + 3e-6 * c + 5e-7 * r * c

    rows, context = (2, 8, 32), (1, 16, 512)
    table = Table(rows, context, tuple(tuple(f(r, c) for c in context) for r in rows))
    for r, c in itertools.product((2, 5, 20, 32), (1, 9, 300)):
        value, outside = table.lookup(r, c)
        assert value == pytest.approx(f(r, c), rel=1e-12) and not outside
    assert table.lookup(64, 9)[1] and table.lookup(8, 1024)[1]
    assert table.lookup(64, 9)[0] == pytest.approx(f(64, 9), rel=1e-12)  # linear extrapolation of a linear law


def test_rows_only_table():
    table = Table((2, 8), (), ((1.0,), (4.0,)))
    assert table.lookup(4) == (2.0, False)
    assert table.lookup(16) == (8.0, True)


def test_uniform_distinct_experts_is_exact():
    # 2 rows each picking 2 of 4 experts: average size of the union over all choices
    choices = list(itertools.combinations(range(4), 2))
    exact = sum(len(set(a) | set(b)) for a in choices for b in choices) / len(choices) ** 2
    assert uniform_distinct_experts(2, 2, 4) == pytest.approx(exact)
    assert uniform_distinct_experts(1, 6, 256) == pytest.approx(6)
    assert uniform_distinct_experts(1, 2, 6) == 2  # not a rounding below: the grid of distinct experts starts there
    assert uniform_distinct_experts(1000, 6, 256) == pytest.approx(256)


def test_routing_statistics_replace_uniform_routing():
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1.0)
    assert cal.distinct_experts(2, 2, 8) == (uniform_distinct_experts(2, 2, 8), False)
    routed = attrs.evolve(cal, routing=((1, 4), (2.0, 3.0)))
    assert routed.distinct_experts(2, 2, 8) == (pytest.approx(2 + 1 / 3), False)
    assert routed.distinct_experts(8, 2, 8)[1]


def test_extrapolations_are_noted_once_per_node_and_kind():
    log = Extrapolations()
    log.note("node n0", "moe", "rows 64")
    log.note("node n0", "moe", "rows 128")
    log.note("nodes n1, n2", "moe", "rows 64")
    assert log.notes == ["node n0: moe time extrapolated beyond the calibration grid (rows 64)",
                         "nodes n1, n2: moe time extrapolated beyond the calibration grid (rows 64)"]


def test_save_and_load_round_trip(tmp_path):
    spec = tiny_spec()
    cal = attrs.evolve(calibration(spec, lambda kind, r, x: 1e-3 * r + 1e-6 * x, frame_s=1e-4, row_s=1e-6,
                                   stream_s=1e-5),
                       routing=((1, 8), (2.0, 7.5)), hosts={"box": (1.0, 1.5, 1.25)},
                       spread=Spread({"n0": (0.9, 1.0, 1.2), "n1": (1.0, 1.1)}, (0.95, 1.0, 1.3), (0.7,), 42.5),
                       coordinator=CoordinatorCalibration(2e-4, 3e-6))
    cal = attrs.evolve(cal, nodes={**cal.nodes, "n1": attrs.evolve(cal.nodes["n1"], restart_s=1.5)})
    path = tmp_path / "cal.json"
    cal.save(path)
    loaded = Calibration.load(path)
    assert loaded == attrs.evolve(cal, source=str(path))
    assert json.loads(path.read_text())["grid_bounds"]["sliding"] == {"rows": [1, 64], "context": [1, 64]}
    assert loaded.spread.levels() == (0.7, 0.9, 0.95, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3)


def test_relative_levels_are_each_round_over_the_median_round():
    assert relative_levels([2.0, 4.0, 3.0]) == (2 / 3, 4 / 3, 1.0)


def test_check_model():
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1.0)
    assert cal.check_model(spec) == []
    int8 = attrs.evolve(spec, model=attrs.evolve(spec.model, formats=WeightFormats(attention=WeightFormat("int8"))))
    [note] = cal.check_model(int8)
    assert "measured with weight formats" in note
    bigger = attrs.evolve(spec, model=attrs.evolve(spec.model, config=attrs.evolve(spec.model.config, hidden_size=128)))
    with pytest.raises(CalibrationError, match=r"meta.model: made for another model: hidden_size 64 \(the spec's model "
                                               r"has 128\)"):
        cal.check_model(bigger)
    stray = attrs.evolve(cal, links={("n0", "n1"): spec.cluster.default_link, ("n1", "n9"): spec.cluster.default_link})
    assert stray.check_model(spec) == ["calibration: links name nodes the spec's cluster does not have, so they are "
                                       "not used: links[1] (n1->n9)"]


def test_a_calibration_records_its_cpu_and_warns_on_another(tmp_path):
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1.0)
    assert cal.meta.cpu == host_cpus.identity() and cal.meta.cpu["model"]
    cal.save(tmp_path / "cal.json")
    assert Calibration.load(tmp_path / "cal.json").check_model(spec) == []  # recorded, read back, the same
    other = {"model": "Intel Xeon Platinum 8480+ (family 6, model 143)", "isa": ["AVX2", "AVX-512", "AMX"]}
    [note] = attrs.evolve(cal, meta=attrs.evolve(cal.meta, cpu=other)).check_model(spec)
    assert note == (f"calibration: measured on Intel Xeon Platinum 8480+ (family 6, model 143) with AVX2, AVX-512, "
                    f"AMX; this machine has {host_cpus.describe(host_cpus.identity())}: its timings may not hold here")


def test_an_older_calibration_without_a_cpu_still_loads(tmp_path):
    raw = calibration(tiny_spec(), lambda kind, r, x: 1.0).to_dict()
    del raw["meta"]["cpu"]
    loaded = Calibration.from_dict(raw)
    assert loaded.meta.cpu is None and loaded.coordinator is None  # the nodes' handling holds the coordinator's work


DELETE = object()


def _edited(raw: dict, path: str, value) -> dict:
    """A copy of `raw` with the value at a dotted path ("links.0.to") replaced, or deleted."""
    raw = copy.deepcopy(raw)
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    d = raw
    for key in parents:
        d = d[key]
    if value is DELETE:
        del d[last]
    else:
        d[last] = value
    return raw


TABLES = "nodes.n0.tables"


@pytest.mark.parametrize("path, value, message", [
    ("format", "other/1", "format: expected 'cascadia.calibration/2'"),
    ("meta.device", DELETE, "meta: missing device"),
    ("meta.kind", "guess", "meta.kind: must be 'measured' or 'analytic'"),
    ("nodes", {}, "nodes: no nodes"),
    ("nodes.n0", [1], "nodes.n0: expected an object, got list"),
    (f"{TABLES}.attention", {}, f"{TABLES}.attention: unknown layer kind"),
    (f"{TABLES}.sliding.rows", [8, 2], f"{TABLES}.sliding.rows: must be strictly increasing"),
    (f"{TABLES}.sliding.rows", [8], f"{TABLES}.sliding.rows: needs at least two row counts"),
    (f"{TABLES}.sliding.context", DELETE, f"{TABLES}.sliding: missing 'context'"),
    (f"{TABLES}.moe.time_s", [[1e-3, 1e-3]], f"{TABLES}.moe.time_s: has 1 entries for 2 rows"),
    (f"{TABLES}.moe.time_s.1", [1e-3], rf"{TABLES}.moe.time_s\[1\]: has 1 values for 2 experts points"),
    (f"{TABLES}.global.time_s.0.1", -1, rf"{TABLES}.global.time_s\[0\]\[1\]: a time cannot be negative"),
    (f"{TABLES}.head.time_s.0", "fast", rf"{TABLES}.head.time_s\[0\]: expected a finite number"),
    (f"{TABLES}.dense.context", [1], f"{TABLES}.dense: a dense table has only 'rows' and 'time_s'"),
    ("nodes.n1.row_s", -1e-6, "nodes.n1.row_s: a time cannot be negative"),
    ("nodes.n1.stream_s", "1ms", "nodes.n1.stream_s: expected a finite number"),
    ("nodes.n1.restart_s", -2, "nodes.n1.restart_s: a time cannot be negative"),
    ("links.0.bandwidth_Bps", 0, r"links\[0\].bandwidth_Bps: must be positive"),
    ("links.1.to", DELETE, r"links\[1\]: missing 'to'"),
    ("links", 5, "links: expected a list"),
    ("links.0.from", ["n0"], r"links\[0\].from: expected a node name, got \['n0'\]"),
    ("links.1", {"from": "n0", "to": "n1", "latency_s": 0, "bandwidth_Bps": 1}, r"links\[1\]: link n0->n1 given twice"),
    ("routing", {"rows": [1, 2], "distinct_experts": [1.0]}, "routing.distinct_experts: has 1 values for 2 rows"),
    ("hosts", {"box": {"speedup": [1, 0]}}, r"hosts.box.speedup\[1\]: must be positive"),
    ("hosts", {"box": {"speedup": []}}, "hosts.box.speedup: expected a non-empty list"),
    ("hosts", {"box": {"cores": 2}}, "hosts.box: missing 'speedup'"),
    ("spread", {"pipeline": [1.0]}, "spread: missing 'tables'"),
    ("spread", {"tables": {"n0": []}}, "spread.tables.n0: expected a non-empty list"),
    ("spread", {"tables": {"n0": [1.0]}, "pipeline": [1.0, 0]}, r"spread.pipeline\[1\]: must be positive"),
    ("spread", {"tables": {"n0": [1.0]}, "watch": "often"}, "spread.watch: expected a list"),
    ("spread", {"tables": {"n0": [1.0]}, "seconds": -1}, "spread.seconds: a time cannot be negative"),
    ("coordinator", {"frame_s": -1}, "coordinator.frame_s: a time cannot be negative"),
    ("coordinator", [1e-4], "coordinator: expected an object, got list"),
])
def test_bad_calibration_files_name_file_and_key(tmp_path, path, value, message):
    good = calibration(tiny_spec(), lambda kind, r, x: 1e-3).to_dict()
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(_edited(good, path, value)))
    with pytest.raises(CalibrationError, match=rf"bad.json: {message}"):
        Calibration.load(file)


def test_unreadable_calibration_files(tmp_path):
    with pytest.raises(CalibrationError, match="missing.json: no such file"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "device.json").symlink_to("/dev/urandom")
    with pytest.raises(CalibrationError, match="device.json: is not a regular file"):
        Calibration.load(tmp_path / "device.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(CalibrationError, match="broken.json: not valid JSON"):
        Calibration.load(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(CalibrationError, match="list.json: expected an object"):
        Calibration.load(tmp_path / "list.json")
