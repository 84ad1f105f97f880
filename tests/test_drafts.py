"""Captured-state draft evaluation: capturing the deployed path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cascadia.drafts.capture import capture
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.sampling import Sampling
from cascadia.spec.types import RuntimeSpec
from cascadia.tensors import HEAD

FIXTURES = Path(__file__).parent / "fixtures"


# ---- capture ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded():
    return Checkpoint.open(FIXTURES / "sharded")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "sharded" / "reference.npz"))


def test_capture_keeps_what_the_head_reads_and_the_deployed_tokens(sharded, reference):
    """The f32 engine's greedy tokens, and head inputs that the head matrix turns into the reference's logits."""
    engine = Engine(sharded, RuntimeSpec(precision="f32", max_streams=1, context_budget=32))
    prompt = reference["ids"][:10]
    captured = capture(engine, prompt, 6)
    assert captured.tokens.tolist() == list(generate(engine, prompt, 6, Sampling()).ids)
    assert captured.head_inputs.shape == (6, sharded.config.hidden_size)
    logits = captured.head_inputs[0] @ sharded.tensor(HEAD).T  # the prompt's last row
    np.testing.assert_allclose(logits, reference["prefill_logits"][9], atol=1e-4 * np.abs(logits).max())
    assert engine.stage.head_input_observer is None  # listening stops with the capture
