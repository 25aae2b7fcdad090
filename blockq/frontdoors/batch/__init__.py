"""Offline batch jobs in OpenAI's batch file format, run by rq workers on the cluster's
Redis: ``blockq batch submit|worker|status|cancel`` (also ``python -m blockq.frontdoors.batch``).

Submitting side: :mod:`blockq.frontdoors.batch.jobs`; the job itself: :mod:`blockq.frontdoors.batch.runner`;
the worker: :mod:`blockq.frontdoors.batch.worker`; file formats: :mod:`blockq.frontdoors.batch.lines`.
"""
