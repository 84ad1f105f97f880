"""Where and how the engine's graphs compile and run: device choice, compile options, bucketed calls.

Precision: "f32" is the exact path (also turns off the plugins' dynamic quantisation of activations, which costs
about 1e-2 relative error on compressed weights). "bf16" is the default elsewhere. "f16" is native on Intel GPUs
and runs as bf16 on a CPU (`device_precision`). `CompiledBlock.precision` reports what the plugin actually chose.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence

import numpy as np
import openvino as ov

from cascadia.errors import NodeError
from cascadia.policy import padded_size
from cascadia.spec.types import DEVICES, PRECISIONS


class DeviceError(NodeError):
    """A device or precision the engine cannot use."""


@functools.cache
def core() -> ov.Core:
    return ov.Core()


def pick_device(requested: str = "auto") -> str:
    """"GPU" when OpenVINO sees one (the target hardware), else "CPU"; an explicit choice must be available."""
    if requested not in DEVICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    available = core().available_devices
    if requested == "auto":
        return "GPU" if any(d.startswith("GPU") for d in available) else "CPU"
    if not any(d.startswith(requested) for d in available):
        raise DeviceError(f"device {requested} is not available (OpenVINO sees {', '.join(available)})")
    return requested


def device_precision(precision: str, device: str) -> str:
    """The precision to ask a device for. A CPU runs an f16 request as bf16: the CPU plugin's fused MoE kernel has
    no f16 version (compiling fails) and most CPUs have no f16 arithmetic at all."""
    return "bf16" if precision == "f16" and device == "CPU" else precision


def runs_as(precision: str, device: str) -> str:
    """The precision a device runs when asked for `precision` (what `CompiledBlock.precision` then reports): on a
    CPU, bf16 only where it has bf16 arithmetic (AVX512_BF16 or AMX; OpenVINO lists BF16 among its optimization
    capabilities), else f32; f16 as bf16 there too (`device_precision`)."""
    asked = device_precision(precision, device)
    if device == "CPU" and asked == "bf16" and "BF16" not in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return "f32"
    return asked


def compile_options(precision: str, threads: int | None = None) -> dict[str, object]:
    if precision not in PRECISIONS:
        raise DeviceError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    options: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision}
    if precision == "f32":
        options["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    if threads is not None:
        options["INFERENCE_NUM_THREADS"] = threads
    return options


class Compiled:
    """One compiled graph with one inference request, its weights resident once. Compiled from an in-memory
    `ov.Model`, the CPU plugin keeps the model's constants beside its own repacked copy (bench/engine.py's model:
    6.2 GiB resident for 3.1 GiB of f32 weights, 1.2 GiB for 0.48 GiB in the paper's int4/int8). Compiled from an
    IR file, it maps the constants from the file instead (3.3 and 0.8 GiB), and once it has repacked them (when
    compiling, and for matmuls on the first call of a shape) `drop_mapped_pages` takes those file pages out of the
    process."""

    def __init__(self, model: ov.Model | Callable[[], ov.Model], device: str, options: dict[str, object],
                 finish: Callable[[ov.Model], None] | None = None):
        """`model`, or what builds it: built, saved and let go before the plugin compiles it, so that its weights
        are not held twice while it does (a whole stage's, `cascadia.engine.stage_graph`). `finish`: what to do to
        the model read back from the file before it compiles (put in the ops an IR file cannot hold)."""
        self.compiled, self._weights_file = _compile_from_file(model, device, options, finish)
        self.drop_mapped_pages()
        self.request = self.compiled.create_infer_request()

    @property
    def precision(self) -> str:
        return {ov.Type.f32: "f32", ov.Type.bf16: "bf16", ov.Type.f16: "f16"}[
            self.compiled.get_property("INFERENCE_PRECISION_HINT")]

    def op_types(self) -> set[str]:
        """Layer types of the runtime model (what the plugin actually runs, after its fusions)."""
        return {op.get_rt_info()["layerType"].astype(str) for op in self.compiled.get_runtime_model().get_ops()}

    def drop_mapped_pages(self) -> None:
        _drop_mapped_pages(self._weights_file)


class CompiledBlock(Compiled):
    """A compiled graph whose every input's first axis is rows; calls pad rows up to a bucket (so the plugin sees
    a few shapes only) and return the real rows of each output."""

    def __init__(self, model: ov.Model, device: str, options: dict[str, object], buckets: Sequence[int]):
        super().__init__(model, device, options)
        self.buckets = tuple(sorted(buckets))
        self._inputs: dict[int, list[np.ndarray]] = {}  # each bucket's input arrays, allocated on first use
        self._bound: int | None = None  # the bucket whose arrays the request reads

    def __call__(self, *inputs: np.ndarray, bucket: int | None = None) -> list[np.ndarray]:
        """The outputs' real rows, the inputs padded to `bucket` rows (None: the smallest bucket that holds them)."""
        rows = inputs[0].shape[0]
        arrays = self._arrays(padded_size(rows, self.buckets) if bucket is None else bucket)
        for array, x in zip(arrays, inputs, strict=True):
            _fill_rows(array, x)
        self.request.infer()
        return [self.request.get_output_tensor(i).data[:rows].copy() for i in range(len(self.compiled.outputs))]

    def _arrays(self, size: int) -> list[np.ndarray]:
        """The input arrays of a bucket, the request reading them. Tensors over arrays of our own, bound once per
        change of bucket: binding costs about 17 us an input, 0.8 ms per decode step on bench/engine.py's model."""
        if size not in self._inputs:
            if size not in self.buckets:
                raise ValueError(f"{size} rows is not one of the buckets {list(self.buckets)}")
            self._inputs[size] = [np.empty([size, *(d.get_length() for d in p.get_partial_shape()[1:])],
                                           p.get_element_type().to_dtype()) for p in self.compiled.inputs]
        if self._bound != size:
            for i, array in enumerate(self._inputs[size]):
                self.request.set_input_tensor(i, ov.Tensor(array, shared_memory=True))
            self._bound = size
        return self._inputs[size]

    def warm_up(self) -> None:
        """Run every bucket once, so that no later call pays for the plugin preparing a new shape. Every row is a
        padding row (`_pad_rows`): all-zero expert indices, one expert named k times in a row, made the CPU's fused
        MoE kernel write out of bounds (a crash once freed memory goes back to the system)."""
        for size in self.buckets:
            self(*(_pad_rows(np.empty([0, *(d.get_length() for d in p.get_partial_shape()[1:])],
                                      p.get_element_type().to_dtype()), size) for p in self.compiled.inputs))
        self.drop_mapped_pages()


