"""A latency objective as a search states it: a quantile of the first-token time and of the time per later token,
each with its bound ("ttft_p90=10s,tpot_p99=400ms"), judged on the requests of one simulated phase.

Quantiles are numpy's "linear" percentiles, as every level summary's are (`cascadia.metrics`). A rejected request
misses the objective; a request of one token has no time per later token, and counts for the first-token bound
alone. Goodput is counted per request against the same bounds (`metrics.meets`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs
import numpy as np

from cascadia import units
from cascadia.metrics import PERCENTILE_METHOD, RequestRecord, meets
from cascadia.spec.types import SloSpec

METRICS = ("ttft", "tpot")
_TERM = re.compile(r"(ttft|tpot)_p(\d+(?:\.\d+)?)")


@attrs.frozen
class Bound:
    """`metric`'s `percentile` (0 < p <= 100) at most `seconds`."""

    metric: str  # "ttft" or "tpot"
    percentile: float
    seconds: float

    def __str__(self) -> str:
        return f"{self.metric}_p{self.percentile:g}={units.format_duration(self.seconds).replace(' ', '')}"


@attrs.frozen
class Verdict:
    """How one phase's requests stand against an objective: each bound's measured quantile, by metric."""

    met: bool
    quantiles: dict[str, float | None]  # metric -> its quantile's seconds (None: no request had one)
    goodput: float  # the fraction of requests (rejected ones included) meeting every bound alone
    requests: int
    rejected: int


@attrs.frozen
class LatencySlo:
    bounds: tuple[Bound, ...]  # the first token's, and the later tokens' where bounded

    @classmethod
    def parse(cls, text: str) -> LatencySlo:
        """"ttft_p90=10s,tpot_p99=400ms", or the first term alone. Raises ValueError saying what is wrong."""
        bounds: dict[str, Bound] = {}
        for term in text.split(","):
            key, _, value = term.strip().partition("=")
            match = _TERM.fullmatch(key.strip())
            if match is None or not value.strip():
                raise ValueError(f"{term.strip()!r} is not like ttft_p90=10s or tpot_p99=400ms")
            metric, percentile = match[1], float(match[2])
            if not 0 < percentile <= 100:
                raise ValueError(f"{key.strip()}: the percentile must be in (0, 100], got {percentile:g}")
            if metric in bounds:
                raise ValueError(f"{metric} is bounded twice in {text!r}")
            try:
                seconds = units.parse_duration(value.strip())
            except units.UnitError as e:
                raise ValueError(f"{key.strip()}: {e}") from None
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ValueError(f"{key.strip()}: the bound must be more than zero, got {value.strip()!r}")
            bounds[metric] = Bound(metric, percentile, seconds)
        if "ttft" not in bounds:
            raise ValueError(f"{text!r} bounds no first token (ttft_pNN=...): without that bound a queue that grows "
                             "without end would meet it, as the time per later token stays flat")
        return cls(tuple(bounds[m] for m in METRICS if m in bounds))

    def __str__(self) -> str:
        return ",".join(map(str, self.bounds))

    def bound(self, metric: str) -> Bound:
        """The bound on `metric` (a KeyError where there is none)."""
        for bound in self.bounds:
            if bound.metric == metric:
                return bound
        raise KeyError(f"the objective {self} bounds no {metric}")

    def per_request(self) -> SloSpec:
        """The bounds as every request's own (for goodput); an unbounded metric, no bound."""
        seconds = {bound.metric: bound.seconds for bound in self.bounds}
        return SloSpec(seconds.get("ttft", math.inf), seconds.get("tpot", math.inf))

    def judge(self, records: Sequence[RequestRecord], rejected: int = 0) -> Verdict:
        """The verdict on one phase's finished requests, `rejected` more refused."""
        quantiles: dict[str, float | None] = {}
        met = rejected == 0 and bool(records)
        for bound in self.bounds:
            values = [v for r in records if (v := getattr(r, bound.metric)) is not None]
            quantiles[bound.metric] = (float(np.percentile(values, bound.percentile, method=PERCENTILE_METHOD))
                                       if values else None)
            met = met and (quantiles[bound.metric] is None or quantiles[bound.metric] <= bound.seconds)
        every = self.per_request()
        total = len(records) + rejected
        goodput = sum(meets(r, every) for r in records) / total if total else 0.0
        return Verdict(met, quantiles, goodput, len(records), rejected)
