"""The ready specs of the new families (specs/llama-*, specs/qwen3-*, specs/deepseek-v3-*, specs/kimi-k2-*): each
loads from its published config.json, plans with its published parameter count, and simulates; and the
pipeline-shards paper's headline, Llama-3.1-8B INT4 on two AI PCs serving two users at 1.79x one PC's single stream,
predicted from the same figures."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from cascadia.graph.build import build_graph, graph_totals
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec

SPECS = Path(__file__).parent.parent / "specs"
# spec: (parameters, active parameters), as transformers counts them (tests/fixtures/param_counts.json)
SIZES = {"llama-3.1-8b-1pc": (8_030_261_248, 8_030_261_248), "llama-3.1-8b-2pc": (8_030_261_248, 8_030_261_248),
         "llama-3.1-70b-4pc": (70_553_706_496, 70_553_706_496),
         "qwen3-30b-a3b-1pc": (30_532_122_624, 3_353_032_704), "qwen3-30b-a3b-2pc": (30_532_122_624, 3_353_032_704),
         "qwen3-235b-a22b-4pc": (235_093_634_560, 22_190_763_520),
         "deepseek-v3-6pc": (671_026_419_200, 37_552_297_472), "kimi-k2-9pc": (1_026_408_232_448, 32_861_500_928)}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_each_spec_plans_its_published_model_on_its_pcs(name):
    spec = load_spec(SPECS / f"{name}.yaml")
    totals = graph_totals(build_graph(spec.model, spec.runtime))
    assert (totals.params, totals.active_params) == SIZES[name]
    assert len(spec.cluster.nodes) == int(name.rsplit("-", 1)[1].removesuffix("pc"))


def decode_tokens_per_s(name: str, users: int) -> float:
    spec = load_spec(SPECS / f"{name}.yaml")
    spec = attrs.evolve(spec, workload=attrs.evolve(spec.workload, concurrency=(users,)))
    return simulate(spec, analytic_calibration(spec))["levels"][0]["decode_tokens_per_s"]


def test_two_pcs_serve_two_users_at_about_twice_one_pcs_single_stream():
    """The paper measured 43.97 tokens/s on two PCs at two users, 1.79x one PC. Predicted here from the PCs' figures:
    a second stage doubles what a lone stream leaves idle (each stage works on one user's row while the other
    computes the other's), less the hop between the PCs."""
    ratio = decode_tokens_per_s("llama-3.1-8b-2pc", 2) / decode_tokens_per_s("llama-3.1-8b-1pc", 1)
    assert 1.6 < ratio < 2.0, ratio
