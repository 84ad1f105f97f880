"""The MoE graphs: the fused one run by the CPU plugin as GatherMatmul, the expert-grouped one as a FullyConnected
per expert, both equal to a numpy mixture of experts, the fused one blind to padding rows; dense MLPs run as
all-active expert slices equal the plain SwiGLU graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from graph_constants import constants

from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock, _pad_rows, compile_options
from cascadia.engine.engine import Engine
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.families.inkling import build_layer
from cascadia.engine.layer_build import up_divisor
from cascadia.engine.quantize import quantize
from cascadia.spec.types import RuntimeSpec, WeightFormat, WeightFormats

FIXTURES = Path(__file__).parent / "fixtures"
E, H, I, S, K = 8, 64, 32, 2, 2  # routed experts, hidden, expert width, shared experts, experts per row  # noqa: E741
BUCKETS = (2, 8, 16)
INT4 = WeightFormat("int4", 32)
F32 = RuntimeSpec(precision="f32")


def weights(rng, *shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    routed = tuple(weights(rng, *s) for s in ((E, I, H), (E, I, H), (E, H, I)))
    shared = tuple(weights(rng, *s) for s in ((S, I, H), (S, I, H), (S, H, I)))
    return routed, shared


PRECISION_FORMATS = dict(params=[("f32", WeightFormat()), ("bf16", WeightFormat()), ("f32", INT4)],
                         ids=["f32", "bf16", "int4-f32"])


def fused_block(experts, precision: str, fmt: WeightFormat) -> CompiledBlock:
    return CompiledBlock(graphs.moe(experts[0], fmt, experts[1], fmt, K), "CPU", compile_options(precision), BUCKETS)


def grouped_block_of(experts, precision: str, fmt: WeightFormat) -> GroupedBlock:
    model = graphs.moe_grouped(experts[0], fmt, experts[1], fmt, K)
    return GroupedBlock(model, "CPU", compile_options(precision), BUCKETS)


@pytest.fixture(scope="module", **PRECISION_FORMATS)
def moe_block(request, experts):
    return fused_block(experts, *request.param), request.param[1]


@pytest.fixture(scope="module", **PRECISION_FORMATS)
def grouped_block(request, experts):
    return grouped_block_of(experts, *request.param), request.param[1]


FORMS = ("fused", "grouped")


@pytest.fixture(scope="module", params=[(form, *p) for form in FORMS for p in PRECISION_FORMATS["params"]],
                ids=[f"{form}-{i}" for form in FORMS for i in PRECISION_FORMATS["ids"]])
def moe_call(request, experts):
    """(x, index, weights, shared weights) -> output of either MoE graph, its block and its weight format."""
    form, precision, fmt = request.param
    if form == "fused":
        block = fused_block(experts, precision, fmt)
        return (lambda *inputs: block(*inputs)[0]), block, fmt
    block = grouped_block_of(experts, precision, fmt)
    return block, block, fmt


def swiglu(x, gate, up, down):
    g = x @ gate.T
    return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T


def reference(experts, fmt, x, index, w, shared_w):
    """Weighted sum of each row's experts in numpy, with the weights the graph holds (dequantised)."""
    routed, shared = ([quantize(m, fmt).dequantize() if fmt.is_integer else m for m in group] for group in experts)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for j in range(K):
            out[t] += w[t, j] * swiglu(x[t], *(m[index[t, j]] for m in routed))
        for j in range(S):
            out[t] += shared_w[t, j] * swiglu(x[t], *(m[j] for m in shared))
    return out


def routing(rng, rows):
    index = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]).astype(np.int32)
    return index, rng.random((rows, K), dtype=np.float32), rng.random((rows, S), dtype=np.float32)


def test_moe_graph_is_fused_into_gather_matmul(moe_block):
    block, _ = moe_block
    types = block.op_types()
    assert "GatherMatmul" in types, sorted(types)
    assert "MatMul" not in types and "FullyConnected" not in types  # no expert computed the dense way


