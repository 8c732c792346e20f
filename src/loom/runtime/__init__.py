"""A run's lifecycle: launch, the process group, the run folder, preflight, watchdog,
stragglers, the flight recorder, logs, host memory."""
