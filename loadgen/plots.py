"""PNG plots of benchmark runs (matplotlib, Agg canvas: no display needed).

Figures are built on :class:`matplotlib.figure.Figure` with an Agg canvas, never through
``pyplot``, so plotting keeps no global state and works in threads and headless
processes. Each function writes one PNG and returns its path; a plot with no data still
gets a file, saying so, so a report always has the same set of files.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from loadgen.summaries import KvSample, RequestRecord

_DPI = 110
# Latencies at or under this are drawn at it: a log axis has no zero.
_LOG_AXIS_FLOOR_MS = 1.0
# Labelled ticks of a log time axis per decade, by the most decades they fit in one panel
# (about six labels: 50 ms to 40 s gets 100 ms, 300 ms, 1 s, 3 s, 10 s, 30 s).
_DECADES_TO_TICK_SUBS = ((1.5, (1.0, 2.0, 5.0)), (3.5, (1.0, 3.0)), (math.inf, (1.0,)))


def run_key(policy: str, rate: float | None) -> str:
    """The name of one (policy, rate) run in per-run maps: ``"block@32"``, or the policy alone."""
    return policy if rate is None else f"{policy}@{rate:g}"


def _new_figure(num_panels: int = 1) -> tuple[Figure, list[Any]]:
    num_columns = min(num_panels, 3)
    num_rows = math.ceil(num_panels / num_columns)
    figure = Figure(figsize=(5.2 * num_columns, 3.8 * num_rows), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(num_rows, num_columns, i + 1) for i in range(num_panels)]
    return figure, axes


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def _no_data(path: Path, title: str) -> Path:
    figure, (axis,) = _new_figure()
    axis.set_title(title)
    axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
    axis.set_axis_off()
    return _save(figure, path)


def _group_by_rate(
    run_to_records: Mapping[str, Sequence[RequestRecord]],
    run_to_policy_rate: Mapping[str, tuple[str, float | None]],
) -> dict[float | None, dict[str, Sequence[RequestRecord]]]:
    """{rate: {policy (or run key when unknown): records}}, rates ascending."""
    rate_to_runs: dict[float | None, dict[str, Sequence[RequestRecord]]] = defaultdict(dict)
    for key, records in run_to_records.items():
        policy, rate = run_to_policy_rate.get(key, (key, None))
        rate_to_runs[rate][policy] = records
    return dict(sorted(rate_to_runs.items(), key=lambda item: (item[0] is None, item[0] or 0.0)))


def plot_latency_cdf(
    path: Path,
    run_to_records: Mapping[str, Sequence[RequestRecord]],
    run_to_policy_rate: Mapping[str, tuple[str, float | None]],
    *,
    field_name: str,
    title: str,
) -> Path:
    """CDF of one latency field (``"ttft_ms"`` or ``"e2e_ms"``) of completed requests.

    One line per policy; one panel per rate when the runs span several rates.
    """
    rate_to_runs = _group_by_rate(run_to_records, run_to_policy_rate)
    if not any(records for runs in rate_to_runs.values() for records in runs.values()):
        return _no_data(path, title)
    return _save(latency_cdf_figure(rate_to_runs, field_name=field_name, title=title), path)


def latency_cdf_figure(
    rate_to_runs: Mapping[float | None, Mapping[str, Sequence[RequestRecord]]], *, field_name: str, title: str
) -> Figure:
    """The figure of :func:`plot_latency_cdf`: latencies span 50 ms to tens of seconds, so
    the time axis is logarithmic (values under 1 ms drawn at 1 ms), labelled in ms and s."""
    figure, axes = _new_figure(len(rate_to_runs))
    for axis, (rate, runs) in zip(axes, rate_to_runs.items(), strict=True):
        all_values_ms = []
        for label, records in runs.items():
            values_ms = np.sort(
                np.asarray(
                    [
                        getattr(r, field_name)
                        for r in records
                        if r.ok and getattr(r, field_name) is not None
                    ],
                    dtype=np.float64,
                )
            )
            values_ms = np.maximum(values_ms[np.isfinite(values_ms)], _LOG_AXIS_FLOOR_MS)
            if values_ms.size:
                axis.plot(values_ms, np.arange(1, values_ms.size + 1) / values_ms.size, label=label)
                all_values_ms.append(values_ms)
        if all_values_ms:
            joined_ms = np.concatenate(all_values_ms)
            log_time_axis(axis, float(joined_ms.min()), float(joined_ms.max()))
        axis.set_xlabel(f"{field_name.removesuffix('_ms').upper()} (log scale)")
        axis.set_ylabel("fraction of requests")
        axis.set_title(title if rate is None else f"{title} at {rate:g} req/s")
        axis.set_ylim(0.0, 1.0)
        axis.grid(alpha=0.3)
        axis.grid(which="minor", alpha=0.1)
        axis.legend(fontsize="small")
    return figure


def duration_label(value_ms: float) -> str:
    """A tick label for a duration in milliseconds: ``50 ms``, ``500 ms``, ``1 s``, ``2.5 s``, ``40 s``."""
    if value_ms < 1000.0:
        return f"{value_ms:.3g} ms"
    return f"{value_ms / 1000.0:.3g} s"


def log_time_axis(axis: Axes, low_ms: float, high_ms: float) -> None:
    """Make the x axis of ``axis`` a log axis of milliseconds spanning ``low_ms`` to
    ``high_ms`` (both > 0), with labelled ticks at 1-2-5 or 1-3 of each decade (one a decade
    when the span is wide), labelled by :func:`duration_label`, and unlabelled minor ticks."""
    axis.set_xscale("log")
    num_decades = math.log10(max(high_ms, low_ms * 1.0001) / low_ms)
    subs = next(subs for max_decades, subs in _DECADES_TO_TICK_SUBS if num_decades <= max_decades)
    axis.xaxis.set_major_locator(LogLocator(base=10.0, subs=subs))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _position: duration_label(value)))
    axis.xaxis.set_minor_locator(LogLocator(base=10.0, subs=np.arange(1.0, 10.0)))
    axis.xaxis.set_minor_formatter(NullFormatter())
    # A little room on both sides, in log space, so the first and last steps show.
    axis.set_xlim(low_ms / 1.15, high_ms * 1.15)


def plot_latency_vs_rate(path: Path, results: Sequence[Mapping[str, Any]]) -> Path:
    """Mean (solid) and P99 (dashed) TTFT per policy against the request rate."""
    policy_to_points: dict[str, list[tuple[float, float | None, float | None]]] = defaultdict(list)
    for result in results:
        if result.get("rate") is None:
            continue
        policy_to_points[str(result.get("policy"))].append(
            (float(result["rate"]), result.get("ttft_mean_ms"), result.get("ttft_p99_ms"))
        )
    if not policy_to_points:
        return _no_data(path, "TTFT vs rate")
    figure, (axis,) = _new_figure()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (policy, points) in enumerate(policy_to_points.items()):
        points.sort()
        color = colors[index % len(colors)]  # one color per policy for both of its lines
        means = [(rate, mean) for rate, mean, _ in points if mean is not None]
        p99s = [(rate, p99) for rate, _, p99 in points if p99 is not None]
        if means:
            axis.plot(*zip(*means, strict=True), "o-", color=color, label=f"{policy} mean")
        if p99s:
            axis.plot(*zip(*p99s, strict=True), "s--", color=color, label=f"{policy} P99")
    axis.set_xlabel("request rate (req/s)")
    axis.set_ylabel("TTFT (ms)")
    axis.set_title("TTFT vs rate")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    return _save(figure, path)


def plot_kv_usage(path: Path, run_to_samples: Mapping[str, Sequence[KvSample]]) -> Path:
    """KV usage of every instance over time, one panel per run (label: the run key)."""
    runs = {key: samples for key, samples in run_to_samples.items() if samples}
    if not runs:
        return _no_data(path, "KV usage per instance")
    figure, axes = _new_figure(len(runs))
    for axis, (key, samples) in zip(axes, runs.items(), strict=True):
        instance_to_points: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for sample in samples:
            instance_to_points[sample.instance].append((sample.at_s, sample.kv_used_fraction))
        for instance in sorted(instance_to_points):
            points = sorted(instance_to_points[instance])
            axis.plot(*zip(*points, strict=True), linewidth=0.8, label=instance)
        axis.set_xlabel("time (s)")
        axis.set_ylabel("KV blocks used (fraction)")
        axis.set_ylim(0.0, 1.05)
        axis.set_title(f"KV usage: {key}")
        axis.grid(alpha=0.3)
        if len(instance_to_points) <= 12:
            axis.legend(fontsize="x-small", ncol=2)
    return _save(figure, path)


def capacity_noise_plot(entries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Capacity and overload goodput against the prediction error (MAE tokens), one line
    per policy; a policy that does not read predictions is a flat dashed line."""
    with_overload = any(entry.get("overload") for entry in entries)
    figure, axes = _new_figure(2 if with_overload else 1)
    maes = sorted({e["length_mae_tokens"] for e in entries if e.get("length_mae_tokens") is not None})
    panels = [("capacity req/s", lambda e: e["capacity_rps"], lambda e: e["capacity_rps_sd"])]
    if with_overload:
        panels.append(("overload goodput %", lambda e: 100 * (e.get("overload") or {}).get("goodput", 0.0),
                       lambda e: 100 * ((e.get("overload") or {}).get("goodput_sd") or 0.0)))
    by_policy: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for entry in entries:
        by_policy[str(entry["policy"])].append(entry)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (label, value, spread) in zip(axes, panels, strict=True):
        for index, (policy, items) in enumerate(by_policy.items()):
            color = colors[index % len(colors)]  # one color per policy in both panels
            if len(items) == 1 and items[0].get("length_mae_tokens") is None:
                axis.axhline(value(items[0]), linestyle="--", label=policy, color=color)
                continue
            items = sorted(items, key=lambda e: e["length_mae_tokens"])
            axis.errorbar([e["length_mae_tokens"] for e in items], [value(e) for e in items],
                          yerr=[spread(e) for e in items], marker="o", capsize=3, label=policy, color=color)
        axis.set_xlabel("prediction error, MAE tokens (0 = true lengths)")
        axis.set_ylabel(label)
        if maes:
            axis.set_xticks(maes)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    return _save(figure, path)


