"""`loom plan`'s predicted per-rank peak memory vs the measured one, on real CPU ranks.

    python benchmarks/plan_accuracy.py      # 30 configurations on 1, 2 and 4 ranks; 3-10 min

Measured: each configuration trains on real gloo ranks (`--fp32`, random tokens, the debug
model at seq 128, batch 2; the MoE rows moe-debug in bf16, expert parallel traced as
balanced routing; the compiled rows where activations weigh more, seq 512, batch 4, vocab
2048; the `DEEP` rows 8 blocks and vocab 512); `FSDPMemTracker` (torch's
`distributed._tools`) follows the second training step (`Trainer.train_step`, optimizer
included) and records the peak of live tensor bytes (compiled and interleaved-pipeline rows:
the CPU allocator's peak over the step, plus the state alive before it, since the tracker
cannot see inside compiled code nor follow a rank holding several stages); the worst rank
counts. Predicted: `loom plan`'s trace of the same flags under fake tensors and a fake
process group (per-block extrapolation from 1 and 2 blocks; pipeline rows: per stage,
composed with the schedule's in-flight micro-batches; compiled blocks and loss:
`loom.plan.compiled`). Both count tensor storages the same way (pipeline rows add torch's
receive buffers to the measured peak: made in the first step, the tracker of the second
cannot see them), so the error is what the fake trace, the extrapolation and the composition
get wrong.
Writes benchmarks/results/plan_accuracy.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import run_ranks
from tests.plan_accuracy import compare

RESULTS = Path(__file__).parent / "results" / "plan_accuracy.json"
BASE = ["--model", "debug", "--fp32", "--dataset", "random", "--seq-len", "128",
        "--batch-size", "2", "--max-steps", "2"]
MOE = ["--model", "moe-debug", "--dtype", "bf16"]  # the plan refuses fp32 experts
DEEP = ["--n-layers", "8", "--vocab-size", "512"]
"""Blocks outweigh the head, and a pipeline stage has 4 of them: extrapolated from 1 and 2,
what a first micro-batch leaves held for the next (unreduced gradients) must scale."""
CONFIGS: dict[int, list[list[str]]] = {
    1: [[], ["--ac", "block", "--loss-impl", "chunked-backward"]],
    2: [["--reshard-after-forward", "never"], ["--tp", "2", "--loss-impl", "loss-parallel"],
        ["--loss-impl", "fused-linear"], ["--pp", "2", "--batch-size", "4"],
        ["--pp", "2", "--pp-schedule", "gpipe", "--batch-size", "4"], ["--cp", "2"],
        [*MOE, "--ep", "2"], ["--grad-accum-steps", "2", *DEEP],
        ["--grad-accum-steps", "2", "--accum-reduce", "micro-batch", *DEEP],
        ["--pp", "2", "--batch-size", "4", *DEEP],
        ["--pp", "2", "--pp-schedule", "gpipe", "--batch-size", "4", *DEEP],
        ["--dtype", "bf16", "--float8", "tensorwise"]],  # emulated; float8 all-gather
    4: [[], ["--dp-replicate", "2", "--ac", "block", "--loss-impl", "chunked"],
        ["--tp", "2", "--loss-impl", "loss-parallel"],
        ["--tp", "2", "--loss-impl", "fused-linear", "--ac", "selective"],
        ["--ac", "selective", "--loss-impl", "chunked-backward", "--batch-size", "4"],
        ["--pp", "2", "--batch-size", "4", "--loss-impl", "chunked-backward"],
        ["--cp", "2", "--ac", "block", "--loss-impl", "fused-linear"],
        [*MOE, "--ep", "2", "--tp", "2"],
        [*MOE, "--ep", "4", "--ac", "block", "--loss-impl", "fused-linear"]],
}
ACTIVATION_HEAVY = ["--seq-len", "512", "--batch-size", "4", "--vocab-size", "2048"]
AT_ALLOCATOR: list[tuple[int, list[str]]] = [
    # What the tracker cannot follow, each a job of its own (`tests.plan_measure`).
    (2, ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--batch-size", "4"]),
    (2, ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--batch-size", "4", *DEEP]),
    (4, ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--batch-size", "8"]),
    (1, ["--loss-impl", "compiled"]),
    (1, ["--compile", *ACTIVATION_HEAVY]),
    (1, ["--compile", "--act-mem-budget", "0.5", *ACTIVATION_HEAVY]),
    (1, ["--compile", "--act-mem-budget", "0.2", "--loss-impl", "compiled", *ACTIVATION_HEAVY]),
    (2, ["--compile", "--act-mem-budget", "0.5", "--loss-impl", "compiled", *ACTIVATION_HEAVY]),
]


def measure(ranks: int, runs: list[list[str]], outdir: Path) -> list[str]:
    argv = [[*BASE, *flags, "--outdir", str(outdir / f"{ranks}-{i}")]
            for i, flags in enumerate(runs)]
    job = run_ranks(ranks, ["-m", "tests.plan_measure", json.dumps(argv)], timeout=900,
                    env={"LOOM_METRICS": "0"})
    if not job.ok:
        raise SystemExit(f"measurement on {ranks} ranks failed:\n{job.describe()}")
    return [r.stdout for r in job.ranks]


def main() -> None:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, runs in CONFIGS.items():
            stdouts = measure(ranks, runs, Path(tmp))
            rows += compare(ranks, [[*BASE, *flags] for flags in runs], stdouts)
        for i, (ranks, flags) in enumerate(AT_ALLOCATOR):
            stdouts = measure(ranks, [flags], Path(tmp) / f"alone-{i}")
            rows += compare(ranks, [[*BASE, *flags]], stdouts)
    print(f"{'ranks':>5}  {'flags':<58}{'predicted':>10}{'measured':>10}{'error':>8}")
    for row in rows:
        flags = " ".join(row.flags[len(BASE):]) or "(FSDP, eager loss)"
        print(f"{row.ranks:>5}  {flags:<58}{row.predicted_mib:>8.2f}Mi{row.measured_mib:>8.2f}Mi"
              f"{100 * row.error:>+7.1f}%")
    worst = max(abs(r.error) for r in rows)
    print(f"worst |error| {100 * worst:.1f}% over {len(rows)} configurations")
    RESULTS.write_text(json.dumps({"base_flags": BASE, "rows": [
        dict(ranks=r.ranks, flags=r.flags[len(BASE):], predicted_mib=r.predicted_mib,
             measured_mib=r.measured_mib, error=r.error) for r in rows],
        "worst_abs_error": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()
