import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadia.policy import (CANCELLED, DECODE, LENGTH, PREFILL, STOP, Admitted, Finished, KVPool, Policy, Rejected,
                             Request, Row, Token, padded_size)
from cascadia.sampling import Sampling


def policy(n_groups=1, max_streams=4, prefill_window=8, row_buckets=(2, 8), context_budget=64):
    return Policy(n_groups, max_streams, prefill_window, row_buckets, context_budget)


def test_requests_wait_for_kv_blocks_and_one_that_never_fits_is_rejected_with_the_numbers():
    """Two nodes' pools for 4 slots: 9 blocks with global layers (a stream holds 2 for its rings and one per 8
    positions), 6 without (2 for its rings). A request holds the blocks of its prompt + max_new_tokens from admission
    to its end; the next waits (in order, though a slot is free) until they are given back."""
    p = Policy(1, 4, 8, (2, 8), context_budget=64, kv_pools=[KVPool(9, 2), KVPool(6, 2, paged=False)], kv_block=8)
    assert p.add_request(Request(0, tuple(range(20)), 4)) == [Admitted(0, 0, 0)]  # 24 positions: 3 blocks and rings
    assert p.add_request(Request(1, tuple(range(10)), 7)) == []  # 17: 3 blocks and rings, 4 free
    assert p.add_request(Request(2, (1,), 1)) == []  # behind request 1
    assert (p.held_blocks, p.waiting) == ([5, 2], 2)
    [rejected] = p.add_request(Request(3, tuple(range(48)), 10))
    assert rejected == Rejected(3, "prompt (48 tokens) + max_new_tokens (10) = 58 positions need 10 K/V blocks of "
                                   "8 (with 2 for its rings), more than a node's pool of 9 (56 positions)")
    events = []
    while not any(isinstance(e, Finished) for e in events):
        f = p.next_frame(0)
        events = p.complete_frame(f, [9] * len(f.sampled_ids))
    assert events[-2:] == [Admitted(1, 0, 0), Admitted(2, 1, 0)] and p.held_blocks == [8, 4]


def test_a_node_without_global_layers_bounds_the_streams_by_their_rings():
    """A pool of 5 blocks where each stream's rings take 2: two streams at once, however short."""
    p = Policy(1, 4, 8, (2, 8), context_budget=64, kv_pools=[KVPool(5, 2, paged=False)], kv_block=8)
    events = [e for i in range(3) for e in p.add_request(Request(i, (1,), 1))]
    assert events == [Admitted(0, 0, 0), Admitted(1, 1, 0)] and p.waiting == 1


def test_a_64k_prompt_enters_in_hundreds_of_frames_while_another_stream_decodes_in_every_one():
    """prefill_window is the per-frame budget of prompt tokens: with 256 and a row bucket of 264 for prefill frames
    (256 prompt rows beside up to 8 decode rows; decode frames, of a few rows, pad to the small buckets), a
    65,536-token prompt takes 256 frames, and the stream already decoding gets a token from each of them: it waits
    at most one chunk."""
    p = Policy(1, 2, 256, (1, 2, 8, 32, 264), context_budget=70_000, kv_block=64)
    p.add_request(Request(0, (5,), 300))
    p.complete_frame(f := p.next_frame(0), [1])
    p.add_request(Request(1, tuple(range(65_536)), 1))
    frames = []
    while len(frames) < 300:
        frames.append(f := p.next_frame(0))
        events = p.complete_frame(f, [7] * len(f.sampled_ids))
        if any(isinstance(e, Token) and e.request_id == 1 for e in events):
            break
    assert len(frames) == 256
    assert all(sum(r.kind == PREFILL for r in f.rows) == 256 and f.rows[0].kind == DECODE for f in frames)
    assert {f.padded_rows for f in frames} == {264}
    assert shape(p.next_frame(0)) == (0, 1, [(0, 257, DECODE, 7, True)])


