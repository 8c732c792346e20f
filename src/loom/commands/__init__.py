"""The thin commands beside `loom train`: eval, generate, doctor, verify, tokenize."""

import loom.families  # noqa: F401  (loom's families register: every command here builds models)
