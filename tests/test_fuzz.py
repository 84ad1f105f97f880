"""Random and mutated inputs of every kind a user or a peer hands Cascadia: specs (with includes of files of every
kind), prompts files, model config.json files and wire messages, the last also through a real stage. Each must give
a result or the reader's own error: never a traceback, never a hang.

Each example runs under a bound (`no_hang`: SIGALRM after HANG_S, which also breaks a read blocked on a FIFO) and an
explicit Hypothesis deadline, both far above what an example takes (milliseconds); they are there to turn a hang
or a runaway allocation into a failure, not to measure speed. Examples are derandomized (the same every run) and
kept out of Hypothesis's database, and each test's examples take a few seconds.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import struct
from datetime import timedelta
from pathlib import Path

import attrs
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import StageEngine
from cascadia.errors import CheckpointError, RequestError, SpecError
from cascadia.graph.planner import plan as make_plan
from cascadia.models import read_config
from cascadia.models.base import ConfigError, UnsupportedModel
from cascadia.models.inkling import FIELD_TYPES, InklingConfig
from cascadia.pipeline.node import ForeignFrame
from cascadia.pipeline.stage import EngineStage, RowSampler
from cascadia.pipeline.wire import (DEFAULT_MAX_MESSAGE_BYTES, Decoder, Frame, Hello, Progress, Ready, Received,
                                    Shutdown, Stats, StatsRequest, Tokens, WireError, decode, encode)
from cascadia.spec.load import load_spec
from cascadia.workload import load_prompts

TINY_SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"
TINY_CONFIG = Path(__file__).parent.parent / "specs" / "tiny" / "config.json"
HANG_S = 20  # an example that runs this long is hung
FUZZ = settings(max_examples=150, deadline=timedelta(seconds=HANG_S), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextlib.contextmanager
def no_hang(seconds: float = HANG_S):
    """Fail, instead of hanging, when the body runs longer than `seconds`."""
    def hung(signum, frame):
        raise AssertionError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


SCALARS = (st.integers(-3, 2**70) | st.integers(-5, 70) | st.floats(allow_nan=True) | st.booleans() | st.none()
           | st.sampled_from(["64GB", "1e-3", "8", "no", "int4", "hybrid", "sparse", "tcp://h:1", "local", "..", "/",
                              "\0", "1,2", "{uniform: [1, 2]}"]) | st.text(max_size=8))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6) | st.sampled_from(["ids", "text", "uniform", "name", "memory"]), inner, max_size=3),
    max_leaves=8)


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    """Files no reader should take for its input, by name: devices, a FIFO, a huge sparse file, binary bytes, a
    folder, a missing file, JSON that is no spec."""
    folder = tmp_path_factory.mktemp("odd")
    os.mkfifo(folder / "fifo")
    with open(folder / "huge", "wb") as f:
        f.truncate(8 * 1024**3)
    (folder / "binary").write_bytes(bytes(range(256)) * 16)
    (folder / "folder").mkdir()
    (folder / "config.json").write_text(TINY_CONFIG.read_text())
    return folder, ["/dev/zero", "/dev/urandom", "/dev/null", str(folder / "fifo"), str(folder / "huge"),
                    str(folder / "binary"), str(folder / "folder"), str(folder / "missing"),
                    str(folder / "config.json"), str(TINY_SPEC)]


# ---- specs -----------------------------------------------------------------------------------------------------------
TINY_TREE = yaml.safe_load(TINY_SPEC.read_text())
PLACES = [("model", "hf_config"), ("model", "formats"), ("model", "checkpoint"), ("model", "overrides"),
          ("cluster", "nodes"), ("cluster", "reserve"), ("cluster", "curve_keys"), ("cluster", "links"),
          ("runtime", "context_budget"), ("runtime", "max_streams"), ("runtime", "row_buckets"),
          ("runtime", "prefill_window"), ("runtime", "precision"), ("workload", "concurrency"),
          ("workload", "prompt_tokens"), ("workload", "prompts_file"), ("workload", "output_tokens"),
          ("workload", "seed"), ("include",)]


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(PLACES), JUNK | st.integers(0, 9)), min_size=1, max_size=4))
def test_specs_with_junk_and_odd_files_give_spec_errors_only(odd_files, edits):
    folder, names = odd_files
    tree = json.loads(json.dumps(TINY_TREE))
    tree["model"]["hf_config"] = str(TINY_CONFIG)
    for where, value in edits:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9:
            value = names[value]  # a file of another kind, where a path goes
        node = tree
        for key in where[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[where[-1]] = value
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    with no_hang():
        try:
            load_spec(path)
        except SpecError as e:
            assert e.problems and all(p.file is not None for p in e.problems)


# ---- prompts files -----------------------------------------------------------------------------------------------
PROMPT_LINES = (st.fixed_dictionaries({"ids": JUNK | st.lists(st.integers(-2, 2**66), max_size=4)})
                | st.fixed_dictionaries({"text": JUNK | st.text(max_size=10)})
                | st.fixed_dictionaries({"ids": st.lists(st.integers(0, 600), min_size=1, max_size=4),
                                         "text": st.text(max_size=4)})
                | JUNK)


@FUZZ
@given(lines=st.lists(PROMPT_LINES.map(json.dumps) | st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
                      max_size=5), raw=st.binary(max_size=40), as_raw=st.booleans())
def test_prompts_files_give_prompts_or_request_errors_only(odd_files, lines, raw, as_raw):
    folder, names = odd_files
    path = folder / "prompts.jsonl"
    path.write_bytes(raw if as_raw else "\n".join(lines).encode("utf-8", "surrogateescape"))
    with no_hang():
        for target in (path, *map(Path, names[:6])):
            try:
                prompts = load_prompts(target, tokenize=lambda text: [ord(c) % 700 for c in text], vocab_size=512)
            except RequestError as e:
                assert str(e).startswith(str(target))
            else:
                assert prompts and all(ids and all(0 <= i < 512 for i in ids) for ids in prompts)


# ---- config.json -------------------------------------------------------------------------------------------------
TINY_FIELDS = json.loads(TINY_CONFIG.read_text())


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(sorted(FIELD_TYPES) + ["text_config", "mtp_config", "model_type",
                                                                      "architectures"]), JUNK,
                               min_size=1, max_size=4), raw=st.binary(max_size=30), as_raw=st.booleans())
def test_config_files_give_configs_or_config_errors_only(tmp_path_factory, changes, raw, as_raw):
    folder = tmp_path_factory.mktemp("config", numbered=True)
    path = folder / "config.json"
    path.write_bytes(raw if as_raw else json.dumps(TINY_FIELDS | changes).encode())
    with no_hang():
        try:
            config = read_config(folder)
        except ConfigError as e:
            assert str(e).startswith(f"{path}: ")
        else:  # every value of the type its field says
            for field in attrs.fields(InklingConfig):
                value = getattr(config, field.name)
                if field.type == "float":
                    assert type(value) is float and np.isfinite(value), field.name
                elif field.type in ("int", "bool", "str"):
                    assert type(value).__name__ == field.type, field.name
        with pytest.raises((CheckpointError, UnsupportedModel)):  # no weights: refused, whatever the config says
            Checkpoint.open(folder)


# ---- wire messages -----------------------------------------------------------------------------------------------
ARRAYS = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4)
MESSAGES = st.one_of(
    st.builds(lambda ids: Frame(ids[0], 0, ids, ids, ids, [True] * len(ids), np.ones((len(ids), 3), np.float32)),
              ARRAYS),
    st.builds(lambda ids: Tokens(ids[0], 1, ids, ids), ARRAYS),
    st.builds(Hello, st.text(max_size=5), st.integers(0, 9), st.integers(0, 9), st.text(max_size=5)),
    st.builds(Progress, st.text(max_size=5), st.integers(0, 9), st.integers(0, 9)),
    st.builds(Ready, st.text(max_size=5), st.integers(0, 9), st.integers(0, 9)),
    st.just(Shutdown()), st.just(StatsRequest()),
    st.builds(Stats, st.text(max_size=5), st.floats(0, 1), st.integers(0, 9), st.integers(0, 9)))


def mutated(frames: list[bytes], data) -> list[bytes]:
    """One message's frames with a byte flipped, a frame cut short, grown, dropped or added."""
    frames = [bytes(memoryview(f)) for f in frames]
    i = data.draw(st.integers(0, len(frames) - 1))
    how = data.draw(st.sampled_from(["flip", "cut", "grow", "drop", "add", "header field"]))
    if how == "flip" and frames[i]:
        at = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i] = frames[i][:at] + bytes([frames[i][at] ^ data.draw(st.integers(1, 255))]) + frames[i][at + 1:]
    elif how == "cut":
        frames[i] = frames[i][:data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif how == "grow":
        frames[i] += data.draw(st.binary(min_size=1, max_size=16))
    elif how == "drop" and len(frames) > 1:
        del frames[i]
    elif how == "add":
        frames.insert(i, data.draw(st.binary(max_size=16)))
    elif how == "header field":  # one of the header's integers after the magic: version .. body bytes
        at = data.draw(st.sampled_from([4, 6, 7, 11, 19, 27, 31, 35, 39, 42, 44, 50]))  # wire_format.HEADER_LAYOUT
        frames[0] = frames[0][:at] + struct.pack("<H", data.draw(st.integers(0, 2**16 - 1))) + frames[0][at + 2:]
    return frames


@FUZZ
@given(message=MESSAGES, data=st.data())
def test_mutated_and_random_wire_messages_decode_or_give_wire_errors_only(message, data):
    frames = mutated(encode(message, sender=1, seq=data.draw(st.integers(0, 2**64 - 1))), data)
    noise = data.draw(st.lists(st.binary(max_size=60), max_size=6))
    with no_hang():
        for candidate in (frames, noise):
            try:
                received = decode(candidate, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES)
            except WireError:
                continue
            assert isinstance(received, Received)
            try:
                Decoder(1, (Frame, Tokens)).decode(candidate)
            except WireError:
                pass


@pytest.fixture(scope="module")
def stages(spec, checkpoint):
    """The first two stages of the tiny spec's plan, each a real engine (the first embeds token ids)."""
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, max_streams=4))
    opened = Checkpoint.open(checkpoint)
    return [EngineStage(StageEngine.for_stage(spec, stage, opened, threads=1), RowSampler(4))
            for stage in make_plan(spec).stages[:2]]


