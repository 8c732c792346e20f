"""transformers' own modules, for architectures no native family serves."""
