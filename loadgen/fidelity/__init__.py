"""The engine model against one real vLLM engine: ``blockq profile`` measures a step-latency
profile, ``blockq fidelity`` replays a trace on the engine and through the engine model and
scores every forecast (docs/fidelity.md)."""
