"""Model definitions: plain PyTorch, no knowledge of parallelism."""
