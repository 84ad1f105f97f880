"""`cascadia run --url`: a spec's workload against a live OpenAI-compatible server, timed on the client side.

The same levels, phases, prompts (as token ids) and arrivals as `cascadia run` serves on its own pipeline, sent as
streamed `/v1/completions` requests by the `openai` client: a request arrives when its client sends it, and each token
when its stream chunk comes back (`cascadia serve` sends a chunk per token, so that tokens are timed one by one, then
one with the finish reason; the count is the usage the server reports). The same `Recorder` turns that into the same
metrics schema, so a run against a deployment, a local run and a simulation read alike. Each node's busy seconds come
from the server's `/status`, when it is a `cascadia serve`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import attrs
import httpx
import openai

from cascadia import metrics
from cascadia.driver import Served, serve_workload
from cascadia.errors import NodeError, RequestError
from cascadia.metrics import Recorder
from cascadia.policy import LENGTH, STOP, Finished, Rejected, Token
from cascadia.spec.types import Spec, WorkloadSpec
from cascadia.workload import Arrivals, Choices, Level, Phase, prompt_length_notes

TIMEOUT_S = 600.0  # one request's longest wait for the server
_FINISH = {"length": LENGTH, "stop": STOP}


@attrs.frozen
class Target:
    """A server: its base URL (http://HOST:PORT), the API key it wants, and the model name (None: its only one)."""

    url: str
    api_key: str | None = None
    model: str | None = None

    @property
    def base(self) -> str:
        return self.url.rstrip("/")


def run_url(spec: Spec, workload: WorkloadSpec, target: Target, prompts: Sequence[tuple[int, ...]] | None,
            on_phase: Callable[[str, str, list], None] = lambda level, phase, records: None) -> dict:
    """Every level of `workload` against the server, in the metrics schema (source "run"). A request the server
    refuses as too long for its context (as the policy does in `cascadia run`), or for want of room (429: its
    waiting queue is full), is rejected; a server that cannot be reached, or fails or refuses a request otherwise,
    is an error naming it."""
    notes = prompt_length_notes(prompts, workload, spec.runtime) if prompts else []
    model = target.model or asyncio.run(_only_model(target))
    served = Served()

    def run_phase(level: Level, phase: Phase, recorder: Recorder) -> dict[str, float]:
        return asyncio.run(_phase(target, model, level.arrivals(phase), phase.streams, recorder))

    serve_workload(spec, workload, prompts, run_phase, served, on_phase)
    return metrics.result("run", attrs.evolve(spec, workload=workload), served.levels, served.records,
                          warnings=[f"measured on the client side, against {target.url} (model {model})", *notes])


def _client(target: Target) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{target.base}/v1", api_key=target.api_key or "none", max_retries=0,
                              timeout=TIMEOUT_S)


async def _only_model(target: Target) -> str:
    async with _client(target) as client:
        try:
            models = [model.id async for model in client.models.list()]
        except openai.APIError as e:
            raise NodeError(f"{target.url}: cannot list the server's models ({e})") from None
    if len(models) != 1:
        raise RequestError(f"{target.url} serves {len(models)} models ({', '.join(models)}): name one (--model)")
    return models[0]


async def _phase(target: Target, model: str, arrivals: Arrivals, requests: int, recorder: Recorder) -> dict:
    """One phase's requests sent as `arrivals` says, each streamed and timed; each node's busy seconds in it."""
    async with _client(target) as client, httpx.AsyncClient(timeout=30) as http:
        busy_before = await _busy_seconds(http, target)
        clock0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()

        def now() -> float:
            return time.perf_counter() - clock0

        def send(batch: list[Choices]) -> None:
            for choices in batch:
                for request in choices:
                    recorder.arrived(request, now())
                tasks.add(asyncio.create_task(_request(client, model, choices, recorder, now)))

        send(arrivals.start(now()))
        left = requests
        try:
            while left:
                due = arrivals.next_time
                timeout = None if due is None else max(0.0, due - now())
                if tasks:
                    finished, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                else:  # open loop, between arrivals
                    finished = set()
                    await asyncio.sleep(timeout)
                tasks -= finished
                for task in finished:
                    for request_id in task.result():  # a failed request stops the run
                        left -= 1
                        send(arrivals.done(request_id))  # closed loop: its client's next request
                send(arrivals.due(now()))
        finally:
            for task in tasks:
                task.cancel()
        busy_after = await _busy_seconds(http, target)
    return {node: seconds - busy_before.get(node, 0.0) for node, seconds in busy_after.items()}


async def _request(client: openai.AsyncOpenAI, model: str, choices: Choices, recorder: Recorder, now) -> list[int]:
    """One request (its choices as `n`), streamed: each choice's tokens' times into the recorder, then its end;
    the ids of its streams."""
    request = choices[0]
    sampling = request.sampling
    options, extra = {"temperature": sampling.temperature}, {"ignore_eos": not request.stop_ids}
    if not sampling.greedy:
        options |= {"top_p": sampling.top_p, "seed": sampling.seed}
        extra |= {name: value for name, value in (("top_k", sampling.top_k), ("min_p", sampling.min_p)) if value}
    times: list[list[float]] = [[] for _ in choices]  # each choice's chunks
    finish: list[str | None] = [None] * len(choices)
    tokens = None
    try:
        stream = await client.completions.create(
            model=model, prompt=list(request.prompt_ids), max_tokens=request.max_new_tokens, stream=True,
            n=len(choices), stream_options={"include_usage": True}, extra_body=extra, **options)
        async for chunk in stream:
            for choice in chunk.choices:
                times[choice.index].append(now())
                finish[choice.index] = choice.finish_reason or finish[choice.index]
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except (openai.BadRequestError, openai.RateLimitError) as e:
        if e.status_code == 400 and e.code != "context_length_exceeded":
            raise RequestError(f"request {request.id}: the server refused it: {e.message}") from None
        recorder.observe([Rejected(r.id, e.message) for r in choices], now())  # too long, or no room: the server's
        return [r.id for r in choices]
    except openai.APIError as e:
        raise NodeError(f"request {request.id}: the server answered {e}") from None
    if tokens is None or None in finish or not all(times):
        raise NodeError(f"request {request.id}: the stream ended without its usage or a choice's finish reason")
    # cascadia serve: a chunk per token, then the finish; a server that sends several tokens in one chunk: those
    # tokens arrived together, at the last chunk's time. Of several choices, the usage counts them all: each has
    # as many tokens as chunks before its finish (cascadia serve's).
    counts = [tokens] if len(choices) == 1 else [len(t) - 1 for t in times]
    if sum(counts) != tokens:
        raise NodeError(f"request {request.id}: its {len(choices)} choices' chunks do not add up to the "
                        f"{tokens} tokens of its usage: cannot time each choice's tokens")
    for r, chunks, count, reason in zip(choices, times, counts, finish):
        token_times = chunks[:count] + chunks[-1:] * (count - len(chunks))
        for index, t in enumerate(token_times):
            recorder.observe([Token(r.id, -1, index)], t)
        recorder.observe([Finished(r.id, None, _FINISH.get(reason, reason), count)], token_times[-1])
    return [r.id for r in choices]


async def _busy_seconds(http: httpx.AsyncClient, target: Target) -> dict[str, float]:
    """Each node's busy seconds so far, as a `cascadia serve` reports them (none from another server)."""
    try:
        response = await http.get(f"{target.base}/status")
        stages = response.json()["stages"] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
    return {stage["node"]: stage["busy_s"] for stage in stages if stage.get("busy_s") is not None}
