"""loom: train Llama-style language models on one process or thousands."""

__version__ = "0.1.0"
