"""Read a text checkpoint of any family (config.json + safetensors, single file or sharded) lazily, as float32 numpy.

A node reads only the tensors of its own layers: opening reads config.json and the shard index (or the single
file's JSON header), a shard's header is parsed the first time one of its tensors is asked for, and tensor data are
read by byte range. The safetensors header is parsed here rather than through `safe_open` because numpy has no
bfloat16, so `safe_open(framework="numpy")` cannot return BF16 tensors; reading the documented layout (8-byte
little-endian header length, JSON header with dtype, shape and data offsets, then the data) handles F32, F16 and BF16
the same way, and FP8 (`F8_E4M3`, as DeepSeek-V3's and Kimi K2's releases store their matrices): each matrix scaled
back by its `weight_scale_inv`, one factor per block of `quantization_config.weight_block_size` (128 x 128). Vision
and audio tensors are ignored; multi-token-prediction tensors (the family's `is_mtp`) are listed apart.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import attrs
import numpy as np

from cascadia.engine.quantize import bf16_to_f32
from cascadia.errors import CheckpointError, shown
from cascadia.files import UnreadableFile, read_json, regular_file_size
from cascadia.models import family, mtp_layers, read_config
from cascadia.models.base import ConfigError, ModelConfig, UnsupportedModel, read_config_json
from cascadia.models.names import EMBED, HEAD, layer_prefix

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Stored dtype -> numpy dtype of the raw little-endian values. BF16 is read as its 16 raw bits, F8_E4M3 as its 8.
_RAW_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1")}
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv`: the block factors of an FP8 `X.weight`


def _e4m3_values() -> np.ndarray:
    """The float32 value of each FP8 e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
    S.1111.111 NaN."""
    byte = np.arange(256)
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude = np.where((exponent == 15) & (mantissa == 7), np.nan, magnitude)
    return np.where(byte >> 7, -magnitude, magnitude).astype(np.float32)


E4M3 = _e4m3_values()
MAX_HEADER_BYTES = 100 * 1024**2  # the safetensors format's own limit on a file's JSON header
MAX_INDEX_BYTES = 64 * 1024**2  # a shard index lists every tensor once: a few MiB for the largest models


@attrs.frozen
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@attrs.frozen
class _Place:
    """Where a tensor is stored: a stored tensor of its own, or rows of one that stacks several (`stacked`, that
    tensor's shape, [n, rows, cols]: the rows `first_row`.. of its first two axes flattened)."""

    file: Path
    stored: str  # its name in the file
    stacked: tuple[int, ...] | None = None
    first_row: int = 0


@attrs.frozen
class _Header:
    entries: dict[str, _Entry]  # stored name -> entry
    file_size: int


def _read_header(path: Path) -> _Header:
    """The JSON header of one safetensors file; raises ValueError saying what is wrong with the file."""
    try:
        size = regular_file_size(path)
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"a header of {header_len} bytes does not fit in a file of {size} bytes")
            if header_len > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {header_len} bytes exceeds the format's limit of {MAX_HEADER_BYTES}")
            header = json.loads(f.read(header_len))
    except UnreadableFile:
        raise
    except OSError as e:
        raise ValueError(f"cannot read: {e.strerror or e}") from None
    except (struct.error, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"not a readable safetensors file (its header is a JSON {type(header).__name__}, "
                         "not an object)")
    entries = {}
    for name, meta in header.items():
        if name != "__metadata__":
            try:
                entries[name] = _entry(meta, data_start=8 + header_len)
            except ValueError as e:
                raise ValueError(f"the header entry of tensor {name!r} is malformed: {e}") from None
    return _Header(entries, size)


