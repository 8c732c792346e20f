"""Number formats: the precision a run computes in, and float8 training."""
