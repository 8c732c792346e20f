"""AdamW vs Muon (--optimizer muon) on the embedded corpus: validation loss at equal tokens,
each optimizer at the best of a small learning-rate sweep, and the step time of both.

    python benchmarks/optimizers.py      # debug model, 60 steps x 512 tokens each, ~6 min CPU

Every run trains the same model from the same seed on the same batches (the embedded corpus,
5% held out for validation) for the same steps; the sweep takes each optimizer's best final
validation loss. Step time: the steady steps' mean (`train/dt`) of the one-process runs, and
of a dp 2 pair (2 gloo ranks, --dp-shard 2) at each optimizer's best rate, which shows the
cost of gathering whole matrices. Results: a table on stdout, JSON in
benchmarks/results/optimizers.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "optimizers.json"
MODEL = ["--model", "debug", "--seq-len", "128", "--batch-size", "4", "--val-fraction",
         "0.05", "--seed", "3", "--log-every", "1000"]
SWEEP = {"adamw": (3e-3, 1e-2), "muon": (3e-3, 1e-2)}


def train(outdir: Path, optimizer: str, lr: float, steps: int, nproc: int = 1) -> dict:
    """One run's final validation loss and steady step time (a fresh job)."""
    argv = ["train", *MODEL, "--optimizer", optimizer, "--lr", str(lr), "--max-steps",
            str(steps), "--outdir", str(outdir)]
    if nproc > 1:
        argv = ["launch", "-n", str(nproc), "--", sys.executable, "-m", "loom", *argv,
                "--dp-shard", str(nproc), "--batch-size", str(4 // nproc)]
    done = subprocess.run([sys.executable, "-m", "loom", *argv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {optimizer} lr {lr}: {done.stderr.strip().splitlines()[-1]}")
    metrics = json.loads((outdir / "summary.json").read_text())["metrics"]
    return {"optimizer": optimizer, "lr": lr, "ranks": nproc,
            "val_loss": metrics["val/loss"]["last"], "train_loss": metrics["train/loss"]["last"],
            "step_s": metrics["train/dt"]["steady_mean"],
            "tokens_per_s": metrics["train/tps"]["steady_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dp2-steps", type=int, default=20)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, rates in SWEEP.items():
            for lr in rates:
                runs.append(train(Path(tmp) / f"{optimizer}-{lr}", optimizer, lr, args.steps))
                print(runs[-1], file=sys.stderr, flush=True)
        best = {o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["val_loss"])
                for o in SWEEP}
        for o, r in best.items():
            runs.append(train(Path(tmp) / f"{o}-dp2", o, r["lr"], args.dp2_steps, nproc=2))
    print(f"{'optimizer':<9} {'lr':>7} {'ranks':>5} {'val loss':>9} {'train loss':>10} "
          f"{'step s':>7} {'tok/s':>7}")
    for r in runs:
        mark = " best" if r in best.values() else ""
        print(f"{r['optimizer']:<9} {r['lr']:>7g} {r['ranks']:>5} {r['val_loss']:>9.4f} "
              f"{r['train_loss']:>10.4f} {r['step_s']:>7.3f} {r['tokens_per_s']:>7.0f}{mark}")
    result = {"model": MODEL, "steps": args.steps, "tokens": args.steps * 512, "runs": runs,
              "best": {o: r["lr"] for o, r in best.items()}}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
