"""The pipeline's message codec: a fixed versioned header plus raw little-endian buffers, one ZeroMQ frame each.

A message is a list of frames: the 52-byte header first (laid out in `cascadia.wire_format`), then the buffers its
kind expects, always the same number (an absent optional array is an empty buffer). The header says how many rows
and columns the arrays hold and how many bytes the buffers hold together, so every buffer's byte length is checked
before a single value is read, and a buffer cut short never reads as a smaller array or as one left out. Nothing is
pickled; decoding only ever builds numpy arrays over the received bytes (no copy) and short UTF-8 strings.

Kinds and their buffers (n = header rows, c = header cols):
  FRAME          slots i32[n], positions i32[n], token_ids i32[n], sample u8[n], temperature f64[n], top_p f64[n],
                 seed u64[n], top_k i32[n], min_p f64[n] (how the last stage draws each sampled row's token),
                 logprobs i32[n] (how many of the likeliest tokens' log-probabilities it reports beside the token;
                 -1: none), adjustments utf-8 (JSON: slot -> `cascadia.sampling.LogitAdjustments` of each stream
                 that starts in the frame and asks for them; empty: none), targets i32[n] (empty: none; for a row
                 not sampled, the token after it, whose log-probability the last stage reports: a prompt's own;
                 -1: none), forks i32[n] (empty: none; for a stream's first row, the slot whose stream it starts
                 as a copy of, as that stands before the frame; -1: none), propose u8[n] (empty: none; 1 on a
                 sampled row whose token the last stage proposes drafts to follow), residual dtype[n, c] (c = 0:
                 absent); the header's bucket is the row count every call of the frame's rows is padded to
  TOKENS         slots i32[n], token_ids i32[n], then for the m rows of the frame that report (sampled, or with a
                 target), in order: logprobs f64[m], top_ids i32[m, k], top_logprobs f64[m, k] (the log-probability
                 of the row's token or target, and of the k likeliest tokens; all three empty when no row asked for
                 them; m and k from the buffers' sizes), logits dtype[n, c] (c = 0: absent), drafts i32[n, K]
                 (empty: none; K from the size), head_inputs f32[n, h] (empty: none; h from the size: the rows the
                 head read, sent back with the logits)
  HELLO          node utf-8, layers i32[2] (first, last), settings utf-8 (the digest of what it was started with),
                 cpus i32[any] (the CPUs its process may run on)
  READY          node utf-8, layers i32[2] (first, last)
  PROGRESS       node utf-8, i64[2] (done, total)
  ERROR          node utf-8, text utf-8
  STATS          node utf-8, f64 busy seconds + u64 frames + u64 rejected + f64 clock, frame ids u64[k], their
                 times f64[k, 3] (taken in, started, done)
  ASSIGN         plan utf-8 (JSON, `Plan.to_dict`), successor utf-8 (the address this node sends its results to)
  SHUTDOWN, STATS_REQUEST: none

Every sender numbers its messages. The coordinator is sender 0. On the data path sender ids follow the pipeline:
the node of stage i is i + 1, so a node's frames come from the sender just before its own. On the control channel a
node's id is fixed by its place among the cluster's members (`cluster.nodes`, then `cluster.spares`: the i-th is
i + 1), so that it stays the same when an ASSIGN moves the node to another stage. A socket's `Decoder` accepts only
its one sender and the kinds that sender sends there, and rejects a number that does not exceed the last one it
accepted (a duplicate or a reordering), so a replayed or misrouted message never reaches a stage. A sender id is
only a claim: that the connection is the sender's is for CurveZMQ to say (`cascadia.pipeline.transport`, which lets
each socket accept only its sender's key); without it a stranger can claim any id.
"""

from __future__ import annotations

import enum
import json
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

import attrs
import numpy as np

from cascadia.sampling import MAX_LOGPROBS, LogitAdjustments
from cascadia.wire_format import HEADER_LAYOUT

MAGIC = b"CSCD"
VERSION = 16
DEFAULT_MAX_MESSAGE_BYTES = 128 * 2**20  # 128 rows of f32 logits over a 201k vocabulary fit
COORDINATOR_SENDER = 0  # the nodes follow in stage order (`node_sender`)