def shape(frame):
    """A frame as (group, padded rows, [(request, position, kind, token, sampled)]) for golden comparisons."""
    return frame.group, frame.padded_rows, [(r.request_id, r.position, r.kind, r.token, r.sampled) for r in frame.rows]


@pytest.mark.parametrize("rows, padded", [(1, 2), (2, 2), (3, 8), (8, 8), (9, 16), (32, 32), (33, 64), (65, 96)])
def test_padding_to_buckets(rows, padded):
    assert padded_size(rows, (2, 8, 16, 24, 32)) == padded


def test_single_stream_prefill_then_decode():
    p = policy()
    assert p.add_request(Request(7, (11, 12, 13), 2)) == [Admitted(7, 0, 0)]
    f = p.next_frame(0)
    assert shape(f) == (0, 8, [(7, 0, PREFILL, 11, False), (7, 1, PREFILL, 12, False), (7, 2, PREFILL, 13, True)])
    assert f.rows[0] == Row(slot=0, request_id=7, position=0, kind=PREFILL, token=11, sampled=False)
    assert p.next_frame(0) is None  # one frame in flight per group
    assert p.complete_frame(f, [40]) == [Token(7, 40, 0)]
    f = p.next_frame(0)
    assert shape(f) == (0, 2, [(7, 3, DECODE, 40, True)])
    assert p.complete_frame(f, [41]) == [Token(7, 41, 1), Finished(7, 0, LENGTH, 2)]
    assert p.done and p.idle and p.next_frame(0) is None


def test_long_prompt_is_chunked_while_others_keep_decoding():
    p = policy(prefill_window=4)
    p.add_request(Request(0, (1,), 3))
    f = p.next_frame(0)
    p.complete_frame(f, [100])
    p.add_request(Request(1, tuple(range(20, 30)), 1))  # 10 prompt tokens: chunks of 4, 4, 2
    frames = []
    for token in (101, 102):
        frames.append(f := p.next_frame(0))
        p.complete_frame(f, [token])
    frames.append(f := p.next_frame(0))
    events = p.complete_frame(f, [555])
    assert [shape(f) for f in frames] == [
        (0, 8, [(0, 1, DECODE, 100, True)] + [(1, i, PREFILL, 20 + i, False) for i in range(4)]),
        (0, 8, [(0, 2, DECODE, 101, True)] + [(1, i, PREFILL, 20 + i, False) for i in range(4, 8)]),
        (0, 2, [(1, 8, PREFILL, 28, False), (1, 9, PREFILL, 29, True)]),
    ]
    assert events == [Token(1, 555, 0), Finished(1, 1, LENGTH, 1)]


def test_window_is_shared_by_several_prompts_oldest_first():
    p = policy(prefill_window=4)
    p.add_request(Request(0, (1, 2, 3), 1))
    p.add_request(Request(1, (4, 5, 6), 1))
    assert shape(p.next_frame(0))[2] == [(0, 0, PREFILL, 1, False), (0, 1, PREFILL, 2, False),
                                         (0, 2, PREFILL, 3, True), (1, 0, PREFILL, 4, False)]


def test_groups_slots_and_waiting_requests():
    p = policy(n_groups=2, max_streams=2)
    events = [e for i in range(3) for e in p.add_request(Request(i, (1,), 1 + i))]
    assert events == [Admitted(0, 0, 0), Admitted(1, 1, 1)]  # request 2 waits for a slot
    assert (p.waiting, p.active) == (1, 2)
    f0, f1 = p.next_frame(0), p.next_frame(1)
    assert [f.group for f in p.in_flight] == [0, 1]
    # group 1 finishes nothing yet; group 0's stream finishes and frees slot 0 for request 2, which joins group 0
    assert p.complete_frame(f1, [5]) == [Token(1, 5, 0)]
    assert p.complete_frame(f0, [5]) == [Token(0, 5, 0), Finished(0, 0, LENGTH, 1), Admitted(2, 0, 0)]
    assert shape(p.next_frame(0)) == (0, 2, [(2, 0, PREFILL, 1, True)])


