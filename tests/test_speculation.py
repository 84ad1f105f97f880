"""Speculative decoding in the pure policy: prompt-lookup drafts, the phrase table, adaptive draft lengths, and
verification exact at any concurrency against a stand-in stage that rewinds as the real ones do."""

import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadia.policy import DECODE, DRAFT, LENGTH, PREFILL, STOP, Finished, Policy, Request, Token, Verified
from cascadia.spec.load import load_spec
from cascadia.spec.problems import SpecError
from cascadia.spec.types import RuntimeSpec
from cascadia.speculation import NgramDrafter, ReplayDrafter, Speculation, parse_speculate

TINY_SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


# ---- drafts ------------------------------------------------------------------------------------------------------
def test_prompt_lookup_takes_the_longest_suffix_seen_before_at_its_latest_occurrence():
    d = NgramDrafter(min_n=1, max_n=3)
    # the suffix (1, 2, 3) occurred at 0..2; (2, 3) later too, at 5..6: the longer one proposes
    assert d.propose(0, [1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], [], 3) == [4, 8, 2]
    assert d.propose(1, [1, 2, 3, 4, 8, 2, 3, 5, 9, 2, 3], [], 3) == [5, 9, 2]  # (9, 2, 3) never: the latest (2, 3)
    assert d.propose(2, [5, 6, 5, 7, 5], [], 2) == [7, 5]  # the latest 5 of two was followed by 7
    assert d.propose(3, [1, 2, 3], [], 4) == []  # nothing occurred twice


def test_prompt_lookup_follows_the_output_as_it_grows():
    d = NgramDrafter(min_n=2, max_n=2)
    prompt = [1, 2, 3]
    assert d.propose(0, prompt, [], 2) == []
    assert d.propose(0, prompt, [1, 2], 2) == [3, 1]
    assert d.propose(0, prompt, [1, 2, 3], 1) == [1]


def test_the_phrase_table_drafts_from_finished_streams_and_forgets_the_oldest():
    d = NgramDrafter(min_n=2, max_n=2, table_size=1)
    d.finish(0, [7, 8], [9, 10])
    assert d.propose(1, [5, 8, 9], [], 3) == [10]  # (8, 9) occurred in request 0, followed by 10
    d.finish(1, [5, 8, 9], [])
    d.finish(2, [1, 1], [1])
    assert d.propose(3, [6, 8, 9], [], 3) == []  # request 0's tokens are gone from the table of one


def test_replay_proposes_the_recorded_continuation():
    d = ReplayDrafter({(1, 2): [5, 6, 7]})
    assert d.propose(0, (1, 2), [5], 4) == [6, 7] and d.propose(1, (3,), [], 4) == []


def test_draft_length_adapts_to_acceptance():
    s = Speculation(ReplayDrafter({(1,): list(range(100))}), max_draft=4)
    assert len(s.drafts(0, (1,), [], room=9)) == 4
    s.verified(0, proposed=4, accepted=1)
    assert len(s.drafts(0, (1,), [], room=9)) == 2
    s.verified(0, proposed=2, accepted=2)
    assert len(s.drafts(0, (1,), [], room=9)) == 3 and len(s.drafts(0, (1,), [], room=1)) == 1


@pytest.mark.parametrize("value, drafters, max_draft", [
    (None, (), 0), ("off", (), 0), ("ngram", ("ngram",), 4), ("ngram:7", ("ngram",), 7), ("mtp", ("mtp",), 1),
    ("mtp:3", ("mtp",), 3), ("ngram+mtp", ("ngram", "mtp"), 4), ("ngram+mtp:2", ("ngram", "mtp"), 2)])
def test_speculate_settings(value, drafters, max_draft):
    assert parse_speculate(value) == max_draft
    assert RuntimeSpec(speculate=value).drafters == drafters


@pytest.mark.parametrize("value", ["ngram:0", "ngram:x", "medusa", "ngram:-1", "", "mtp+ngram", "mtp:0"])
def test_bad_speculate_settings_say_what_is_accepted(value):
    with pytest.raises(ValueError, match=r"ngram, mtp, ngram\+mtp, each optionally :MAX_DRAFT"):
        parse_speculate(value)
    with pytest.raises(ValueError, match=r"ngram, mtp, ngram\+mtp, each optionally :MAX_DRAFT"):
        RuntimeSpec(speculate=value)


# ---- the policy --------------------------------------------------------------------------------------------------
def speculating(outputs, n_groups=2, max_draft=4, buckets=(1, 2, 4, 8)) -> Policy:
    return Policy(n_groups, 4, 4, buckets, 64, speculation=Speculation(ReplayDrafter(outputs), max_draft))