# magic, version, kind, sender, sequence number, then _Fields: frame id, group, rows, bucket, cols, dtype code; then
# the body's bytes
_HEADER = struct.Struct(HEADER_LAYOUT)
_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f2")}  # payload dtype codes; 0 = no payload
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_I32 = np.dtype("<i4")
_F64 = np.dtype("<f8")
_U64 = np.dtype("<u8")
_F32 = np.dtype("<f4")
_LAYERS = struct.Struct("<ii")
_PROGRESS = struct.Struct("<qq")
_STATS = struct.Struct("<dQQd")


class WireError(ValueError):
    """A message that does not decode; the text says which check failed."""


class VersionMismatch(WireError):
    """A message in another protocol version: its sender runs another version of Cascadia."""


class Kind(enum.IntEnum):
    FRAME = 1
    TOKENS = 2
    HELLO = 3
    PROGRESS = 4
    READY = 5
    SHUTDOWN = 6
    ERROR = 7
    STATS_REQUEST = 8
    STATS = 9
    ASSIGN = 10
    INVITE = 11
    PROBE = 12
    TIMED = 13


def _vector(values, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=dtype).reshape(-1)


def _matrix(values) -> np.ndarray | None:
    if values is None:
        return None
    values = np.asarray(values)
    if values.ndim != 2 or values.dtype not in _DTYPE_CODES:
        raise ValueError(f"expected a 2-D float32/float16 array, got {values.dtype} of shape {values.shape}")
    return np.ascontiguousarray(values)


def _same_rows(message, names: tuple[str, ...]) -> None:
    rows = {name: len(getattr(message, name)) for name in names if getattr(message, name) is not None}
    if len(set(rows.values())) > 1:
        raise ValueError(f"{type(message).__name__}: row counts differ: {rows}")


@attrs.frozen(eq=False)
class Frame:
    """Rows travelling forward through the pipeline, one row per (stream, position)."""

    frame_id: int
    group: int
    slots: np.ndarray = attrs.field(converter=lambda v: _vector(v, _I32))  # [n] each row's stream slot
    positions: np.ndarray = attrs.field(converter=lambda v: _vector(v, _I32))  # [n] position in its stream
    token_ids: np.ndarray = attrs.field(converter=lambda v: _vector(v, _I32))  # [n] the row's input token
    sample: np.ndarray = attrs.field(converter=lambda v: _vector(v, np.bool_))  # [n] sample a token from this row
    residual: np.ndarray | None = attrs.field(default=None, converter=_matrix)  # [n, hidden]; None into the first role
    bucket: int = 0  # rows each engine call of the frame is padded to (the policy's); 0: the smallest that holds them
    # how each row's token is drawn (`cascadia.sampling.Sampling`); by default greedy
    temperature: np.ndarray = attrs.field(default=attrs.Factory(lambda f: np.zeros(len(f.slots)), takes_self=True),
                                          converter=lambda v: _vector(v, _F64))
    top_p: np.ndarray = attrs.field(default=attrs.Factory(lambda f: np.ones(len(f.slots)), takes_self=True),
                                    converter=lambda v: _vector(v, _F64))
    seed: np.ndarray = attrs.field(default=attrs.Factory(lambda f: np.zeros(len(f.slots)), takes_self=True),
                                   converter=lambda v: _vector(v, _U64))
    top_k: np.ndarray = attrs.field(default=attrs.Factory(lambda f: np.zeros(len(f.slots)), takes_self=True),
                                    converter=lambda v: _vector(v, _I32))
    min_p: np.ndarray = attrs.field(default=attrs.Factory(lambda f: np.zeros(len(f.slots)), takes_self=True),
                                    converter=lambda v: _vector(v, _F64))
    logprobs: np.ndarray = attrs.field(default=attrs.Factory(lambda f: np.full(len(f.slots), -1), takes_self=True),
                                       converter=lambda v: _vector(v, _I32))
    # how the logits of each stream starting in the frame (a row at position 0) change before its draws, by slot
    adjustments: dict[int, LogitAdjustments] = attrs.field(factory=dict)
    # [n] or None: the token after each row not sampled whose log-probability is reported (-1: none)
    targets: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: _vector(v, _I32)))
    # [n] or None: for the first row of a stream that starts as a copy of another's, that one's slot (-1: none)
    forks: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: _vector(v, _I32)))
    # [n] or None: the sampled rows whose token the last stage proposes drafts to follow (its MTP layer's)
    propose: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: _vector(v, np.bool_)))

    def __attrs_post_init__(self) -> None:
        _same_rows(self, ("slots", "positions", "token_ids", "sample", "residual", "temperature", "top_p", "seed",
                          "top_k", "min_p", "logprobs", "targets", "forks", "propose"))

    @property
    def starting(self) -> np.ndarray:
        """[n] bool: the rows that start a stream: at position 0, or forking another."""
        return _starting(self.positions, self.forks)

    def forked(self) -> list[tuple[int, int, int]]:
        """(slot, the slot it starts as a copy of, its first row's position) of each stream forking another."""
        if self.forks is None:
            return []
        rows = np.flatnonzero(self.forks >= 0)
        return list(zip(self.slots[rows].tolist(), self.forks[rows].tolist(), self.positions[rows].tolist()))

    @property
    def reporting(self) -> np.ndarray:
        """[n] bool: the rows whose log-probabilities TOKENS may carry: those sampled, and those with a target."""
        return self.sample if self.targets is None else self.sample | (self.targets >= 0)

    @property
    def rows(self) -> int:
        return len(self.slots)


