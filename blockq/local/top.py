"""``blockq top``: a live terminal view of a running cluster, redrawn every ``--interval-s``.

Everything comes from Redis, read the way ``blockq status`` reads it
(:func:`blockq.local.status.collect_status`), plus the newest entries of the ``done`` stream:

- per instance (its latest heartbeat): state, KV blocks used (a bar), running / waiting
  requests, entries in its queue stream, emulator lag; and the TTFT (p50 / p99) of the
  requests it finished in the last ``--window-s``; on a line of its own, the worst median
  TTFT forecast errors by instance (the forecast check, docs/dispatcher.md), the untrusted
  ones marked;
- predictor: the version that annotated the newest finished request, and that version's
  rolling error over the last ``--records`` finished requests it predicted (MAE tokens and
  Acc-50, as the predictor's feedback consumer defines them);
- dispatcher: the lease holder and how long its lease has left; decisions per second
  between two samples, which Redis 7 counts itself (``entries-read`` of the ``dispatch``
  group on ``ready``); an older Redis keeps no such counter, so there it is placements per
  second by flow: requests finished plus the growth of the instance queues. Also the mean
  TTFT forecast error (predicted − measured) of recent requests.

:func:`read_sample` is the only reader; :func:`build_view` (two samples to a
:class:`TopView`) is pure; :func:`render_view` turns a view into rich renderables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from blockq.config import Settings
from blockq.local.status import collect_status
from blockq.prediction_accuracy import compute_metrics
from blockq.runtime.service_runner import settings_from_args
from blockq.wire.health import InstanceState
from blockq.wire.keys import GROUP_DISPATCH, PAYLOAD_FIELD, Keys
from blockq.wire.protocol import DoneRecord, ValidationError, decode_done_record
from blockq.wire.streams import connect

DEFAULT_INTERVAL_S = 1.0
DEFAULT_WINDOW_S = 60.0
DEFAULT_NUM_RECORDS = 1000
KV_BAR_WIDTH = 20
MAX_FORECAST_CHECK_SHOWN = 6  # instances named on the forecast check's line, worst first
STATE_TO_STYLE = {InstanceState.LIVE: "green", InstanceState.SUSPECT: "yellow", InstanceState.DEAD: "bold red",
                  InstanceState.DRAINING: "cyan", InstanceState.STOPPED: "dim", InstanceState.JOINING: "blue"}


@dataclass(frozen=True)
class DoneEntry:
    """One ``done`` entry: its stream id as (ms, seq) on Redis' clock, and its record."""

    entry_id: tuple[int, int]
    record: DoneRecord


@dataclass(frozen=True)
class TopSample:
    """What one read of Redis returned. ``done`` is newest first; ``decisions_read`` is
    None where Redis does not count reads (before 7.0) or the group does not exist yet."""

    taken_at_s: float
    status: dict[str, Any]
    done: tuple[DoneEntry, ...]
    decisions_read: int | None
    lease_ttl_ms: int | None

    @property
    def num_queued(self) -> int:
        return sum(int(i["queue"]) for i in self.status["instances"])


@dataclass(frozen=True)
class LatencySummary:
    """TTFT of the ``ok`` requests finished in the window (ms; None without any)."""

    num_requests: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_mean_ms: float | None


@dataclass(frozen=True)
class InstanceRow:
    instance_id: str
    state: str
    heartbeat_age_ms: float
    kv_used_blocks: int
    kv_total_blocks: int | None
    num_running: int
    num_waiting: int
    num_queued: int
    lag_p99_ms: float
    recent: LatencySummary
    # The forecast check's figures (blockq status's ``forecast_error``; None: no record).
    forecast_error: dict[str, Any] | None = None

    @property
    def kv_used_fraction(self) -> float | None:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else None


@dataclass(frozen=True)
class PredictorView:
    """The newest version seen and its error over the records it predicted (tokens, 0..1)."""

    version: str | None
    num_scored: int
    mae_tokens: float | None
    acc50: float | None
    version_to_num_records: dict[str, int]


@dataclass(frozen=True)
class DispatcherView:
    leader: str | None
    lease_ttl_ms: int | None
    decisions_per_s: float | None
    decisions_counted_by: str   # "entries read" | "placements by flow" | "" (no earlier sample)
    completions_per_s: float
    ttft_forecast_error_ms: float | None


@dataclass(frozen=True)
class TopView:
    redis_url: str | None
    prefix: str
    taken_at_s: float
    window_s: float
    instances: tuple[InstanceRow, ...]
    recent: LatencySummary
    predictor: PredictorView
    dispatcher: DispatcherView
    num_dead_letters: int
    pending: dict[str, int]


