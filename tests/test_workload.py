import os
from pathlib import Path

import attrs
import numpy as np
import pytest

from cascadia.errors import RequestError
from cascadia.policy import Request
from cascadia.spec.types import LengthSpec, RuntimeSpec, WorkloadSpec
from cascadia.workload import (PHASES, ClosedLoop, OpenLoop, build_levels, describe, load_prompts, override,
                               prompt_length_notes)


def test_levels_phases_and_requests():
    workload = WorkloadSpec(concurrency=(1, 3), prompt_tokens=LengthSpec(2, 5), output_tokens=7, seed=4)
    levels = build_levels(workload, vocab_size=50)
    assert [level.concurrency for level in levels] == [1, 3]
    assert all(tuple(p.name for p in level.phases) == PHASES for level in levels)
    requests = [r for level in levels for phase in level.phases for [r] in phase.requests]
    assert [len(phase.requests) for level in levels for phase in level.phases] == [1, 1, 3, 3]  # default: c each
    assert [r.id for r in requests] == list(range(8))
    assert all(2 <= len(r.prompt_ids) <= 5 and all(0 <= t < 50 for t in r.prompt_ids) for r in requests)
    assert all(r.max_new_tokens == 7 and not r.stop_ids for r in requests)
    assert len({r.prompt_ids for r in requests}) > 1


def test_seeded_and_independent_of_other_levels():
    workload = WorkloadSpec(concurrency=(2, 4), requests=5, prompt_tokens=LengthSpec(1, 30), seed=1)
    assert build_levels(workload, 100) == build_levels(workload, 100)
    alone = build_levels(WorkloadSpec(concurrency=(4,), requests=5, prompt_tokens=LengthSpec(1, 30), seed=1), 100)
    prompts = [[r.prompt_ids for [r] in phase.requests] for phase in alone[0].phases]
    assert prompts == [[r.prompt_ids for [r] in phase.requests] for phase in build_levels(workload, 100)[1].phases]
    other_seed = build_levels(WorkloadSpec(concurrency=(2, 4), requests=5, prompt_tokens=LengthSpec(1, 30), seed=2),
                              100)
    assert other_seed != build_levels(workload, 100)


def test_prompts_file_cycles_in_order(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"ids": [5, 6]}\n\n{"ids": [7]}\n')
    prompts = load_prompts(path)
    assert prompts == [(5, 6), (7,)]
    levels = build_levels(WorkloadSpec(concurrency=(3,)), 100, prompts, stop_ids=frozenset({2}))
    assert [r.prompt_ids for phase in levels[0].phases for [r] in phase.requests] == [(5, 6), (7,)] * 3
    assert levels[0].phases[0].requests[0][0].stop_ids == {2}


def test_text_prompts_need_a_tokenizer(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "ab"}\n')
    assert load_prompts(path, tokenize=lambda text: [ord(c) for c in text]) == [(97, 98)]
    with pytest.raises(RequestError, match="prompts.jsonl:1: a 'text' prompt needs a tokenizer"):
        load_prompts(path)


@pytest.mark.parametrize("content, message", [
    ('{"ids": [1, 2]}\n[1, 2]\n', r":2: expected an object with 'ids'"),
    ('{"ids": []}\n', r":1: 'ids' must be a non-empty list"),
    ('{"ids": [1, -2]}\n', r":1: 'ids' must be a non-empty list of non-negative integers"),
    ('{"ids": [1}\n', r":1: not valid JSON"),
    ('\n', "no prompts"),
])
def test_bad_prompt_files(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(RequestError, match=message):
        load_prompts(path)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(RequestError, match="nope.jsonl: cannot read prompts: no such file"):
        load_prompts(tmp_path / "nope.jsonl")


def test_a_prompt_with_both_ids_and_text_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"ids": [1]}\n{"ids": [1, 2], "text": "ab"}\n')
    with pytest.raises(RequestError, match=f"^{path}:2: give 'ids' or 'text', not both$"):
        load_prompts(path, tokenize=lambda text: [ord(c) for c in text])


@pytest.mark.parametrize("ids, bad", [([5, 4611686018427387904], 4611686018427387904),
                                      ([1, 123456789012345678901], 123456789012345678901), ([512], 512)])
def test_ids_beyond_the_vocabulary_are_refused_naming_the_line(tmp_path, ids, bad):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"ids": [3]}}\n{{"ids": {ids}}}\n')
    assert load_prompts(path) == [(3,), tuple(ids)]  # without a vocabulary nothing bounds them
    with pytest.raises(RequestError, match=rf"^{path}:2: token id {bad} lies outside the model's vocabulary "
                                           rf"\(0..511\)$"):
        load_prompts(path, vocab_size=512)


def test_text_encoded_beyond_the_vocabulary_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(RequestError, match=r":1: token id 97 lies outside the model's vocabulary \(0..63\)"):
        load_prompts(path, tokenize=lambda text: [ord(c) for c in text], vocab_size=64)


