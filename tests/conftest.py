"""Fixtures shared by the tests that run the tiny local spec end to end (pipeline, calibrate, validate), and the
suite's own temporary folder."""

import os
import tempfile
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


@pytest.fixture(scope="session", autouse=True)
def own_temporary_folder(tmp_path_factory):
    """The suite's temporary files, and those of every process it starts, go to a folder of its own, which holds no
    run folder (`cascadia-run-*`) at the end: a run removes its own however it ends, short of SIGKILL."""
    folder = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # read TMPDIR again
    yield folder
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    left = sorted(path.name for path in folder.glob("cascadia-run-*"))
    assert not left, f"runs left their folders in {folder}: {', '.join(left)}"