# --- reading --------------------------------------------------------------------------------


def read_sample(client: redis.Redis, settings: Settings, *, num_records: int = DEFAULT_NUM_RECORDS) -> TopSample:
    """One sample: the status, the newest ``num_records`` done entries, the dispatch
    group's read counter and the leader's lease TTL."""
    keys = settings.keys
    status = collect_status(client, settings)
    ttl_ms = int(client.pttl(keys.dispatcher_lease))
    return TopSample(taken_at_s=time.time(), status=status, done=_read_done(client, keys, num_records),
                     decisions_read=_decisions_read(client, keys), lease_ttl_ms=ttl_ms if ttl_ms >= 0 else None)


def _read_done(client: redis.Redis, keys: Keys, num_records: int) -> tuple[DoneEntry, ...]:
    entries = []
    for entry_id, fields in client.xrevrange(keys.done, count=num_records):
        try:
            record = decode_done_record(fields[PAYLOAD_FIELD.encode()])
        except (KeyError, ValidationError, TypeError):
            continue  # the feedback consumer dead-letters these; a view just skips them
        milliseconds, sequence = entry_id.decode().split("-")
        entries.append(DoneEntry((int(milliseconds), int(sequence)), record))
    return tuple(entries)


def _decisions_read(client: redis.Redis, keys: Keys) -> int | None:
    try:
        groups = client.xinfo_groups(keys.ready)
    except redis.ResponseError:  # no ready stream yet
        return None
    for group in groups:
        name = group.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == GROUP_DISPATCH:
            value = group.get("entries-read")
            return int(value) if value is not None else None
    return None


# --- the view model (pure) ------------------------------------------------------------------


def latency_summary(records: Sequence[DoneRecord]) -> LatencySummary:
    ok = [r for r in records if r.status == "ok"]
    ttft_ms = np.asarray([r.ttft_ms for r in ok if r.ttft_ms is not None], dtype=float)
    tpot_ms = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    return LatencySummary(len(records), float(np.percentile(ttft_ms, 50)) if ttft_ms.size else None,
                          float(np.percentile(ttft_ms, 99)) if ttft_ms.size else None,
                          float(np.mean(tpot_ms)) if tpot_ms else None)


def predictor_view(records: Sequence[DoneRecord]) -> PredictorView:
    """``records`` newest first; scored as the feedback consumer scores them: ``ok``, with a
    prediction and at least one output token."""
    scored = [r for r in records if r.status == "ok" and r.predicted_output_tokens is not None
              and r.output_tokens >= 1 and r.predictor_version]
    versions = Counter(r.predictor_version for r in scored)
    if not scored:
        return PredictorView(None, 0, None, None, {})
    version = scored[0].predictor_version
    mine = [r for r in scored if r.predictor_version == version]
    metrics = compute_metrics([r.predicted_output_tokens for r in mine], [r.output_tokens for r in mine])
    return PredictorView(version, len(mine), float(metrics["mae"]), float(metrics["acc50"]),
                         dict(versions.most_common()))


def _decisions_per_s(sample: TopSample, previous: TopSample | None) -> tuple[float | None, str]:
    if previous is None or sample.taken_at_s <= previous.taken_at_s:
        return None, ""
    elapsed_s = sample.taken_at_s - previous.taken_at_s
    if sample.decisions_read is not None and previous.decisions_read is not None:
        return max(0, sample.decisions_read - previous.decisions_read) / elapsed_s, "entries read"
    # Every placement adds an entry to an instance queue, and every finished request's entry
    # leaves it: placed = finished + growth of the queues (re-placements move entries: no net).
    newest_before = previous.done[0].entry_id if previous.done else (0, 0)
    num_finished = sum(1 for entry in sample.done if entry.entry_id > newest_before)
    num_placed = max(0, num_finished + sample.num_queued - previous.num_queued)
    return num_placed / elapsed_s, "placements by flow"


