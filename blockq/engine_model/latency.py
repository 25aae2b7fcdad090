"""Step-latency model: seconds for one engine step as a function of its batch.

A step's time is modelled as four additive parts::

    seconds = linear_scale * linear_s(num_prefill_tokens + num_decode_seqs)
            + kv_token_s * num_kv_tokens_attended
            + prefill_pair_s * num_prefill_attention_pairs
            + step_overhead_s

* ``linear_s(tokens)``: the linear layers (projections, MLP, norms), a piecewise-linear
  table over the tokens of the step, fitted from per-operator GPU profiles.
* ``kv_token_s``: attention reading the KV cache is memory bound; seconds per KV token
  read (K and V of every layer) at the GPU's achievable HBM bandwidth.
* ``prefill_pair_s``: prefill attention is compute bound; seconds per (query, key) pair.
* ``step_overhead_s``: fixed cost of a step (kernel launches, LM-head weight read).

Where the shipped figures come from is documented in :mod:`blockq.engine_model.fit_profiles`.
:meth:`StepLatencyModel.refit` rescales the four parts from observed step timings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

import numpy as np


def estimate_prefill_attention_pairs(num_prefill_tokens: int) -> int:
    """(query, key) pairs of one causal prefill chunk of this size starting at position 0.

    Used when a step's exact pair count is unknown (e.g. step samples carried as three
    numbers): exact for a whole fresh prompt, an underestimate for a later chunk.
    """
    return num_prefill_tokens * (num_prefill_tokens + 1) // 2


@dataclass(frozen=True)
class StepSample:
    """One observed engine step: its batch and how long it took.

    ``num_kv_tokens_attended`` is the sum over the step's sequences of the context each
    one's attention reads (tokens computed after the step). ``num_prefill_attention_pairs``
    is the sum over prefill chunks of chunk x (tokens before it + (chunk + 1) / 2); None when
    unknown, in which case :func:`estimate_prefill_attention_pairs` stands in.
    """

    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens_attended: int
    duration_s: float
    num_prefill_attention_pairs: int | None = None


_COEFFICIENT_NAMES = ("linear_scale", "kv_token_s", "prefill_pair_s", "step_overhead_s")


@dataclass(frozen=True)
class StepLatencyModel:
    """Immutable step-latency model; see the module docstring for the formula.

    ``linear_knot_tokens`` (strictly increasing, >= 1) and ``linear_knot_s`` define the
    linear-layer table; between knots it is interpolated, above the last knot extrapolated
    along the last segment, below the first knot held at the first value, and zero for an
    empty step. All coefficients are non-negative and finite.

    Raises:
        ValueError: naming the field, when the table or a coefficient is invalid.
    """

    linear_knot_tokens: tuple[int, ...]
    linear_knot_s: tuple[float, ...]
    kv_token_s: float
    prefill_pair_s: float
    step_overhead_s: float
    linear_scale: float = 1.0
    # Dense per-token table so that a lookup in the dispatcher's hot loop is O(1).
    _linear_table_s: list[float] = field(init=False, repr=False, compare=False, hash=False)
    _tail_slope_s: float = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "linear_knot_tokens", tuple(int(k) for k in self.linear_knot_tokens))
        object.__setattr__(self, "linear_knot_s", tuple(float(v) for v in self.linear_knot_s))
        self._validate()
        knots = np.array(self.linear_knot_tokens, dtype=float)
        values = np.array(self.linear_knot_s, dtype=float)
        table = np.interp(np.arange(self.linear_knot_tokens[-1] + 1, dtype=float), knots, values)
        table[0] = 0.0
        slope = 0.0
        if len(knots) >= 2:
            slope = max(0.0, (values[-1] - values[-2]) / (knots[-1] - knots[-2]))
        object.__setattr__(self, "_linear_table_s", table.tolist())
        object.__setattr__(self, "_tail_slope_s", float(slope))

    def _validate(self) -> None:
        _check_fields(self.linear_knot_tokens, self.linear_knot_s,
                      {name: getattr(self, name) for name in _COEFFICIENT_NAMES})

    # --- evaluation -----------------------------------------------------------------------

    @property
    def linear_table_s(self) -> list[float]:
        """The dense linear-layer table: seconds for 0 .. last knot tokens (read-only)."""
        return self._linear_table_s

    @property
    def tail_slope_s(self) -> float:
        """Seconds per token above the last knot."""
        return self._tail_slope_s


    def linear_seconds(self, num_tokens: int) -> float:
        """Unscaled linear-layer seconds for a step of ``num_tokens`` tokens (>= 0)."""
        table = self._linear_table_s
        if num_tokens < len(table):
            return table[num_tokens]
        return table[-1] + (num_tokens - len(table) + 1) * self._tail_slope_s

    def step_seconds(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_kv_tokens_attended: int,
        num_prefill_attention_pairs: int | None = None,
    ) -> float:
        """Modelled seconds of one step; arguments are non-negative counts.

        ``num_prefill_attention_pairs`` as in :class:`StepSample`; None estimates it.
        """
        num_tokens = num_prefill_tokens + num_decode_seqs
        table = self._linear_table_s
        if num_tokens < len(table):
            linear_s = table[num_tokens]
        else:
            linear_s = table[-1] + (num_tokens - len(table) + 1) * self._tail_slope_s
        if num_prefill_attention_pairs is None:
            num_prefill_attention_pairs = num_prefill_tokens * (num_prefill_tokens + 1) // 2
        return (self.linear_scale * linear_s
                + self.kv_token_s * num_kv_tokens_attended
                + self.prefill_pair_s * num_prefill_attention_pairs
                + self.step_overhead_s)

    # --- refitting ------------------------------------------------------------------------

    def refit(
        self,
        samples: Sequence[StepSample],
        prior_weight_samples: float = 1.0,
        min_samples: int = 4,
    ) -> StepLatencyModel:
        """A model whose four coefficients best explain ``samples``; the table shape is kept.

        Least squares with non-negative coefficients, regularised toward this model's
        coefficients as if it were ``prior_weight_samples`` extra observations (each
        column scaled to its RMS over the samples): with few or uninformative samples
        (e.g. no prefill at all) the result is a blend that keeps what the samples cannot
        tell. Nearly collinear parts (a constant overhead and the linear layers of small
        batches) are split with the prior's help, so judge a refit by its predictions
        rather than by single coefficients. Samples with a non-finite or non-positive
        duration are ignored; fewer than ``min_samples`` usable ones return ``self``.
        """
        features, durations_s = self._sample_features(samples)
        if len(durations_s) < min_samples:
            return self
        prior = np.array([getattr(self, name) for name in _COEFFICIENT_NAMES])
        column_rms = np.sqrt(np.mean(features * features, axis=0))
        # A feature absent from every sample carries no information: the prior decides it.
        column_rms[column_rms == 0.0] = 1.0
        penalty = math.sqrt(max(prior_weight_samples, 0.0)) * np.diag(column_rms)
        design = np.vstack([features, penalty]) / column_rms
        target = np.concatenate([durations_s, penalty @ prior])
        scaled = _nonnegative_least_squares(design, target)
        if scaled is None:
            return self
        coefficients = scaled / column_rms
        return replace(self, **{name: float(value) for name, value in
                                zip(_COEFFICIENT_NAMES, coefficients, strict=True)})

    def _sample_features(self, samples: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray]:
        """Rows [linear_s, kv tokens, prefill pairs, 1] and durations of the usable samples."""
        rows: list[tuple[float, float, float, float]] = []
        durations_s: list[float] = []
        for sample in samples:
            if not math.isfinite(sample.duration_s) or sample.duration_s <= 0.0:
                continue
            pairs = sample.num_prefill_attention_pairs
            if pairs is None:
                pairs = estimate_prefill_attention_pairs(sample.num_prefill_tokens)
            num_tokens = sample.num_prefill_tokens + sample.num_decode_seqs
            rows.append((self.linear_seconds(num_tokens), float(sample.num_kv_tokens_attended),
                         float(pairs), 1.0))
            durations_s.append(sample.duration_s)
        return np.array(rows, dtype=float).reshape(-1, 4), np.array(durations_s, dtype=float)

    # --- serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain floats and lists (msgpack- and JSON-able); inverse of :meth:`from_dict`."""
        return {
            "linear_knot_tokens": list(self.linear_knot_tokens),
            "linear_knot_s": list(self.linear_knot_s),
            "linear_scale": self.linear_scale,
            "kv_token_s": self.kv_token_s,
            "prefill_pair_s": self.prefill_pair_s,
            "step_overhead_s": self.step_overhead_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepLatencyModel:
        """Build from :meth:`to_dict` output; unknown keys are ignored.

        Raises:
            ValueError: naming a missing or invalid field.
        """
        _check_required(data)
        return cls(
            linear_knot_tokens=tuple(data["linear_knot_tokens"]),
            linear_knot_s=tuple(data["linear_knot_s"]),
            kv_token_s=float(data["kv_token_s"]),
            prefill_pair_s=float(data["prefill_pair_s"]),
            step_overhead_s=float(data["step_overhead_s"]),
            linear_scale=float(data.get("linear_scale", 1.0)),
        )


def check_latency_model_dict(data: dict[str, Any]) -> None:
    """What :meth:`StepLatencyModel.from_dict` would refuse, refused the same way, without
    building the model's dense table (about 80 us): for checks on a hot path, such as
    decoding every heartbeat.

    Raises:
        ValueError: naming a missing or invalid field.
    """
    _check_required(data)
    try:
        knots = tuple(int(k) for k in data["linear_knot_tokens"])
        values = tuple(float(v) for v in data["linear_knot_s"])
        coefficients = {name: float(data[name]) if name != "linear_scale" else float(data.get(name, 1.0))
                        for name in _COEFFICIENT_NAMES}
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"latency model: a field is not a number ({exc})") from None
    _check_fields(knots, values, coefficients)


