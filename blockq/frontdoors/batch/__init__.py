"""Offline batch jobs in OpenAI's batch file format, run by rq workers on the cluster's
Redis: ``blockq batch submit|worker|status|cancel`` (also ``python -m blockq.frontdoors.batch``).

Submitting side: :mod:`blockq.frontdoors.batch.jobs`; the job itself: :mod:`blockq.frontdoors.batch.runner`
(its lease: :mod:`blockq.frontdoors.batch.job_lease`); the worker: :mod:`blockq.frontdoors.batch.worker`;
where a job's files may be: :mod:`blockq.frontdoors.batch.files`; file formats and limits:
:mod:`blockq.frontdoors.batch.lines`.
"""