def _compile_from_file(model: ov.Model | Callable[[], ov.Model], device: str, options: dict[str, object],
                       finish: Callable[[ov.Model], None] | None = None) -> tuple[ov.CompiledModel, str]:
    """Compile `model` (or the one it builds, let go once saved) through a temporary IR file, deleted at once (the
    plugin's mapping keeps its data on disk until the block goes). Returns the compiled model and the path its
    weights were mapped from."""
    folder = tempfile.mkdtemp(prefix="cascadia-ir-", dir=_IR_FOLDER)
    try:
        xml = os.path.join(folder, "block.xml")
        ov.save_model(model if isinstance(model, ov.Model) else model(), xml, compress_to_fp16=False)
        _give_back_freed_heap()
        weights = os.path.join(folder, "block.bin")
        source: str | ov.Model = xml
        if finish is not None:
            source = core().read_model(xml)  # its weights mapped from the file, as compile_model(xml) maps them
            finish(source)
        with _dropping_mapped_pages(weights):
            return core().compile_model(source, device, options), weights
    finally:
        shutil.rmtree(folder)


def _give_back_freed_heap() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim; elsewhere nothing). Building a graph frees
    large arrays that glibc keeps in its heap (their frees raise its threshold for mapping large blocks apart), and
    the plugin allocates its repacked weights elsewhere: without this the process holds both (the race's Qwen3-MoE
    as one stage graph at int4 peaked at 1.86 GB, 1.27 GB with this, 1.13 GB with `_dropping_mapped_pages` too)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextlib.contextmanager
def _dropping_mapped_pages(path: str, every_s: float = 0.05):
    """Drop the file pages of `path` from this process every `every_s` while the block runs: the plugin reads each
    weight once as it repacks it, so a large graph's compile holds its repacked weights and only the pages it reads
    now, not the whole file beside them (that stage graph: 1.86 GB at its peak, 1.62 GB with this alone)."""
    done = threading.Event()

    def drop() -> None:
        while not done.wait(every_s):
            _drop_mapped_pages(path)

    dropper = threading.Thread(target=drop, name="drop-mapped-pages", daemon=True)
    dropper.start()
    try:
        yield
    finally:
        done.set()
        dropper.join()


def _drop_mapped_pages(path: str) -> None:
    """Take the pages of every read-only shared mapping of `path` out of this process's resident memory (Linux:
    madvise MADV_DONTNEED over each such range of /proc/self/maps). A later access reads them from the file again,
    so nothing is lost; elsewhere, a no-op."""
    try:
        with open("/proc/self/maps") as maps:
            ranges = [line.split()[0] for line in maps if path in line and line.split()[1] == "r--s"]
    except FileNotFoundError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for span in ranges:
        start, end = (int(x, 16) for x in span.split("-"))
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


_MADV_DONTNEED = 4
# On disk, not in memory: /tmp is a tmpfs on some systems, and the pages of a tmpfs file are memory that dropping
# them from the mapping would not free.
_IR_FOLDER = "/var/tmp" if os.path.isdir("/var/tmp") else None


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """x padded to `rows` rows (see `_fill_rows`)."""
    out = np.empty((rows, *x.shape[1:]), x.dtype)
    _fill_rows(out, x)
    return out


def _fill_rows(out: np.ndarray, x: np.ndarray) -> None:
    """x's rows, then padding rows, into `out`. Float inputs pad with zero rows. Integer inputs (expert indices,
    token ids) repeat the first real row: the CPU's fused MoE kernel computes every row's experts, at a cost per
    row, and a padding row naming other experts would also read their weights (one decode row padded to two: 6.1 ms
    with experts 0, 1, ..., 3.5 ms with the real row's, 1.3 ms unpadded, on bench/engine.py's model). With no real
    row (warm-up) they are 0, 1, 2, ...: a row must never name one expert twice, which makes that kernel write out
    of bounds."""
    n = len(x)
    out[:n] = x
    if n == len(out):
        return
    if out.dtype.kind not in "iu":
        out[n:] = 0
    elif n:
        out[n:] = x[0]
    else:
        out[:] = np.arange(math.prod(out.shape[1:]), dtype=out.dtype).reshape(out.shape[1:])
