"""The thin commands beside `loom train`: eval, generate, doctor, verify, tokenize."""
