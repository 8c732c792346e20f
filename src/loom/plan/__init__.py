"""`loom plan`: predict a training step's per-rank peak memory and time before launch."""
