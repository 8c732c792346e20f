"""Checkpoints: the checkpointer, its on-disk format and schema, what is trusted on load,
resume, digests."""