# a stream's first rows: a frame that belongs
NEW_STREAM = st.builds(lambda slot, n, token: [(slot, p, token) for p in range(n)], st.integers(0, 3),
                       st.integers(1, 9), st.integers(0, 511))
FRAME_ROWS = NEW_STREAM | st.lists(st.tuples(st.integers(0, 6), st.integers(0, 70), st.integers(0, 600)), max_size=9)


def test_frames_reach_a_stage_only_when_they_belong_to_its_streams(stages):
    """Any frame the wire lets through: the stage computes it, or refuses it as ForeignFrame before any state
    changes; nothing else escapes. The examples hold frames of both kinds."""
    outcomes = collections.Counter()

    @FUZZ
    @given(rows=FRAME_ROWS, bucket=st.integers(0, 12), width=st.sampled_from([None, 64, 63, 65]), first=st.booleans())
    def fuzz(rows, bucket, width, first):
        stage = stages[0 if first else 1]
        n = len(rows)
        slots, positions, tokens = (np.array([r[k] for r in rows], np.int32) for k in range(3))
        residual = None if width is None else np.ones((n, width), np.float32)
        frame = Frame(1, 0, slots, positions, tokens, [True] * n, residual, bucket)
        lengths = stage.engine.lengths.copy()
        with no_hang():
            try:
                result = stage.process(frame)
            except ForeignFrame:
                assert np.array_equal(stage.engine.lengths, lengths)  # refused before anything changed
                outcomes["refused"] += 1
            else:
                assert result.rows == n and result.residual.shape == (n, 64)
                outcomes["computed"] += 1

    fuzz()
    assert outcomes["computed"] > 10 and outcomes["refused"] > 10, outcomes
