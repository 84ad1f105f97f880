"""The HTTP front end of `cascadia serve`: an OpenAI-compatible API (and Anthropic's Messages API) over a
`PipelineService`, as a Starlette app (FastAPI routes and validation, server-sent events by sse-starlette).

Every request becomes one stream of the shared policy (`n` of them for `n` choices, which share its prompt's
computation), admitted the moment it arrives. Its events come from the service thread into the stream's asyncio
queue, and go out as one stream chunk per generated token (text held back while it ends inside a character or could
begin a stop string: `TextStream`). A client that goes away, or `POST /v1/cancel/{id}`, cancels its streams; a stop
string found in a choice's text cancels its stream too, with finish reason "stop". Bad input gets an OpenAI-style
error body and a 4xx, a full queue 429 with Retry-After, a server that is loading, failed or shutting down 503.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from importlib import resources

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException
from tokenizers import Tokenizer

from cascadia import __version__
from cascadia.errors import CascadiaError
from cascadia.pipeline.coordinator import Logprobs, PromptLogprobs
from cascadia.pipeline.service import Failed, PipelineService
from cascadia.policy import CANCELLED, LENGTH, STOP, Admitted, Finished, Rejected, Verified
from cascadia.policy import Request as StreamRequest
from cascadia.policy import Token
from cascadia.sampling import Sampling
from cascadia.serve import messages
from cascadia.serve.api import (ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest, Reply, TokenizeRequest,
                                error_body, usage)
from cascadia.serve.chat import ChatTemplate
from cascadia.serve.logprobs import Reported, TokenText, chat_logprobs, completion_logprobs
from cascadia.serve.prom import CONTENT_TYPE, Metrics
from cascadia.serve.responses import ResponseBody, ResponsesRequest, response_status, response_usage
from cascadia.serve.text import TextStream
from cascadia.spec.types import NodeSpec
from cascadia.grammar import GrammarError
from cascadia.serve.tools import ToolFormat, tool_format

KEEP_ALIVE_S = 5  # an SSE comment line this often keeps a paused stream's connection open (a node is replaced)
RATE_WINDOW_S = 60  # tokens/s on the page: over this many seconds
RETRY_AFTER_S = 1
_WAKE = object()  # put in a request's event queue to end its wait
_STOPPED = object()  # put there when the server stops at once: the request ends with an error


@attrs.frozen
class ServeSettings:
    model_name: str
    context_budget: int  # positions per stream: prompt + output tokens
    max_waiting: int  # requests that may wait for a slot (all taken) before more get 429
    max_body_bytes: int
    api_key: str | None = None  # requests to /v1/ without it get 401


class ApiError(Exception):
    """A request the server refuses: its status, OpenAI-style body and Prometheus reason."""

    def __init__(self, status: int, message: str, reason: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.reason, self.headers = status, reason, headers
        self.body = error_body(message, kind, param, code)


class Generation:
    """One choice of a request being served (a stream): the service's events for it, turned into text pieces."""

    def __init__(self, server: Server, stream: StreamRequest, completion_id: str, stop: list[str],
                 response_format: str | None = None, index: int = 0, calls: ToolFormat | None = None):
        self.server, self.stream, self.id, self.index = server, stream, completion_id, index  # index: its choice
        self.calls = calls  # the format its reply's calls are parsed out in (None: none are)
        self.response_format = response_format  # the format a structured reply is held to (json_object, ...)
        self.text = TextStream(server.tokenizer, stop) if server.tokenizer else None
        self.tokens = 0
        self.reported: list[Reported] = []  # each token's log-probabilities, when the request asks for them
        self._logprobs: Logprobs | None = None  # those of the token about to come
        self.prompt_reported: dict[int, PromptLogprobs] = {}  # by position, where the prompt's are asked for
        self.finish_reason: str | None = None
        self.rest = ""
        self.admitted = False
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._arrived = time.perf_counter()
        self._first_token: float | None = None

    def on_event(self, event, t: float) -> None:
        """From the service thread: hand the event to the request's loop (none once the server has stopped)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server stopped, and no one waits for this request
            pass

    async def pieces(self) -> AsyncIterator[str]:
        """Each generated token's text (maybe ""); at the end `finish_reason` is set, and `rest` holds the text held
        back until then (a stop string's prefix that never completed, an unfinished UTF-8 character)."""
        while self.finish_reason is None:
            event = await self._events.get()
            if event is _WAKE:  # cancelled here: `finish_reason` is set
                continue
            if event is _STOPPED:
                self._end("error")
                raise ApiError(503, "the server was stopped before the request finished", "stopped", "server_error")
            if isinstance(event, Admitted):
                self.admitted = True
                self.server.waiting -= 1
            elif isinstance(event, Logprobs):
                self._logprobs = event
            elif isinstance(event, PromptLogprobs):  # a replay after a node's loss may send them again
                self.prompt_reported.setdefault(event.position, event)
            elif isinstance(event, Token):
                self._on_token()
                if self._logprobs is not None:
                    offset = self.text.offset if self.text else sum(len(str(r.token)) for r in self.reported)
                    self.reported.append(Reported(event.token, self._logprobs.logprob, self._logprobs.top, offset))
                    self._logprobs = None
                piece = self.text.push(event.token) if self.text else str(event.token)
                if self.text is not None and self.text.stopped:
                    self.server.service.cancel(self.stream.id)
                    self._end(STOP)
                yield piece
            elif isinstance(event, Verified):
                self.server.metrics.drafts_proposed.inc(event.proposed)
                self.server.metrics.drafts_accepted.inc(event.accepted)
            elif isinstance(event, Finished):
                self._end({LENGTH: "length", STOP: "stop", CANCELLED: "cancelled"}[event.reason])
                self.rest = self.text.finish() if self.text is not None else ""
            elif isinstance(event, Rejected):  # the checks before submitting make this rare
                self._end("rejected")
                raise ApiError(400, event.reason, "rejected", code="context_length_exceeded")
            elif isinstance(event, Failed):
                self._end("error")
                raise ApiError(503, f"the pipeline failed: {event.reason}", "failed", "server_error")

    def cancel(self) -> None:
        if self.finish_reason is None:
            self.server.service.cancel(self.stream.id)
            self._end("cancelled")
            self._events.put_nowait(_WAKE)

    def stop(self) -> None:
        """The server stops at once: the request ends with a 503 error (a stream with an error event)."""
        if self.finish_reason is None:
            self.server.service.cancel(self.stream.id)
            self._events.put_nowait(_STOPPED)

    def _on_token(self) -> None:
        now = time.perf_counter()
        if self._first_token is None:
            self._first_token = now
            self.server.metrics.ttft.observe(now - self._arrived)
        self.tokens += 1
        self.server.metrics.tokens.inc()
        self.server.recent_tokens.append(now)

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        if not self.admitted:
            self.server.waiting -= 1
        self.server.open.pop(self.stream.id, None)
        self.server.metrics.requests.labels(reason).inc()
        if self.response_format is not None:
            self.server.metrics.structured.labels(self.response_format, reason).inc()
        if self._first_token is not None and self.tokens > 1:
            self.server.metrics.tpot.observe((time.perf_counter() - self._first_token) / (self.tokens - 1))


class Server:
    """The app's state: the service, the tokenizer and chat template, the open requests, the metrics."""

    def __init__(self, service: PipelineService, settings: ServeSettings, tokenizer: Tokenizer | None,
                 chat: ChatTemplate | None, no_chat: str):
        self.service, self.settings = service, settings
        self.tokenizer, self.chat, self.no_chat = tokenizer, chat, no_chat
        self.open: dict[int, Generation] = {}  # by stream id
        self.waiting = 0  # streams submitted, not yet admitted
        self.draining = False  # shutting down: no new requests
        self.recent_tokens: deque[float] = deque()
        self.ids = itertools.count()
        self.metrics = Metrics(service.status, lambda: (len(self.open) - self.waiting, self.waiting))
        self.token_text = TokenText(tokenizer)

    def prompt(self, body: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(body, ChatRequest):
            return self.chat_ids(body.messages, body.template_variables(), body.add_generation_prompt,
                                 body.continue_final_message)
        return body.prompt if isinstance(body.prompt, list) else self.text_ids(body.prompt, "prompt")

    def chat_ids(self, messages: list[ChatMessage], variables: dict, add_generation_prompt: bool = True,
                 continue_final: bool = False) -> list[int]:
        """A chat's token ids, as the chat template renders it (special tokens in the text, none added; see
        `ChatTemplate.render`)."""
        if self.chat is None or self.tokenizer is None:
            raise ApiError(400, f"chat messages need a chat template: {self.no_chat}; use /v1/completions",
                           "invalid_request", param="messages")
        text = self.chat.render([m.for_template() for m in messages], variables, add_generation_prompt,
                                continue_final)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_ids(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer_for(param).encode(text, add_special_tokens=add_special_tokens).ids

    def tokenizer_for(self, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, "text needs the checkpoint's tokenizer.json; give token ids", "invalid_request",
                           param=param)
        return self.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise ApiError(404, f"no model named {model!r}; this server serves {self.settings.model_name!r}",
                           "invalid_request", param="model", code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.service.spec.model.config.vocab_size
        if ids and max(ids) >= vocab:
            raise ApiError(400, f"token id {max(ids)} is beyond the vocabulary (0..{vocab - 1})", "invalid_request",
                           param=param)

    def start(self, body: ChatRequest | CompletionRequest, id_prefix: str | None = None) -> list[Generation]:
        """Check a request against the model and the queue, and submit it: one generation per choice (its id:
        `id_prefix` and a random part, by default the prefix of its endpoint's objects)."""
        status = self.service.status()
        if self.draining or not status.accepting:
            why = "the server is shutting down" if self.draining else \
                (status.down or status.error or f"loading ({status.loading})")
            raise ApiError(503, f"not serving: {why}", "unavailable", "server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.check_model(body.model)
        prompt = self.prompt(body)
        budget = self.settings.context_budget
        if not prompt:
            raise ApiError(400, "the prompt has no tokens", "invalid_request", param="prompt")
        self.check_ids(prompt, "prompt")
        wanted = body.wanted_tokens()
        if len(prompt) + (wanted or 1) > budget:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({wanted or 1}) exceeds the "
                                f"context length of {budget} positions", "context_length",
                           param="max_tokens" if wanted else "messages", code="context_length_exceeded")
        max_streams = self.service.spec.runtime.max_streams
        if body.n > max_streams:
            raise ApiError(400, f"n: {body.n} choices need as many stream slots at once, more than this server's "
                                f"{max_streams}", "invalid_request", param="n")
        if len(self.open) + body.n > max_streams + self.settings.max_waiting:
            raise ApiError(429, f"every stream slot is taken and {self.waiting} requests are waiting; try again "
                                "shortly",
                           "queue_full", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        config = self.service.spec.model.config
        seed = secrets.randbits(63) if body.seed is None else body.seed
        if body.logit_bias:
            self.check_ids(list(body.logit_bias), "logit_bias")
        if body.response_format is not None and body.response_format.type != "text":
            self.tokenizer_for("response_format")  # the grammar's vocabulary
        calls = self.calls_format(body) if isinstance(body, ChatRequest) and body.tools else None
        stop_ids = () if body.ignore_eos else config.eos_ids
        reporting = {"logprobs": body.reported_logprobs(), "prompt_logprobs": body.prompt_logprobs(),
                     "adjust": body.adjustments(len(prompt), tuple(sorted(config.eos_ids)))}
        sampling = Sampling(body.temperature, body.top_p, seed, max(body.top_k, 0), body.min_p, **reporting) \
            if body.temperature else Sampling(**reporting)
        prefix = id_prefix or ("chatcmpl-" if isinstance(body, ChatRequest) else "cmpl-")
        completion_id = f"{prefix}{secrets.token_hex(12)}"
        structured = body.response_format.type if body.response_format is not None else "text"
        generations = [Generation(self, StreamRequest(next(self.ids), prompt, wanted or budget - len(prompt), stop_ids,
                                                      attrs.evolve(sampling, seed=sampling.seed + index)),
                                  completion_id, body.stop_strings, None if structured == "text" else structured,
                                  index, calls) for index in range(body.n)]
        by_stream = {generation.stream.id: generation for generation in generations}

        def on_event(event, t: float) -> None:
            if isinstance(event, PromptLogprobs):  # the first choice computes the prompt for them all
                for generation in generations:
                    generation.on_event(event, t)
            else:
                by_stream[event.request_id].on_event(event, t)

        self.open.update(by_stream)
        self.waiting += len(generations)
        self.service.submit([generation.stream for generation in generations], on_event)
        return generations

    def calls_format(self, body: ChatRequest) -> ToolFormat | None:
        """The format a chat's calls are written in, where they are parsed out of its reply (`tools` given, and
        `tool_choice` not none), with the reply held to calls where `tool_choice` forces them."""
        fmt = tool_format(self.chat.source) if self.chat else None
        if fmt is None:
            raise ApiError(400, "tools: this checkpoint's chat template writes no tool calls in a format this server "
                                "reads (Hermes' <tool_call>...</tool_call>, or Llama 3.1's JSON)", "unsupported",
                           param="tools")
        try:
            body.force_calls(fmt)
        except GrammarError as e:
            raise ApiError(400, f"tools: a function's parameters cannot hold a call: {e}", "invalid_request",
                           param="tools") from None
        return fmt if body.calls_tools else None

    def tokens_per_s(self) -> float:
        now = time.perf_counter()
        while self.recent_tokens and self.recent_tokens[0] < now - RATE_WINDOW_S:
            self.recent_tokens.popleft()
        return len(self.recent_tokens) / RATE_WINDOW_S


class BodyLimit:
    """ASGI middleware: a request's body is read whole before the app sees it, and refused with `too_large()` once
    it passes `max_bytes` (`too_large` makes the response for its path), whether it declares its length or comes in
    chunks."""

    def __init__(self, app, max_bytes: int, too_large: Callable[[str], Response]) -> None:
        self.app, self.max_bytes, self.too_large = app, max_bytes, too_large

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self.too_large(scope["path"])(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self.too_large(scope["path"])(scope, receive, send)
            if not message.get("more_body"):
                break
        whole: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict:
            nonlocal whole
            if whole is None:
                return await receive()  # after the body: a disconnect, for a streaming response to notice
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="cascadia serve", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.server = server

    def refusal(path: str, e: ApiError) -> JSONResponse:
        """The error's response, in the shape of the API its path belongs to."""
        server.metrics.rejected.labels(e.reason).inc()
        body = messages.error_body(e.status, str(e)) if messages.on_path(path) else e.body
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return refusal(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return await api_error(request, _validation_error(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return await api_error(request, ApiError(e.status_code, str(e.detail), "http"))

    @app.exception_handler(CascadiaError)
    async def refused(request: Request, e: CascadiaError):
        return await api_error(request, ApiError(400, str(e), "invalid_request"))

    def too_large(path: str) -> JSONResponse:
        return refusal(path, ApiError(413, f"the request body is over the limit of {server.settings.max_body_bytes}"
                                           " bytes", "too_large"))

    app.add_middleware(BodyLimit, max_bytes=server.settings.max_body_bytes, too_large=too_large)

    @app.middleware("http")  # added last, so it runs first: no body is read for a request without the key
    async def guard(request: Request, call_next):
        """The key on /v1/: a bearer token, or `x-api-key` as Anthropic's clients send it."""
        if request.url.path.startswith("/v1/") and (key := server.settings.api_key) is not None:
            bearer = request.headers.get("authorization", "").encode()
            header = request.headers.get("x-api-key", "").encode()
            if not (hmac.compare_digest(bearer, f"Bearer {key}".encode()) or hmac.compare_digest(header, key.encode())):
                return refusal(request.url.path, ApiError(401, "missing or wrong API key (Authorization: Bearer KEY, "
                                                               "or x-api-key: KEY)", "unauthorized",
                                                          code="invalid_api_key"))
        return await call_next(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _respond(server, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(server, body, request, chat=False)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        [generation] = server.start(body.as_chat(), id_prefix="resp_")
        reply = ResponseBody(body, generation.id, server.settings.model_name)
        prompt_tokens = len(generation.stream.prompt_ids)
        if body.stream:
            return EventSourceResponse(_response_events(generation, reply, prompt_tokens), ping=KEEP_ALIVE_S)
        [text] = await _collected([generation], request)
        return reply.response(response_status(generation.finish_reason), text,
                              response_usage(prompt_tokens, generation.tokens))

    @app.post(messages.PATH)
    async def create_message(body: messages.MessagesRequest, request: Request):
        chat = body.as_chat()
        [generation] = server.start(chat, id_prefix="msg_")
        reply = messages.MessageBody(generation.id, server.settings.model_name, len(generation.stream.prompt_ids))
        if body.stream:
            return EventSourceResponse(_message_events(generation, reply, chat.tool_names), ping=KEEP_ALIVE_S)
        [text] = await _collected([generation], request)
        calls = []
        if generation.calls is not None:
            content, calls = generation.calls.parse(text, chat.tool_names)
            text = content if calls else text
        stopped_by = generation.text.stopped_by
        return reply.message(text, messages.stop_reason(generation.finish_reason, stopped_by, bool(calls)),
                             stopped_by, generation.tokens, calls)

    @app.post(messages.PATH + "/count_tokens")
    async def count_message_tokens(body: messages.MessagesPrompt):
        server.check_model(body.model)
        return {"input_tokens": len(server.chat_ids(body.chat_messages(), {}, continue_final=body.prefilled))}

    @app.post("/v1/cancel/{completion_id}")
    async def cancel(completion_id: str):
        choices = [generation for generation in server.open.values() if generation.id == completion_id]
        if not choices:
            raise ApiError(404, f"no open request {completion_id!r}", "not_found", param="id")
        for generation in choices:
            generation.cancel()
        return {"id": completion_id, "cancelled": True}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if body.messages is not None:
            ids = server.chat_ids(body.messages, {}, body.add_generation_prompt)
        else:
            ids = server.text_ids(body.prompt if body.prompt is not None else body.content, "prompt",
                                  body.adds_special_tokens)
        return {"count": len(ids), "max_model_len": server.settings.context_budget, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        server.check_ids(body.tokens, "tokens")
        text = server.tokenizer_for("tokens").decode(body.tokens, skip_special_tokens=False)
        return {"prompt": text, "content": text}  # vLLM's key, and llama-server's

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.settings.model_name, "object": "model",
                                            "created": 0, "owned_by": "cascadia"}]}

    @app.get("/health")
    async def health():
        status = server.service.status()
        if status.ready and not server.draining:
            return {"status": "ok"}
        state, detail = ("shutting down", "") if server.draining else ("failed", status.error) if status.error \
            else ("down", status.down) if status.down else ("loading", status.loading)
        return JSONResponse({"status": state, "detail": detail}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/status")
    async def status():
        return _status(server, await asyncio.to_thread(server.service.busy_seconds))

    @app.get("/")
    async def page():
        return HTMLResponse(resources.files("cascadia.serve").joinpath("page.html").read_text(encoding="utf-8"))

    return app


async def _respond(server: Server, body: ChatRequest | CompletionRequest, request: Request, chat: bool):
    generations = server.start(body)
    reply = Reply(chat, generations[0].id, server.settings.model_name)
    prompt_tokens = len(generations[0].stream.prompt_ids)
    if body.stream:
        return EventSourceResponse(_stream(generations, reply, body, prompt_tokens), ping=KEEP_ALIVE_S)
    choices = []
    for generation, text in zip(generations, await _collected(generations, request)):
        echoed, echoed_logprobs = _echoed(server, body, generation)
        reported = echoed_logprobs + _shifted(generation.reported, len(echoed))
        content, calls = (echoed + text, [])
        if generation.calls is not None:
            content, calls = generation.calls.parse(content, body.tool_names)
        choices.append(reply.choice(generation.index, content, generation.finish_reason,
                                    _logprobs(server, reported, chat) if body.reported_logprobs() >= 0 else None,
                                    [call.as_dict() for call in calls]))
    return reply.whole(choices, prompt_tokens, sum(generation.tokens for generation in generations))


async def _collected(generations: list[Generation], request: Request) -> list[str]:
    """The whole text of each choice of a request answered at once; a client that goes away meanwhile cancels
    them."""
    collect = asyncio.gather(*map(_collect, generations))
    try:
        while not collect.done():
            await asyncio.wait({collect}, timeout=0.25)
            if not collect.done() and await request.is_disconnected():
                for generation in generations:
                    generation.cancel()
        return await collect
    finally:
        collect.cancel()
        for generation in generations:
            generation.cancel()


async def _collect(generation: Generation) -> str:
    return "".join([piece async for piece in generation.pieces()]) + generation.rest


async def _stream(generations: list[Generation], reply: Reply, body: ChatRequest | CompletionRequest,
                  prompt_tokens: int):
    """The server-sent events of a streamed completion: each choice's chunks (`_choice_chunks`) as they come, then a
    usage chunk of them all when `include_usage` asks. A client that goes away cancels its streams (this generator
    is closed, and `finally` runs)."""
    failed: list[Generation] = []
    try:
        chunks = [_choice_chunks(generation, generations, reply, body, prompt_tokens, failed)
                  for generation in generations]
        async for chunk in (chunks[0] if len(chunks) == 1 else _merged(chunks)):
            yield chunk
        if failed:
            return
        if body.include_usage:
            yield {"data": json.dumps(reply.usage_chunk(prompt_tokens, sum(g.tokens for g in generations)))}
        yield {"data": "[DONE]"}
    finally:
        for generation in generations:
            generation.cancel()


async def _merged(iterators: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators in the order they come; an exception of one is raised here."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                queue.put_nowait(item)
            queue.put_nowait(done)
        except Exception as e:  # noqa: BLE001 (raised again where the items are taken)
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(drain(iterator)) for iterator in iterators]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not done:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _choice_chunks(generation: Generation, generations: list[Generation], reply: Reply,
                         body: ChatRequest | CompletionRequest, prompt_tokens: int, failed: list[Generation]):
    """One choice's chunks: a chat's first names the role, then one per token, and the last the finish reason
    (with any held-back text), so that a client can time each token by its chunk; each with the usage of all the
    choices so far when `continuous_usage_stats` asks. A failure is an error chunk, and the choice is put in
    `failed`."""
    def chunk(text: str | None, finish_reason: str | None = None, first: bool = False,
              logprobs: dict | None = None, tool_call: dict | None = None) -> dict:
        so_far = usage(prompt_tokens, sum(g.tokens for g in generations)) if body.usage_on_every_chunk else None
        return {"data": json.dumps(reply.chunk(text, finish_reason, first, so_far, logprobs, tool_call,
                                               generation.index))}

    content = generation.calls.stream() if generation.calls is not None else None  # holds a reply's calls back
    if reply.chat:
        yield chunk("", first=True)
    try:
        sent, echoed = 0, None  # tokens whose log-probabilities went out; the echoed prompt, once it went
        async for piece in generation.pieces():
            piece = piece if content is None else content.push(piece)
            if echoed is None:  # with the first token: every prompt row has reported by then
                echoed, reported = _echoed(generation.server, body, generation)
                if echoed or reported:
                    yield chunk(echoed, logprobs=_logprobs(generation.server, reported, reply.chat)
                                if body.prompt_logprobs() else None)
            reported, sent = generation.reported[sent:], len(generation.reported)
            yield chunk(piece, logprobs=_logprobs(generation.server, _shifted(reported, len(echoed)), reply.chat)
                        if body.reported_logprobs() >= 0 else None)
    except ApiError as e:
        failed.append(generation)
        yield {"data": json.dumps(e.body)}
        return
    rest, calls = generation.rest, []
    if content is not None:
        content.push(rest)
        rest, calls = content.finish(body.tool_names)
    if calls:
        if rest:
            yield chunk(rest)
        for index, call in enumerate(calls):
            yield chunk(None, tool_call={"index": index} | call.as_dict())
        yield chunk(None, "tool_calls")
    else:
        yield chunk(rest or None, generation.finish_reason)


def _echoed(server: Server, body: ChatRequest | CompletionRequest, generation: Generation
            ) -> tuple[str, list[Reported]]:
    """What a completion's `echo` puts before the reply: its prompt's text (as given, or its ids decoded), and its
    tokens' log-probabilities where asked for (the first token, which follows nothing, has none); "" and none
    without echo."""
    if not (isinstance(body, CompletionRequest) and body.echo):
        return "", []
    ids = generation.stream.prompt_ids
    if isinstance(body.prompt, str):
        text = body.prompt
    else:
        text = server.tokenizer.decode(list(ids), skip_special_tokens=True) if server.tokenizer else \
            "".join(map(str, ids))
    if not body.prompt_logprobs():
        return text, []
    decoded = TextStream(server.tokenizer) if server.tokenizer else None
    reported, offset = [], 0
    for position, token in enumerate(ids):
        if decoded is not None:
            offset = decoded.offset
            decoded.push(token)
        found = generation.prompt_reported.get(position)
        reported.append(Reported(token, found and found.logprob, found and found.top, offset))
        offset += 0 if decoded is not None else len(str(token))
    return text, reported


def _shifted(reported: list[Reported], by: int) -> list[Reported]:
    """The reply's tokens' log-probabilities, their text offsets after `by` characters of echoed prompt."""
    return [attrs.evolve(r, offset=r.offset + by) for r in reported] if by else reported


def _logprobs(server: Server, reported: list[Reported], chat: bool) -> dict:
    return (chat_logprobs if chat else completion_logprobs)(reported, server.token_text)


async def _response_events(generation: Generation, reply: ResponseBody, prompt_tokens: int):
    """A streamed response's typed events (see `cascadia.serve.responses`); a failure is an `error` event, and the
    stream ends there. A client that goes away cancels its request, as for a chat stream."""
    try:
        yield reply.event("response.created", response=reply.response("in_progress"))
        yield reply.event("response.in_progress", response=reply.response("in_progress"))
        yield reply.event("response.output_item.added", output_index=0, item=reply.message("in_progress", None))
        yield reply.text_event("response.content_part.added", part=reply.part(""))
        pieces = []
        try:
            async for piece in generation.pieces():
                if piece:
                    pieces.append(piece)
                    yield reply.text_event("response.output_text.delta", delta=piece, logprobs=[])
        except ApiError as e:
            error = e.body["error"]
            yield reply.event("error", code=error["code"], message=error["message"], param=error["param"])
            return
        if generation.rest:
            pieces.append(generation.rest)
            yield reply.text_event("response.output_text.delta", delta=generation.rest, logprobs=[])
        text = "".join(pieces)
        yield reply.text_event("response.output_text.done", text=text, logprobs=[])
        yield reply.text_event("response.content_part.done", part=reply.part(text))
        yield reply.event("response.output_item.done", output_index=0, item=reply.message("completed", text))
        status = response_status(generation.finish_reason)
        yield reply.event("response.completed" if status == "completed" else "response.incomplete",
                          response=reply.response(status, text, response_usage(prompt_tokens, generation.tokens)))
    finally:
        generation.cancel()


async def _message_events(generation: Generation, reply: messages.MessageBody, tool_names: set[str]):
    """A streamed message's named events (see `cascadia.serve.messages`); a failure is an `error` event, and the
    stream ends there. A client that goes away cancels its request, as for a chat stream."""
    content = generation.calls.stream() if generation.calls is not None else None  # holds the reply's calls back
    try:
        yield reply.event("message_start", message=reply.message(None, None, None, 0))
        yield reply.event("content_block_start", index=0, content_block=reply.block(""))
        try:
            async for piece in generation.pieces():
                if piece := piece if content is None else content.push(piece):
                    yield reply.event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
        except ApiError as e:
            yield {"event": "error", "data": json.dumps(messages.error_body(e.status, str(e)))}
            return
        rest, calls = generation.rest, []
        if content is not None:
            content.push(rest)
            rest, calls = content.finish(tool_names)
        if rest:
            yield reply.event("content_block_delta", index=0, delta={"type": "text_delta", "text": rest})
        yield reply.event("content_block_stop", index=0)
        for index, call in enumerate(calls, 1):
            yield reply.event("content_block_start", index=index, content_block=reply.tool_use(call, False))
            yield reply.event("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                         "partial_json": call.arguments})
            yield reply.event("content_block_stop", index=index)
        stopped_by = generation.text.stopped_by
        yield reply.event("message_delta", delta={"stop_reason": messages.stop_reason(generation.finish_reason,
                                                                                      stopped_by, bool(calls)),
                                                  "stop_sequence": stopped_by}, usage=reply.usage(generation.tokens))
        yield reply.event("message_stop")
    finally:
        generation.cancel()


def _validation_error(e: RequestValidationError) -> ApiError:
    """The first problem of a request body, as OpenAI words it."""
    problem = e.errors()[0]
    where = [str(part) for part in problem.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    if problem.get("type") == "unsupported":
        return ApiError(400, problem["msg"], "unsupported", param=problem["ctx"]["param"])
    if problem.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown parameter {param!r}", "invalid_request", param=param)
    if problem.get("type") in ("lone_surrogate", "invalid_param"):
        return ApiError(400, problem["msg"], "invalid_request", param=problem["ctx"]["param"])
    if problem.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({problem.get('msg')})", "invalid_request")
    message = problem.get("msg", "invalid")
    return ApiError(400, f"{param}: {message}" if param else message, "invalid_request", param=param)


def _status(server: Server, busy_s: dict[str, float]) -> dict:
    """What the page shows: the plan's stages, each node's load, the requests, the recent tokens per second; and
    each node's busy seconds so far (`busy_s`), for a load generator's busy shares."""
    status = server.service.status()
    cluster = server.service.spec.cluster
    return {
        "model": server.settings.model_name, "ready": status.ready and not server.draining,
        "loading": status.loading, "error": status.error,
        "running": len(server.open) - server.waiting, "waiting": server.waiting,
        "tokens_per_s": server.tokens_per_s(),
        "stages": [{"node": s.node, "layers": [s.first_layer, s.last_layer], "roles": list(s.roles),
                    "busy": status.busy.get(s.node), "frames_per_s": status.frames_per_s.get(s.node),
                    "busy_s": busy_s.get(s.node), "machine": _machine(cluster.node(s.node))}
                   for s in server.service.plan.stages],
        "standing_by": list(status.standing_by),
        # members holding no stage now: spares, and nodes whose stage another took
        "spares": [{"node": n.name, "machine": _machine(n)} for n in cluster.members
                   if n.name not in {s.node for s in server.service.plan.stages}],
    }


def _machine(node: NodeSpec) -> dict:
    """A node's machine as the spec says it, or as the node measured it when the fleet formed itself (bytes, bytes/s,
    FLOP/s; None where not given)."""
    return {"address": node.address, "device": node.device, "memory": node.memory_bytes,
            "memory_bandwidth": node.memory_bandwidth,
            "compute": node.compute_flops, "disk_bandwidth": node.disk_bandwidth}
