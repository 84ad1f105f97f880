import attrs
import pytest
from sim_specs import tiny_spec

from cascadia.graph.costs import head_cost, layer_costs, layer_ops
from cascadia.policy import padded_size
from cascadia.sim.analytic import analytic_calibration, row_grid
from cascadia.sim.calibration import ANALYTIC, CalibrationError

BANDWIDTH = 1e9


def test_rows_cover_every_frame_the_policy_can_make():
    spec = tiny_spec()  # buckets 2, 4, 8; 7 decoding streams + 4 prompt rows of the 8th in one group at most
    assert row_grid(spec) == (2, 4, 8, 16)
    runtime = spec.runtime
    assert padded_size(runtime.max_streams - 1 + runtime.prefill_window, runtime.row_buckets) == 16
    one_stream = attrs.evolve(spec, runtime=attrs.evolve(runtime, max_streams=1, row_buckets=(1, 2, 8, 32, 256),
                                                          prefill_window=256))
    assert row_grid(one_stream) == (1, 2, 8, 32, 256)  # its frames: a decode row, or a prompt window


def test_memory_bound_tables_follow_the_bytes():
    spec = tiny_spec()
    cal = analytic_calibration(spec)
    assert cal.is_analytic and cal.meta.kind == ANALYTIC and cal.meta.date is None
    tables = cal.nodes["n1"].tables
    sliding = layer_costs(spec.model)[0]
    ops = layer_ops(spec.model, 1)  # a MoE layer
    expert = layer_costs(spec.model)[1].expert_bytes
    # attention: one stream's K/V over the attended positions, read once by its rows, on top of its weights
    weights = sum(ops[k].weight_bytes for k in ("input_norm", "attention", "attn_sconv"))
    t, _ = tables["sliding"].lookup(4, 16)
    assert t == pytest.approx((weights + 16 * sliding.kv_bytes_per_position) / BANDWIDTH)
    # MoE: one more distinct expert costs one expert's bytes
    t6, _ = tables["moe"].lookup(8, 6)
    t7, _ = tables["moe"].lookup(8, 7)
    assert t7 - t6 == pytest.approx(expert / BANDWIDTH)
    assert t6 == pytest.approx((sum(op.weight_bytes for k, op in ops.items() if k in (
        "post_norm", "router", "shared_experts", "mlp_sconv")) + 6 * expert) / BANDWIDTH)
    # head: its weights once, plus the logits of every row
    head = head_cost(spec.model)
    assert tables["head"].lookup(2)[0] == pytest.approx((head.weight_bytes + 2 * 512 * 4) / BANDWIDTH)


def test_compute_bound_when_flops_are_scarce():
    spec = tiny_spec()
    slow = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=tuple(
        attrs.evolve(n, compute_flops=1e3) for n in spec.cluster.nodes)))
    head = head_cost(spec.model)
    assert analytic_calibration(slow).nodes["n0"].tables["head"].lookup(16)[0] == pytest.approx(
        16 * head.flops_per_row / 1e3)


def test_links_are_the_spec_ring():
    cal = analytic_calibration(tiny_spec())
    assert sorted(cal.links) == [("n0", "n1"), ("n1", "n2"), ("n2", "n0")]
    assert cal.links["n2", "n0"].latency == 1e-4


def test_needs_memory_bandwidth():
    with pytest.raises(CalibrationError, match="node n0: no memory_bandwidth in the spec"):
        analytic_calibration(tiny_spec(bandwidth=None))
