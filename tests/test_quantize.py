"""4-bit packing and chunked quantisation: packed bytes as OpenVINO packs them, and arrays quantised a few entries
along axis 0 at a time exactly as quantised whole."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops
import pytest

from cascadia.engine.ov_ops import weight
from cascadia.engine.quantize import Nibbles, Quantized, quantize, quantize_stacks
from cascadia.spec.types import WeightFormat

# Odd entry sizes (3 x 5 values) make chunks start and end in the middle of a byte.
SHAPES = [(6, 4, 8), (7, 3, 5)]


def four_bit_values(shape, signed: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(-8, 8, shape).astype(np.int8) if signed else rng.integers(0, 16, shape).astype(np.uint8)


def openvino_packed(values: np.ndarray) -> bytes:
    """OpenVINO's own packing (through Python lists: slow, fine for small arrays)."""
    constant = ops.constant(values, ov.Type.i4 if values.dtype == np.int8 else ov.Type.u4)
    return np.array(constant.get_data()).tobytes()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("signed", [True, False], ids=["i4", "u4"])
def test_nibbles_pack_as_openvino_does_in_any_pieces(shape, signed):
    values = four_bit_values(shape, signed)
    whole = Nibbles.zeros(shape, signed)
    whole.put(0, values)
    assert whole.data.tobytes() == openvino_packed(values)
    pieces = Nibbles.zeros(shape, signed)
    for first, count in ((0, 1), (1, 2), (3, 3), (6, len(values) - 6)):
        pieces.put(first, values[first: first + count])
    np.testing.assert_array_equal(pieces.data, whole.data)
    np.testing.assert_array_equal(pieces.unpack(), values)
    assert pieces.unpack().dtype == values.dtype


FORMATS = [WeightFormat("int4", 32), WeightFormat("int4", 4, symmetric=False), WeightFormat("int8", 4),
           WeightFormat("int8", None, symmetric=False)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantising_in_chunks_equals_quantising_whole(shape, fmt):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
    bounds = [0, 1, 4, shape[0]]  # uneven chunks
    chunks = ([w[a:b] for w in arrays] for a, b in zip(bounds, bounds[1:]))
    for chunked, w in zip(quantize_stacks(chunks, shape[0], fmt), arrays, strict=True):
        whole = quantize(w, fmt)
        assert type(chunked.values) is type(whole.values) is (Nibbles if fmt.bits == 4 else np.ndarray)
        np.testing.assert_array_equal(chunked.scale, whole.scale)
        np.testing.assert_array_equal(chunked.dequantize(), whole.dequantize())
        for got, expected in ((chunked.values, whole.values), (chunked.zero_point, whole.zero_point)):
            if isinstance(got, Nibbles):
                got, expected = got.data, expected.data
            np.testing.assert_array_equal(got, expected)


def test_chunks_must_hold_the_count():
    w = np.ones((3, 4, 8), np.float32)
    with pytest.raises(ValueError, match="the chunks held 3 entries along axis 0, expected 4"):
        quantize_stacks([(w,)], 4, WeightFormat("int4"))


@pytest.mark.parametrize("fmt", [WeightFormat("int4", 4), WeightFormat("int4", None, symmetric=False)], ids=str)
def test_graph_holds_openvino_packing_of_the_values(fmt):
    """The 4-bit constants of a weight's graph are the bytes OpenVINO itself makes of the quantised values: grouped
    [out, groups, group]; per row (one group) [out, in], with zero points [out, 1]."""
    w = np.random.default_rng(2).standard_normal((5, 12), dtype=np.float32)
    q = quantize(w, fmt)
    model = ov.Model([weight(w, fmt)], [], "weight")
    got = sorted((list(op.get_output_shape(0)), np.array(op.get_data()).tobytes()) for op in model.get_ordered_ops()
                 if op.get_type_name() == "Constant" and op.get_element_type() in (ov.Type.i4, ov.Type.u4))
    if fmt.group_size:
        expected = [q.values.unpack()]
    else:
        expected = [q.values.unpack()[:, 0, :], q.zero_point.unpack()[:, :, 0]]
    assert got == sorted((list(v.shape), openvino_packed(v)) for v in expected)


@pytest.mark.parametrize("fmt", [WeightFormat("int4", 4), WeightFormat("int4", 5, symmetric=False),
                                 WeightFormat("int8"), WeightFormat("int8", 5, symmetric=False)],
                         ids=["int4", "int4-asym", "int8", "int8-asym"])
def test_one_expert_and_experts_stacked_by_rows_quantise_as_the_stack(fmt):
    """`Quantized.entry` (one expert of a stack) and `Quantized.concat` (gate over up) hold exactly the values of the
    stack they come from, also where an entry starts or ends in the middle of a byte (3 x 5 values)."""
    width = 5 if fmt.group_size == 5 else 4
    stack = quantize(np.random.default_rng(1).standard_normal((4, 3, width), dtype=np.float32), fmt)
    whole = stack.dequantize()
    for e in range(4):
        assert np.array_equal(stack.entry(e).dequantize(), whole[e])
    joined = Quantized.concat([stack.entry(3), stack.entry(1)])
    assert np.array_equal(joined.dequantize(), np.concatenate([whole[3], whole[1]]))
