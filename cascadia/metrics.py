"""One metrics schema for `cascadia run` and `cascadia simulate`, so that a validation is a diff of two JSON files.

A backend feeds a `Recorder` per phase with arrivals and the policy's events, each with its clock's time (seconds),
and counts the seconds each node was busy. `summarize_level` turns a phase into a level summary:
- decode_tokens_per_s: output tokens after each request's first, over the time during which at least one stream was
  decoding (between its first token and its last);
- phase_tokens_per_s: all output tokens over the phase's wall time (first arrival to last token);
- ttft_s, tpot_s: first-token latency and mean time per later token of each request, p50, p95 and p99 by numpy's
  "linear" percentile method;
- goodput (with a workload SLO): the fraction of requests whose TTFT and TPOT both meet it, and those requests per
  second of the phase's wall time;
- busy: the fraction of the phase's wall time each node spent computing;
- speculation: the draft tokens proposed and accepted (their tokens kept), and the mean accepted per verifying step
  (a stream's drafts in one frame; None without any).
A level is `concurrency` closed-loop clients, or open-loop arrivals at `rate` requests per second (the other None).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from cascadia.policy import CANCELLED, Event, Finished, Rejected, Request, Token, Verified
from cascadia.spec.dump import dump_spec
from cascadia.spec.types import SloSpec, Spec
from cascadia.table import format_rows

SCHEMA = "cascadia.metrics/1"
PERCENTILE_METHOD = "linear"
# The figures a prediction is checked on: name -> (keys into a level summary, unit shown, scale to that unit)
FIGURES = {
    "decode tok/s": (("decode_tokens_per_s",), "tok/s", 1.0),
    "phase tok/s": (("phase_tokens_per_s",), "tok/s", 1.0),
    "TTFT p50": (("ttft_s", "p50"), "ms", 1e3),
    "TTFT p95": (("ttft_s", "p95"), "ms", 1e3),
    "TPOT p50": (("tpot_s", "p50"), "ms", 1e3),
}


@attrs.frozen
class RequestRecord:
    level: int | None  # the level's concurrency (closed loop)
    rate: float | None  # the level's arrival rate (open loop)
    phase: str
    request_id: int
    prompt_tokens: int
    output_tokens: int
    t_arrival: float
    t_first_token: float
    t_finish: float
    token_times: tuple[float, ...]  # when each output token was known

    @property
    def ttft(self) -> float:
        return self.t_first_token - self.t_arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token request."""
        if self.output_tokens < 2:
            return None
        return (self.t_finish - self.t_first_token) / (self.output_tokens - 1)


@attrs.define
class Speculated:
    """A phase's speculation: draft tokens proposed and accepted over its verifying steps."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def add(self, verified: Verified) -> None:
        self.proposed += verified.proposed
        self.accepted += verified.accepted
        self.steps += 1

    def summary(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "mean_accepted_per_step": self.accepted / self.steps if self.steps else None}


class Recorder:
    """Timestamps one phase's requests from the policy's events: the same bookkeeping in both backends."""

    def __init__(self, level: int | None, phase: str, rate: float | None = None) -> None:
        self.level, self.rate, self.phase = level, rate, phase
        self.rejected: list[Rejected] = []
        self.cancelled: list[Finished] = []  # requests cancelled before they finished: no record
        self._arrivals: dict[int, tuple[Request, float]] = {}
        self._token_times: dict[int, list[float]] = {}
        self._records: list[RequestRecord] = []
        self.speculation = Speculated()

    def arrived(self, request: Request, t: float) -> None:
        self._arrivals[request.id] = (request, t)
        self._token_times[request.id] = []  # made here, not looked up with a default for each token

    def observe(self, events: Iterable[Event], t: float) -> list[int]:
        """Take events that happened at `t`; returns the ids of the requests they ended (finished, cancelled,
        rejected)."""
        ended = []
        for event in events:
            if isinstance(event, Token):
                self._token_times[event.request_id].append(t)
            elif isinstance(event, Finished) and event.reason == CANCELLED:
                self._arrivals.pop(event.request_id, None)
                self._token_times.pop(event.request_id, None)
                self.cancelled.append(event)
                ended.append(event.request_id)
            elif isinstance(event, Finished):
                request, t_arrival = self._arrivals.pop(event.request_id)
                times = self._token_times.pop(event.request_id)
                self._records.append(RequestRecord(self.level, self.rate, self.phase, request.id,
                                                   len(request.prompt_ids), len(times), t_arrival, times[0], times[-1],
                                                   tuple(times)))
                ended.append(event.request_id)
            elif isinstance(event, Rejected):
                self._arrivals.pop(event.request_id, None)
                self._token_times.pop(event.request_id, None)
                self.rejected.append(event)
                ended.append(event.request_id)
            elif isinstance(event, Verified):
                self.speculation.add(event)
        return ended

    @property
    def records(self) -> list[RequestRecord]:
        """Finished requests, in request-id order."""
        return sorted(self._records, key=lambda r: r.request_id)


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=float), [50, 95, 99], method=PERCENTILE_METHOD)
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def meets(record: RequestRecord, slo: SloSpec) -> bool:
    """Whether a request met the SLO: its first token in time, and (with more than one) its later ones."""
    return record.ttft <= slo.ttft and (record.tpot is None or record.tpot <= slo.tpot)


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize_level(records: Sequence[RequestRecord], busy_s: Mapping[str, float], *, concurrency: int | None = None,
                    rate: float | None = None, rejected: int = 0, cancelled: int = 0,
                    slo: SloSpec | None = None, speculation: Speculated | None = None) -> dict:
    """The summary of one measured phase of a level (`concurrency` clients, or arrivals at `rate` per second);
    `busy_s` holds each node's busy seconds in it."""
    wall = max(r.t_finish for r in records) - min(r.t_arrival for r in records) if records else 0.0
    decode_tokens = sum(r.output_tokens - 1 for r in records)
    decoding_s = _union_length((r.t_first_token, r.t_finish) for r in records if r.output_tokens > 1)
    output_tokens = sum(r.output_tokens for r in records)
    goodput = None
    if slo is not None:
        good = sum(meets(r, slo) for r in records)
        goodput = {"slo": {"ttft_s": slo.ttft, "tpot_s": slo.tpot},
                   "fraction": good / (len(records) + rejected) if records or rejected else None,
                   "requests_per_s": good / wall if wall > 0 else None}
    return {
        "concurrency": concurrency,
        "rate": rate,
        "requests": len(records),
        "rejected": rejected,
        "cancelled": cancelled,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "decode_tokens_per_s": decode_tokens / decoding_s if decoding_s > 0 else None,
        "phase_tokens_per_s": output_tokens / wall if wall > 0 else None,
        "ttft_s": _percentiles([r.ttft for r in records]),
        "tpot_s": _percentiles([r.tpot for r in records if r.tpot is not None]),
        "goodput": goodput,
        "busy": {node: (seconds / wall if wall > 0 else 0.0) for node, seconds in busy_s.items()},
        "speculation": (speculation or Speculated()).summary(),
    }