@pytest.mark.parametrize("make, message", [
    (lambda path: path.write_bytes(bytes(range(256)) * 4), r"not UTF-8 text \(invalid start byte at byte 128\)"),
    (lambda path: os.mkfifo(path), "is not a regular file"),
    (lambda path: path.symlink_to("/dev/zero"), "is not a regular file"),
], ids=["binary", "fifo", "device"])
def test_a_prompts_file_that_is_no_text_file_is_named(tmp_path, make, message):
    path = tmp_path / "p.jsonl"
    make(path)
    with pytest.raises(RequestError, match=rf"^{path}: cannot read prompts: {message}"):
        load_prompts(path)


def test_prompts_longer_than_the_context_are_named_and_none_fitting_is_an_error(tmp_path):
    runtime = RuntimeSpec(context_budget=16)
    workload = WorkloadSpec(output_tokens=4, prompts_file=tmp_path / "p.jsonl")
    assert prompt_length_notes([(1,) * 12, (1,) * 3], workload, runtime) == []
    assert prompt_length_notes([(1,) * 13, (1,) * 3, (1,) * 20], workload, runtime) == [
        f"{tmp_path / 'p.jsonl'}: 2 of its 3 prompts are rejected: prompt + output (4) tokens exceed "
        "runtime.context_budget (16)"]
    with pytest.raises(RequestError, match=r"p.jsonl: none of its 2 prompts fits: prompt \+ output \(4\) tokens "
                                           r"exceed runtime.context_budget \(16\) \(the shortest has 13 tokens\)"):
        prompt_length_notes([(1,) * 13, (1,) * 20], workload, runtime)


def test_closed_loop_sends_the_next_request_when_one_is_done():
    requests = [(Request(i, (1,), 1),) for i in range(5)]
    loop = ClosedLoop(requests, clients=2)
    assert loop.start(0.0) == requests[:2] and loop.next_time is None and loop.due(9.0) == []
    assert [loop.done(i) for i in (1, 0, 2, 3)] == [[requests[2]], [requests[3]], [requests[4]], []]
    assert ClosedLoop(requests[:1], clients=3).start(0.0) == requests[:1]


def test_a_client_asking_several_choices_sends_its_next_request_when_all_are_done():
    workload = WorkloadSpec(concurrency=(1,), requests=2, prompt_tokens=LengthSpec.fixed(3), choices=3, greedy=False,
                            seed=5)
    [phase, _] = build_levels(workload, 100)[0].phases
    first, second = phase.requests
    assert [r.id for r in first + second] == list(range(6)) and phase.streams == 6
    assert {r.prompt_ids for r in first} == {first[0].prompt_ids} and [r.sampling.seed for r in first] == [5, 6, 7]
    loop = ClosedLoop(phase.requests, clients=1)
    assert loop.start(0.0) == [first] and loop.done(2) == [] and loop.done(0) == [] and loop.done(1) == [second]


def test_open_loop_sends_requests_at_their_seeded_poisson_times():
    requests = [(Request(i, (1,), 1),) for i in range(400)]
    loop = OpenLoop(requests, rate=4.0, seed=3)
    assert loop.start(10.0) == requests[:1]  # the first at the start
    times = [10.0]
    while (due := loop.next_time) is not None:
        assert loop.due(due - 1e-9) == [] and loop.done(0) == []  # not before its time, nor because one finished
        sent = loop.due(due)
        times += [due] * len(sent)
    gaps = np.diff(times)
    assert len(times) == 400 and all(gaps >= 0)
    assert 0.22 < gaps.mean() < 0.28 and 0.8 < gaps.std() / gaps.mean() < 1.2  # exponential gaps of mean 1/4 s
    again = OpenLoop(requests, rate=4.0, seed=3)
    assert again.start(10.0) == requests[:1] and again.next_time == times[1]  # seeded: the same times


def test_override_replaces_only_what_is_given():
    workload = WorkloadSpec(concurrency=(1,), requests=None, prompt_tokens=LengthSpec(3, 9), output_tokens=5,
                            prompts_file=Path("prompts.jsonl"))
    assert override(workload) == workload
    assert override(workload, output_tokens=2) == attrs.evolve(workload, output_tokens=2)
    changed = override(workload, concurrency=(2, 4), requests=3, output_tokens=8, prompt_tokens=6)
    assert (changed.concurrency, changed.requests, changed.output_tokens, changed.prompt_tokens,
            changed.prompts_file) == ((2, 4), 3, 8, LengthSpec(6, 6), None)


def test_a_table_says_the_workload_it_measured_and_which_counts_are_defaults():
    closed = WorkloadSpec(concurrency=(1, 4), prompt_tokens=LengthSpec(8, 24), output_tokens=16)
    assert describe(closed) == ("closed loop at 1, 4 streams; each level a warm-up, then as many measured requests as "
                                "it has streams (the default); prompts of 8-24 tokens (uniform), 16 tokens out each, "
                                "greedy")
    opened = attrs.evolve(closed, rate=(2.0, 0.5), requests=40, prompt_tokens=LengthSpec.fixed(64), greedy=False,
                          temperature=0.7, top_p=0.9, stop_at_eos=True)
    assert describe(opened) == ("open loop at 2, 0.5 requests/s (Poisson arrivals); each level a warm-up, then 40 "
                                "measured requests; prompts of 64 tokens, up to 16 tokens out each, sampled at "
                                "temperature 0.7, top-p 0.9")
    default = describe(attrs.evolve(opened, requests=None))
    assert "10 s of measured arrivals, at least 16 requests (the default)" in default
