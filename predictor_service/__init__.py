"""Output-length prediction for blockq: models, features, training/eval, stream stage.

Services obtain a predictor with :func:`predictor_service.models.load_predictor`; the
models are pure (no Redis, no clock); :mod:`predictor_service.stage` wraps them.
"""
