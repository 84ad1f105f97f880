import struct

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascadia.pipeline import wire
from cascadia.pipeline.wire import (VERSION, Assign, Decoder, Encoder, Error, Frame, Hello, Invite, Probe, Progress,
                                    Ready, Shutdown, Stats, StatsRequest, Timed, Tokens, WireError, decode, encode)
from cascadia.sampling import MAX_LOGPROBS, LogitAdjustments
from cascadia.wire_format import frame_bytes, tokens_bytes

# No per-example deadline: the suite runs on shared, busy machines.
PROPERTY = settings(max_examples=60, deadline=None)
FLOAT_DTYPES = st.sampled_from([np.float32, np.float16])
IDS = st.integers(0, 2**31 - 1)
NAMES = st.text(max_size=20)


@st.composite
def frames(draw, min_rows=0):
    n = draw(st.integers(min_rows, 6))
    hidden = draw(st.integers(0, 5))
    ints = st.lists(IDS, min_size=n, max_size=n)
    residual = None
    if hidden:
        values = draw(st.lists(st.floats(-1e4, 1e4, width=16), min_size=n * hidden, max_size=n * hidden))
        residual = np.array(values, dtype=draw(FLOAT_DTYPES)).reshape(n, hidden)
    sample = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # sampled rows only, and never for no rows (as the policy makes them)
    propose = [s and draw(st.booleans()) for s in sample] if n and draw(st.booleans()) else None
    return Frame(draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)), draw(ints), draw(ints), draw(ints),
                 sample, residual, draw(st.integers(0, 2**32 - 1)),
                 draw(st.lists(st.floats(0, 4), min_size=n, max_size=n)),
                 draw(st.lists(st.floats(0, 1, exclude_min=True), min_size=n, max_size=n)),
                 draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
                 draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
                 draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)),
                 draw(st.lists(st.integers(-1, MAX_LOGPROBS), min_size=n, max_size=n)), propose=propose)


@st.composite
def tokens(draw, min_rows=0):
    n = draw(st.integers(min_rows, 6))
    vocab = draw(st.integers(0, 7))
    logits = np.array(draw(st.lists(st.floats(-1e4, 1e4, width=16), min_size=n * vocab, max_size=n * vocab)),
                      dtype=draw(FLOAT_DTYPES)).reshape(n, vocab) if vocab else None
    ints = st.lists(IDS, min_size=n, max_size=n)
    reported = (None, None, None)
    if n and draw(st.booleans()):  # as a last stage sends them: never for no rows
        k = draw(st.integers(0, 3))
        reported = tuple(np.array(draw(st.lists(values, min_size=size, max_size=size)), dtype).reshape(shape)
                         for values, dtype, size, shape in (
                             (st.floats(-1e4, 0), np.float64, n, (n,)),
                             (IDS, np.int32, n * k, (n, k)),
                             (st.floats(-1e4, 0), np.float64, n * k, (n, k))))
    drafts = head_inputs = None
    if n and draw(st.booleans()):  # the MTP layer's drafts, and what the head read (scoring): never for no rows
        k, width = draw(st.integers(1, 3)), draw(st.integers(1, 5))
        drafts = np.array(draw(st.lists(st.integers(-1, 2**31 - 1), min_size=n * k, max_size=n * k))).reshape(n, k)
        head_inputs = np.array(draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=n * width,
                                             max_size=n * width)), np.float32).reshape(n, width)
    return Tokens(draw(IDS), draw(IDS), draw(ints), draw(ints), logits, *reported, drafts, head_inputs)


CONTROLS = st.one_of(
    st.builds(Hello, NAMES, st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1), st.text(max_size=20)),
    st.builds(Ready, NAMES, st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)),
    st.builds(Progress, NAMES, st.integers(0, 2**40), st.integers(0, 2**40)),
    st.just(Shutdown()),
    st.builds(Error, NAMES, st.text(max_size=200)),
    st.just(StatsRequest()),
    st.builds(Stats, NAMES, st.floats(0, 1e6), st.integers(0, 2**63), st.integers(0, 2**63), st.floats(0, 1e6),
              st.lists(st.tuples(st.integers(0, 2**63), st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 1e6)),
                       max_size=4).map(tuple)),
    st.builds(Assign, st.text(max_size=200), NAMES, st.text(max_size=200)),
    st.builds(Invite, st.text(max_size=200), st.text(max_size=200), NAMES, NAMES),
    st.builds(Probe, NAMES, NAMES, st.lists(st.integers(0, 2**63), max_size=3).map(tuple), st.binary(max_size=64)),
    st.builds(Timed, NAMES, st.lists(st.floats(0, 1e6), max_size=3).map(tuple)),
)
MESSAGES = st.one_of(frames(), tokens(), CONTROLS)


