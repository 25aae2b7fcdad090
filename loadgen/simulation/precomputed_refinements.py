"""Remaining-length refinements for a simulated run, computed up front.

A live worker asks the predictor to refine a request's length each time it crosses a
checkpoint (every 64 generated tokens by default: :mod:`workers.refinement`), from the
text it has generated so far. A trace with text (ShareGPT) records each answer, and the
emulated engine ends a request where its answer ended, so the partial output at every
checkpoint is known before the run: the answer's first ``g`` tokens (the project
tokenizer's). The refinements are computed once per sample, in batches, by the real
refinement model, and reused for every policy and rate; a simulated instance's beats then
report them as a live worker's would (:class:`~workers.refinement.RefinementTable`).

``truth`` instead of a model (benchmarks only, like the ``oracle`` policy) refines every
running request at each checkpoint to its recorded length: the most any refinement at
that cadence could tell the dispatcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import structlog

from blockq.text.tokenizer import AnswerTokenizer
from blockq.wire.protocol import Request
from loadgen.simulation.workload import AnnotatedSample
from loadgen.traces import TraceRequest
from predictor_service.models.refine import RefineInput, RefineModel
from workers.refinement import (
    DEFAULT_REFINE_EVERY_TOKENS,
    RefinedLength,
    RefinementTable,
    checkpoints_below,
)

log = structlog.get_logger(__name__)

_BATCH_INPUTS = 4096


def _refine_inputs(trace_request: TraceRequest, request: Request, answer_ids: list[int],
                   tokenizer: AnswerTokenizer, every_tokens: int) -> Iterator[RefineInput]:
    prediction = request.prediction
    if prediction is None:
        return
    for cut in checkpoints_below(request.true_output_tokens or trace_request.true_output_tokens, every_tokens):
        yield RefineInput(
            prompt=trace_request.prompt if isinstance(trace_request.prompt, str) else "",
            prompt_tokens=prediction.prompt_tokens,
            first_guess_p10_tokens=max(1, prediction.p10_tokens or prediction.predicted_output_tokens),
            first_guess_p50_tokens=max(1, prediction.predicted_output_tokens),
            first_guess_p90_tokens=max(1, prediction.p90_tokens or prediction.predicted_output_tokens),
            generated_tokens=cut, partial_text=tokenizer.prefix_text(answer_ids, cut),
            max_tokens=request.max_tokens)


TRUTH = "truth"


def refine_sample_with_truth(sample: AnnotatedSample, every_tokens: int = DEFAULT_REFINE_EVERY_TOKENS
                             ) -> AnnotatedSample:
    """``sample`` refined to each request's recorded length at every checkpoint."""
    by_request = {}
    for request in sample.requests:
        if request is None or request.true_output_tokens is None:
            continue
        total = min(request.true_output_tokens, request.max_tokens)
        by_request[request.id] = [RefinedLength(cut, total, total, total + 1)
                                  for cut in checkpoints_below(total, every_tokens)]
    return dataclasses.replace(sample, refinements=RefinementTable(every_tokens, by_request))


def refine_sample(sample: AnnotatedSample, model: RefineModel,
                  every_tokens: int = DEFAULT_REFINE_EVERY_TOKENS) -> AnnotatedSample:
    """``sample`` with a :class:`RefinementTable` of every request whose trace recorded
    its answer's text. Requests without text (or without a prediction) keep their first
    guess, as a live worker's do when the predictor has no refinement model."""
    tokenizer = AnswerTokenizer()
    pairs = [(trace_request, request) for trace_request, request in zip(sample.trace_requests, sample.requests,
                                                                        strict=True)
             if request is not None and trace_request.output_text]
    answer_ids = tokenizer.encode([trace_request.output_text or "" for trace_request, _ in pairs])
    owners: list[str] = []
    inputs: list[RefineInput] = []
    for (trace_request, request), ids in zip(pairs, answer_ids, strict=True):
        for one in _refine_inputs(trace_request, request, ids, tokenizer, every_tokens):
            owners.append(request.id)
            inputs.append(one)
    by_request: dict[str, list[RefinedLength]] = {}
    for start in range(0, len(inputs), _BATCH_INPUTS):
        batch = inputs[start:start + _BATCH_INPUTS]
        for owner, one, remaining in zip(owners[start:start + _BATCH_INPUTS], batch, model.predict(batch),
                                         strict=True):
            by_request.setdefault(owner, []).append(RefinedLength.from_remaining(
                one.generated_tokens, remaining.p10_tokens, remaining.predicted_output_tokens,
                remaining.p90_tokens))
    log.info("sample_refined", seed=sample.seed, num_requests=len(pairs), num_refinements=len(inputs),
             model_version=model.version, every_tokens=every_tokens)
    return dataclasses.replace(sample, refinements=RefinementTable(every_tokens, by_request))