def plot_fleet_timelines(path: Path, timelines: Mapping[str, Mapping[str, Sequence[float]]], *,
                         slo_ttft_ms: float) -> Path:
    """Fleet size (top) and per-minute P99 TTFT (bottom, log axis, the SLO dashed) over
    time, one line per scaler: ``{scaler: {"at_s", "size", "minute_s", "p99_ttft_ms"}}``."""
    if not timelines:
        return _no_data(path, "fleet size over time")
    figure = Figure(figsize=(10, 6.4), dpi=_DPI)
    FigureCanvasAgg(figure)
    size_axis, ttft_axis = figure.add_subplot(2, 1, 1), figure.add_subplot(2, 1, 2)
    for name, timeline in timelines.items():
        size_axis.step(np.asarray(timeline["at_s"]) / 60, timeline["size"], where="post", label=name)
        p99 = np.minimum(np.asarray(timeline["p99_ttft_ms"], dtype=float), 1e6)
        ttft_axis.plot(np.asarray(timeline["minute_s"]) / 60, p99, label=name)
    size_axis.set_ylabel("instances (started)")
    size_axis.legend()
    ttft_axis.axhline(slo_ttft_ms, linestyle="--", color="grey", label="SLO")
    ttft_axis.set_yscale("log")
    ttft_axis.set_ylabel("P99 TTFT per minute (ms)")
    ttft_axis.set_xlabel("minutes")
    ttft_axis.legend()
    return _save(figure, path)
