"""The mixture-of-experts family: model and spec (expert parallel: loom.parallel.expert)."""