def build_view(sample: TopSample, previous: TopSample | None = None, *,
               window_s: float = DEFAULT_WINDOW_S) -> TopView:
    """The view of ``sample``; rates need the ``previous`` sample (None: not shown)."""
    recent = [e.record for e in sample.done if e.record.finished_at_s >= sample.taken_at_s - window_s]
    rows = tuple(InstanceRow(
        instance_id=i["id"], state=i["state"], heartbeat_age_ms=i["last_heartbeat_age_ms"],
        kv_used_blocks=i["kv_used_blocks"], kv_total_blocks=i["kv_total_blocks"], num_running=i["running"],
        num_waiting=i["waiting"], num_queued=i["queue"], lag_p99_ms=i["lag_p99_ms"],
        recent=latency_summary([r for r in recent if r.instance == i["id"]]),
        forecast_error=i.get("forecast_error")) for i in sample.status["instances"])
    forecast_errors_ms = [r.predicted_ttft_ms - r.ttft_ms for r in recent
                          if r.status == "ok" and r.predicted_ttft_ms is not None and r.ttft_ms is not None]
    decisions_per_s, counted_by = _decisions_per_s(sample, previous)
    leader = sample.status["dispatcher_leader"]
    dispatcher = DispatcherView(
        leader=leader.rsplit(":", 1)[0] if leader else None,  # the lease value is "{holder}:{term token}"
        lease_ttl_ms=sample.lease_ttl_ms, decisions_per_s=decisions_per_s, decisions_counted_by=counted_by,
        completions_per_s=len(recent) / window_s,
        ttft_forecast_error_ms=float(np.mean(forecast_errors_ms)) if forecast_errors_ms else None)
    return TopView(
        redis_url=sample.status["redis_url"], prefix=sample.status["prefix"], taken_at_s=sample.taken_at_s,
        window_s=window_s, instances=rows, recent=latency_summary(recent),
        predictor=predictor_view([e.record for e in sample.done]), dispatcher=dispatcher,
        num_dead_letters=sample.status["dead_letters"], pending=sample.status["pending"])


# --- rendering ------------------------------------------------------------------------------


def kv_bar(fraction: float | None, width: int = KV_BAR_WIDTH) -> str:
    """A text bar of ``width`` cells for a fraction in [0, 1] (None: unknown, blank)."""
    if fraction is None:
        return " " * width
    num_full = round(min(1.0, max(0.0, fraction)) * width)
    return "█" * num_full + "░" * (width - num_full)


def _ms(value_ms: float | None) -> str:
    return "—" if value_ms is None else f"{value_ms:,.0f}"


def _instances_table(view: TopView) -> Table:
    table = Table(title=f"instances (TTFT: requests finished in the last {view.window_s:g} s)",
                  title_justify="left", expand=False)
    for name in ("instance", "state", "beat ms", "KV used", "run", "wait", "queued",
                 "done", "TTFT p50 ms", "TTFT p99 ms", "lag p99 ms"):
        table.add_column(name, justify="left" if name in ("instance", "state", "KV used") else "right")
    for row in view.instances:
        fraction = row.kv_used_fraction
        kv_text = Text(kv_bar(fraction), style="red" if (fraction or 0) > 0.9 else "magenta")
        kv_text.append(f" {row.kv_used_blocks}/{row.kv_total_blocks or '?'}"
                       + (f" {100 * fraction:.0f}%" if fraction is not None else ""), style="default")
        table.add_row(row.instance_id, Text(row.state, style=STATE_TO_STYLE.get(row.state, "default")),
                      f"{row.heartbeat_age_ms:,.0f}", kv_text, str(row.num_running), str(row.num_waiting),
                      str(row.num_queued), str(row.recent.num_requests), _ms(row.recent.ttft_p50_ms),
                      _ms(row.recent.ttft_p99_ms), f"{row.lag_p99_ms:.1f}")
    recent = view.recent
    table.add_section()
    table.add_row("all", f"{sum(r.state == 'live' for r in view.instances)} live", "", "",
                  str(sum(r.num_running for r in view.instances)), str(sum(r.num_waiting for r in view.instances)),
                  str(sum(r.num_queued for r in view.instances)), str(recent.num_requests),
                  _ms(recent.ttft_p50_ms), _ms(recent.ttft_p99_ms), "")
    return table


def _forecast_check_line(view: TopView) -> Text:
    """Per instance, the median TTFT forecast error (the forecast check), worst first; the
    untrusted ones in red."""
    scored = sorted(((row.forecast_error["ttft_mape"], row.instance_id, row.forecast_error.get("trusted", True))
                     for row in view.instances if row.forecast_error and row.forecast_error.get("ttft_mape") is not None),
                    reverse=True)
    line = Text("forecasts   median TTFT error by instance: ")
    if not scored:
        return line.append("—")
    for index, (error, instance_id, trusted) in enumerate(scored[:MAX_FORECAST_CHECK_SHOWN]):
        line.append((", " if index else "") + f"{instance_id} {100 * error:.0f}%"
                    + ("" if trusted else " untrusted"), style="default" if trusted else "bold red")
    if len(scored) > MAX_FORECAST_CHECK_SHOWN:
        line.append(f", … ({len(scored)} instances)")
    return line


