"""Host operators per training step: loom's real step against a plain PyTorch loop.

    python benchmarks/host_ops.py                       # preset s shape, seq 64, batch 1, fp32
    python benchmarks/host_ops.py --cases loom-eager plain-eager --steps 2

A step that is host-bound costs what the host dispatches, so the measure is the number of
top-level aten operators the torch profiler records per step (an operator called by another
is not counted again; a compiled region, forward or backward, counts once). Nothing is
timed: the count does not depend on a shared machine's load.

Cases, each a fresh process (dp 2: two gloo ranks, rank 0 reports):

- loom eager / loom --compile: `Trainer.fit()` at one process, every step's work included
  (the executor, clipping, the optimizer, the metrics' per-step bookkeeping); the loader's
  own operators are not counted, as the plain loop draws none.
- plain eager / plain compiled: loom's own `Transformer` (the same config), a cross-entropy
  over its logits, fused AdamW and a foreach clip; compiled: torch.compile on model + loss.
- loom dp2 --compile: two ranks under FSDP2 over gloo, the same model; also with
  `--reshard-after-forward never` (zero2), and under SimpleFSDP (simple-fsdp).

Ratios are against the plain loop in the same mode (dp2 against the plain compiled one),
all measured in the same run. Operators are counted over every thread (the targets'
measure) and on the training thread alone: on the CPU gloo runs a collective's copies as
operators on threads of its own, where on a GPU NCCL runs them as kernels the host never
dispatches (SimpleFSDP's collectives are inside its graph, so they show there only). The
vocabulary is 2048 by default (`--model-flags`): the operator count does not depend on it,
the run time does. Writes benchmarks/results/host_ops.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import free_port, rank_env

RESULTS = Path(__file__).parent / "results" / "host_ops.json"
MODEL = "--model s --seq-len 64 --batch-size 1 --fp32 --vocab-size 2048"
CASES = {  # name: (kind, extra loom flags, ranks, the plain case it is compared with)
    "plain-eager": ("plain", [], 1, None),
    "plain-compiled": ("plain", ["--compile"], 1, None),
    "loom-eager": ("loom", [], 1, "plain-eager"),
    "loom-compile": ("loom", ["--compile"], 1, "plain-compiled"),
    "loom-dp2-compile": ("loom", ["--compile"], 2, "plain-compiled"),
    "loom-dp2-compile-zero2": ("loom", ["--compile", "--reshard-after-forward", "never"], 2,
                               "plain-compiled"),
    "loom-dp2-compile-simple-fsdp": ("loom", ["--compile", "--data-parallel", "simple-fsdp"],
                                     2, "plain-compiled"),
}
TARGETS = {"loom-eager": 1.0, "loom-compile": 1.0, "loom-dp2-compile": 2.0}
"""The issue's acceptance ratios (issue #42)."""
STEP_MARK, LOADER_MARK = "host_ops.step", "host_ops.loader"


def compiled_region(event: FunctionEvent) -> bool:
    """A compiled forward (dynamo's region) or backward (AOT's autograd node) call."""
    return event.name.startswith("Torch-Compiled Region") or event.name in (
        "CompiledFunction", "CompiledFunctionBackward")


def counted(event: FunctionEvent) -> bool:
    return event.name.startswith("aten::") or compiled_region(event)


def top_level(event: FunctionEvent) -> bool:
    """Counted, with no counted operator above it and not under the loader's mark."""
    parent = event.cpu_parent
    while parent is not None:
        if counted(parent) or parent.name == LOADER_MARK:
            return False
        parent = parent.cpu_parent
    return True


def ops_per_step(events: Iterable[FunctionEvent], training_thread: bool = False) -> list[int]:
    """Top-level operators between consecutive step marks (the last step's mark to the end
    of the record closes the last window), by start time, over every thread, or only the
    thread that runs the step (the one that records its marks)."""
    events = list(events)
    marks = sorted(e.time_range.start for e in events if e.name == STEP_MARK)
    threads = {e.thread for e in events if e.name == STEP_MARK}
    counts = [0] * len(marks)
    for e in events:
        if not counted(e) or not top_level(e) or (training_thread and e.thread not in threads):
            continue
        k = sum(1 for m in marks if m <= e.time_range.start) - 1
        if k >= 0:
            counts[k] += 1
    return counts


def breakdown(events: Iterable[FunctionEvent], steps: int,
              top: int = 60) -> list[tuple[str, float]]:
    """The most dispatched top-level operators, per recorded step (`--breakdown`), each
    named with the innermost labelled region it ran in (FSDP's hooks, the optimizer)."""
    events = list(events)
    first = min((e.time_range.start for e in events if e.name == STEP_MARK), default=0)
    names: dict[str, int] = {}
    for e in events:
        if counted(e) and top_level(e) and e.time_range.start >= first:
            label = e.cpu_parent
            while label is not None and label.name.startswith(("aten::", "autograd::")):
                label = label.cpu_parent
            region = re.sub(r" \(.*\)$", "", label.name) if label is not None else ""
            name = f"{region} > {e.name}" if region else e.name  # units' ops summed
            names[name] = names.get(name, 0) + 1
    ranked = sorted(names.items(), key=lambda kv: -kv[1])[:top]
    return [(name, n / steps) for name, n in ranked]


def mark_step() -> None:
    with record_function(STEP_MARK):
        pass


