"""Peak memory of a DeepSeek-V3 training step with and without multi-token prediction, per
--loss-impl, at a large vocabulary.

    python benchmarks/mtp_memory.py     # deepseek-v3-mtp-debug, vocab 128,000; ~2 min

MTP's depths return their hidden states to the criterion, which scores them with the main
loss's mode (`loom.losses.Criterion`), so under fused-linear no (tokens x vocab) logits
exist for any depth: the MTP run should cost about its extra hidden states and its module,
not (1 + D) times the logits. Each (mode, depths) runs in a fresh subprocess: the forward
and backward of one micro-batch through the run's own criterion (`Criterion.model_sums`,
what the accumulation loop runs), fp32 on the CPU.

Peak memory is torch's own accounting, as in benchmarks/losses.py: every allocation and free
the profiler records in time order; the peak is the most bytes live at once above what
existed before the step (the parameters, the batch). Gradients of the parameters are part of
it (the output weight's is vocab x dim).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loom.config import parse_args
from loom.losses import IGNORE_INDEX, build_criterion
from loom.models.resolve import plain_model
from loom.parallel.init import init_weights
from loom.trainer.executor import depths_of
from memtrack import peak_live_bytes

MODES = ("fused-linear", "chunked")
RESULTS = Path(__file__).parent / "results" / "mtp_memory.json"


def measure(mode: str, mtp_layers: int, vocab: int, batch: int, seq: int, chunk: int) -> dict:
    """Run in the subprocess: the peak of one forward and backward."""
    torch.set_num_threads(1)
    cfg = parse_args(["--model", "deepseek-v3-mtp-debug", "--dataset", "random", "--fp32",
                      "--vocab-size", str(vocab), "--seq-len", str(seq), "--batch-size",
                      str(batch), "--loss-impl", mode, "--loss-chunk-size", str(chunk),
                      "--mtp-layers", str(mtp_layers)])
    with torch.device("meta"):
        model = plain_model(cfg)
    init_weights(model, 0, torch.device("cpu"))
    model.train()
    criterion = build_criterion(cfg.loss, model.output, in_forward=True,
                                depths=depths_of(model))
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(vocab, (batch, seq), generator=gen)
    labels = torch.randint(vocab, (batch, seq), generator=gen)
    labels[:, ::16] = IGNORE_INDEX
    targets = criterion.targets(labels, True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sums = criterion.model_sums(model, inputs, targets)
        criterion.objective(sums).div((labels != IGNORE_INDEX).sum()).backward()
    return {"mode": mode, "mtp_layers": mtp_layers, "vocab": vocab, "batch": batch,
            "seq_len": seq, "chunk_size": chunk, "peak_bytes": peak_live_bytes(prof),
            "mtp_loss": float(sums[2])}


def run_fresh(args: argparse.Namespace, mode: str, mtp_layers: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--mtp", str(mtp_layers),
           "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq),
           "--chunk-size", str(args.chunk_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| --loss-impl | MTP depths | peak MiB | peak / without MTP |",
             "| --- | ---: | ---: | ---: |"]
    plain = {r["mode"]: r for r in results if r["mtp_layers"] == 0}
    for r in results:
        base = plain[r["mode"]]["peak_bytes"]
        lines.append(f"| {r['mode']} | {r['mtp_layers']} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['peak_bytes'] / base:.3f} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--mtp", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.mtp, args.vocab, args.batch, args.seq,
                                 args.chunk_size)))
        return
    results = [run_fresh(args, mode, depths) for mode in args.modes for depths in (0, 1)]
    args.out.write_text(json.dumps({"command": "python benchmarks/mtp_memory.py",
                                    "results": results}, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