def as_bytes(message_frames) -> list[bytes]:
    """What a receiver gets: every frame as separate bytes."""
    return [memoryview(f).tobytes() for f in message_frames]


def stamped(parts: list[bytes]) -> list[bytes]:
    """Buffers edited on purpose, with the header's count of their bytes made to agree, so that what is checked is
    their content."""
    body = sum(map(len, parts[1:]))
    return [parts[0][:_BODY] + struct.pack("<Q", body) + parts[0][_BODY + 8:], *parts[1:]]


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name in a.__attrs_attrs__:
        x, y = getattr(a, name.name), getattr(b, name.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


@PROPERTY
@given(MESSAGES, st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_round_trip(message, sender, seq):
    received = decode(as_bytes(encode(message, sender, seq)))
    assert (received.sender, received.seq) == (sender, seq)
    assert_same(received.message, message)


def test_frame_without_residual_is_what_the_first_role_receives():
    frame = decode(as_bytes(encode(Frame(1, 0, [3], [0], [42], [True]), 0, 1))).message
    assert frame.residual is None and frame.token_ids.tolist() == [42] and frame.sample.tolist() == [True]


@PROPERTY
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_are_rejected(raw):
    with pytest.raises(WireError):
        decode(raw)


@PROPERTY
@given(st.one_of(frames(), tokens()), st.data())
def test_any_truncation_is_rejected(message, data):
    parts = as_bytes(encode(message, 1, 1))
    i = data.draw(st.sampled_from([i for i, p in enumerate(parts) if p]), label="frame")
    cut = data.draw(st.integers(0, len(parts[i]) - 1), label="new length")
    parts[i] = parts[i][:cut]
    with pytest.raises(WireError):  # even a cut that would leave a well-formed message: an optional array gone
        decode(parts)


@PROPERTY
@given(MESSAGES, st.data())
def test_missing_or_extra_buffers_are_rejected(message, data):
    parts = as_bytes(encode(message, 1, 1))
    if len(parts) > 1 and data.draw(st.booleans(), label="drop"):
        del parts[data.draw(st.integers(1, len(parts) - 1), label="dropped")]
    else:
        parts.append(b"")
    with pytest.raises(WireError):
        decode(parts)


# Byte offsets of header fields in wire._HEADER.
_MAGIC, _VERSION, _KIND, _ROWS, _BUCKET, _COLS, _DTYPE, _BODY = 0, 4, 6, 31, 35, 39, 43, 44


def corrupt(header: bytes, offset: int, fmt: str, value) -> bytes:
    return header[:offset] + struct.pack(fmt, value) + header[offset + struct.calcsize(fmt):]


@PROPERTY
@given(st.one_of(frames(min_rows=1), tokens(min_rows=1)), st.data())
def test_corrupted_fields_are_rejected(message, data):
    parts = as_bytes(encode(message, 1, 1))
    *_, rows, _, cols, code, body = wire._HEADER.unpack(parts[0])
    field = data.draw(st.sampled_from(["magic", "version", "kind", "rows", "cols", "dtype", "body"]), label="field")
    if field == "magic":
        magic = data.draw(st.binary(min_size=4, max_size=4).filter(lambda b: b != wire.MAGIC))
        parts[0] = corrupt(parts[0], _MAGIC, "4s", magic)
    elif field == "version":
        version = data.draw(st.integers(0, 2**16 - 1).filter(lambda v: v != VERSION))
        parts[0] = corrupt(parts[0], _VERSION, "<H", version)
    elif field == "kind":
        parts[0] = corrupt(parts[0], _KIND, "B", data.draw(st.integers(0, 255).filter(lambda k: k != parts[0][_KIND])))
    elif field == "rows":
        parts[0] = corrupt(parts[0], _ROWS, "<I", data.draw(st.integers(0, 2**32 - 1).filter(lambda r: r != rows)))
    elif field == "cols":
        parts[0] = corrupt(parts[0], _COLS, "<I", data.draw(st.integers(0, 2**32 - 1).filter(lambda c: c != cols)))
    elif field == "dtype":
        parts[0] = corrupt(parts[0], _DTYPE, "B", data.draw(st.integers(0, 255).filter(lambda c: c != code)))
    else:
        parts[0] = corrupt(parts[0], _BODY, "<Q", data.draw(st.integers(0, 2**64 - 1).filter(lambda b: b != body)))
    with pytest.raises(WireError):
        decode(parts)


@PROPERTY
@given(MESSAGES, st.data())
def test_any_corrupted_byte_gives_wire_error_or_a_valid_message(message, data):
    parts = as_bytes(encode(message, 1, 1))
    i = data.draw(st.sampled_from([i for i, p in enumerate(parts) if p]), label="frame")
    at = data.draw(st.integers(0, len(parts[i]) - 1), label="offset")
    parts[i] = parts[i][:at] + bytes([data.draw(st.integers(0, 255), label="byte")]) + parts[i][at + 1:]
    try:
        decode(parts)
    except WireError:
        pass


def test_unknown_version_names_both_versions():
    parts = as_bytes(encode(Shutdown(), 0, 1))
    parts[0] = corrupt(parts[0], _VERSION, "<H", VERSION + 1)
    with pytest.raises(WireError, match=f"version {VERSION + 1}, this build speaks version {VERSION}"):
        decode(parts)


def test_message_over_the_size_limit_is_rejected():
    frame = Frame(1, 0, [0, 1], [0, 0], [1, 2], [True, True], np.zeros((2, 64), np.float32))
    parts = encode(frame, 0, 1)
    size = sum(memoryview(p).nbytes for p in parts)
    assert decode(parts, max_message_bytes=size).message.rows == 2
    with pytest.raises(WireError, match=f"message of {size} bytes exceeds the limit of {size - 1}"):
        decode(parts, max_message_bytes=size - 1)


def test_value_checks():
    good = as_bytes(encode(Frame(1, 0, [0], [0], [5], [True]), 0, 1))
    bad_sample = good[:4] + [b"\x02"] + good[5:]
    with pytest.raises(WireError, match="sample: value 2"):
        decode(bad_sample)
    negative_slot = [good[0], np.array([-1], np.int32).tobytes(), *good[2:]]
    with pytest.raises(WireError, match="slots: negative"):
        decode(negative_slot)
    error = as_bytes(encode(Error("n", "x"), 0, 1))
    with pytest.raises(WireError, match="text: not UTF-8"):
        decode([*error[:2], b"\xff"])


@pytest.mark.parametrize("message, offset", [(Shutdown(), _ROWS), (Hello("n", 0, 1), _COLS),
                                             (Tokens(1, 0, [0], [5]), _BUCKET),
                                             (Frame(1, 0, [0], [0], [5], [True]), _DTYPE)])
def test_header_fields_a_kind_does_not_use_must_be_zero(message, offset):
    parts = as_bytes(encode(message, 0, 1))
    parts[0] = parts[0][:offset] + b"\x01" + parts[0][offset + 1:]
    with pytest.raises(WireError, match="do not match its body"):
        decode(parts)


def test_decoder_rejects_duplicates_and_reordering():
    decoder = Decoder(sender=1, kinds=(StatsRequest, Shutdown))
    encoder = Encoder(sender=1, start=0)
    m1, m2, m3 = (encoder.encode(StatsRequest()) for _ in range(3))
    decoder.decode(m1)
    decoder.decode(m3)
    with pytest.raises(WireError, match="sequence number 3 from sender 1 is duplicate"):
        decoder.decode(m3)
    with pytest.raises(WireError, match="sequence number 2 from sender 1 is out of order .last accepted 3"):
        decoder.decode(m2)
    assert decoder.decode(encoder.encode(Shutdown())).seq == 4  # a rejection does not break the sender's stream


FAR_AHEAD = 2**62  # a sequence number that would shut out every later message, were it recorded


def test_decoder_rejects_other_senders_and_kinds_without_moving_the_sequence_on():
    decoder = Decoder(sender=1, kinds=(Frame,))
    frame = Frame(1, 0, [0], [0], [5], [True])
    with pytest.raises(WireError, match="^Frame from sender 77; only sender 1 sends here$"):
        decoder.decode(encode(frame, 77, FAR_AHEAD))
    with pytest.raises(WireError, match="^unexpected StatsRequest from sender 1$"):
        decoder.decode(encode(StatsRequest(), 1, FAR_AHEAD))
    assert decoder.decode(encode(frame, 1, 1)).seq == 1


def test_messages_check_their_row_counts():
    with pytest.raises(ValueError, match="row counts differ"):
        Frame(1, 0, [0, 1], [0], [5, 6], [True, True])
    with pytest.raises(ValueError, match="row counts differ"):
        Tokens(1, 0, [0], [5], np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="2-D float32/float16"):
        Frame(1, 0, [0], [0], [5], [True], np.zeros((1, 3), np.float64))


@pytest.mark.parametrize("field, value, message", [("temperature", -1.0, "temperature: each must be"),
                                                    ("temperature", float("nan"), "temperature: each must be"),
                                                    ("top_p", 0.0, "top_p: each must lie in"),
                                                    ("top_p", 1.5, "top_p: each must lie in"),
                                                    ("top_k", -1, "top_k: each must be >= 0"),
                                                    ("min_p", 1.5, "min_p: each must lie in"),
                                                    ("min_p", float("nan"), "min_p: each must lie in"),
                                                    ("logprobs", -2, "logprobs: each must lie in"),
                                                    ("logprobs", MAX_LOGPROBS + 1, "logprobs: each must lie in")])
def test_a_frame_that_asks_for_an_impossible_draw_is_rejected(field, value, message):
    frame = attrs.evolve(Frame(1, 0, [0], [0], [5], [True]), **{field: [value]})
    with pytest.raises(WireError, match=message):
        decode(as_bytes(encode(frame, 0, 1)))


@pytest.mark.parametrize("logprobs, top_ids, top_logprobs, message", [
    ([0.5], [[1]], [[-1.0]], "logprobs: each must be a finite number <= 0"),
    ([float("nan")], [[1]], [[-1.0]], "logprobs: each must be a finite number <= 0"),
    ([-0.5], [[1]], [[0.5]], "logprobs: each must be a finite number <= 0"),
    ([-0.5], [[-1]], [[-1.0]], "top_ids: negative value"),
])
def test_tokens_with_impossible_log_probabilities_are_rejected(logprobs, top_ids, top_logprobs, message):
    tokens = Tokens(1, 0, [0], [5], None, logprobs, top_ids, top_logprobs)
    with pytest.raises(WireError, match=message):
        decode(as_bytes(encode(tokens, 0, 1)))


def test_top_log_probabilities_come_with_the_tokens_own():
    parts = as_bytes(encode(Tokens(1, 0, [0], [5], None, [-0.5], [[1, 2]], [[-0.5, -2.0]]), 0, 1))
    parts[3] = b""  # the tokens' own log-probabilities left out
    with pytest.raises(WireError, match="sent without the tokens' logprobs"):
        decode(stamped(parts))
    parts = as_bytes(encode(Tokens(1, 0, [0], [5], None, [-0.5], [[1, 2]], [[-0.5, -2.0]]), 0, 1))
    parts[5] = parts[5][:8]  # one value for two ids
    with pytest.raises(WireError, match="top_logprobs: 8 bytes, expected 2 x 8"):
        decode(stamped(parts))
    with pytest.raises(ValueError, match="without the rest"):
        Tokens(1, 0, [0], [5], None, [-0.5])


def test_logit_adjustments_travel_with_the_first_row_of_their_stream():
    adjust = LogitAdjustments(3, min_tokens=2, stop_ids=(1,), logit_bias=((5, -1.5),), repetition_penalty=1.2,
                              frequency_penalty=0.5, presence_penalty=-0.25)
    frame = Frame(1, 0, [4, 6], [0, 9], [5, 6], [True, True], adjustments={4: adjust})
    assert decode(as_bytes(encode(frame, 0, 1))).message.adjustments == {4: adjust}
    parts = as_bytes(encode(frame, 0, 1))
    for buffer, message in ((b'{"6": {"prompt_tokens": 3}}', r"for slots \[6\], where no stream starts"),
                            (b'{"4": {"prompt_tokens": 3, "repetition_penalty": -1}}', "repetition_penalty > 0"),
                            (b'{"4": {"prompt_tokens": 3, "colour": 1}}', "unexpected keyword"),
                            (b'[1, 2]', "adjustments: "), (b'{"4": ', "adjustments: ")):
        with pytest.raises(WireError, match=message):
            decode(stamped(parts[:11] + [buffer] + parts[12:]))


def test_targets_name_the_next_token_of_rows_not_sampled():
    frame = Frame(1, 0, [4, 4, 4], [0, 1, 2], [5, 6, 7], [False, False, True], logprobs=[0, 0, 0],
                  targets=[6, 7, -1])
    decoded = decode(as_bytes(encode(frame, 0, 1))).message
    assert decoded.targets.tolist() == [6, 7, -1] and decoded.reporting.tolist() == [True, True, True]
    assert Frame(1, 0, [4], [0], [5], [False]).reporting.tolist() == [False]
    for targets in ([6, 7, 8], [-2, 7, -1]):  # a target on a sampled row; below -1
        with pytest.raises(WireError, match="targets: each is a token id or -1"):
            decode(as_bytes(encode(attrs.evolve(frame, targets=targets), 0, 1)))


def test_forks_name_the_slot_a_stream_starts_as_a_copy_of():
    frame = Frame(1, 0, [3, 4, 5], [20, 20, 20], [7, 7, 7], [True, True, True], forks=[-1, 3, 3],
                  adjustments={4: LogitAdjustments(prompt_tokens=21, min_tokens=2)})
    decoded = decode(as_bytes(encode(frame, 0, 1))).message
    assert decoded.forks.tolist() == [-1, 3, 3] and decoded.forked() == [(4, 3, 20), (5, 3, 20)]
    assert decoded.starting.tolist() == [False, True, True] and list(decoded.adjustments) == [4]
    assert Frame(1, 0, [4], [0], [5], [False]).forked() == []
    for forks in ([-1, 4, 3], [-2, 3, 3]):  # a stream forking itself; below -1
        with pytest.raises(WireError, match="forks: each is another row's slot or -1"):
            decode(as_bytes(encode(attrs.evolve(frame, forks=forks), 0, 1)))
    with pytest.raises(WireError, match=r"adjustments: for slots \[3\], where no stream starts"):
        decode(as_bytes(encode(attrs.evolve(frame, adjustments={3: LogitAdjustments(prompt_tokens=21)}), 0, 1)))


def test_propose_marks_sampled_rows_that_drafts_should_follow():
    frame = Frame(1, 0, [3, 3, 4], [20, 21, 5], [7, 8, 9], [False, True, True], propose=[False, True, True])
    assert decode(as_bytes(encode(frame, 0, 1))).message.propose.tolist() == [False, True, True]
    assert decode(as_bytes(encode(attrs.evolve(frame, propose=None), 0, 1))).message.propose is None
    with pytest.raises(WireError, match="propose: each is 0 or 1, and 0 for a row not sampled"):
        decode(as_bytes(encode(attrs.evolve(frame, propose=[True, True, True]), 0, 1)))


def test_decoded_arrays_view_the_received_buffers():
    residual = np.arange(8, dtype=np.float32).reshape(2, 4)
    parts = as_bytes(encode(Frame(1, 0, [0, 1], [0, 0], [1, 2], [True, False], residual), 0, 1))
    frame = decode(parts).message
    assert np.shares_memory(frame.residual, np.frombuffer(parts[15], np.uint8))
    assert not frame.residual.flags.writeable


@pytest.mark.parametrize("rows, hidden", [(1, 0), (3, 8), (32, 64)])
def test_the_costed_message_sizes_are_the_encoded_ones(rows, hidden):
    """What the planner and the simulator charge a link for is what the codec sends."""
    residual = np.zeros((rows, hidden), np.float32) if hidden else None
    frame = Frame(1, 0, [0] * rows, [0] * rows, [0] * rows, [True] * rows, residual, bucket=32)
    assert sum(map(len, as_bytes(encode(frame, 0, 1)))) == frame_bytes(rows, hidden)
    tokens = Tokens(1, 0, [0] * rows, [0] * rows)
    assert sum(map(len, as_bytes(encode(tokens, 0, 1)))) == tokens_bytes(rows)


def test_a_sender_started_again_numbers_above_its_earlier_life():
    decoder = Decoder(sender=1, kinds=(Shutdown,))
    first_life = Encoder(sender=1)
    for _ in range(1000):
        decoder.decode(first_life.encode(Shutdown()))
    assert decoder.decode(Encoder(sender=1).encode(Shutdown())).seq > 1000  # a restarted node's first message
