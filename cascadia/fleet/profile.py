"""What a PC measures of itself once, before it announces itself to a fleet: the figures a spec's node entry holds
(`NodeSpec`: memory, memory bandwidth, compute, disk bandwidth, device), taken on the machine instead of written by
hand, in about two seconds.

- memory: what it can still give a process now (`host_memory.available_bytes`);
- memory bandwidth: a streaming read on every core it may use (`doctor.measure_bandwidth`, best of 3);
- compute: an f32-input matrix product compiled by OpenVINO on the device the node computes on, at the precision it
  runs the engine's default at (bf16 where the CPU has it), best of a few calls;
- disk: a file of `DISK_PROBE_BYTES` written beside the checkpoint (or in the temporary folder), flushed, dropped from
  the page cache and read back: the speed a restarted node reads its weights at.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np

from cascadia.doctor import measure_bandwidth
from cascadia.host_cpus import available
from cascadia.host_memory import available_bytes
from cascadia.units import format_bytes, format_flops, format_rate

COMPUTE_SHAPE = (256, 2048, 2048)  # rows, input columns, output columns: about 2 GFLOP a call
COMPUTE_CALLS = 5
DISK_PROBE_BYTES = 64 * 2**20
ENGINE_PRECISION = "bf16"  # the precision a spec's runtime asks for by default


@attrs.frozen
class Profile:
    cores: int  # the CPUs the node's process may use
    memory_bytes: int  # free now
    device: str  # the OpenVINO device it computes on: "GPU" when OpenVINO sees one, else "CPU"
    precision: str  # what that device runs the engine's default precision as
    memory_bandwidth: float  # bytes/s
    compute_flops: float  # FLOP/s
    disk_bandwidth: float | None  # bytes/s; None where it could not be measured

    def describe(self) -> str:
        disk = format_rate(self.disk_bandwidth, digits=3) if self.disk_bandwidth else "unmeasured"
        return (f"{self.cores} cores, {format_bytes(self.memory_bytes, digits=3)} free, {self.device} "
                f"({self.precision}), memory {format_rate(self.memory_bandwidth, digits=3)}, compute "
                f"{format_flops(self.compute_flops, digits=3)}, disk {disk}")


def measure(folder: Path | None = None) -> Profile:
    """This machine's profile; the disk probe is written in `folder` (default: the temporary folder)."""
    from cascadia.engine.device import pick_device, runs_as

    free = available_bytes()
    device = pick_device("auto")
    precision = runs_as(ENGINE_PRECISION, device)
    disk = measure_disk_read(folder or Path(tempfile.gettempdir()))
    return Profile(cores=len(available()), memory_bytes=free[0] if free else 0, device=device, precision=precision,
                   memory_bandwidth=significant(measure_bandwidth()),
                   compute_flops=significant(measure_compute(device, precision)),
                   disk_bandwidth=None if disk is None else significant(disk))


def significant(measured: float) -> float:
    """A measured figure to the 3 significant digits it holds (a spec written of it reads as it was measured)."""
    return float(f"{measured:.3g}")


def measure_compute(device: str, precision: str) -> float:
    """FLOP/s of one compiled matrix product on `device` at `precision`, the best of COMPUTE_CALLS calls."""
    import openvino as ov
    import openvino.opset16 as ops

    from cascadia.engine.device import compile_options, core

    rows, columns, outputs = COMPUTE_SHAPE
    rng = np.random.default_rng(0)
    x = ops.parameter([rows, columns], ov.Type.f32)
    weight = ops.constant(rng.standard_normal((columns, outputs), dtype=np.float32))
    compiled = core().compile_model(ov.Model([ops.matmul(x, weight, False, False)], [x]), device,
                                    compile_options(precision))
    request = compiled.create_infer_request()
    data = rng.standard_normal((rows, columns), dtype=np.float32)
    request.infer([data])  # the first call packs the weights
    best = float("inf")
    for _ in range(COMPUTE_CALLS):
        start = time.perf_counter()
        request.infer([data])
        best = min(best, time.perf_counter() - start)
    return 2 * rows * columns * outputs / best


def measure_disk_read(folder: Path, size: int = DISK_PROBE_BYTES) -> float | None:
    """Bytes/s of reading back a file written in `folder` and dropped from the page cache; None where the folder
    cannot take it (read-only, full) or the cache cannot be dropped (not Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".cascadia-disk-probe-") as probe:
            block = np.random.default_rng(0).bytes(2**20)
            for _ in range(size // len(block)):
                probe.write(block)
            probe.flush()
            os.fsync(probe.fileno())  # dirty pages cannot be dropped
            os.posix_fadvise(probe.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            with open(probe.name, "rb", buffering=0) as reader:
                start = time.perf_counter()
                while reader.read(len(block)):
                    pass
                return size / (time.perf_counter() - start)
    except OSError:
        return None
