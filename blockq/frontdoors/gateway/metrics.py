"""The gateway's Prometheus metrics, on a registry of its own, served at ``GET /metrics``
on the gateway's HTTP port (:func:`blockq.runtime.metrics_server.metrics_response`).

Metrics (label ``endpoint`` is the route, e.g. ``/v1/chat/completions``):

- ``blockq_gateway_requests_total{code,endpoint}``: finished HTTP requests by status code;
- ``blockq_gateway_request_duration_seconds{endpoint}``: histogram, request start to last byte;
- ``blockq_gateway_time_to_first_chunk_seconds{endpoint}``: histogram, streaming only;
- ``blockq_gateway_in_flight_requests``: generation requests being served now;
- ``blockq_gateway_prompt_tokens_total``, ``blockq_gateway_completion_tokens_total``;
- ``blockq_gateway_client_disconnects_total``: requests cancelled because the client left;
- ``blockq_gateway_slow_clients_total{phase}``: calls ended because the client was too slow:
  ``body_read`` (body not in within ``read_timeout_s``: 408) or ``stream_write`` (a stream
  write not drained within ``write_timeout_s``: connection dropped, requests cancelled).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 3.0 is a bound: the TTFT objective's share can be read from the buckets exactly.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0,
                     300.0)


class LabelledMetric:
    """A prometheus_client counter or histogram called with its labels as keywords
    (``inc(code="200", endpoint="/v1/models")``, ``observe(0.2, endpoint=...)``): the call
    shape the gateway's handlers use."""

    def __init__(self, metric: Counter | Histogram) -> None:
        self.metric = metric

    def _child(self, labels: dict[str, str]) -> Counter | Histogram:
        return self.metric.labels(**labels) if labels else self.metric

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)  # type: ignore[union-attr]

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)  # type: ignore[union-attr]


class GatewayMetrics:
    """Every metric the gateway exports, on ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = LabelledMetric(Counter("blockq_gateway_requests", "HTTP requests by endpoint and status code.",
                                               ["code", "endpoint"], registry=r))
        self.duration = LabelledMetric(Histogram("blockq_gateway_request_duration_seconds",
                                                 "Request duration, request start to last byte, seconds.",
                                                 ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r))
        self.first_chunk = LabelledMetric(Histogram("blockq_gateway_time_to_first_chunk_seconds",
                                                    "Streaming: request start to first output chunk, seconds.",
                                                    ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r))
        self.in_flight = Gauge("blockq_gateway_in_flight_requests", "Generation requests in flight.", registry=r)
        self.prompt_tokens = LabelledMetric(Counter("blockq_gateway_prompt_tokens",
                                                    "Prompt tokens of finished requests.", registry=r))
        self.completion_tokens = LabelledMetric(Counter("blockq_gateway_completion_tokens", "Generated tokens.",
                                                        registry=r))
        self.disconnects = LabelledMetric(Counter("blockq_gateway_client_disconnects",
                                                  "Requests cancelled because the client disconnected.", registry=r))
        self.slow_clients = LabelledMetric(Counter("blockq_gateway_slow_clients",
                                                   "Calls ended because the client did not send its body in "
                                                   "time (phase body_read) or read its stream (stream_write).",
                                                   ["phase"], registry=r))