def test_new_request_joins_least_populated_group():
    p = policy(n_groups=3, max_streams=8)
    admitted = [e for i in range(5) for e in p.add_request(Request(i, (1,), 3))]
    assert [e.group for e in admitted] == [0, 1, 2, 0, 1]
    p.complete_frame(p.next_frame(2), [9])
    p.complete_frame(p.next_frame(2), [9])
    events = p.complete_frame(p.next_frame(2), [9])
    assert events[-1] == Finished(2, 2, LENGTH, 3)
    assert p.add_request(Request(5, (1,), 1)) == [Admitted(5, 2, 2)]  # group 2 is now the emptiest


def test_stop_token_finishes_early():
    p = policy()
    p.add_request(Request(0, (1,), 10, stop_ids={2}))
    p.complete_frame(p.next_frame(0), [5])
    assert p.complete_frame(p.next_frame(0), [2]) == [Token(0, 2, 1), Finished(0, 0, STOP, 2)]


def test_context_budget_rejects_with_reason():
    p = policy(context_budget=10)
    [event] = p.add_request(Request(0, tuple(range(6)), 5))
    assert isinstance(event, Rejected) and "6 tokens" in event.reason and "budget of 10" in event.reason
    assert p.done
    assert p.add_request(Request(1, tuple(range(6)), 4)) == [Admitted(1, 0, 0)]


@pytest.mark.parametrize("request_, message", [
    (Request(0, (), 1), "empty prompt"),
    (Request(0, (1,), 0), "max_new_tokens must be at least 1"),
])
def test_invalid_requests(request_, message):
    with pytest.raises(ValueError, match=message):
        policy().add_request(request_)


def test_misuse_is_an_error():
    p = policy()
    p.add_request(Request(0, (1,), 2))
    with pytest.raises(ValueError, match="already added"):
        p.add_request(Request(0, (1,), 2))
    f = p.next_frame(0)
    with pytest.raises(ValueError, match="samples 1 rows, got 0 tokens"):
        p.complete_frame(f, [])
    with pytest.raises(TypeError, match="in row order"):
        p.complete_frame(f, {0: 1})
    p.complete_frame(f, [1])
    with pytest.raises(ValueError, match="not in flight"):
        p.complete_frame(f, [1])
    with pytest.raises(ValueError, match="group 1 is not in 0..0"):
        p.next_frame(1)
    with pytest.raises(ValueError, match="row_buckets"):
        Policy(1, 1, 8, (8, 2), 10)