def _starting(positions: np.ndarray, forks: np.ndarray | None) -> np.ndarray:
    return positions == 0 if forks is None else (positions == 0) | (forks >= 0)


@attrs.frozen(eq=False)
class Tokens:
    """Tokens sampled by the last role for the sampled rows of one frame (and their logits, when scoring), with the
    log-probabilities of the frame's reporting rows (`Frame.reporting`) when some row asked for them
    (`cascadia.sampling.log_probabilities`; a row that did not ask has zeros there)."""

    frame_id: int
    group: int
    slots: np.ndarray = attrs.field(converter=lambda v: _vector(v, _I32))  # [n]
    token_ids: np.ndarray = attrs.field(converter=lambda v: _vector(v, _I32))  # [n]
    logits: np.ndarray | None = attrs.field(default=None, converter=_matrix)  # [n, vocab] or None
    logprobs: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: _vector(v, _F64)))  # [m]: each reporting row's token's or target's, or None
    top_ids: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: np.ascontiguousarray(v, _I32)))  # [m, k]: the likeliest tokens, most likely first
    top_logprobs: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: np.ascontiguousarray(v, _F64)))  # [m, k]: theirs
    # [n, K]: drafts the last stage's MTP layer proposes after each row's token (-1: none), or None
    drafts: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: np.ascontiguousarray(v, _I32)))
    # [n, hidden]: what the head read for each row (its final hidden state after the norm), when scoring, or None
    head_inputs: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(
        lambda v: np.ascontiguousarray(v, _F32)))

    def __attrs_post_init__(self) -> None:
        _same_rows(self, ("slots", "token_ids", "logits", "drafts", "head_inputs"))
        if self.drafts is not None and (self.drafts.ndim != 2 or (self.drafts.size and self.drafts.min() < -1)):
            raise ValueError(f"Tokens: drafts must be [n, K] token ids or -1, got shape {self.drafts.shape}")
        _same_rows(self, ("logprobs", "top_ids", "top_logprobs"))
        reported = [name for name in ("logprobs", "top_ids", "top_logprobs") if getattr(self, name) is not None]
        if reported and len(reported) < 3:
            raise ValueError(f"Tokens: {', '.join(reported)} without the rest of the log-probabilities")
        if reported and (self.top_ids.ndim != 2 or self.top_ids.shape != self.top_logprobs.shape):
            raise ValueError(f"Tokens: top_ids {self.top_ids.shape} and top_logprobs {self.top_logprobs.shape} "
                             "must be [n, k] alike")


@attrs.frozen
class Hello:
    """A node is up, its sockets open, and about to load `first_layer..last_layer`; `settings` is the digest of the
    spec and plan it was started with (`cascadia.pipeline.settings.settings_digest`)."""

    node: str
    first_layer: int
    last_layer: int
    settings: str = ""
    cpus: tuple[int, ...] = ()  # the CPUs its process may run on


@attrs.frozen
class Progress:
    node: str
    done: int
    total: int


@attrs.frozen
class Ready:
    """A node has loaded its layers and serves frames."""

    node: str
    first_layer: int
    last_layer: int