def layout(frame):
    return [(r.request_id, r.position, r.kind, r.token) for r in frame.rows]


def test_drafts_follow_their_decode_row_and_are_accepted_up_to_the_first_mismatch():
    p = speculating({(1, 2, 3): [9, 8, 7, 6, 5, 4]})
    p.add_request(Request(0, (1, 2, 3), 6))
    assert p.complete_frame(p.next_frame(0), [9]) == [Token(0, 9, 0)]
    f = p.next_frame(0)
    assert layout(f) == [(0, 3, DECODE, 9), (0, 4, DRAFT, 8), (0, 5, DRAFT, 7), (0, 6, DRAFT, 6), (0, 7, DRAFT, 5)]
    assert f.padded_rows == 8 and all(r.sampled for r in f.rows)
    # drafts 8 and 7 match the tokens sampled before them, 6 does not (7 was sampled where 6 was drafted)
    assert p.complete_frame(f, [8, 7, 1, 0, 0]) == [Token(0, 8, 1), Token(0, 7, 2), Token(0, 1, 3),
                                                    Verified(0, 4, 2)]
    f = p.next_frame(0)
    assert layout(f)[0] == (0, 6, DECODE, 1)  # the stream goes on where it stands: a rewind of two positions


def test_stop_ids_and_max_new_tokens_cut_accepted_drafts():
    p = speculating({(1, 2): [3, 4, 5, 6]})
    p.add_request(Request(0, (1, 2), 4, stop_ids={5}))
    p.complete_frame(p.next_frame(0), [3])
    f = p.next_frame(0)
    assert [r.token for r in f.rows] == [3, 4, 5]  # two drafts: the stream has three tokens left, one per row
    assert p.complete_frame(f, [4, 5, 6]) == [Token(0, 4, 1), Token(0, 5, 2), Verified(0, 2, 1),
                                              Finished(0, 0, STOP, 3)]


def test_speculation_only_with_idle_groups_and_rows_left_in_the_largest_bucket():
    outputs = {(i,): [1] * 20 for i in range(4)}
    p = speculating(outputs, n_groups=2, buckets=(1, 2, 4))
    p.add_request(Request(0, (0,), 20))
    first = p.next_frame(0)
    assert first.propose and not first.drafted  # a prompt's frame asks the last stage for drafts to come
    p.complete_frame(first, [1])
    assert [r.kind for r in p.next_frame(0).rows] == [DECODE, DRAFT, DRAFT, DRAFT]  # the largest bucket: 4 rows
    p.add_request(Request(1, (1,), 20))  # now every group holds a stream: no idle stage
    assert p.complete_frame(p.in_flight[0], [1] * 4) == [Token(0, 1, i) for i in (1, 2, 3, 4)] + [Verified(0, 3, 3)]
    busy = p.next_frame(0)
    assert [r.kind for r in busy.rows] == [DECODE] and not busy.propose
    plain = Policy(2, 4, 4, (1, 2, 4), 64)  # without speculation, never
    plain.add_request(Request(0, (0,), 3))
    assert not plain.next_frame(0).propose


def test_decode_and_prompt_rows_come_before_drafts():
    p = speculating({(i, i): [1] * 20 for i in range(4)}, n_groups=3, buckets=(1, 2, 4, 8))
    for i in range(2):
        p.add_request(Request(i, (i, i), 20))
    for g in (0, 1):
        p.complete_frame(p.next_frame(g), [1])
    p.cancel(1)
    p.add_request(Request(2, (2, 2, 2, 2, 2, 2, 2), 20))  # group 1: a prompt of 7 rows, 4 per window
    assert [r.kind for r in p.next_frame(1).rows] == [PREFILL] * 4
    f = p.next_frame(0)
    assert [r.kind for r in f.rows] == [DECODE] + [DRAFT] * 4  # max_draft 4 of the 7 rows left


def test_a_stream_without_drafts_in_a_drafted_frame_has_nothing_verified():
    p = speculating({(0,): [1] * 20})  # stream 2's prompt has no recorded continuation: no drafts
    for request in (Request(0, (0,), 20), Request(1, (1,), 1), Request(2, (2,), 20)):  # groups 0, 1 and 0
        p.add_request(request)
    f0 = p.next_frame(0)
    assert p.complete_frame(p.next_frame(1), [7]) == [Token(1, 7, 0), Finished(1, 1, LENGTH, 1)]  # group 1 idle
    p.complete_frame(f0, [1, 1])
    f = p.next_frame(0)
    assert layout(f) == [(0, 1, DECODE, 1)] + [(0, i, DRAFT, 1) for i in (2, 3, 4, 5)] + [(2, 1, DECODE, 1)]
    assert p.complete_frame(f, [1, 1, 1, 1, 1, 3]) == [Token(0, 1, i) for i in (1, 2, 3, 4, 5)] + [
        Verified(0, 4, 4), Token(2, 3, 1)]


