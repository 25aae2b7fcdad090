"""Benchmarks, one module a subject: live clusters (``blockq bench``), placement decisions
(``dispatch-bench``), the engine model and emulated engines (``bench-engine``), the gateway,
batch throughput, and vLLM's own benchmark client against the gateway."""
