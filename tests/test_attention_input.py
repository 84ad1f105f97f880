"""The graph that opens a decoder layer (`graphs.attention_input`): the input norm, the q|k|v|r projection and q's
head norm inside one compiled block equal the host's FP32 norms around a plain projection; padding rows stay finite."""

from __future__ import annotations

import numpy as np

from cascadia.engine import graphs
from cascadia.engine.device import CompiledBlock, compile_options
from cascadia.engine.layers import head_rms_norm, rms_norm
from cascadia.spec.types import WeightFormat

H, HEADS, KV, D, R, EPS = 64, 4, 2, 16, 8, 1e-6


def test_norms_inside_the_block_equal_the_host_norms():
    rng = np.random.default_rng(0)
    widths = (HEADS * D, KV * D, KV * D, HEADS * R)
    q, k, v, r = (rng.standard_normal((width, H), dtype=np.float32) / 8 for width in widths)
    norm, q_norm = 1 + rng.standard_normal(H, dtype=np.float32) / 4, 1 + rng.standard_normal(D, dtype=np.float32) / 4
    block = CompiledBlock(graphs.attention_input([q, k, v, r], WeightFormat(), norm, q_norm, EPS), "CPU",
                          compile_options("f32"), (1, 8))
    x = 3 * rng.standard_normal((5, H), dtype=np.float32)
    got_q, got_kvr = block(x)  # 5 rows padded to 8 with zero rows: their norm must not turn into NaN
    projected = rms_norm(x, norm, EPS) @ np.concatenate([q, k, v, r]).T
    expected_q = head_rms_norm(projected[:, : HEADS * D], q_norm, EPS).reshape(5, -1)
    np.testing.assert_allclose(got_q, expected_q, rtol=0, atol=1e-6 * np.abs(expected_q).max())
    np.testing.assert_allclose(got_kvr, projected[:, HEADS * D:], rtol=0, atol=1e-6 * np.abs(projected).max())
    assert all(np.isfinite(out).all() for out in block(np.zeros((1, H), np.float32)))
