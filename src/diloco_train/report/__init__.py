"""What a run reports: metrics, sinks, plots, log tags, its header and summary."""
