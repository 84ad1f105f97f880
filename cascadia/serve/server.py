"""`cascadia serve`: the pipeline service and the HTTP app under uvicorn, until SIGTERM or Ctrl-C.

It listens on its HTTP address before any node starts, so that a taken port is one error and starts nothing; a
pipeline that cannot start (a missing or corrupt checkpoint, a taken control port) stops the server with that
pipeline's error, as `cascadia run` gives it. A node lost after the pipeline started is the failover's business.

Shutting down, in order: new requests get 503 at once; the open ones may finish for up to `shutdown_timeout_s`;
then those still open are cancelled (their streams end with finish reason "cancelled"); uvicorn closes the
connections; the service shuts the nodes down (local node processes stop, and are killed if they do not), so no
process is left behind. A second signal skips the wait: the open requests end at once with an error (a stream with
an error event), and the command then fails (exit status 1) saying how many; a third one stops without waiting for
them to be told.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from cascadia.errors import CascadiaError, NodeError
from cascadia.graph.plan import Plan
from cascadia.pipeline.service import PipelineService
from cascadia.serve.app import Server, ServeSettings, build_app
from cascadia.serve.chat import ChatTemplate
from cascadia.spec.types import Spec
from cascadia.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, load_tokenizer

log = logging.getLogger(__name__)


def serve(spec: Spec, plan: Plan, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000,
          checkpoint: Path | None = None, shutdown_timeout_s: float = 30.0,
          beside: Callable[[PipelineService], contextlib.AbstractContextManager] | None = None, **pipeline) -> None:
    """Serve until stopped (see the module's text); `pipeline` holds `PipelineService`'s other options, and
    `beside` what runs beside the service while it serves (a fleet's late joiner). Text needs the checkpoint's
    tokenizer.json, chat its tokenizer_config.json's chat template; without them only token-id completions are
    served."""
    checkpoint = checkpoint or spec.model.checkpoint
    tokenizer = chat = None
    no_chat = f"{checkpoint}/{TOKENIZER_CONFIG_FILE} has no chat_template" if checkpoint else "no checkpoint named"
    if checkpoint is not None and (Path(checkpoint) / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(checkpoint)
        chat = ChatTemplate.of_checkpoint(checkpoint)
        if not (Path(checkpoint) / TOKENIZER_CONFIG_FILE).is_file():
            no_chat = f"{checkpoint}/{TOKENIZER_CONFIG_FILE} is missing"
    elif checkpoint is not None:
        no_chat = f"{checkpoint}/{TOKENIZER_FILE} is missing"
    listener = _listen(host, port)
    log.info("%s", context_line(spec))
    try:
        service = PipelineService(spec, plan, checkpoint=checkpoint, **pipeline)
        server = Server(service, settings, tokenizer, chat, no_chat)
        try:
            uv = _Uvicorn(server, shutdown_timeout_s, uvicorn.Config(build_app(server), log_level="info",
                                                                    timeout_graceful_shutdown=5))
            with beside(service) if beside else contextlib.nullcontext():
                uv.run([listener])
        finally:
            service.close()
    finally:
        listener.close()
    if service.start_error is not None:
        raise service.start_error
    if uv.stopped_at_once is not None:
        raise CascadiaError(f"stopped at once by a second signal: {uv.stopped_at_once} open requests ended with an "
                            "error")


def context_line(spec: Spec) -> str:
    """What a stream holds, said at the start: a prompt plus its reply beyond it is refused."""
    runtime, model = spec.runtime, spec.model.config.max_position_embeddings
    held = "the model's whole context" if runtime.context_budget >= model else f"the model holds {model:,}"
    return (f"serving {spec.model.name}: {runtime.context_budget:,} positions a stream (runtime.context_budget; "
            f"{held}), {runtime.max_streams} streams at once")


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP server's socket, bound and listening; a `NodeError` naming the address when it cannot be."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        reason = "address already in use" if e.errno == errno.EADDRINUSE else os.strerror(e.errno) if e.errno else e
        raise NodeError(f"cannot listen on http://{host}:{port}: {reason}") from None


class _Uvicorn(uvicorn.Server):
    """uvicorn, with a shutdown that lets open requests finish for a while first (see the module's text)."""

    def __init__(self, server: Server, shutdown_timeout_s: float, config: uvicorn.Config):
        super().__init__(config)
        self.cascadia, self.shutdown_timeout_s = server, shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopped_at_once: int | None = None  # after a second signal: how many requests it ended

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT and SIGTERM go to `handle_exit` while serving (and are not raised again afterwards: a server
        that shut down as asked exits 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s): it also stops when the pipeline could not start, as nothing can be served."""
        return self.cascadia.service.start_error is not None or await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is None or self.stopped_at_once is not None:  # not serving yet, or a third signal
            self.should_exit = self.force_exit = True
            return
        if self.cascadia.draining:  # a second signal
            self.stopped_at_once = len(self.cascadia.open)
            self._loop.call_soon_threadsafe(self._stop_at_once)
            return
        self.cascadia.draining = True
        log.info("shutting down: %d open requests may finish for up to %g s", len(self.cascadia.open),
                 self.shutdown_timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    def _stop_at_once(self) -> None:
        log.warning("stopping at once: %d open requests end with an error", len(self.cascadia.open))
        for generation in list(self.cascadia.open.values()):
            generation.stop()
        self.should_exit = True  # uvicorn then lets the responses send their error (timeout_graceful_shutdown)

    async def _drain(self) -> None:
        deadline = self._loop.time() + self.shutdown_timeout_s
        while self.cascadia.open and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        for generation in list(self.cascadia.open.values()):
            generation.cancel()
        await asyncio.sleep(0.1)  # the cancelled streams send their last chunks
        self.should_exit = True
