"""Per-step metrics and the run folder (spec/metrics.md).

Every rank writes `metrics-<rank>.jsonl` (`rows`); rank 0 also writes `config.json` and, at
the end, `summary.json`, `plots/` and a text plot of the loss (`summary`). A step's values
(loss, pre-clip norm, any health statistics: `health`) stay on the device until the logging
step, where every queued row is read in one `.tolist()`: other steps read nothing. Batch,
FLOPs and peak are derived once (`facts`). `--no-metrics` ($LOOM_METRICS=0) swaps in
`NullMetrics`, the overhead baseline (`sink`, beside the `RunMetrics` protocol both answer
to); `Metrics` is the recorder (`recorder`), `build_metrics` picks and builds one (`build`).
"""

from loom.observability.metrics.build import build_metrics
from loom.observability.metrics.facts import RunFacts, environment_facts, run_facts, step_flops
from loom.observability.metrics.health import memory_stats, tensor_stats
from loom.observability.metrics.recorder import Metrics
from loom.observability.metrics.rows import StepClock, read_rows, run_history
from loom.observability.metrics.sink import MAX_QUEUED, NullMetrics, RunMetrics, RunPlace
from loom.observability.metrics.summary import steady_start, summarize

__all__ = ["MAX_QUEUED", "Metrics", "NullMetrics", "RunFacts", "RunMetrics", "RunPlace",
           "StepClock", "build_metrics", "environment_facts", "memory_stats", "read_rows",
           "run_facts", "run_history", "steady_start", "step_flops", "summarize",
           "tensor_stats"]