def test_grouped_moe_runs_each_expert_as_a_fully_connected(grouped_block):
    types = grouped_block[0].op_types()
    assert "FullyConnected" in types, sorted(types)
    assert "GatherMatmul" not in types and "MatMul" not in types


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_moe_equals_numpy_experts(moe_call, experts, rows):
    """Fused: includes rows padded up to a bucket. Padding index rows with zeros (one expert named twice)
    corrupted a real row that chose experts 1 and 0: row 0 always does. Grouped: one row leaves most experts
    untouched (empty branches). bf16 (f32 weights): measured 9.3e-3 (fused) and 9.7e-3 (grouped)."""
    call, block, fmt = moe_call
    rng = np.random.default_rng(rows)
    for _ in range(10):
        x = rng.standard_normal((rows, H), dtype=np.float32)
        index, w, shared_w = routing(rng, rows)
        index[0] = [1, 0]
        expected = reference(experts, fmt, x, index, w, shared_w)
        got = call(x, index, w, shared_w)
        tolerance = 2e-2 if block.precision == "bf16" else 1e-5
        assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_padding_rows_do_not_change_real_rows(moe_block):
    """Whatever the padding rows hold, zero routing weight keeps them out of the real rows."""
    block, _ = moe_block
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, H), dtype=np.float32)
    index, w, shared_w = routing(rng, 3)
    alone = block(x, index, w, shared_w)[0]
    junk_x = np.concatenate([x, 100 * rng.standard_normal((5, H), dtype=np.float32)])
    junk_index, _, _ = routing(rng, 5)
    padded = block(junk_x, np.concatenate([index, junk_index]), np.concatenate([w, np.zeros((5, K), np.float32)]),
                   np.concatenate([shared_w, np.zeros((5, S), np.float32)]))[0]
    np.testing.assert_allclose(padded[:3], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_padding_rows_repeat_the_first_real_row_of_integer_inputs():
    """So that a padded MoE call reads no expert weights the real rows do not (see `_pad_rows`)."""
    index = np.array([[3, 1], [0, 2]], np.int32)
    assert _pad_rows(index, 4).tolist() == [[3, 1], [0, 2], [3, 1], [3, 1]]
    assert _pad_rows(np.ones((1, 3), np.float32), 2).tolist() == [[1, 1, 1], [0, 0, 0]]
    assert _pad_rows(np.empty((0, 3), np.int32), 2).tolist() == [[0, 1, 2], [0, 1, 2]]  # warm-up: distinct experts


def test_warm_up_rows_name_distinct_experts(moe_block, monkeypatch):
    """Warm-up rows are padding rows: all-zero indices (one expert named K times in a row) made the fused kernel
    write out of bounds."""
    block, _ = moe_block
    calls = []
    monkeypatch.setattr(CompiledBlock, "__call__", lambda self, *inputs: calls.append(inputs))
    block.warm_up()
    assert [len(x) for x, *_ in calls] == list(BUCKETS)
    assert all(len(set(row)) == K for _, index, *_ in calls for row in index.tolist())


def test_grouped_warm_up_touches_as_many_experts_as_the_rows_can(grouped_block, monkeypatch):
    block, _ = grouped_block
    calls = []
    monkeypatch.setattr(GroupedBlock, "__call__", lambda self, *inputs: calls.append(inputs))
    block.warm_up()
    assert [len(x) for x, *_ in calls] == list(BUCKETS)
    for _, index, *_ in calls:
        assert all(len(set(row)) == K for row in index.tolist())
        assert len(np.unique(index)) == min(E, index.size)


@pytest.fixture(scope="module")
def dense_engines():
    checkpoint = Checkpoint.open(FIXTURES / "base")  # layers 0 and 3 are dense, width 64
    return Engine(checkpoint, F32), Engine(checkpoint, F32, dense_slices=4)


def test_dense_mlp_as_expert_slices_equals_dense(dense_engines):
    plain, sliced = dense_engines
    dense_layers = [i for i in range(plain.config.num_hidden_layers) if plain.config.is_dense(i)]
    rng = np.random.default_rng(3)
    h = rng.standard_normal((5, plain.config.hidden_size), dtype=np.float32)
    for i in dense_layers:
        assert "GatherMatmul" in sliced.stage.layers[i].mlp.op_types()
        expected = plain.stage.layers[i].feed_forward(h)
        # Measured: 2e-7 relative (the slices sum in a different order).
        np.testing.assert_allclose(sliced.stage.layers[i].feed_forward(h), expected, rtol=0,
                                   atol=1e-5 * np.abs(expected).max())
    ids = np.load(FIXTURES / "base" / "reference.npz")["ids"]
    np.testing.assert_allclose(sliced.score(ids), plain.score(ids), rtol=0, atol=1e-5)


def test_dense_slices_must_divide_the_width():
    with pytest.raises(ValueError, match="dense_slices=5 does not divide the dense MLP width 64"):
        Engine(Checkpoint.open(FIXTURES / "base"), F32, dense_slices=5)


@pytest.mark.parametrize("fmt", [INT4, WeightFormat("int4", 4, symmetric=False), WeightFormat("int8")],
                         ids=["int4", "int4-asym-g4", "int8-per-row"])
def test_expert_by_expert_build_packs_the_same_bytes_as_whole_stacks(fmt):
    """A MoE layer read from a (bf16) checkpoint one expert at a time holds exactly the constants of the graph built
    from its whole float32 stacks."""
    ckpt = Checkpoint.open(FIXTURES / "bf16_unpadded")
    cfg = ckpt.config
    layer = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_dense(i))
    built = build_layer(cfg, layer, ckpt.layer(layer), WeightFormats(routed_experts=fmt, shared_experts=fmt),
                        lambda model: model)

    t = ckpt.layer(layer)
    gate_up, width = t["mlp.experts.gate_up_proj"], cfg.moe_intermediate_size
    routed = (gate_up[:, :width], gate_up[:, width:], t["mlp.experts.down_proj"])
    shared = tuple(t[f"mlp.shared_experts.{p}_proj"] for p in ("gate", "up", "down"))
    divisor = max(up_divisor(*routed, t["post_attention_layernorm.weight"]),
                  up_divisor(*shared, t["post_attention_layernorm.weight"]))
    assert built.up_divisor == divisor
    routed, shared = ((g, u / np.float32(divisor), d) for g, u, d in (routed, shared))
    whole = graphs.moe(routed, fmt, shared, fmt, cfg.num_experts_per_tok)
    assert constants(built.mlp) == constants(whole)
