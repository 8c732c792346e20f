"""Per-step metrics and the run folder (spec/metrics.md).

Every rank writes `metrics-<rank>.jsonl` (`rows`); rank 0 also writes `config.json` and, at
the end, `summary.json`, `plots/` and a text plot of the loss (`summary`). A step costs one
host sync: loss, pre-clip norm and any health statistics (`health`) travel together in one
`.tolist()`. Batch, FLOPs and peak are derived once (`facts`). `--no-metrics`
($LOOM_METRICS=0) swaps in `NullMetrics`, the overhead baseline (`recorder`).
"""

from loom.metrics.facts import RunFacts, environment_facts, run_facts, step_flops
from loom.metrics.health import memory_stats, tensor_stats
from loom.metrics.recorder import Metrics, NullMetrics, RunMetrics, RunPlace, build_metrics
from loom.metrics.rows import StepClock, read_rows, run_history
from loom.metrics.summary import steady_start, summarize

__all__ = ["Metrics", "NullMetrics", "RunFacts", "RunMetrics", "RunPlace", "StepClock",
           "build_metrics", "environment_facts", "memory_stats", "read_rows", "run_facts",
           "run_history", "steady_start", "step_flops", "summarize", "tensor_stats"]
