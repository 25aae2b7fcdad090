"""The dispatcher: cluster view from heartbeats, runtime simulator, placement policies."""