_REQUIRED_FIELDS = ("linear_knot_tokens", "linear_knot_s", "kv_token_s", "prefill_pair_s", "step_overhead_s")


def _check_required(data: dict[str, Any]) -> None:
    for name in _REQUIRED_FIELDS:
        if name not in data:
            raise ValueError(f"{name}: is required")


def _check_fields(knots: tuple[int, ...], values: tuple[float, ...], coefficients: dict[str, Any]) -> None:
    """ValueError naming the field, when the table or a coefficient is invalid."""
    if not knots or len(knots) != len(values):
        raise ValueError("linear_knot_tokens: must be non-empty and as long as linear_knot_s")
    if knots[0] < 1 or any(b <= a for a, b in zip(knots, knots[1:], strict=False)):
        raise ValueError("linear_knot_tokens: must be >= 1 and strictly increasing")
    if knots[-1] > 1_000_000:
        raise ValueError(f"linear_knot_tokens: last knot must be <= 1000000 (got {knots[-1]})")
    if any(not math.isfinite(v) or v < 0.0 for v in values):
        raise ValueError("linear_knot_s: must be finite and >= 0")
    for name, value in coefficients.items():
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0.0:
            raise ValueError(f"{name}: must be a finite number >= 0 (got {value!r})")


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray | None:
    """Exact NNLS for a handful of columns: the best of the non-negative subset solutions.

    With four coefficients there are only 16 subsets, so enumerating them is both exact and
    cheaper than an iterative active-set method. None if no subset gives a finite answer.
    """
    num_columns = design.shape[1]
    best: np.ndarray | None = None
    best_residual = math.inf
    for size in range(num_columns, -1, -1):
        for subset in combinations(range(num_columns), size):
            solution = np.zeros(num_columns)
            if subset:
                columns = list(subset)
                values, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
                if np.any(values < 0.0) or not np.all(np.isfinite(values)):
                    continue
                solution[columns] = values
            residual = float(np.sum((design @ solution - target) ** 2))
            if residual < best_residual:
                best, best_residual = solution, residual
    return best
