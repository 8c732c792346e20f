"""DiLoCo against synchronous replica groups: bytes sent across the groups and the loss.

    python benchmarks/diloco.py [--steps 200] [--sync-every 10]   # a few minutes on 2 cores

Two runs of `loom launch --ft-replica-groups 2 -n 4` (2 groups x --dp-shard 2, gloo, the
embedded corpus, the same seed and global batch): `--ft average` (every step's gradients
averaged over the groups: HSDP's step, equal to `--dp-replicate 2` within 1e-5 in
tests/parity/test_ft_replica_groups.py) and `--ft diloco --sync-every H`. Bytes are
measured, not computed: each rank counts what it hands to torchft's allreduce across the
groups (summary.json's `ft.bytes_sent`, rank 0's). The loss is each run's group 0 training
loss, the mean of the last 20 logged steps beside the whole curve. Writes
benchmarks/results/diloco.json and diloco.svg (the two loss curves).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))
from loom.observability.flops import cpu_model_name  # noqa: E402

TRAIN = ["--model", "debug", "--n-layers", "2", "--seq-len", "128", "--batch-size", "4",
         "--fp32", "--seed", "3", "--log-every", "1", "--dp-shard", "2",
         "--ft-replica-groups", "2"]


def run(name: str, steps: int, flags: list[str], tmp: Path) -> dict:
    """One run's group-0 summary and loss curve."""
    outdir = tmp / name
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn",
           "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "loom", "launch", "--ft-replica-groups", "2", "-n", "4",
            "--", sys.executable, "-m", "loom", "train", *TRAIN, "--max-steps", str(steps),
            *flags, "--outdir", str(outdir)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    group = outdir / "group-0"
    summary = json.loads((group / "summary.json").read_text())
    rows = [json.loads(line) for line in (group / "metrics-0.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    return {"flags": flags, "steps": summary["ft"]["steps_trained"],
            "bytes_sent": summary["ft"]["bytes_sent"],
            "bytes_per_step": summary["ft"]["bytes_sent"] / steps,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]), "loss": losses}


def svg(runs: dict[str, dict], path: Path) -> None:
    """The loss curves as a small SVG (no plotting dependency)."""
    width, height, pad = 640, 360, 40
    every = [v for r in runs.values() for v in r["loss"]]
    low, high = min(every), max(every)
    steps = max(len(r["loss"]) for r in runs.values())
    colours = ["#1f77b4", "#d62728"]
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="13">training loss (group 0) by step; '
             f'{low:.2f} to {high:.2f}</text>']
    for i, (name, r) in enumerate(runs.items()):
        points = " ".join(
            f"{pad + (width - 2 * pad) * s / max(1, steps - 1):.1f},"
            f"{height - pad - (height - 2 * pad) * (v - low) / max(1e-9, high - low):.1f}"
            for s, v in enumerate(r["loss"]))
        lines += [f'<polyline fill="none" stroke="{colours[i % 2]}" points="{points}"/>',
                  f'<text x="{width - 200}" y="{40 + 16 * i}" font-size="12" '
                  f'fill="{colours[i % 2]}">{name}</text>']
    path.write_text("\n".join([*lines, "</svg>", ""]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"average": run("average", args.steps, ["--ft", "average"], Path(tmp)),
                f"diloco H={args.sync_every}": run(
                    "diloco", args.steps, ["--ft", "diloco", "--sync-every",
                                           str(args.sync_every)], Path(tmp))}
    base = runs["average"]["bytes_per_step"]
    print("| run | steps | bytes sent per step (rank 0) | vs average | loss, last 20 steps |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in runs.items():
        print(f"| {name} | {r['steps']} | {r['bytes_per_step']:,.0f} | "
              f"{r['bytes_per_step'] / base:.3f} | {r['final_loss']:.4f} |")
    RESULTS.mkdir(exist_ok=True)
    record = {"cpu": cpu_model_name(), "runs": runs,
              "command": " ".join(["python benchmarks/diloco.py", *sys.argv[1:]])}
    (RESULTS / "diloco.json").write_text(json.dumps(record, indent=1) + "\n")
    svg(runs, RESULTS / "diloco.svg")


if __name__ == "__main__":
    main()
