"""The cluster in virtual time (``blockq simulate``): the dispatcher core and the emulated
workers' own code, driven by discrete events.

:mod:`.config` (what is modelled), :mod:`.instance` (a worker and its engine),
:mod:`.cluster` (the event loop), :mod:`.workload` (samples annotated up front),
:mod:`.runner` (one run → a bench summary), :mod:`.report` (mean ± sd tables),
:mod:`.cli` (the command).
"""