def plain_loop(flags: list[str], steps: int, warmup: int) -> profile:
    """The reference: loom's Transformer, cross-entropy, foreach clip, fused AdamW."""
    import loom.families  # noqa: F401  (registers loom's model families)
    from loom.config import parse_args
    from loom.models.resolve import plain_model
    from loom.trainer.resolve import resolve_model

    cfg = resolve_model(parse_args([*flags, "--dataset", "random"]))
    torch.manual_seed(0)
    model = plain_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    inputs = torch.randint(0, cfg.model.vocab_size, shape)
    labels = torch.randint(0, cfg.model.vocab_size, shape)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    loss_fn = torch.compile(loss_of) if cfg.parallel.compile else loss_of

    def step() -> None:
        loss_fn(inputs, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            mark_step()
            step()
    return prof


def marked_loader(batches: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """The loop's batches (`loom.trainer.reading.steps_until`), each drawn under the loader
    mark (not counted)."""
    def drawn(*args: Any) -> Iterator[Any]:
        steps = batches(*args)
        while True:
            with record_function(LOADER_MARK):
                item = next(steps, None)
            if item is None:
                return
            yield item
    return drawn


def loom_run(flags: list[str], steps: int, warmup: int) -> profile | None:
    """loom's `fit()` over warmup + steps + 1 steps, the middle `steps` recorded; the last
    (a logging step: the end) is left out. Rank 0 returns the record."""
    import loom.families  # noqa: F401  (registers loom's model families)
    import loom.trainer.trainer as loop
    from loom.config import parse_args
    from loom.trainer.resolve import resolve_model
    from rank_trainer import rank_trainer

    total = warmup + steps + 1
    with tempfile.TemporaryDirectory() as outdir:
        cfg = resolve_model(parse_args([*flags, "--dataset", "random", "--seed", "0",
                                        "--max-steps", str(total), "--log-every",
                                        str(10 * total), "--outdir", outdir]))
        with rank_trainer(cfg) as trainer:
            loop.steps_until = marked_loader(loop.steps_until)  # this case's own process
            step, prof = trainer.train_step, profile(activities=[ProfilerActivity.CPU])

            def recorded_step(micro: Any) -> Any:
                done = trainer.loop.step
                if done == warmup:
                    prof.start()
                elif done == warmup + steps:
                    prof.stop()
                if warmup <= done < warmup + steps:
                    mark_step()
                return step(micro)

            trainer.train_step = recorded_step  # type: ignore[method-assign]
            trainer.fit()
    return prof if trainer.info.rank == 0 else None


def worker(case: str, model_flags: list[str], steps: int, warmup: int) -> None:
    kind, extra, _, _ = CASES[case]
    torch.set_num_threads(1)
    run = plain_loop if kind == "plain" else loom_run
    prof = run([*model_flags, *extra], steps, warmup)
    if prof is not None:
        print("RESULT " + json.dumps(ops_per_step(prof.events())))
        print("TRAINING " + json.dumps(ops_per_step(prof.events(), training_thread=True)))
        print("BREAKDOWN " + json.dumps(breakdown(prof.events(), steps)))


def run_case(case: str, model_flags: str, steps: int,
             warmup: int) -> tuple[list[int], list[int], list[list[Any]]]:
    """One case in fresh processes; rank 0's per-step counts (every thread, the training
    thread) and its busiest operators."""
    ranks, port = CASES[case][2], free_port()
    cmd = [sys.executable, __file__, "--worker", case, "--model-flags", model_flags,
           "--steps", str(steps), "--warmup", str(warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, env={**env, **rank_env(r, ranks, port, None)} if ranks > 1
                              else env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(ranks)]
    outputs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{case} failed:\n{outputs[0][1][-3000:]}")
    lines = outputs[0][0].splitlines()
    tags = ("RESULT", "TRAINING", "BREAKDOWN")
    found = {tag: json.loads(x[len(tag) + 1:]) for x in lines for tag in tags
             if x.startswith(tag + " ")}
    return found["RESULT"], found["TRAINING"], found["BREAKDOWN"]


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| case | host ops / step | vs plain | target | training thread | vs plain "
             "| plain case |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in results.items():
        ratio, own = (f"{r[key]:.2f}x" if r.get(key) is not None else ""
                      for key in ("ratio", "training_ratio"))
        target = f"<= {TARGETS[name]:.1f}x" if name in TARGETS else ""
        lines.append(f"| {name} | {r['median']:,} | {ratio} | {target} | "
                     f"{r['training_median']:,} | {own} | {r['baseline'] or ''} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--model-flags", default=MODEL, help="loom train flags of the model")
    parser.add_argument("--steps", type=int, default=3, help="recorded steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="steps before recording")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--breakdown", action="store_true",
                        help="print each case's most dispatched operators per step")
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, shlex.split(args.model_flags), args.steps, args.warmup)
        return
    cases = [c for c in CASES if c in args.cases or c in {CASES[n][3] for n in args.cases}]
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        counts, own, busiest = run_case(case, args.model_flags, args.steps, args.warmup)
        baseline = CASES[case][3]
        median, own_median = int(statistics.median(counts)), int(statistics.median(own))
        ratio, own_ratio = ((median / results[baseline]["median"],
                             own_median / results[baseline]["training_median"]) if baseline
                            else (None, None))
        results[case] = {"per_step": counts, "median": median, "baseline": baseline,
                         "ratio": ratio, "target": TARGETS.get(case),
                         "training_per_step": own, "training_median": own_median,
                         "training_ratio": own_ratio,
                         "flags": [*shlex.split(args.model_flags), *CASES[case][1]],
                         "ranks": CASES[case][2]}
        print(f"{case}: {counts} (training thread: {own})", flush=True)
        if args.breakdown:
            print("\n".join(f"  {n:8.1f}  {name}" for name, n in busiest), flush=True)
    print(table(results))
    print(f"\n{args.model_flags}; {args.steps} recorded steps after {args.warmup}; "
          "top-level aten operators, a compiled region counted once; every thread, then the "
          "training thread alone")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model_flags": args.model_flags, "steps": args.steps,
                                    "warmup": args.warmup, "torch": torch.__version__,
                                    "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
