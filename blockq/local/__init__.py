"""The local-cluster tooling: ``blockq up`` / ``down`` under a supervisor, the embedded Redis,
the cluster's state directory, ``blockq status`` / ``top`` and the tiny test model."""