# ---- properties over random workloads, arrival times and completion orders ------------------------------------
requests_st = st.lists(st.tuples(st.integers(1, 25), st.integers(1, 8)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(requests=requests_st, n_groups=st.integers(1, 4), max_streams=st.integers(1, 6),
       window=st.integers(1, 9), data=st.data())
def test_properties(requests, n_groups, max_streams, window, data):
    p = Policy(n_groups, max_streams, window, (2, 8, 16), context_budget=30)
    pending = [Request(i, tuple(range(100 + i, 100 + i + n)), m) for i, (n, m) in enumerate(requests)]
    outputs: dict[int, list[int]] = {}
    positions: dict[int, list[int]] = {}
    group_of: dict[int, int] = {}
    finished, rejected, decoding = set(), set(), set()
    in_flight = {}

    def observe(events):
        for e in events:
            if isinstance(e, Rejected):
                rejected.add(e.request_id)
            elif isinstance(e, Admitted):
                group_of[e.request_id] = e.group
            elif isinstance(e, Token):
                outputs.setdefault(e.request_id, []).append(e.token)
                decoding.add(e.request_id)
            elif isinstance(e, Finished):
                finished.add(e.request_id)
                decoding.discard(e.request_id)

    while pending or in_flight or not p.done:
        if pending and (not in_flight or data.draw(st.booleans())):  # requests arrive at random moments
            observe(p.add_request(pending.pop(0)))
        for g in range(n_groups):
            if (f := p.next_frame(g)) is None:
                continue
            assert g not in in_flight
            in_flight[g] = f
            assert sum(r.kind == PREFILL for r in f.rows) <= window
            assert f.padded_rows >= len(f.rows)
            # every decoding stream of the group has its row: admitting prompts never stalls decoding
            assert {r.request_id for r in f.rows if r.kind == DECODE} == {s for s in decoding if group_of[s] == g}
        owners = {}
        for f in in_flight.values():
            for r in f.rows:
                assert owners.setdefault(r.slot, r.request_id) == r.request_id  # no slot shared by two streams
                assert group_of[r.request_id] == f.group
        if in_flight:
            f = in_flight.pop(data.draw(st.sampled_from(sorted(in_flight))))  # frames return in any order
            for r in f.rows:
                positions.setdefault(r.request_id, []).append(r.position)
            observe(p.complete_frame(f, [7] * len(f.sampled_ids)))
    assert p.idle
    for i, (n, m) in enumerate(requests):
        if n + m > 30:
            assert i in rejected and i not in positions
            continue
        assert i in finished and len(outputs[i]) == m
        assert positions[i] == list(range(n + m - 1))  # contiguous, each position once, in order


def test_decoding_streams_get_a_row_in_every_frame_while_a_prompt_is_admitted():
    p = policy(max_streams=8, prefill_window=8, context_budget=1000)
    for i in range(3):
        p.add_request(Request(i, (1,), 50))
    p.complete_frame(p.next_frame(0), [1, 1, 1])
    p.add_request(Request(3, tuple(range(100)), 1))
    for chunk in range(13):  # 100 prompt rows in windows of 8
        f = p.next_frame(0)
        assert [r.request_id for r in f.rows if r.kind == DECODE] == [0, 1, 2]
        assert sum(r.kind == PREFILL for r in f.rows) == min(8, 100 - 8 * chunk)
        p.complete_frame(f, [1] * len(f.sampled_ids))


# ---- cancellation -------------------------------------------------------------------------------------------------
def test_cancelling_a_waiting_request_takes_it_out_of_the_queue():
    p = policy(max_streams=1)
    p.add_request(Request(0, (1,), 5))
    p.add_request(Request(1, (2,), 5))
    assert p.waiting == 1
    assert p.cancel(1) == [Finished(1, None, CANCELLED, 0)]
    assert p.waiting == 0 and p.cancel(1) == [] and p.cancel(99) == []  # once; unknown ids are no error


def test_cancelling_an_idle_stream_frees_its_slot_at_once_for_the_next_waiting_request():
    p = policy(max_streams=1)
    p.add_request(Request(0, (1,), 5))
    p.add_request(Request(1, (2,), 5))
    f = p.next_frame(0)
    p.complete_frame(f, [9])  # request 0 decodes, nothing in flight
    assert p.cancel(0) == [Finished(0, 0, CANCELLED, 1), Admitted(1, 0, 0)]
    assert [r.request_id for r in p.next_frame(0).rows] == [1]


def test_a_stream_cancelled_with_its_rows_in_flight_is_freed_when_that_frame_completes_without_its_token():
    p = policy(max_streams=1)
    p.add_request(Request(0, (1, 2), 5))
    p.add_request(Request(1, (3,), 5))
    f = p.next_frame(0)
    assert p.cancel(0) == []  # the nodes are still writing its state
    assert p.complete_frame(f, [9]) == [Finished(0, 0, CANCELLED, 0), Admitted(1, 0, 0)]
    assert p.cancel(0) == []


@settings(max_examples=150, deadline=None)
@given(requests=requests_st, n_groups=st.integers(1, 3), max_streams=st.integers(1, 4), data=st.data())
def test_cancels_at_random_moments_free_every_slot_and_silence_the_stream(requests, n_groups, max_streams, data):
    p = Policy(n_groups, max_streams, 4, (2, 8, 16), context_budget=30)
    pending = [Request(i, tuple(range(1, n + 1)), m) for i, (n, m) in enumerate(requests)]
    ended: dict[int, str] = {}
    cancelled_at: set[int] = set()
    in_flight = {}

    def observe(events):
        for e in events:
            if isinstance(e, Token):
                assert e.request_id not in cancelled_at  # no token after the cancel call returned
            elif isinstance(e, (Finished, Rejected)):
                assert e.request_id not in ended  # one end each
                ended[e.request_id] = e.reason if isinstance(e, Finished) else "rejected"

    while pending or in_flight or not p.done:
        action = data.draw(st.sampled_from(["add", "cancel", "complete"]))
        if action == "add" and pending:
            observe(p.add_request(pending.pop(0)))
        elif action == "cancel":
            request_id = data.draw(st.integers(0, len(requests) - 1))
            if request_id not in ended and not any(r.id == request_id for r in pending):
                cancelled_at.add(request_id)
            observe(p.cancel(request_id))
        for g in range(n_groups):
            if (f := p.next_frame(g)) is not None:
                in_flight[g] = f
                assert not {r.request_id for r in f.rows} & (cancelled_at - set(ended))  # no new rows once cancelled
        if in_flight and (action == "complete" or not pending):
            f = in_flight.pop(data.draw(st.sampled_from(sorted(in_flight))))
            observe(p.complete_frame(f, [7] * len(f.sampled_ids)))
    assert p.idle and p.active == 0 and set(ended) == set(range(len(requests)))
    assert all(ended[i] == CANCELLED for i in cancelled_at)


# ---- replay: the nodes lost every stream's state ------------------------------------------------------------------
class FakeModel:
    """A stage that samples from its streams' tokens: a row at position 0 starts its slot afresh (as a stage does), a
    row that forks another slot starts it as a copy of that one as it stands before the frame, and each sampled
    token is a hash of the stream's seed and the tokens it holds, so any state a replay or fork got wrong shows."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}
        self.rows = 0  # computed

    def run(self, frame):
        for row in frame.rows:
            if row.fork >= 0:
                assert len(self.tokens[row.fork]) == row.position, "a fork of a stream not where it stands"
                self.tokens[row.slot] = self.tokens[row.fork][:]
        sampled = []
        for row in frame.rows:
            held = self.tokens.setdefault(row.slot, [])
            if row.position == 0:
                held.clear()
            assert row.position == len(held), "a row not at its stream's next position"
            held.append(row.token)
            if row.sampled:
                sampled.append(zlib.crc32(bytes(str((row.sampling.seed, held)), "ascii")) % 50)
        self.rows += len(frame.rows)
        return sampled


def serve_all(requests, n_groups, max_streams, replay_at=frozenset(), draw=lambda options: options[0], rows=None):
    """Every request through a policy and FakeModel (a list of requests: the choices of one prompt); with
    `replay_at`, the nodes lose their state (`replay`, and a fresh FakeModel) after those frame completions. Each
    request's output tokens; the rows computed added to `rows`."""
    p = Policy(n_groups, max_streams, 3, (2, 8, 16), context_budget=40)
    model, outputs, in_flight, completions = FakeModel(), {}, {}, 0
    for request in requests:
        p.add_choices(request) if isinstance(request, list) else p.add_request(request)
    while not p.done:
        for g in range(n_groups):
            if (f := p.next_frame(g)) is not None:
                in_flight[g] = f
        f = in_flight.pop(draw(sorted(in_flight)))
        for e in p.complete_frame(f, model.run(f)):
            if isinstance(e, Token):
                outputs.setdefault(e.request_id, []).append(e.token)
        completions += 1
        if completions in replay_at:
            in_flight.clear()  # frames in flight are lost with the node
            model = FakeModel()
            p.replay()
    if rows is not None:
        rows.append(model.rows)
    return outputs


@settings(max_examples=100, deadline=None)
@given(requests=requests_st, n_groups=st.integers(1, 3), max_streams=st.integers(1, 5),
       replay_at=st.sets(st.integers(1, 40), max_size=4), data=st.data())
def test_a_replay_at_any_moment_gives_the_tokens_of_a_run_without_one(requests, n_groups, max_streams, replay_at,
                                                                      data):
    requests = [Request(i, tuple(range(1 + i, 1 + i + min(n, 20))), m) for i, (n, m) in enumerate(requests)]
    expected = serve_all(requests, n_groups, max_streams)
    draw = lambda options: data.draw(st.sampled_from(options))  # noqa: E731 (frames come back in any order)
    assert serve_all(requests, n_groups, max_streams, replay_at, draw) == expected


def test_a_replay_onto_a_new_plan_takes_its_pool_and_rejects_what_can_never_fit_it():
    """Pools of 6 blocks of 8 positions, then of 4 (the survivors of a loss hold more layers each)."""
    p = Policy(1, 4, 8, (2, 8), context_budget=64, kv_pools=[KVPool(6)], kv_block=8)
    p.add_request(Request(0, tuple(range(20)), 4))  # 3 blocks
    p.add_request(Request(1, tuple(range(20)), 20))  # 5 blocks: waits
    assert (p.fits([KVPool(3)]), p.fits([KVPool(2)]), p.fits([KVPool(3, 1)]), p.fits([])) == (True, False, False, True)
    with pytest.raises(ValueError, match=r"the streams hold \[3\] K/V blocks, more than the pools' \[2\]"):
        p.replay([KVPool(2)])
    [rejected] = p.replay([KVPool(4)])
    assert rejected == Rejected(1, "prompt (20 tokens) + max_new_tokens (20) = 40 positions need 5 K/V blocks of "
                                   "8, more than a node's pool of 4 (32 positions)")
    assert (p.kv_pools, p.held_blocks, p.waiting, p.active) == ((KVPool(4),), [3], 0, 1)


def test_a_replay_prefills_each_stream_again_then_decodes():
    p = policy(prefill_window=4)
    p.add_request(Request(0, (5, 6, 7), 4))
    first = p.next_frame(0)
    p.complete_frame(first, [9])
    p.complete_frame(p.next_frame(0), [8])  # output so far: 9, 8; in flight: the row of 8
    p.next_frame(0)
    assert p.replay() == []
    again = p.next_frame(0)
    assert [(r.position, r.token, r.kind, r.sampled) for r in again.rows] == [
        (0, 5, PREFILL, False), (1, 6, PREFILL, False), (2, 7, PREFILL, False), (3, 9, PREFILL, False)]
    assert p.complete_frame(again, []) == []  # no row of it is sampled: the window ended before the last
    rest = p.next_frame(0)
    assert [(r.position, r.token, r.sampled) for r in rest.rows] == [(4, 8, True)]
    assert p.complete_frame(rest, [3]) == [Token(0, 3, 2)]


# ---- choices of one prompt ------------------------------------------------------------------------------------------
def choices(first_id, prompt, max_new_tokens, n, **sampling):
    return [Request(first_id + i, prompt, max_new_tokens, sampling=Sampling(seed=first_id + i, **sampling))
            for i in range(n)]


def test_choices_of_a_prompt_fork_the_first_before_its_last_row():
    p = policy(prefill_window=8)
    assert p.add_choices(choices(1, (11, 12, 13, 14), 2, 3)) == [Admitted(1, 0, 0), Admitted(2, 1, 0),
                                                                 Admitted(3, 2, 0)]
    f = p.next_frame(0)
    assert shape(f)[2] == [(1, 0, PREFILL, 11, False), (1, 1, PREFILL, 12, False), (1, 2, PREFILL, 13, False)]
    assert p.complete_frame(f, []) == []
    f = p.next_frame(0)
    assert [(r.slot, r.request_id, r.position, r.token, r.sampled, r.fork) for r in f.rows] == [
        (0, 1, 3, 14, True, -1), (1, 2, 3, 14, True, 0), (2, 3, 3, 14, True, 0)]
    assert p.complete_frame(f, [40, 41, 42]) == [Token(1, 40, 0), Token(2, 41, 0), Token(3, 42, 0)]
    f = p.next_frame(0)
    assert shape(f)[2] == [(1, 4, DECODE, 40, True), (2, 4, DECODE, 41, True), (3, 4, DECODE, 42, True)]
    # a one-token prompt: nothing to fork, every choice starts at position 0 in the first frame
    p = policy()
    p.add_choices(choices(1, (11,), 2, 2))
    assert [(r.request_id, r.position, r.sampled, r.fork) for r in p.next_frame(0).rows] == [(1, 0, True, -1),
                                                                                            (2, 0, True, -1)]


def test_choices_wait_for_slots_and_blocks_for_all_of_them_and_are_rejected_together():
    p = Policy(1, 3, 8, (2, 8), context_budget=64, kv_pools=[KVPool(9)], kv_block=8)
    p.add_request(Request(0, tuple(range(20)), 4))  # 3 blocks, a slot
    assert p.add_choices(choices(1, (5, 6), 10, 2)) == [Admitted(1, 1, 0), Admitted(2, 2, 0)]  # 2 blocks each
    assert p.add_choices(choices(3, (5, 6), 10, 2)) == [] and p.waiting == 2  # no slot for them
    p.cancel(0)
    assert p.waiting == 2  # one slot free, not two
    assert p.add_choices(choices(5, tuple(range(30)), 10, 3)) == [
        Rejected(i, "prompt (30 tokens) + max_new_tokens (10) = 40 positions need 5 K/V blocks of 8 each, 3 choices, "
                    "more than a node's pool of 9 (72 positions)") for i in (5, 6, 7)]
    with pytest.raises(ValueError, match="request 9 is not a choice of request 8's prompt"):
        p.add_choices([Request(8, (1, 2), 3), Request(9, (1, 3), 3)])
    with pytest.raises(ValueError, match="4 choices of one prompt need as many slots, more than max_streams"):
        p.add_choices(choices(10, (1, 2), 3, 4))


def test_a_choice_cancelled_before_it_forks_and_choices_of_a_cancelled_first_go_on():
    p = policy(prefill_window=2)
    p.add_choices(choices(1, (11, 12, 13, 14), 3, 3))
    p.complete_frame(p.next_frame(0), [])  # positions 0, 1 of request 1
    assert p.cancel(2) == [Finished(2, 1, CANCELLED, 0)]
    assert [(r.request_id, r.position, r.fork) for r in p.next_frame(0).rows] == [(1, 2, -1)]
    p = policy(prefill_window=2)
    p.add_choices(choices(1, (11, 12, 13, 14), 3, 3))
    p.complete_frame(p.next_frame(0), [])
    assert p.cancel(1) == [Finished(1, 0, CANCELLED, 0)]
    assert [(r.request_id, r.position, r.fork) for r in p.next_frame(0).rows] == [(2, 0, -1), (2, 1, -1)]


@settings(max_examples=100, deadline=None)
@given(families=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(1, 3)), min_size=1, max_size=6),
       n_groups=st.integers(1, 3), max_streams=st.integers(3, 5), replay_at=st.sets(st.integers(1, 40), max_size=3),
       data=st.data())
def test_each_choice_gets_the_tokens_of_its_request_alone_its_prompt_computed_once(families, n_groups, max_streams,
                                                                                   replay_at, data):
    """Choices of a prompt (each with its seed) give the tokens of the same requests served one by one, frames
    coming back in any order, through replays at any moment; without replays, each prompt is computed once and
    one row more per further choice."""
    asked = [choices(10 * i, tuple(range(1 + i, 1 + i + n)), m, k) for i, (n, m, k) in enumerate(families)]
    alone, shared = [], []
    expected = serve_all([r for family in asked for r in family], n_groups, max_streams, rows=alone)
    assert serve_all(asked, n_groups, max_streams, rows=shared) == expected
    assert alone[0] - shared[0] == sum((len(f) - 1) * (len(f[0].prompt_ids) - 1) for f in asked)
    draw = lambda options: data.draw(st.sampled_from(options))  # noqa: E731 (frames come back in any order)
    assert serve_all(asked, n_groups, max_streams, replay_at, draw) == expected