def _entry(meta: object, data_start: int) -> _Entry:
    """One tensor's header entry: {"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}."""
    if not isinstance(meta, dict):
        raise ValueError(f"expected a JSON object, got {meta!r}")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be text, got {dtype!r}")
    if not _counts(shape):
        raise ValueError(f"shape must be a list of integers >= 0, got {shape!r}")
    if not (_counts(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise ValueError(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    return _Entry(dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])


def _weight_map(index: Path) -> dict[str, Path]:
    """The shard of each stored tensor, as a shard index lists them. A shard is named by a path inside the index's
    folder: `../x.safetensors` or `/x` would have the checkpoint read any file. (Shards may be symbolic links, as in
    the Hugging Face cache, so the name is checked, not where it leads.)"""
    try:
        weight_map = read_json(index, MAX_INDEX_BYTES, "a shard index")["weight_map"]
        entries = list(weight_map.items())
    except UnreadableFile as e:
        raise CheckpointError(f"{index}: {e}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: no readable weight_map ({type(e).__name__}: {e})") from None
    stored = {}
    for name, file in entries:
        if not isinstance(file, str) or not file or "\0" in file:
            raise CheckpointError(f"{index}: weight_map[{shown(name)}]: expected a file name, got {shown(file)}")
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"{index}: weight_map[{shown(name)}]: {file!r} lies outside the checkpoint folder "
                                  f"{index.parent}: a shard must be a file in it")
        stored[name] = index.parent / file
    return stored


def _counts(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


class Checkpoint:
    """One checkpoint directory. Use `Checkpoint.open(path)`."""

    def __init__(self, path: Path, config: ModelConfig, listing: Path, files: dict[str, _Place],
                 headers: dict[Path, _Header], scales: dict[str, _Place] | None = None,
                 fp8_block: tuple[int, int] = (128, 128)):
        self.path = path
        self.config = config
        self._listing = listing  # the file that says which tensors exist (index or single file)
        self._files = files  # canonical name -> where it is stored
        self._headers = headers  # safetensors headers parsed so far
        self._scales = scales or {}  # stored name of an FP8 matrix -> where its block factors are
        self._fp8_block = fp8_block  # rows and columns of a block of one factor
        self._family = family(config)
        self._expected = self._family.all_tensors(config)  # canonical name -> (shape, group)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        try:
            config = read_config(path / "config.json")
            fp8_block = _fp8_block(read_config_json(path / "config.json")[0].get("quantization_config"))
        except UnsupportedModel:
            raise  # not a fault of the checkpoint: a model Cascadia does not run
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        except ValueError as e:
            raise CheckpointError(f"{path / 'config.json'}: quantization_config: {e}") from None
        headers = {}
        if (listing := path / INDEX_FILE).is_file():
            stored = _weight_map(listing)
        elif (listing := path / SINGLE_FILE).is_file():
            try:
                headers[listing] = _read_header(listing)
            except ValueError as e:
                raise CheckpointError(f"{listing}: {e}") from None
            stored = dict.fromkeys(headers[listing].entries, listing)
        else:
            raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        files, scales, described = {}, {}, family(config)
        for name, file in stored.items():
            if name.endswith(SCALE_SUFFIX):
                scales[name.removesuffix(SCALE_SUFFIX)] = _Place(file, name)
            elif (stacked := described.stacked_parts(config, name)) is not None:
                shape, parts = stacked
                files |= {canonical: _Place(file, name, shape, first) for canonical, first in parts}
            elif (canonical := described.canonical_name(name)) is not None:
                files[canonical] = _Place(file, name)
        return cls(path, config, listing, files, headers, scales, fp8_block)

    # ---- listing ------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Text-model tensors present (canonical names), multi-token-prediction ones excluded."""
        return sorted(n for n in self._files if not self._is_mtp(n))

    def mtp_names(self) -> list[str]:
        return sorted(n for n in self._files if self._is_mtp(n))

    @property
    def head_weight(self) -> str:
        """The LM head's matrix: its own tensor, or the embedding's table where the head is tied to it."""
        return HEAD if HEAD in self._family.head_tensors(self.config) else EMBED

    # ---- reading ------------------------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """One tensor as float32, its shape checked against the family's (`model.mtp.*` come unchecked)."""
        file, entry = self._checked_entry(name)
        return self._read_finite(name, file, entry, 0, entry.shape[0] if entry.shape else 1)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, checked as by `tensor`, without reading its data."""
        return self._checked_entry(name)[1].shape

    def slices(self, name: str, per: int = 1) -> Iterator[np.ndarray]:
        """A tensor's slices along axis 0, `per` at a time (fewer in the last), as float32, each read from its own
        byte range: safetensors data are row-major, so slices along axis 0 (experts of a stack) are contiguous."""
        file, entry = self._checked_entry(name)
        for first in range(0, entry.shape[0], per):
            yield self._read_finite(name, file, entry, first, min(per, entry.shape[0] - first))

    def layer(self, layer: int) -> LayerTensors:
        """One decoder layer's tensors, by name relative to its prefix (as the family's `layer_tensors`), each
        read when first asked for."""
        return LayerTensors(self, layer_prefix(layer), self._layer_tensors(layer).keys())

    def mtp_layer(self, index: int = 0) -> LayerTensors:
        """A multi-token-prediction layer's tensors, by name relative to its prefix (the family's `mtp_tensors`),
        each checked for its shape first: CheckpointError for a family or checkpoint without such a layer."""
        cfg, described = self.config, self._family
        if not 0 <= index < mtp_layers(cfg):
            raise CheckpointError(f"{self.path}: the model has no multi-token-prediction layer {index} that Cascadia "
                                  f"runs (its config says num_mtp_layers: {getattr(cfg, 'num_mtp_layers', None)}; "
                                  "only Inkling's are run)")
        prefix, expected = described.mtp_layer_prefix(index), described.mtp_tensors(cfg)
        for rel, (shape, _) in expected.items():
            if (stored := self._checked_entry(prefix + rel)[1].shape) != shape:
                raise CheckpointError(f"{self._files[prefix + rel].file}: tensor {prefix + rel!r} (expected shape "
                                      f"{shape}): stored with shape {stored}")
        return LayerTensors(self, prefix, expected.keys())

    def embedding(self) -> dict[str, np.ndarray]:
        return {name: self.tensor(name) for name in self._family.embedding_tensors(self.config)}

    def head(self) -> dict[str, np.ndarray]:
        return {name: self.tensor(name) for name in self._family.head_tensors(self.config)}

    def validate(self, layers: Iterable[int] | None = None, embed: bool = False, head: bool = False) -> None:
        """Check presence, shape and dtype of the given layers (None: every layer) and, if asked, of the embedding
        and the head, from the safetensors headers alone: no tensor data is read."""
        names = list(self._family.embedding_tensors(self.config)) if embed else []
        for layer in range(self.config.num_hidden_layers) if layers is None else layers:
            names += [layer_prefix(layer) + rel for rel in self._layer_tensors(layer)]
        names += list(self._family.head_tensors(self.config)) if head else []
        for name in names:
            self._checked_entry(name)

    # ---- internals ----------------------------------------------------------------------------------------
    def _layer_tensors(self, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise CheckpointError(f"{self.path}: layer {layer} out of range (the model has "
                                  f"{self.config.num_hidden_layers} layers)")
        return self._family.layer_tensors(self.config, layer)

    def _is_mtp(self, name: str) -> bool:
        return self._family.is_mtp(self.config, name)

    def _checked_entry(self, name: str) -> tuple[Path, _Entry]:
        """Where a tensor's bytes are, after checking everything that can be checked without reading them."""
        expected = self._expected[name][0] if name in self._expected else None
        if expected is None and not self._is_mtp(name):
            raise CheckpointError(f"{self.path}: {name!r} is not a tensor of the {type(self.config).__name__} "
                                  "text model")

        def fail(file: Path, problem: str) -> CheckpointError:
            shape = f"expected shape {expected}" if expected else "shape not checked"
            return CheckpointError(f"{file}: tensor {name!r} ({shape}): {problem}")

        if name not in self._files:
            raise fail(self._listing, "missing from the checkpoint")
        place = self._files[name]
        file, entry = place.file, self._stored_entry(place, fail)
        if expected is not None and entry.shape != (place.stacked or expected):
            raise fail(file, f"stored with shape {entry.shape}" + (f" in {place.stored!r}, not {place.stacked}"
                                                                     if place.stacked else ""))
        if place.stacked:  # its rows of the stack's first two axes, flattened: contiguous bytes
            itemsize = _RAW_DTYPES[entry.dtype].itemsize
            entry = _Entry(entry.dtype, expected, entry.offset + place.first_row * expected[1] * itemsize,
                           math.prod(expected) * itemsize)
        return file, entry

    def _scaled_back(self, name: str, file: Path, entry: _Entry, values: np.ndarray, first: int) -> np.ndarray:
        """Rows first.. of an FP8 matrix times their blocks' factors (its `weight_scale_inv`)."""
        place = self._files[name]
        scale_place = self._scales.get(place.stored)
        if len(entry.shape) != 2 or place.stacked:
            raise CheckpointError(f"{file}: tensor {name!r}: an FP8 tensor of shape {entry.shape} (only matrices "
                                  "stored one by one are read)")
        if scale_place is None:
            raise CheckpointError(f"{file}: tensor {name!r} is stored as F8_E4M3 without its "
                                  f"{place.stored + SCALE_SUFFIX!r}")
        (rows, cols), (block_rows, block_cols) = entry.shape, self._fp8_block
        wanted = (-(-rows // block_rows), -(-cols // block_cols))
        scale = self._stored_entry(scale_place, lambda at, problem: CheckpointError(
            f"{at}: tensor {scale_place.stored!r}: {problem}"))
        if scale.dtype not in ("F32", "BF16") or scale.shape != wanted:
            raise CheckpointError(f"{scale_place.file}: tensor {scale_place.stored!r}: expected F32 factors of shape "
                                  f"{wanted} (blocks of {block_rows} x {block_cols}), got {scale.dtype} {scale.shape}")
        factors = _read(scale_place.file, scale, 0, wanted[0])
        at_rows = (first + np.arange(len(values))) // block_rows
        return values * factors[at_rows][:, np.arange(cols) // block_cols]

    def _stored_entry(self, place: _Place, fail: Callable[[Path, str], CheckpointError]) -> _Entry:
        """A stored tensor's header entry (its file's header parsed the first time), checked to be readable whole:
        a dtype read here, as many bytes as its shape holds, all in the file; `fail(file, problem)` says what is
        not."""
        file = place.file
        if file not in self._headers:
            try:
                self._headers[file] = _read_header(file)
            except ValueError as e:
                raise fail(file, str(e)) from None
        header = self._headers[file]
        entry = header.entries.get(place.stored)
        if entry is None:
            raise fail(file, f"the index places {place.stored!r} in this file but the file does not hold it")
        if entry.dtype not in _RAW_DTYPES:
            raise fail(file, f"stored as {entry.dtype}; only {', '.join(_RAW_DTYPES)} can be read")
        if entry.nbytes != math.prod(entry.shape) * _RAW_DTYPES[entry.dtype].itemsize:
            raise fail(file, f"its {entry.nbytes} bytes do not hold shape {entry.shape} in {entry.dtype}")
        if entry.offset + entry.nbytes > header.file_size:
            raise fail(file, f"the file is truncated: the tensor ends at byte {entry.offset + entry.nbytes}, "
                             f"the file has {header.file_size} bytes")
        return entry

    def _read_finite(self, name: str, file: Path, entry: _Entry, first: int, count: int) -> np.ndarray:
        """`_read`, refusing NaN and infinite weights here, where the tensor and file can be named: downstream they
        would end in an error naming neither (or, in unquantised weights, in NaN logits)."""
        values = _read(file, entry, first, count)
        if entry.dtype == "F8_E4M3":
            values = self._scaled_back(name, file, entry, values, first)
        if not _all_finite(values):
            index = np.unravel_index(np.argmin(np.isfinite(values)), values.shape)  # the first non-finite value
            at = [first + int(index[0]), *map(int, index[1:])] if index else []
            raise CheckpointError(f"{file}: tensor {name!r}: holds NaN or infinite values (the first, at {at}, "
                                  f"is {values[index]})")
        return values


def _fp8_block(quantization: object) -> tuple[int, int]:
    """A config's `quantization_config`: none, or FP8 with its block of one scale factor (DeepSeek's `fp8`,
    `weight_block_size` [128, 128] by default); a ValueError for any other."""
    if quantization is None:
        return (128, 128)
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"quant_method {shown(method)} is not read (only unquantised checkpoints and fp8 ones with "
                         "block scales are)")
    block = quantization.get("weight_block_size", [128, 128])
    if not (_counts(block) and len(block) == 2 and min(block) > 0):
        raise ValueError(f"weight_block_size must be two positive integers, got {shown(block)}")
    return block[0], block[1]


def _all_finite(values: np.ndarray) -> bool:
    """Whether no value is NaN or infinite. A dot product is the cheapest full pass numpy offers (BLAS, no
    temporary array; about an eighth of the time of reading and widening bfloat16): NaN or infinity anywhere makes
    it non-finite. Only then, or when it overflows (squares summing beyond 3e38), is the exact test run."""
    flat = values.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        screen = flat @ flat
    return bool(np.isfinite(screen)) or bool(np.isfinite(flat).all())


def _read(file: Path, entry: _Entry, first: int, count: int) -> np.ndarray:
    """Slices [first, first + count) along axis 0 of a tensor (the whole of a 0-d one) as float32."""
    dtype = _RAW_DTYPES[entry.dtype]
    per_slice = math.prod(entry.shape[1:])
    offset = entry.offset + first * per_slice * dtype.itemsize
    raw = np.fromfile(file, dtype=dtype, count=count * per_slice, offset=offset)
    shape = (count, *entry.shape[1:]) if entry.shape else ()
    if entry.dtype == "BF16":
        return bf16_to_f32(raw).reshape(shape)
    if entry.dtype == "F8_E4M3":
        return E4M3[raw].reshape(shape)  # not yet scaled back (`Checkpoint._scaled_back`)
    return raw.astype(np.float32, copy=False).reshape(shape)


class LayerTensors(Mapping[str, np.ndarray]):
    """A layer's tensors by relative name, each read once, when first asked for; `slices` streams a stack without
    keeping it (for MoE expert stacks quantised one expert at a time)."""

    def __init__(self, checkpoint: Checkpoint, prefix: str, names: Iterable[str]):
        self._checkpoint, self._prefix, self._names = checkpoint, prefix, list(names)
        self._read: dict[str, np.ndarray] = {}

    def __getitem__(self, rel: str) -> np.ndarray:
        if rel not in self._read:
            if rel not in self._names:
                raise KeyError(rel)
            self._read[rel] = self._checkpoint.tensor(self._prefix + rel)
        return self._read[rel]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def slices(self, rel: str, per: int = 1) -> Iterator[np.ndarray]:
        if rel not in self._names:
            raise KeyError(rel)
        return self._checkpoint.slices(self._prefix + rel, per)
