"""Load generation: trace readers, arrival processes, replay, metrics, reports, plots."""
