"""Online refit of the ``fast`` model from served requests' true lengths.

The ``done`` stream carries no prompt text, so the stage remembers the
:class:`PredictionInput` of each request it annotated (:class:`RequestInputCache`,
bounded by count and by prompt characters, oldest first out) and the feedback consumer
hands each counted done record to :meth:`OnlineRefitter.observe_done`, which joins the
two into a :class:`FeedbackSample`.

Refit policy: once ``min_samples`` new samples have arrived and either
``refit_every_samples`` new samples or ``refit_interval_s`` seconds have passed since
the last refit, :func:`~predictor_service.models.fast_fit.refit_fast` runs in a worker
thread (``asyncio.to_thread``) on the most recent ``max_samples`` samples. Each refit
starts from the *base* model (the one loaded at start), so the model never grows past
the base plus ``num_rounds`` trees per quantile and old feedback ages out of the window.

Swap: the new model is published with one attribute assignment on the stage
(``slot.predictor = model``) in the event loop; the stage reads that attribute once per
batch, so a batch is annotated by one model and every annotated request carries the
version that predicted it. The model it replaced is kept for :meth:`rollback`. With
``save_dir`` set, each new model is also written to ``save_dir/<version>`` (with a
manifest derived from the base model's).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog

from blockq.wire.protocol import DoneRecord
from predictor_service.manifest import Manifest
from predictor_service.models import FeedbackSample, LengthPredictor, PredictionInput

if TYPE_CHECKING:
    from predictor_service.models.fast import FastLengthModel

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class OnlineRefitOptions:
    """When and how the ``fast`` model refits (counts are samples, times seconds).

    ``max_tracked_requests`` / ``max_tracked_prompt_chars`` bound the memory of the
    request-input cache; ``poll_interval_s`` is how often :meth:`OnlineRefitter.run`
    checks whether a refit is due; ``save_dir`` None keeps new models in memory only.
    """

    refit_every_samples: int = 2000
    refit_interval_s: float = 600.0
    min_samples: int = 200
    max_samples: int = 20_000
    num_rounds: int = 30
    max_tracked_requests: int = 50_000
    max_tracked_prompt_chars: int = 64_000_000
    poll_interval_s: float = 1.0
    save_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("refit_every_samples", "min_samples", "max_samples", "num_rounds",
                     "max_tracked_requests", "max_tracked_prompt_chars"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")
        if self.refit_interval_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("refit_interval_s and poll_interval_s: must be > 0")
        if self.min_samples > self.max_samples:
            raise ValueError("min_samples: must not exceed max_samples")


class RequestInputCache:
    """Bounded map request id -> the :class:`PredictionInput` it was annotated with.

    Holds at most ``max_requests`` entries and ``max_prompt_chars`` prompt characters;
    the oldest entries are evicted first (a request whose done record comes later is
    then simply not used for refit).
    """

    def __init__(self, max_requests: int, max_prompt_chars: int) -> None:
        self.max_requests = max_requests
        self.max_prompt_chars = max_prompt_chars
        self._request_id_to_input: OrderedDict[str, PredictionInput] = OrderedDict()
        self.num_prompt_chars = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._request_id_to_input)

    def remember(self, request_id: str, one: PredictionInput) -> None:
        """Store (or replace) the input of ``request_id``, evicting the oldest if full."""
        previous = self._request_id_to_input.pop(request_id, None)
        if previous is not None:
            self.num_prompt_chars -= len(previous.prompt)
        self._request_id_to_input[request_id] = one
        self.num_prompt_chars += len(one.prompt)
        while self._request_id_to_input and (
            len(self._request_id_to_input) > self.max_requests
            or self.num_prompt_chars > self.max_prompt_chars
        ):
            _, evicted = self._request_id_to_input.popitem(last=False)
            self.num_prompt_chars -= len(evicted.prompt)
            self.num_evicted += 1

    def pop(self, request_id: str) -> PredictionInput | None:
        """Remove and return the input of ``request_id``; None when unknown or evicted."""
        one = self._request_id_to_input.pop(request_id, None)
        if one is not None:
            self.num_prompt_chars -= len(one.prompt)
        return one


class PredictorSlot(Protocol):
    """Where the serving predictor lives (the stage): read per batch, swapped whole."""

    predictor: LengthPredictor


class OnlineRefitter:
    """Collects feedback samples and refits, swaps and rolls back the ``fast`` model.

    Construct it before the stage serves; ``clock`` (monotonic seconds) is injected.
    ``base_manifest`` is needed only to save models (``options.save_dir``).
    """

    def __init__(self, slot: PredictorSlot, options: OnlineRefitOptions | None = None, *,
                 base_manifest: Manifest | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        from predictor_service.models.fast import FastLengthModel

        if not isinstance(slot.predictor, FastLengthModel):
            raise ValueError(
                f"online refit: needs the 'fast' backend (got {slot.predictor.backend!r})"
            )
        self.options = options or OnlineRefitOptions()
        if self.options.save_dir is not None and base_manifest is None:
            raise ValueError("base_manifest: required to save refitted models (save_dir)")
        self.slot = slot
        self.base_model: FastLengthModel = slot.predictor
        self.previous_model: LengthPredictor | None = None
        self.base_manifest = base_manifest
        self.clock = clock
        self.cache = RequestInputCache(
            self.options.max_tracked_requests, self.options.max_tracked_prompt_chars
        )
        self.samples: deque[FeedbackSample] = deque(maxlen=self.options.max_samples)
        self.num_new_samples = 0
        self.num_unmatched = 0
        self.num_refits = 0
        self.num_failed_refits = 0
        self.num_rollbacks = 0
        self.is_refitting = False
        self.last_refit_at_s = clock()

    def remember(self, request_id: str, one: PredictionInput) -> None:
        """Stage hook: note the input of an annotated request (for the later join)."""
        self.cache.remember(request_id, one)

    def observe_done(self, record: DoneRecord) -> bool:
        """Feedback hook: join a counted done record with its input; True when it became
        a sample (False: not annotated here, evicted, or no valid length)."""
        one = self.cache.pop(record.request_id)
        if one is None or record.output_tokens < 1:
            self.num_unmatched += 1
            return False
        self.samples.append(FeedbackSample(one, record.output_tokens))
        self.num_new_samples += 1
        return True

    def is_refit_due(self) -> bool:
        """Whether a refit should start now (see the module docstring)."""
        options = self.options
        if self.is_refitting or self.num_new_samples < options.min_samples:
            return False
        return (
            self.num_new_samples >= options.refit_every_samples
            or self.clock() - self.last_refit_at_s >= options.refit_interval_s
        )

    async def refit(self) -> FastLengthModel | None:
        """Refit in a worker thread and swap the new model in; returns it, or None when
        there are no samples, a refit is already running, or fitting failed (logged;
        the serving model stays)."""
        if self.is_refitting or not self.samples:
            return None
        from predictor_service.models.fast_fit import refit_fast

        self.is_refitting = True
        samples = list(self.samples)
        self.num_new_samples = 0
        self.last_refit_at_s = self.clock()
        started_at_s = time.perf_counter()
        try:
            model = await asyncio.to_thread(
                refit_fast, self.base_model, samples,
                num_rounds=self.options.num_rounds, seed=self.options.seed,
            )  # fmt: skip
        except Exception as exc:  # a failed refit must never stop serving
            self.num_failed_refits += 1
            log.error("predictor_refit_failed", error=repr(exc), num_samples=len(samples))
            return None
        finally:
            self.is_refitting = False
        self._swap(model, num_samples=len(samples), refit_s=time.perf_counter() - started_at_s)
        if self.options.save_dir is not None and self.base_manifest is not None:
            await self._save(model, Path(self.options.save_dir) / model.version, self.base_manifest)
        return model

    def _swap(self, model: FastLengthModel, *, num_samples: int, refit_s: float) -> None:
        old = self.slot.predictor
        self.previous_model = old
        self.slot.predictor = model  # the one write the stage observes
        self.num_refits += 1
        log.info("predictor_model_swapped", old_version=old.version, new_version=model.version,
                 num_samples=num_samples, refit_s=round(refit_s, 3))  # fmt: skip

    async def _save(self, model: FastLengthModel, model_dir: Path, manifest: Manifest) -> None:
        from predictor_service.models.fast_fit import save_fast_model

        try:
            await asyncio.to_thread(save_fast_model, model, model_dir, manifest)
        except OSError as exc:
            log.error("predictor_model_save_failed", model_dir=str(model_dir), error=repr(exc))
            return
        log.info("predictor_model_saved", model_dir=str(model_dir), version=model.version)

    def rollback(self) -> bool:
        """Put the previous model back (one level); False when there is none."""
        previous = self.previous_model
        if previous is None:
            return False
        current = self.slot.predictor
        self.slot.predictor = previous
        self.previous_model = None
        self.num_rollbacks += 1
        log.warning("predictor_model_rolled_back", from_version=current.version,
                    to_version=previous.version)  # fmt: skip
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Refit whenever one is due, until ``stop`` is set."""
        while not stop.is_set():
            if self.is_refit_due():
                await self.refit()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.options.poll_interval_s)
