"""What a run reports: metrics, FLOPs, plots, progress, trackers, profiles, memory snapshots."""
