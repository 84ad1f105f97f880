"""One metrics schema for `cascadia run` and `cascadia simulate`, so that a validation is a diff of two JSON files.

A backend feeds a `Recorder` per phase with arrivals and the policy's events, each with its clock's time (seconds),
and counts the seconds each node was busy. `summarize_level` turns a phase into a level summary:
- decode_tokens_per_s: output tokens after each request's first, over the time during which at least one stream was
  decoding (between its first token and its last);
- phase_tokens_per_s: all output tokens over the phase's wall time (first arrival to last token);
- ttft_s, tpot_s: first-token latency and mean time per later token of each request, p50 and p95 by numpy's
  "linear" percentile method;
- busy: the fraction of the phase's wall time each node spent computing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from cascadia.policy import Event, Finished, Rejected, Request, Token
from cascadia.spec.dump import dump_spec
from cascadia.spec.types import Spec
from cascadia.table import format_rows

SCHEMA = "cascadia.metrics/1"
PERCENTILE_METHOD = "linear"


@attrs.frozen
class RequestRecord:
    level: int  # the level's concurrency
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


class Recorder:
    """Timestamps one phase's requests from the policy's events: the same bookkeeping in both backends."""

    def __init__(self, level: int, phase: str) -> None:
        self.level, self.phase = level, phase
        self.rejected: list[Rejected] = []
        self._arrivals: dict[int, tuple[Request, float]] = {}
        self._token_times: dict[int, list[float]] = {}
        self._records: list[RequestRecord] = []

    def arrived(self, request: Request, t: float) -> None:
        self._arrivals[request.id] = (request, t)

    def observe(self, events: Iterable[Event], t: float) -> None:
        for event in events:
            if isinstance(event, Token):
                self._token_times.setdefault(event.request_id, []).append(t)
            elif isinstance(event, Finished):
                request, t_arrival = self._arrivals.pop(event.request_id)
                times = self._token_times.pop(event.request_id)
                self._records.append(RequestRecord(self.level, self.phase, request.id, len(request.prompt_ids),
                                                   len(times), t_arrival, times[0], times[-1], tuple(times)))
            elif isinstance(event, Rejected):
                self._arrivals.pop(event.request_id, None)
                self.rejected.append(event)

    @property
    def records(self) -> list[RequestRecord]:
        """Finished requests, in request-id order."""
        return sorted(self._records, key=lambda r: r.request_id)


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    p50, p95 = np.percentile(np.asarray(values, dtype=float), [50, 95], method=PERCENTILE_METHOD)
    return {"p50": float(p50), "p95": float(p95)}


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize_level(concurrency: int, records: Sequence[RequestRecord], busy_s: Mapping[str, float],
                    rejected: int = 0) -> dict:
    """The summary of one measured phase; `busy_s` holds each node's busy seconds during the phase."""
    wall = max(r.t_finish for r in records) - min(r.t_arrival for r in records) if records else 0.0
    decode_tokens = sum(r.output_tokens - 1 for r in records)
    decoding_s = _union_length((r.t_first_token, r.t_finish) for r in records if r.output_tokens > 1)
    output_tokens = sum(r.output_tokens for r in records)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "rejected": rejected,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "decode_tokens_per_s": decode_tokens / decoding_s if decoding_s > 0 else None,
        "phase_tokens_per_s": output_tokens / wall if wall > 0 else None,
        "ttft_s": _percentiles([r.ttft for r in records]),
        "tpot_s": _percentiles([r.tpot for r in records if r.tpot is not None]),
        "busy": {node: (seconds / wall if wall > 0 else 0.0) for node, seconds in busy_s.items()},
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
        "requests": [attrs.asdict(r) for r in records],
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(result_: dict) -> str:
    """The level summaries as an aligned plain-text table."""
    header = ("streams", "requests", "tokens", "decode tok/s", "phase tok/s", "TTFT p50 ms", "TTFT p95 ms",
              "TPOT p50 ms", "TPOT p95 ms", "busiest node")
    rows = [header]
    for level in result_["levels"]:
        busiest = max(level["busy"].items(), key=lambda item: item[1], default=None)
        rows.append((str(level["concurrency"]), str(level["requests"]), str(level["output_tokens"]),
                     _rate(level["decode_tokens_per_s"]), _rate(level["phase_tokens_per_s"]),
                     _ms(level["ttft_s"]["p50"]), _ms(level["ttft_s"]["p95"]),
                     _ms(level["tpot_s"]["p50"]), _ms(level["tpot_s"]["p95"]),
                     f"{busiest[0]} {busiest[1]:.0%}" if busiest else "-"))
    return format_rows(rows, left={len(header) - 1})
