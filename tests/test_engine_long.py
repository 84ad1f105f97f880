"""The f32 engine against transformers at long positions (tests/fixtures/long, made by scripts/make_fixtures.py):
a 6,080-token prompt in chunked prefill, then 64 greedy tokens, on a model whose sliding rings wrap hundreds of times
and whose global layers are log-scaled (tau 2.8 at the end). The checkpoint is rewritten from the fixture's config
and seed; only some positions' logits are stored."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from cascadia.engine import attention
from cascadia.engine.attention import SPAN_KEYS
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.init_model import init_model
from cascadia.graph.planner import plan as make_plan
from cascadia.model_config import InklingConfig
from cascadia.pipeline.run import Pipeline
from cascadia.spec.types import RuntimeSpec

FIXTURE = Path(__file__).parent / "fixtures" / "long"
TOLERANCE = 1e-4  # largest |engine - reference| relative to the largest |reference logit|


def assert_close(logits: np.ndarray, reference: np.ndarray) -> None:
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    assert error <= TOLERANCE, f"relative error {error:.2e}"
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURE / "reference.npz"))


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, reference):
    config = InklingConfig.from_hf_dict(json.loads((FIXTURE / "config.json").read_text()))
    folder = tmp_path_factory.mktemp("long-checkpoint")
    init_model(config, folder, seed=int(reference["seed"]))
    return folder


def long_runtime(**changes) -> RuntimeSpec:
    return RuntimeSpec(**{"precision": "f32", "max_streams": 2, "context_budget": 6144} | changes)


def greedy_continuation(engine: Engine, prompt: np.ndarray, n: int, slot: int = 0) -> tuple[list[int], np.ndarray]:
    engine.release(slot)
    row = engine.prefill(slot, prompt)
    tokens, rows = [], []
    for _ in range(n):
        rows.append(row)
        tokens.append(int(row.argmax()))
        row = engine.step([slot], [tokens[-1]])[0]
    return tokens, np.stack(rows)


@pytest.mark.parametrize("row_buckets, span_keys", [((1, 2, 8, 16, 24, 32), SPAN_KEYS), ((1, 8, 256), SPAN_KEYS),
                                                    ((1, 8, 256), 192)],
                         ids=["chunks-32", "chunks-256", "chunks-256-spans-192"])
def test_chunked_prefill_and_greedy_decode_match_transformers(long_checkpoint, reference, row_buckets, span_keys,
                                                              monkeypatch):
    """Attention over the global layers' keys in spans of SPAN_KEYS (two spans at the end) and of 192 keys (32
    spans, 3 blocks each, combined on the thread pool)."""
    monkeypatch.setattr(attention, "SPAN_KEYS", span_keys)
    engine = Engine(Checkpoint.open(long_checkpoint), long_runtime(row_buckets=row_buckets), threads=1)
    prompt = reference["prompt_ids"]
    assert_close(engine.score(prompt)[reference["positions"]], reference["prompt_logits"])
    tokens, logits = greedy_continuation(engine, prompt, len(reference["greedy_ids"]), slot=1)
    assert tokens == reference["greedy_ids"].tolist()
    assert_close(logits, reference["greedy_logits"])


def test_the_pipeline_matches_transformers_at_long_positions(spec, long_checkpoint, reference):
    """The long model on the tiny spec's three local nodes: prompt in frames of 64 rows, then the greedy tokens
    one frame each (teacher-forced: each row's logits are those greedy decoding takes its token from)."""
    model = attrs.evolve(spec.model, config=Checkpoint.open(long_checkpoint).config, checkpoint=long_checkpoint)
    spec = attrs.evolve(spec, model=model, runtime=long_runtime(row_buckets=(1, 8, 64)),
                        workload=attrs.evolve(spec.workload, concurrency=(1,)))
    prompt, greedy = reference["prompt_ids"], reference["greedy_ids"]
    with Pipeline.start(spec, make_plan(spec), checkpoint=long_checkpoint, with_logits=True,
                        node_timeout_s=60) as pipeline:
        logits = pipeline.score(np.r_[prompt, greedy[:-1]], prefill=len(prompt))
    assert_close(logits[reference["positions"]], reference["prompt_logits"])
    assert_close(logits[len(prompt) - 1:], reference["greedy_logits"])