@attrs.frozen
class Shutdown:
    pass


@attrs.frozen
class Error:
    node: str
    text: str


@attrs.frozen
class StatsRequest:
    pass


@attrs.frozen
class Stats:
    node: str
    busy_s: float  # total time spent inside the stage's process()
    frames: int
    rejected: int  # messages that failed to decode
    clock: float = 0.0  # the node's clock (time.monotonic) as it answered, to place its frame times
    frame_times: tuple[tuple[int, float, float, float], ...] = ()  # since its last Stats: (frame id, taken in,
    # started, done) on its clock, for each frame it computed


@attrs.frozen
class Assign:
    """The coordinator gives a node its place in the pipeline: a spare takes a lost node's stage, every node its
    stage of a new plan, a neighbour of a moved stage its new peers. The node serves its stage of `plan` (JSON,
    `Plan.to_dict`), sends its results to `successor`, and answers READY once it does. `spec` (YAML), for nodes
    invited into the run (`cascadia.fleet`): the spec as it is now, its cluster grown by the nodes that joined
    since; empty: as the node has it."""

    plan: str
    successor: str
    spec: str = ""


@attrs.frozen
class Invite:
    """A coordinator that found a node standing by (`cascadia.fleet`) asks it to join its run: the node serves its
    stage of `plan` (JSON, `Plan.to_dict`) of `spec` (YAML, `spec.dump.dump_spec`), reaching the coordinator at
    `control` and, holding the last stage, sending its tokens to `tokens`. An address whose host is "*" names the
    coordinator's host as the node reached it. The node answers HELLO, or ERROR saying why it cannot."""

    spec: str
    plan: str
    control: str
    tokens: str


@attrs.frozen
class Probe:
    """Measuring the link from one standing-by node to another, before a fleet is planned (`cascadia.fleet.links`).
    From the coordinator, at a node's door: send each of `sizes` bytes to `target` (the door of node `peer`), timing
    each until it is answered, and answer TIMED with the times. From that node, at the target's door: `data`, which
    the target answers with an empty TIMED."""

    target: str
    peer: str
    sizes: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    data: bytes = b""


@attrs.frozen
class Timed:
    """A node's answer to a PROBE: the seconds each size took (none, from the node that took the data)."""

    node: str
    seconds: tuple[float, ...] = attrs.field(default=(), converter=tuple)


Message = (Frame | Tokens | Hello | Progress | Ready | Shutdown | Error | StatsRequest | Stats | Assign | Invite
           | Probe | Timed)


@attrs.frozen
class Received:
    sender: int
    seq: int
    message: Message


def node_sender(index: int) -> int:
    """The sender id of the node that holds stage `index` (0-based) on the data path, or of the cluster's
    `index`-th member on the control channel."""
    return COORDINATOR_SENDER + 1 + index


# --- encoding ---------------------------------------------------------------------------------------------------

class _Fields(NamedTuple):
    """The header fields that describe a message's body; a kind leaves those it does not use at zero."""

    frame_id: int = 0
    group: int = 0
    rows: int = 0
    bucket: int = 0
    cols: int = 0
    dtype: int = 0  # code of the payload's dtype, 0 when there is no payload


def _utf8(text: str) -> bytes:
    return text.encode("utf-8")


def _payload_fields(frame_id: int, group: int, rows: int, payload: np.ndarray | None, bucket: int = 0) -> _Fields:
    if payload is None:
        return _Fields(frame_id, group, rows, bucket)
    return _Fields(frame_id, group, rows, bucket, payload.shape[1], _DTYPE_CODES[payload.dtype])


def _payload(matrix: np.ndarray | None):
    return b"" if matrix is None else matrix


def _as_bytes(flags: np.ndarray | None) -> np.ndarray | None:
    return None if flags is None else flags.view(np.uint8)


