"""`/metrics`: the server's state and history in the Prometheus text format, written by `prometheus_client` into a
registry of its own (several servers in one process, as in the tests, do not share one)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from cascadia.pipeline.service import Status

# Buckets in seconds: first tokens from tens of milliseconds (the tiny model) to minutes (a long prompt on the
# paper's fleet), later tokens from milliseconds to seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, status: Callable[[], Status], queued: Callable[[], tuple[int, int]]):
        """`status`: the pipeline's; `queued`: (requests running, requests waiting) as the server counts them."""
        self.registry = CollectorRegistry()
        self.tokens = Counter("cascadia_generated_tokens", "Output tokens generated", registry=self.registry)
        self.requests = Counter("cascadia_requests", "Requests that ended, by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("cascadia_requests_rejected", "Requests refused, by reason", ["reason"],
                                registry=self.registry)
        self.ttft = Histogram("cascadia_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("cascadia_time_per_output_token_seconds", "A request's mean time per later token",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.drafts_proposed = Counter("cascadia_draft_tokens_proposed", "Draft tokens verified (speculation)",
                                       registry=self.registry)
        self.drafts_accepted = Counter("cascadia_draft_tokens_accepted", "Draft tokens that gave their stream its "
                                       "token (speculation)", registry=self.registry)
        self.structured = Counter("cascadia_structured_requests", "Requests held to a response format that ended, "
                                  "by format and finish reason (stop: the JSON is whole)",
                                  ["format", "finish_reason"], registry=self.registry)
        self.registry.register(_Live(status, queued))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """What is read at the moment of the scrape: requests running and waiting, each node's busy fraction."""

    def __init__(self, status: Callable[[], Status], queued: Callable[[], tuple[int, int]]):
        self._status, self._queued = status, queued

    def collect(self):
        running, waiting = self._queued()
        yield GaugeMetricFamily("cascadia_requests_running", "Requests holding a stream slot", value=running)
        yield GaugeMetricFamily("cascadia_requests_waiting", "Requests waiting for a slot", value=waiting)
        status = self._status()
        yield GaugeMetricFamily("cascadia_ready", "1 while every node is up and requests are taken",
                                value=float(status.ready))
        busy = GaugeMetricFamily("cascadia_node_busy_ratio", "Fraction of the last second a node spent computing",
                                 labels=["node"])
        for node, fraction in status.busy.items():
            busy.add_metric([node], fraction)
        yield busy
        failures = CounterMetricFamily("cascadia_node_failures", "Nodes lost (process ended, connection closed, or "
                                       "silent while holding up the pipeline)", labels=["node"])
        for node, count in status.failures.items():
            failures.add_metric([node], count)
        yield failures
        yield GaugeMetricFamily("cascadia_nodes_standing_by", "Nodes ready to take a lost node's stage (spares); "
                                "fewer than the spec's spares: reduced redundancy", value=len(status.standing_by))
        standby_losses = CounterMetricFamily("cascadia_standby_losses", "Nodes lost while standing by (a local one is "
                                             "started again to stand by)", labels=["node"])
        for node, count in status.standby_losses.items():
            standby_losses.add_metric([node], count)
        yield standby_losses
        recoveries = SummaryMetricFamily("cascadia_recovery_seconds", "From a node's loss to serving again",
                                         count_value=len(status.recoveries_s), sum_value=sum(status.recoveries_s))
        yield recoveries
