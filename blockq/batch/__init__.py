"""Offline batch jobs in OpenAI's batch file format, run by rq workers on the cluster's
Redis: ``blockq batch submit|worker|status|cancel`` (also ``python -m blockq.batch``).

Submitting side: :mod:`blockq.batch.jobs`; the job itself: :mod:`blockq.batch.runner`;
the worker: :mod:`blockq.batch.worker`; file formats: :mod:`blockq.batch.lines`.
"""