def _body(message: Message) -> tuple[Kind, _Fields, list]:
    """The kind, header fields and buffers of a message."""
    match message:
        case Frame():
            fields = _payload_fields(message.frame_id, message.group, message.rows, message.residual, message.bucket)
            return Kind.FRAME, fields, [message.slots, message.positions, message.token_ids,
                                        message.sample.view(np.uint8), message.temperature, message.top_p,
                                        message.seed, message.top_k, message.min_p, message.logprobs,
                                        _adjustments_json(message.adjustments), _payload(message.targets),
                                        _payload(message.forks), _payload(_as_bytes(message.propose)),
                                        _payload(message.residual)]
        case Tokens():
            fields = _payload_fields(message.frame_id, message.group, len(message.slots), message.logits)
            return Kind.TOKENS, fields, [message.slots, message.token_ids, *map(_payload, (
                message.logprobs, message.top_ids, message.top_logprobs, message.logits, message.drafts,
                message.head_inputs))]
        case Hello():
            return Kind.HELLO, _Fields(), [_utf8(message.node), _LAYERS.pack(message.first_layer, message.last_layer),
                                           _utf8(message.settings), np.asarray(message.cpus, dtype=_I32)]
        case Ready():
            return Kind.READY, _Fields(), [_utf8(message.node), _LAYERS.pack(message.first_layer, message.last_layer)]
        case Progress():
            return Kind.PROGRESS, _Fields(), [_utf8(message.node), _PROGRESS.pack(message.done, message.total)]
        case Shutdown():
            return Kind.SHUTDOWN, _Fields(), []
        case Error():
            return Kind.ERROR, _Fields(), [_utf8(message.node), _utf8(message.text)]
        case StatsRequest():
            return Kind.STATS_REQUEST, _Fields(), []
        case Stats():
            return Kind.STATS, _Fields(), [_utf8(message.node),
                                           _STATS.pack(message.busy_s, message.frames, message.rejected,
                                                       message.clock),
                                           np.array([t[0] for t in message.frame_times], dtype=_U64),
                                           np.array([t[1:] for t in message.frame_times], dtype=_F64).reshape(-1)]
        case Assign():
            return Kind.ASSIGN, _Fields(), [_utf8(message.plan), _utf8(message.successor), _utf8(message.spec)]
        case Invite():
            return Kind.INVITE, _Fields(), [_utf8(message.spec), _utf8(message.plan), _utf8(message.control),
                                            _utf8(message.tokens)]
        case Probe():
            return Kind.PROBE, _Fields(), [_utf8(message.target), _utf8(message.peer),
                                           np.asarray(message.sizes, dtype=_U64), message.data]
        case Timed():
            return Kind.TIMED, _Fields(), [_utf8(message.node), np.asarray(message.seconds, dtype=_F64)]
    raise TypeError(f"not a wire message: {message!r}")


def encode(message: Message, sender: int, seq: int) -> list:
    """The frames of a message: header bytes, then buffers (numpy arrays are sent as they are, without a copy)."""
    kind, fields, buffers = _body(message)
    body_bytes = sum(memoryview(buffer).nbytes for buffer in buffers)
    return [_HEADER.pack(MAGIC, VERSION, kind, sender, seq, *fields, body_bytes), *buffers]


class Encoder:
    """Encodes the messages of one sender, numbering them up by one from `start`: by default the wall clock's
    nanoseconds as it was made, so that a sender started again (a node restarted, a machine rebooted) numbers above
    everything of its earlier life, and its peers take its messages."""

    def __init__(self, sender: int, start: int | None = None):
        self.sender = sender
        self._seq = time.time_ns() if start is None else start

    def encode(self, message: Message) -> list:
        self._seq += 1
        return encode(message, self.sender, self._seq)


# --- decoding ---------------------------------------------------------------------------------------------------

_BUFFER_COUNTS = {Kind.FRAME: 15, Kind.TOKENS: 8, Kind.HELLO: 4, Kind.READY: 2, Kind.PROGRESS: 2, Kind.SHUTDOWN: 0,
                  Kind.ERROR: 2, Kind.STATS_REQUEST: 0, Kind.STATS: 4, Kind.ASSIGN: 3,
                  Kind.INVITE: 4, Kind.PROBE: 4, Kind.TIMED: 2}


def _array(buffer: memoryview, dtype: np.dtype, count: int, name: str) -> np.ndarray:
    if buffer.nbytes != count * dtype.itemsize:
        raise WireError(f"{name}: {buffer.nbytes} bytes, expected {count} x {dtype.itemsize}")
    return np.frombuffer(buffer, dtype=dtype, count=count)


def _indices(buffer: memoryview, rows: int, name: str) -> np.ndarray:
    values = _array(buffer, _I32, rows, name)
    if rows and values.min() < 0:
        raise WireError(f"{name}: negative value {values.min()}")
    return values


