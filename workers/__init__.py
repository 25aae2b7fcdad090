"""Per-instance workers: queue consumer, request bundling, engine adapters, heartbeats."""