def _summary_lines(view: TopView) -> list[Text]:
    dispatcher, predictor = view.dispatcher, view.predictor
    lease = f" (lease {dispatcher.lease_ttl_ms / 1000:.1f} s left)" if dispatcher.lease_ttl_ms is not None else ""
    rate = ("—" if dispatcher.decisions_per_s is None
            else f"{dispatcher.decisions_per_s:,.1f}/s ({dispatcher.decisions_counted_by})")
    lines = [
        Text(f"blockq top  {time.strftime('%H:%M:%S', time.localtime(view.taken_at_s))}  redis {view.redis_url}  "
             f"prefix {view.prefix}  dead letters {view.num_dead_letters}", style="bold"),
        Text(f"dispatcher  leader {dispatcher.leader or 'none'}{lease}  decisions {rate}  "
             f"finished {dispatcher.completions_per_s:,.2f}/s"),
        Text(f"latency     TTFT forecast error {_ms(dispatcher.ttft_forecast_error_ms)} ms (predicted - measured)  "
             f"TPOT mean {_ms(view.recent.tpot_mean_ms)} ms  (last {view.window_s:g} s)"),
        _forecast_check_line(view),
    ]
    if predictor.version is None:
        lines.append(Text("predictor   no scored requests yet"))
    else:
        others = [f"{v} ({n})" for v, n in predictor.version_to_num_records.items() if v != predictor.version]
        lines.append(Text(
            f"predictor   version {predictor.version}  MAE {predictor.mae_tokens:,.1f} tokens  "
            f"Acc-50 {100 * (predictor.acc50 or 0):.0f}%  over its last {predictor.num_scored} requests"
            + (f"  (also in the window: {', '.join(others)})" if others else "")))
    lines.append(Text("pending     " + "  ".join(f"{k}={v}" for k, v in view.pending.items()), style="dim"))
    return lines


def render_view(view: TopView) -> Group:
    return Group(*_summary_lines(view), _instances_table(view))


def render_text(view: TopView, width: int = 160) -> str:
    """The frame as plain text (no colours or cursor moves), ``width`` columns wide."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(render_view(view))
    return out.getvalue()


# --- the command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S,
                        help="seconds between refreshes (and between the two reads of --once)")
    parser.add_argument("--window-s", type=float, default=DEFAULT_WINDOW_S,
                        help="recent = finished in the last this many seconds (TTFT, finished/s)")
    parser.add_argument("--records", type=int, default=DEFAULT_NUM_RECORDS,
                        help="newest done records read per refresh: the predictor's rolling window, "
                             "and at most this many count in the recent TTFT and finished/s")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--width", type=int, default=None,
                        help="columns (default: the terminal's; 160 when not a terminal)")


def run(args: argparse.Namespace) -> int:
    """Refresh until interrupted (Ctrl-C), or print one frame with ``--once``."""
    if args.interval_s <= 0 or args.window_s <= 0 or args.records < 1:
        raise SystemExit("blockq top: --interval-s and --window-s must be > 0, --records >= 1")
    settings = settings_from_args(args)
    client = connect(settings.redis_url)
    console = Console(width=args.width)
    if args.width is None and not console.is_terminal:
        console = Console(width=160)
    # Ctrl-C (or SIGTERM) ends the loop between frames: an interrupt raised inside a Redis
    # read or a console write could leave either half done.
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        previous = read_sample(client, settings, num_records=args.records)
        if args.once:
            stop.wait(args.interval_s)  # a second read, so that the rates have an interval
            view = build_view(read_sample(client, settings, num_records=args.records), previous,
                              window_s=args.window_s)
            console.print(render_view(view))
            return 0
        with _frames(console) as show:
            show(render_view(build_view(previous, window_s=args.window_s)))
            while not stop.wait(args.interval_s):
                try:
                    sample = read_sample(client, settings, num_records=args.records)
                except redis.RedisError as exc:  # Redis restarting: say so and keep trying
                    show(Text(f"redis unreachable: {exc}", style="bold red"))
                    continue
                show(render_view(build_view(sample, previous, window_s=args.window_s)))
                previous = sample
        return 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        client.close()


@contextlib.contextmanager
def _frames(console: Console) -> Iterator[Callable[[RenderableType], None]]:
    """A function that shows a frame: redrawn in place on a terminal; elsewhere (a file, a
    pipe) each frame printed after the last, since redrawing would only pile up there."""
    if not console.is_terminal:
        def show_next(frame: RenderableType) -> None:
            console.print(frame)
            console.print()

        yield show_next
        return
    with Live(console=console, auto_refresh=False) as live:
        yield lambda frame: live.update(frame, refresh=True)