def _payload_matrix(buffer: memoryview, rows: int, cols: int, code: int, name: str) -> np.ndarray | None:
    if cols == 0:
        if buffer.nbytes:
            raise WireError(f"{name}: {buffer.nbytes} bytes but the header says none")
        return None
    if code not in _DTYPES:
        raise WireError(f"{name}: unknown dtype code {code}")
    return _array(buffer, _DTYPES[code], rows * cols, name).reshape(rows, cols)


def _adjustments_json(adjustments: dict[int, LogitAdjustments]) -> bytes:
    return _utf8(json.dumps({slot: attrs.asdict(a) for slot, a in adjustments.items()})) if adjustments else b""


def _adjustments(buffer: memoryview, starting: set[int]) -> dict[int, LogitAdjustments]:
    """A FRAME's logit adjustments by slot, each for a stream that starts in the frame (`starting`)."""
    if not buffer.nbytes:
        return {}
    try:
        adjustments = {int(slot): LogitAdjustments(**fields)
                       for slot, fields in json.loads(_text(buffer, "adjustments")).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise WireError(f"adjustments: {e}") from None
    if strays := sorted(set(adjustments) - starting):
        raise WireError(f"adjustments: for slots {strays}, where no stream starts in the frame")
    return adjustments


def _targets(buffer: memoryview, rows: int, sample: np.ndarray) -> np.ndarray | None:
    if not buffer.nbytes:
        return None
    targets = _array(buffer, _I32, rows, "targets")
    if not ((targets >= -1) & ((targets == -1) | ~sample)).all():
        raise WireError("targets: each is a token id or -1, and -1 for a sampled row")
    return targets


def _forks(buffer: memoryview, rows: int, slots: np.ndarray) -> np.ndarray | None:
    if not buffer.nbytes:
        return None
    forks = _array(buffer, _I32, rows, "forks")
    if not ((forks >= -1) & (forks != slots)).all():
        raise WireError("forks: each is another row's slot or -1")
    return forks


def _propose(buffer: memoryview, rows: int, sample: np.ndarray) -> np.ndarray | None:
    if not buffer.nbytes:
        return None
    propose = _array(buffer, np.dtype(np.uint8), rows, "propose")
    if not ((propose <= 1) & (sample | (propose == 0))).all():
        raise WireError("propose: each is 0 or 1, and 0 for a row not sampled")
    return propose.view(np.bool_)


def _per_row(buffer: memoryview, rows: int, dtype: np.dtype, name: str) -> np.ndarray | None:
    """A matrix of `rows` rows whose width its size gives (None: none sent)."""
    if not buffer.nbytes:
        return None
    if not rows or buffer.nbytes % (dtype.itemsize * rows):
        raise WireError(f"{name}: {buffer.nbytes} bytes, not a whole number of values for each of {rows} rows")
    return _array(buffer, dtype, buffer.nbytes // dtype.itemsize, name).reshape(rows, -1)


def _drafts(buffer: memoryview, rows: int) -> np.ndarray | None:
    """A TOKENS message's drafts [rows, K] (None: none sent)."""
    if (drafts := _per_row(buffer, rows, _I32, "drafts")) is None:
        return None
    if drafts.min() < -1:
        raise WireError(f"drafts: value {drafts.min()} is neither a token id nor -1")
    return drafts


def _reported(buffers: list[memoryview]) -> tuple:
    """A TOKENS message's log-probabilities, ids and values of the likeliest (None, None, None: none asked for)."""
    chosen, ids, values = buffers
    if not chosen.nbytes:
        if ids.nbytes or values.nbytes:
            raise WireError("top_ids, top_logprobs: sent without the tokens' logprobs")
        return None, None, None
    if chosen.nbytes % _F64.itemsize:
        raise WireError(f"logprobs: {chosen.nbytes} bytes, not a whole number of values")
    rows = chosen.nbytes // _F64.itemsize
    chosen = _array(chosen, _F64, rows, "logprobs")
    k = ids.nbytes // (_I32.itemsize * rows) if rows else 0
    ids = _indices(ids, rows * k, "top_ids").reshape(rows, k)
    values = _array(values, _F64, rows * k, "top_logprobs").reshape(rows, k)
    if not (np.isfinite(chosen).all() and (chosen <= 0).all() and (values <= 0).all()):  # NaN fails too
        raise WireError("logprobs: each must be a finite number <= 0")
    return chosen, ids, values


def _text(buffer: memoryview, name: str) -> str:
    try:
        return bytes(buffer).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"{name}: not UTF-8 ({e.reason} at byte {e.start})") from None


def _unpack(layout: struct.Struct, buffer: memoryview, name: str) -> tuple:
    if buffer.nbytes != layout.size:
        raise WireError(f"{name}: {buffer.nbytes} bytes, expected {layout.size}")
    return layout.unpack(buffer)


def _message(kind: Kind, fields: _Fields, b: list[memoryview]) -> Message:
    frame_id, group, rows, bucket, cols, code = fields
    match kind:
        case Kind.FRAME:
            sample = _array(b[3], np.dtype(np.uint8), rows, "sample")
            if rows and sample.max() > 1:
                raise WireError(f"sample: value {sample.max()} is not 0 or 1")
            temperature, top_p = _array(b[4], _F64, rows, "temperature"), _array(b[5], _F64, rows, "top_p")
            if not (np.isfinite(temperature).all() and (temperature >= 0).all()):
                raise WireError("temperature: each must be a finite number >= 0")
            if not ((top_p > 0) & (top_p <= 1)).all():  # NaN fails too
                raise WireError("top_p: each must lie in (0, 1]")
            top_k, min_p = _array(b[7], _I32, rows, "top_k"), _array(b[8], _F64, rows, "min_p")
            if not (top_k >= 0).all():
                raise WireError("top_k: each must be >= 0")
            if not ((min_p >= 0) & (min_p <= 1)).all():
                raise WireError("min_p: each must lie in [0, 1]")
            logprobs = _array(b[9], _I32, rows, "logprobs")
            if not ((logprobs >= -1) & (logprobs <= MAX_LOGPROBS)).all():
                raise WireError(f"logprobs: each must lie in -1..{MAX_LOGPROBS}")
            slots, positions = _indices(b[0], rows, "slots"), _indices(b[1], rows, "positions")
            forks = _forks(b[12], rows, slots)
            return Frame(frame_id, group, slots, positions, _indices(b[2], rows, "token_ids"), sample.view(np.bool_),
                         _payload_matrix(b[14], rows, cols, code, "residual"), bucket, temperature, top_p,
                         _array(b[6], _U64, rows, "seed"), top_k, min_p, logprobs,
                         _adjustments(b[10], set(slots[_starting(positions, forks)].tolist())),
                         _targets(b[11], rows, sample.view(np.bool_)), forks,
                         _propose(b[13], rows, sample.view(np.bool_)))
        case Kind.TOKENS:
            return Tokens(frame_id, group, _indices(b[0], rows, "slots"), _indices(b[1], rows, "token_ids"),
                          _payload_matrix(b[5], rows, cols, code, "logits"), *_reported(b[2:5]), _drafts(b[6], rows),
                          _per_row(b[7], rows, _F32, "head_inputs"))
        case Kind.HELLO:
            if b[3].nbytes % _I32.itemsize:
                raise WireError(f"cpus: {b[3].nbytes} bytes, not a whole number of ids")
            cpus = tuple(int(cpu) for cpu in _indices(b[3], b[3].nbytes // _I32.itemsize, "cpus"))
            return Hello(_text(b[0], "node"), *_unpack(_LAYERS, b[1], "layers"), _text(b[2], "settings"), cpus)
        case Kind.READY:
            return Ready(_text(b[0], "node"), *_unpack(_LAYERS, b[1], "layers"))
        case Kind.PROGRESS:
            return Progress(_text(b[0], "node"), *_unpack(_PROGRESS, b[1], "progress"))
        case Kind.SHUTDOWN:
            return Shutdown()
        case Kind.ERROR:
            return Error(_text(b[0], "node"), _text(b[1], "text"))
        case Kind.STATS_REQUEST:
            return StatsRequest()
        case Kind.STATS:
            ids = _array(b[2], _U64, b[2].nbytes // _U64.itemsize, "frame ids")
            times = _array(b[3], _F64, 3 * len(ids), "frame times").reshape(-1, 3)
            frame_times = tuple((int(i), *map(float, t)) for i, t in zip(ids, times))
            return Stats(_text(b[0], "node"), *_unpack(_STATS, b[1], "stats"), frame_times)
        case Kind.ASSIGN:
            return Assign(_text(b[0], "plan"), _text(b[1], "successor"), _text(b[2], "spec"))
        case Kind.INVITE:
            return Invite(_text(b[0], "spec"), _text(b[1], "plan"), _text(b[2], "control"), _text(b[3], "tokens"))
        case Kind.PROBE:
            sizes = _array(b[2], _U64, b[2].nbytes // _U64.itemsize, "sizes")
            return Probe(_text(b[0], "target"), _text(b[1], "peer"), tuple(map(int, sizes)), bytes(b[3]))
        case Kind.TIMED:
            seconds = _array(b[1], _F64, b[1].nbytes // _F64.itemsize, "seconds")
            if not (np.isfinite(seconds).all() and (seconds >= 0).all()):  # NaN fails too
                raise WireError("seconds: each must be a finite number >= 0")
            return Timed(_text(b[0], "node"), tuple(map(float, seconds)))


def decode(frames: Sequence, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Received:
    """Decode the frames of one message (bytes, memoryviews or zmq.Frame objects); raise WireError if anything is
    wrong. Arrays in the result are read-only views of the received frames."""
    if not frames:
        raise WireError("empty message")
    views = [memoryview(f) for f in frames]
    size = sum(v.nbytes for v in views)
    if size > max_message_bytes:
        raise WireError(f"message of {size} bytes exceeds the limit of {max_message_bytes}")
    if views[0].nbytes != _HEADER.size:
        raise WireError(f"header of {views[0].nbytes} bytes, expected {_HEADER.size}")
    magic, version, kind, sender, seq, *fields, body_bytes = _HEADER.unpack(views[0])
    fields = _Fields(*fields)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise VersionMismatch(f"protocol version {version}, this build speaks version {VERSION}")
    if kind not in _BUFFER_COUNTS:
        raise WireError(f"unknown message kind {kind}")
    kind = Kind(kind)
    buffers = views[1:]
    if len(buffers) != _BUFFER_COUNTS[kind]:
        raise WireError(f"{kind.name} with {len(buffers)} buffers, expected {_BUFFER_COUNTS[kind]}")
    if size - views[0].nbytes != body_bytes:
        raise WireError(f"{kind.name} with {size - views[0].nbytes} bytes of buffers, the header says {body_bytes}")
    message = _message(kind, fields, buffers)
    # Header fields this kind does not use must be zero, so that every header byte is accounted for.
    if _body(message)[1] != fields:
        raise WireError(f"{kind.name}: header fields {fields} do not match its body")
    return Received(sender, seq, message)


class Decoder:
    """Decodes what one sender sends on one socket: a message from another sender, of a kind not in `kinds`, or whose
    sequence number does not exceed the last one accepted (a duplicate or a reordering) is rejected. Only an accepted
    message moves the sequence on, so a stray message cannot shut the real sender out; a receiver that checks a
    message's content too (`check`, then `accept`) keeps a message whose content cannot belong from moving it."""

    def __init__(self, sender: int, kinds: tuple[type, ...], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.sender = sender
        self.kinds = kinds
        self.max_message_bytes = max_message_bytes
        self._last_seq: int | None = None

    def decode(self, frames: Sequence) -> Received:
        """`check` and `accept`."""
        received = self.check(frames)
        self.accept(received)
        return received

    def accept(self, received: Received) -> None:
        """Move the sequence on to a checked message's number."""
        self._last_seq = received.seq

    def check(self, frames: Sequence) -> Received:
        """The message, with every check `decode` makes, but not yet accepted."""
        received = decode(frames, self.max_message_bytes)
        what = f"{type(received.message).__name__} from sender {received.sender}"
        if received.sender != self.sender:
            raise WireError(f"{what}; only sender {self.sender} sends here")
        if not isinstance(received.message, self.kinds):
            raise WireError(f"unexpected {what}")
        last = self._last_seq
        if last is not None and received.seq <= last:
            order = "duplicate" if received.seq == last else "out of order"
            raise WireError(f"sequence number {received.seq} from sender {received.sender} is {order} "
                            f"(last accepted {last})")
        return received
