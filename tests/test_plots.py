"""loadgen.plots: latency CDFs on a log time axis with readable ms / s ticks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes

from loadgen.plots import duration_label, latency_cdf_figure, plot_latency_cdf
from loadgen.summaries import RequestRecord

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(ttft_ms: float | None, *, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        request_id="r", submitted_at_s=0.0, instance="i0", prompt_tokens=10, true_output_tokens=20,
        predicted_output_tokens=20, output_tokens=20, queue_wait_ms=1.0, ttft_ms=ttft_ms, tpot_ms=30.0,
        e2e_ms=None if ttft_ms is None else ttft_ms + 600.0, predicted_ttft_ms=None, predicted_e2e_ms=None,
        num_preemptions=0, ok=ok)


def _visible_tick_labels(axis: Axes) -> list[str]:
    """The major tick labels inside the axis' limits (the locator also places some just outside)."""
    low, high = axis.get_xlim()
    axis.figure.canvas.draw()
    return [tick.get_text() for tick, value in zip(axis.get_xticklabels(), axis.get_xticks(), strict=True)
            if low <= value <= high]


def test_duration_labels_switch_from_ms_to_s() -> None:
    assert [duration_label(v) for v in (1, 50, 300, 999, 1000, 2500, 40_000)] == [
        "1 ms", "50 ms", "300 ms", "999 ms", "1 s", "2.5 s", "40 s"]


def test_cdf_over_50_ms_to_40_s_is_on_a_log_axis_with_ms_and_s_ticks() -> None:
    values_ms = np.geomspace(50.0, 40_000.0, 200)
    records = [_record(float(v)) for v in values_ms] + [_record(None, ok=False)]
    figure = latency_cdf_figure({8.0: {"block": records}}, field_name="ttft_ms", title="TTFT CDF")
    (axis,) = figure.axes
    assert axis.get_xscale() == "log"
    assert _visible_tick_labels(axis) == ["100 ms", "300 ms", "1 s", "3 s", "10 s", "30 s"]
    assert axis.get_xlabel() == "TTFT (log scale)"
    (line,) = axis.get_lines()
    np.testing.assert_allclose(line.get_xdata(), values_ms)
    assert line.get_ydata()[-1] == 1.0


def test_a_narrow_span_gets_1_2_5_ticks_and_zero_latencies_sit_on_the_floor(tmp_path: Path) -> None:
    records = [_record(v) for v in (0.0, 40.0, 60.0, 90.0, 150.0, 250.0)]
    figure = latency_cdf_figure({None: {"llumnix": records}}, field_name="ttft_ms", title="TTFT CDF")
    (axis,) = figure.axes
    assert axis.get_lines()[0].get_xdata()[0] == 1.0  # a log axis has no zero
    assert "100 ms" in _visible_tick_labels(axis)
    narrow = latency_cdf_figure({None: {"llumnix": records[1:]}}, field_name="ttft_ms", title="TTFT CDF")
    assert _visible_tick_labels(narrow.axes[0]) == ["50 ms", "100 ms", "200 ms"]
    path = plot_latency_cdf(tmp_path / "ttft_cdf.png", {"llumnix": records}, {"llumnix": ("llumnix", None)},
                            field_name="ttft_ms", title="TTFT CDF")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
