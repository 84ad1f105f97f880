"""The command line's one error handler: a `CascadiaError` is one line with its exit status; anything else is named
as a bug, with the way to see its traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import cascadia.cli.specs
from cascadia.cli import cli
from cascadia.errors import CheckpointError, SpecError
from cascadia.spec.load import load_spec as real_load_spec

TINY = str(Path(__file__).parent.parent / "specs" / "tiny-local.yaml")


def fail_with(monkeypatch, error: Exception) -> None:
    def load_spec(path):
        raise error

    monkeypatch.setattr(cascadia.cli.specs, "load_spec", load_spec)


@pytest.mark.parametrize("error, status", [(SpecError(["a.yaml:3: model: wrong", "a.yaml:4: runtime: wrong"]), 2),
                                           (CheckpointError("ckpt: no such folder"), 1)])
def test_a_cascadia_error_is_its_message_and_status(monkeypatch, error, status):
    fail_with(monkeypatch, error)
    result = CliRunner().invoke(cli, ["plan", TINY])
    assert result.exit_code == status
    assert result.output == f"Error: {error}\n"


def test_an_unexpected_error_is_one_line_naming_it_and_the_way_to_its_traceback(monkeypatch):
    fail_with(monkeypatch, ZeroDivisionError("division by zero"))
    result = CliRunner().invoke(cli, ["plan", TINY])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: unexpected ZeroDivisionError in `cascadia plan`: division by zero")
    assert "cascadia --debug" in result.output and "CASCADIA_DEBUG=1" in result.output


@pytest.mark.parametrize("how", ["--debug", "CASCADIA_DEBUG"])
def test_debug_lets_the_traceback_through(monkeypatch, how):
    fail_with(monkeypatch, ZeroDivisionError("division by zero"))
    if how == "CASCADIA_DEBUG":
        monkeypatch.setenv("CASCADIA_DEBUG", "1")
    result = CliRunner().invoke(cli, ["--debug", "plan", TINY] if how == "--debug" else ["plan", TINY])
    assert isinstance(result.exception, ZeroDivisionError)


def test_a_real_spec_still_plans():
    assert real_load_spec(TINY).model.name == "tiny"
    assert CliRunner().invoke(cli, ["plan", TINY]).exit_code == 0


@pytest.mark.parametrize("command", [["score", "{ckpt}", "--ids", "{ids}", "--out", "{out}"],
                                     ["generate", "{ckpt}", "--ids", "1,2"], ["init-model", "{ckpt}", "{out}"]])
def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path, command):
    """A checkpoint of a family Cascadia does not know is not read as Inkling (a Llama one used to fail on a missing
    `embed_norm` tensor)."""
    ckpt = tmp_path / "mixtral"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64,
                                                  "architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2}))
    (ckpt / "model.safetensors").write_bytes(b"")
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    paths = {"ckpt": ckpt, "ids": tmp_path / "ids.json", "out": tmp_path / "out"}
    result = CliRunner().invoke(cli, [part.format(**paths) for part in command])
    assert result.exit_code == 2
    assert result.output == (f"Error: {ckpt}/config.json: model_type 'mixtral' is not supported "
                             "(supported: inkling, inkling_text, llama, qwen3_moe, deepseek_v3)\n")
    assert not (tmp_path / "out").exists()
