"""Fixtures shared by the tests that run the tiny local spec end to end (pipeline, calibrate, validate)."""

from pathlib import Path

import pytest

from cascadia.engine.init_model import init_model
from cascadia.spec.load import load_spec

TINY_SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


@pytest.fixture(scope="session")
def spec():
    """The tiny Inkling-shaped model on 3 local nodes."""
    return load_spec(TINY_SPEC)


@pytest.fixture(scope="session")
def checkpoint(spec, tmp_path_factory):
    """Random weights for the tiny spec (seed 1), written once per test session."""
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    init_model(spec.model.config, folder, seed=1)
    return folder
