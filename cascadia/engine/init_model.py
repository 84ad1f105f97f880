"""Random checkpoints of any family: seeded weights for every tensor the family names, written as safetensors.

The weights are drawn so that a random model is numerically sane at any size: matrices are N(0, 1/fan_in) (about
0.02 at the real model's widths, and large enough at tiny widths that every layer changes the logits), norm weights
and global scales lie near 1, convolution taps and routing corrections are small. Each tensor has its own generator
seeded from (seed, name), so a tensor's values do not depend on which other tensors were drawn.

Tensors are drawn and written a slice at a time (memory stays at one slice), into shards of at most
`max_shard_bytes` with a `model.safetensors.index.json` when there is more than one, as transformers lays them out.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np

from cascadia.engine.checkpoint import INDEX_FILE, SINGLE_FILE
from cascadia.engine.quantize import round_to_bf16
from cascadia.models import family
from cascadia.models.base import ModelConfig
from cascadia.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TokenizerError, build_tokenizer, tokenizer_config

DTYPES = ("f32", "bf16")
DEFAULT_SHARD_BYTES = 2 * 1024**3
_CHUNK_VALUES = 1 << 22  # values drawn and written at once (16 MiB of float32)


def random_chunks(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """One tensor of the random model as consecutive slices along its first axis, so that writing a full-size
    expert bank never holds it whole. One generator draws them in order: the values do not depend on the slicing;
    the family scales them by the tensor's role (its `random_values`)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    rows = max(1, _CHUNK_VALUES // math.prod(shape[1:]))
    for start in range(0, shape[0], rows):
        noise = rng.standard_normal((min(rows, shape[0] - start), *shape[1:]), dtype=np.float32)
        yield family(cfg).random_values(name, shape, noise)


def random_tensor(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One float32 tensor of the random model, whole."""
    return np.concatenate(list(random_chunks(cfg, seed, name, shape)))


def random_weights(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 tensor) for every text-model tensor, in checkpoint order, one at a time."""
    for name, (shape, _group) in family(cfg).all_tensors(cfg).items():
        yield name, random_tensor(cfg, seed, name, shape)


def _stored_dtype(cfg: ModelConfig, name: str, dtype: str) -> str:
    return "BF16" if dtype == "bf16" and not family(cfg).kept_f32(name) else "F32"


def _stored_bytes(cfg: ModelConfig, name: str, shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * (2 if _stored_dtype(cfg, name, dtype) == "BF16" else 4)


def _encode(x: np.ndarray, stored: str) -> bytes:
    return (round_to_bf16(x) if stored == "BF16" else x.astype("<f4")).tobytes()


def _shards(cfg: ModelConfig, tensors: dict[str, tuple[int, ...]], dtype: str,
            max_shard_bytes: int) -> list[dict[str, tuple]]:
    """Consecutive tensors grouped into shards of at most max_shard_bytes (a larger tensor gets a shard alone)."""
    shards: list[dict[str, tuple]] = [{}]
    size = 0
    for name, shape in tensors.items():
        nbytes = _stored_bytes(cfg, name, shape, dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    return shards


def _write_shard(cfg: ModelConfig, path: Path, tensors: dict[str, tuple[int, ...]], dtype: str, seed: int) -> int:
    """Write one safetensors file, drawing each tensor as its turn comes; returns the data bytes written."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # "pt": what transformers expects to find
    offset = 0
    for name, shape in tensors.items():
        nbytes = _stored_bytes(cfg, name, shape, dtype)
        header[name] = {"dtype": _stored_dtype(cfg, name, dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header so that the data start 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in tensors.items():
            for chunk in random_chunks(cfg, seed, name, shape):
                f.write(_encode(chunk, header[name]["dtype"]))
    return offset


@attrs.frozen
class InitReport:
    out_dir: Path
    weight_files: tuple[str, ...]
    weight_bytes: int
    tokenizer_size: int | None  # entries in tokenizer.json, None when none was written
    notes: tuple[str, ...]  # what could not be done as asked, in words


def init_model(config: ModelConfig, out_dir: str | Path, seed: int = 0, dtype: str = "f32",
               max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Callable[[str], None] | None = None
               ) -> InitReport:
    """Write a random checkpoint: config.json, model.safetensors (or shards + index) and tokenizer.json, replacing
    any safetensors already in out_dir. `progress` hears of each shard of a sharded (large) model."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):  # a previous checkpoint's shards would shadow or mix in
        stale.unlink()
    hf = config.to_hf_dict() | {"dtype": "bfloat16" if dtype == "bf16" else "float32"}
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")

    shards = _shards(config, {name: shape for name, (shape, _) in family(config).all_tensors(config).items()}, dtype,
                     max_shard_bytes)
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for i, (file, tensors) in enumerate(zip(files, shards)):
        total += _write_shard(config, out_dir / file, tensors, dtype, seed)
        if progress and len(files) > 1:
            progress(f"wrote {file} ({i + 1}/{len(files)}, {total / 1e9:.2f} GB so far)")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, tensors in zip(files, shards) for name in tensors}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    tokenizer_size, notes = _write_tokenizer(config, out_dir)
    return InitReport(out_dir, tuple(files), total, tokenizer_size, notes)


def _write_tokenizer(config: ModelConfig, out_dir: Path) -> tuple[int | None, tuple[str, ...]]:
    """Write tokenizer.json and tokenizer_config.json (special tokens, chat template) when the vocabulary allows a
    tokenizer; (its size or None, notes on what fell short)."""
    try:
        tokenizer = build_tokenizer(config)
    except TokenizerError as e:
        for stale in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):  # older ones would not match this model
            (out_dir / stale).unlink(missing_ok=True)
        return None, (f"no {TOKENIZER_FILE}: {e}",)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config(config), indent=2) + "\n")
    size = tokenizer.get_vocab_size()
    if size < config.output_vocab_size:
        return size, (f"{TOKENIZER_FILE} has {size} entries, fewer than the model's {config.output_vocab_size}: "
                      f"the embedded training text allows no more merges",)
    return size, ()
