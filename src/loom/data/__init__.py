"""Datasets, tokenizers and distributed loading."""
