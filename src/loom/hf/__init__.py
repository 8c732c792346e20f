"""Hugging Face interop at the command level: which implementation a Hub model runs as, and
export."""
