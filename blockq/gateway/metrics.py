"""A minimal Prometheus registry for the gateway: counters, a gauge and histograms,
rendered in the text exposition format (version 0.0.4) at ``GET /metrics``.

Metrics (label ``endpoint`` is the route, e.g. ``/v1/chat/completions``):

- ``blockq_gateway_requests_total{endpoint,code}``: finished HTTP requests by status code;
- ``blockq_gateway_request_duration_seconds{endpoint}``: histogram, request start to last byte;
- ``blockq_gateway_time_to_first_chunk_seconds{endpoint}``: histogram, streaming only;
- ``blockq_gateway_in_flight_requests``: generation requests being served now;
- ``blockq_gateway_prompt_tokens_total``, ``blockq_gateway_completion_tokens_total``;
- ``blockq_gateway_client_disconnects_total``: requests cancelled because the client left.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Labels = tuple[tuple[str, str], ...]


def _format_labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    pairs = (*labels, *extra)
    if not pairs:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in pairs)
    return "{" + ",".join(escaped) + "}"


class Counter:
    def __init__(self, name: str, help_text: str, kind: str = "counter") -> None:
        self.name = name
        self.help_text = help_text
        self.kind = kind
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def set(self, value: float, **labels: str) -> None:
        """For gauges: replace the value."""
        self.values[tuple(sorted(labels.items()))] = value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{self.name}{_format_labels(k)} {v:g}" for k, v in sorted(self.values.items())]
        if not self.values and self.kind == "gauge":
            lines.append(f"{self.name} 0")
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = buckets
        self.counts: dict[Labels, list[int]] = {}
        self.sums: dict[Labels, float] = defaultdict(float)

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[key] += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        for key, counts in sorted(self.counts.items()):
            cumulative = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f"{self.name}_bucket{_format_labels(key, (('le', le),))} {cumulative}")
            lines.append(f"{self.name}_sum{_format_labels(key)} {self.sums[key]:.6f}")
            lines.append(f"{self.name}_count{_format_labels(key)} {cumulative}")
        return lines


class GatewayMetrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        self.requests = Counter("blockq_gateway_requests_total", "HTTP requests by endpoint and status code.")
        self.duration = Histogram("blockq_gateway_request_duration_seconds", "Request duration, seconds.")
        self.first_chunk = Histogram("blockq_gateway_time_to_first_chunk_seconds",
                                     "Streaming: request start to first output chunk, seconds.")
        self.in_flight = Counter("blockq_gateway_in_flight_requests", "Generation requests in flight.", "gauge")
        self.prompt_tokens = Counter("blockq_gateway_prompt_tokens_total", "Prompt tokens of finished requests.")
        self.completion_tokens = Counter("blockq_gateway_completion_tokens_total", "Generated tokens.")
        self.disconnects = Counter("blockq_gateway_client_disconnects_total",
                                   "Requests cancelled because the client disconnected.")

    def render(self) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.duration, self.first_chunk, self.in_flight, self.prompt_tokens,
                       self.completion_tokens, self.disconnects):
            lines += metric.render()
        return "\n".join(lines) + "\n"