# ---- exactness: a stand-in stage that rewinds ----------------------------------------------------------------------
class RewindingModel:
    """A last stage that samples from its streams' tokens (a hash of the tokens up to the row), and takes rows that
    start up to `rewind` positions before where a stream's state stands, dropping what lies beyond: what a stage
    does, without tensors."""

    def __init__(self, rewind: int):
        self.rewind = rewind
        self.tokens: dict[int, list[int]] = {}

    def run(self, frame) -> list[int]:
        sampled = []
        for row in frame.rows:
            held = self.tokens.setdefault(row.slot, [])
            if row.position == 0:
                held.clear()
            assert len(held) - self.rewind <= row.position <= len(held), "a row its stream cannot continue from"
            del held[row.position:]
            held.append(row.token)
            if row.sampled:
                sampled.append(zlib.crc32(bytes(str(held), "ascii")) % 5)  # few tokens: drafts often match
        return sampled


class WrongDrafter:
    """Proposes a token that is never the one sampled (the stand-in samples 0..4)."""

    def propose(self, request_id, prompt, output, limit):
        return [99] * limit

    def finish(self, request_id, prompt, output):
        pass


def serve(requests, n_groups, drafter=None, max_draft=3, draw=lambda options: options[0]):
    """Each request's output tokens, and the Verified events."""
    speculation = Speculation(drafter, max_draft) if drafter is not None else None
    p = Policy(n_groups, 4, 3, (1, 2, 4), 64, speculation=speculation)
    model, outputs, verified, in_flight = RewindingModel(max_draft if drafter else 0), {}, [], {}
    for request in requests:
        p.add_request(request)
    while not p.done:
        for f in p.next_frames():
            in_flight[f.group] = f
        f = in_flight.pop(draw(sorted(in_flight)))
        for e in p.complete_frame(f, model.run(f)):
            if isinstance(e, Token):
                outputs.setdefault(e.request_id, []).append(e.token)
            verified += [e] if isinstance(e, Verified) else []
    return outputs, verified


requests_st = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(requests=requests_st, n_groups=st.integers(1, 4), max_draft=st.integers(1, 4), data=st.data())
def test_speculation_gives_the_tokens_of_a_run_without_it(requests, n_groups, max_draft, data):
    requests = [Request(i, tuple((i + j) % 3 for j in range(n)), m, stop_ids={4} if stop else ())
                for i, (n, m, stop) in enumerate(requests)]
    expected, _ = serve(requests, n_groups)
    draw = lambda options: data.draw(st.sampled_from(options))  # noqa: E731 (frames come back in any order)
    prompts = {r.prompt_ids: expected[r.id] for r in requests}
    for drafter in (NgramDrafter(min_n=1, max_n=2), ReplayDrafter(prompts), WrongDrafter()):
        outputs, verified = serve(requests, n_groups, drafter, max_draft, draw)
        assert outputs == expected, type(drafter).__name__
        if isinstance(drafter, WrongDrafter):
            assert all(v.accepted == 0 for v in verified)
        if isinstance(drafter, ReplayDrafter):  # every draft right: only a stream's end cuts its last step
            last = {v.request_id: v for v in verified}
            assert all(v.accepted == v.proposed for v in verified if v is not last[v.request_id])


def test_the_replay_drafter_takes_a_lone_stream_to_its_end_in_fewer_frames():
    request = Request(0, (1, 2, 1, 2), 12)
    expected, _ = serve([request], n_groups=2)
    outputs, verified = serve([request], 2, ReplayDrafter({request.prompt_ids: expected[0]}))
    assert outputs == expected
    assert [(v.proposed, v.accepted) for v in verified] == [(3, 3)] * 2 + [(2, 2)]  # then one last plain decode


@pytest.mark.parametrize("value, problem", [("ngram:3", None), ("ngram:0", "runtime.speculate"),
                                            ("lookahead", "runtime.speculate")])
def test_the_spec_runtime_may_speculate(tmp_path, value, problem):
    text = TINY_SPEC.read_text().replace("runtime:\n", f"runtime:\n  speculate: {value}\n")
    (tmp_path / "spec.yaml").write_text(text.replace("hf_config: tiny/", f"hf_config: {TINY_SPEC.parent}/tiny/"))
    if problem is None:
        assert load_spec(tmp_path / "spec.yaml").runtime.max_draft == 3
    else:
        with pytest.raises(SpecError, match=rf"{problem}.*ngram, mtp, ngram\+mtp, each optionally :MAX_DRAFT"):
            load_spec(tmp_path / "spec.yaml")
