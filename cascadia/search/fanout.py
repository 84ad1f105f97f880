"""Where a search's fleets are evaluated: in this process, on a pool of processes over this machine's cores, or on
the workers of a Ray cluster (`cascadia[ray]`), as Vidur-Search fans its configurations out.

Each is a `Pool`: `submit` starts a call and returns a handle, `done` waits for the first of the given handles to
finish and returns it with its result. A call's exception is raised where its result is taken.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable, Collection
from typing import Any, Protocol

from cascadia.errors import CascadiaError
from cascadia.host_cpus import available

LOCAL_OBJECT_STORE = 200 * 2**20  # bytes of shared memory a local Ray instance keeps: fleets and results are small


class Pool(Protocol):
    width: int  # calls worth keeping in flight

    def submit(self, call: Callable, *args) -> Any: ...

    def done(self, handles: Collection[Any]) -> tuple[Any, Any]: ...

    def close(self) -> None: ...


class InProcess:
    """Each call made when submitted, here."""

    width = 1

    def submit(self, call: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(call(*args))
        return future

    def done(self, handles: Collection[concurrent.futures.Future]) -> tuple[concurrent.futures.Future, Any]:
        handle = next(iter(handles))
        return handle, handle.result()

    def close(self) -> None:
        pass


PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal for this process when its parent ends


def _end_with(parent: int) -> None:
    """In a pool's process: end when `parent`, the search's process, ends, however it ends (killed, too)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(0)


class Processes(InProcess):
    """`width` processes of this machine, started fresh (spawned: no state of this one shared), each ending with
    this one."""

    def __init__(self, width: int):
        self.width = width
        self.executor = concurrent.futures.ProcessPoolExecutor(width, mp_context=multiprocessing.get_context("spawn"),
                                                               initializer=_end_with, initargs=(os.getpid(),))

    def submit(self, call: Callable, *args) -> concurrent.futures.Future:
        return self.executor.submit(call, *args)

    def done(self, handles: Collection[concurrent.futures.Future]) -> tuple[concurrent.futures.Future, Any]:
        finished, _ = concurrent.futures.wait(handles, return_when=concurrent.futures.FIRST_COMPLETED)
        handle = next(iter(finished))
        return handle, handle.result()

    def close(self) -> None:
        """Calls not started are dropped; those running finish first (their processes are this one's children)."""
        self.executor.shutdown(wait=True, cancel_futures=True)


class RayCluster:
    """The workers of the Ray cluster at `address` ("auto": the one this machine belongs to; "local": a new one on
    this machine, on 127.0.0.1 alone)."""

    def __init__(self, address: str):
        try:
            import ray
        except ImportError:
            raise CascadiaError("--ray needs Ray, which is not installed (pip install 'cascadia[ray]')") from None
        self.ray = ray
        if address not in ("auto", "local"):
            _reachable(address)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            if address == "local":
                ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                         num_cpus=len(available()), object_store_memory=LOCAL_OBJECT_STORE)
            else:
                ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise CascadiaError(f"--ray {address}: cannot join the cluster ({e})") from None
        self.width = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote: dict[Callable, Any] = {}

    def submit(self, call: Callable, *args) -> Any:
        if call not in self._remote:
            self._remote[call] = self.ray.remote(call)
        return self._remote[call].remote(*args)

    def done(self, handles: Collection[Any]) -> tuple[Any, Any]:
        (handle,), _ = self.ray.wait(list(handles), num_returns=1)
        return handle, self.ray.get(handle)

    def close(self) -> None:
        self.ray.shutdown()


REACH_S = 5.0  # seconds to wait for a Ray cluster's address to answer


def _reachable(address: str) -> None:
    """Refuse, naming it, an address ("HOST:PORT", or "ray://HOST:PORT") nothing answers at within REACH_S: Ray's
    own join retries for minutes."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise CascadiaError(f"--ray {address}: expected HOST:PORT, 'auto' or 'local'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_S).close()
    except (OSError, ValueError) as e:
        raise CascadiaError(f"--ray {address}: nothing answers there ({getattr(e, 'strerror', None) or e})") from None