def spec_summary(spec: Spec) -> dict:
    """The resolved spec as plain data, with the file it came from."""
    return {"source": str(spec.source) if spec.source else None, **dump_spec(spec)}


def result(source: str, spec: Spec, levels: Sequence[dict], records: Sequence[RequestRecord],
           calibration: dict | None = None, plan: dict | None = None, warnings: Sequence[str] = ()) -> dict:
    """The whole result of `cascadia run` ("run") or `cascadia simulate` ("simulate")."""
    return {
        "schema": SCHEMA,
        "source": source,
        "spec": spec_summary(spec),
        "plan": plan,
        "calibration": calibration,
        "warnings": list(warnings),
        "levels": list(levels),
        "requests": [attrs.asdict(r, recurse=False) for r in records],  # plain fields: no visit to each token time
    }


def figure(level: dict, name: str) -> float | None:
    """A level summary's value of one of the FIGURES."""
    for key in FIGURES[name][0]:
        level = level[key]
    return level


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def describe_level(level: dict) -> str:
    """"concurrency 4" or "rate 2.5/s" of a level summary."""
    return f"rate {level['rate']:g}/s" if level.get("rate") is not None else f"concurrency {level['concurrency']}"


def level_label(level: dict) -> str:
    """A level summary's load: its concurrency, or "R/s" for open-loop arrivals."""
    return f"{level['rate']:g}/s" if level.get("rate") is not None else str(level["concurrency"])


def has_rates(levels: Iterable[dict]) -> bool:
    """Whether any of the level summaries is open-loop (an arrival rate, not a concurrency)."""
    return any(level.get("rate") is not None for level in levels)


def load_heading(levels: Iterable[dict]) -> str:
    """The heading over `level_label`s: "streams" for concurrency levels, "load" once any is an arrival rate."""
    return "load" if has_rates(levels) else "streams"


def format_table(result_: dict) -> str:
    """The level summaries as an aligned plain-text table. Open-loop levels (arrival rates) add the p99 columns,
    rejected requests a column of their count, and a workload SLO a goodput column (the fraction of requests
    meeting it, rejected ones counted as missing it)."""
    levels = result_["levels"]
    open_loop = has_rates(levels)
    with_slo = any(level.get("goodput") for level in levels)
    with_rejected = any(level.get("rejected") for level in levels)
    speculated = any((level.get("speculation") or {}).get("proposed") for level in levels)
    columns = [(load_heading(levels), level_label), ("requests", lambda lv: str(lv["requests"])),
               *([("rejected", lambda lv: str(lv["rejected"]))] if with_rejected else []),
               ("tokens", lambda lv: str(lv["output_tokens"])),
               ("decode tok/s", lambda lv: _rate(lv["decode_tokens_per_s"])),
               ("phase tok/s", lambda lv: _rate(lv["phase_tokens_per_s"]))]
    for metric, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for p in ("p50", "p95", "p99") if open_loop else ("p50", "p95"):
            columns.append((f"{name} {p} ms", lambda lv, m=metric, p=p: _ms(lv[m][p])))
    if with_slo:
        columns.append(("goodput", lambda lv: "-" if not lv.get("goodput") or lv["goodput"]["fraction"] is None
                        else f"{lv['goodput']['fraction']:.0%}"))
    if speculated:
        columns.append(("drafts accepted", _accepted))
    columns.append(("busiest node", _busiest))
    rows = [tuple(name for name, _ in columns)] + [tuple(cell(level) for _, cell in columns) for level in levels]
    return format_rows(rows, left={len(columns) - 1})


def _accepted(level: dict) -> str:
    """"accepted/proposed (mean per step)" of a level's drafts."""
    drafts = level.get("speculation") or {}
    if not drafts.get("proposed"):
        return "-"
    return f"{drafts['accepted']}/{drafts['proposed']} ({drafts['mean_accepted_per_step']:.2f}/step)"


def _busiest(level: dict) -> str:
    busiest = max(level["busy"].items(), key=lambda item: item[1], default=None)
    return f"{busiest[0]} {busiest[1]:.0%}" if busiest else "-"
