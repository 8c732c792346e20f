"""Training throughput of loom's layouts against a bare PyTorch loop and the GEMM bound.

    python benchmarks/throughput.py              # debug-sized model, CPU: the layout table
    python benchmarks/throughput.py --peer       # the peer config: loom vs an old commit
    python benchmarks/throughput.py --peer --old-src /tmp/loom-old/src   # (git worktree add)
    python benchmarks/throughput.py --fp32 --layouts "1 rank" --modes eager   # #42's fp32 row

Every configuration is a fresh `loom train` job (random tokens, metrics on); the bare loop
is one process training the same model with plain AdamW and cross-entropy (no FSDP, no
metrics): the floor of framework overhead. It computes in the precision loom's jobs resolve
to (`--dtype auto` on this CPU): fp32, or bf16 with fp32 master weights as FSDP's mixed
precision does; a row is compared only with bare loops of its own precision.
Configurations run interleaved, round after round (A B A B), so a machine whose load changes
hurts all of them alike; each figure is the best round's median post-warm-up step. Columns per row:

- tok/s/rank: tokens per step / step time / ranks; `vs bare`: that over the bare loop at
  the same threads per process (a rank's share of the cores).
- `vs GEMM`: the GEMM lower bound of the step (FLOPs per rank / the measured matmul peak)
  over the step time: MFU as a fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import run_ranks

from loom.runtime.host_memory import TRIM_THRESHOLD

RESULTS = Path(__file__).parent / "results"
DEBUG = ["--model", "debug", "--dataset", "random"]
PEER = ["--dim", "256", "--n-layers", "4", "--n-heads", "4", "--n-kv-heads", "4",
        "--hidden-dim", "768", "--vocab-size", "32000", "--seq-len", "256", "--batch-size", "2",
        "--dataset", "random"]
LAYOUTS = {"1 rank": (1, []), "2 ranks dp": (2, []), "2 ranks tp": (2, ["--tp", "2"]),
           "2 ranks hsdp": (2, ["--dp-replicate", "2", "--dp-shard", "1"])}
MODES = {"eager": [], "compiled": ["--compile"], "fused-linear": ["--loss-impl", "fused-linear"]}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def loom_job(name: str, nproc: int, flags: list[str], steps: int, warmup: int,
             src: str | None = None, env: dict[str, str] | None = None) -> dict:
    """One fresh `loom train` job; the median post-warm-up step of rank 0's rows."""
    env = {"OMP_NUM_THREADS": str(max(1, cores() // nproc)), **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        if src:  # another checkout's loom, ahead of this one on the path, with its own cache
            env.update(PYTHONPATH=src, LOOM_CACHE_DIR=str(Path(tmp) / "cache"))
        job = run_ranks(nproc, ["-m", "loom", "train", *flags, "--max-steps", str(steps),
                                "--seed", "0", "--outdir", "run"], timeout=1800, env=env,
                        cwd=Path(tmp))
        if not job.ok:
            raise RuntimeError(f"{name} failed: {job.describe()[-2000:]}")
        run = Path(tmp) / "run"
        rows = [json.loads(line) for line in (run / "metrics-0.jsonl").read_text().splitlines()]
        config = json.loads((run / "config.json").read_text())
    derived = config.get("derived", {})
    steady = rows[warmup:]
    dt = statistics.median(r["train/dt"] for r in steady)
    memory = max(r.get("train/mem_alloc_peak", r.get("train/mem_rss_peak", 0.0)) for r in rows)
    gemm_s = derived["flops_per_rank"] / derived["peak_flops"]
    return {"config": name, "ranks": nproc, "step_s": dt,
            "tokens_per_s": rows[0]["train/tokens"] / dt,
            "tokens_per_s_per_rank": rows[0]["train/tokens"] / dt / nproc,
            "mfu": 100 * gemm_s / dt, "vs_gemm": gemm_s / dt, "peak_mem_gib": memory,
            "threads": max(1, cores() // nproc), "dtype": run_dtype(config),
            "flops_per_rank": derived["flops_per_rank"],
            "peak_flops": derived["peak_flops"]}


def run_dtype(config: dict) -> str:
    """A run's compute precision from its config.json (older trees: `parallel.fp32`)."""
    if "precision" in config:
        return config["precision"]["dtype"]
    return "fp32" if config["parallel"]["fp32"] else "bf16"


RETAIN_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
"""glibc's settings of `--host-memory retain`, for a bare loop (set before it starts)."""


def cpu() -> str:
    """The CPU the figures were measured on: its name and bf16 evidence."""
    from loom.numerics.precision import cpu_bf16_support
    from loom.observability.flops import cpu_model_name

    return f"{cpu_model_name()}, {cpu_bf16_support()[1]}"


def auto_dtype() -> str:
    """What `--dtype auto` resolves to on this machine's CPU."""
    import torch

    from loom.numerics.precision import resolve_precision

    return resolve_precision("auto", torch.device("cpu")).dtype


def bare_job(flags: list[str], steps: int, warmup: int, threads: int, copies: int = 1,
             retain: bool = False, dtype: str = "fp32") -> dict:
    """The bare loop in fresh processes (this file with --bare); `copies` > 1 runs that many
    at once, as the ranks of a job share the machine's cores, caches and memory bandwidth,
    and reports one copy's mean figures. `retain`: with loom's host-memory settings."""
    env = {"OMP_NUM_THREADS": str(threads), **(RETAIN_ENV if retain else {})}
    with tempfile.TemporaryDirectory() as tmp:
        job = run_ranks(copies, [__file__, "--bare", "--steps", str(steps), "--warmup",
                                 str(warmup), "--dtype", dtype, "--flags", json.dumps(flags)],
                        timeout=1800, env=env, cwd=Path(tmp))
    if not job.ok:
        raise RuntimeError(f"bare loop failed: {job.describe()[-2000:]}")
    results = [json.loads(r.stdout.strip().splitlines()[-1]) for r in job.ranks]
    step_s = statistics.mean(r["step_s"] for r in results)
    tokens = results[0]["tokens_per_s"] * results[0]["step_s"]
    return {"ranks": 1, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_rank": tokens / step_s, "threads": threads, "copies": copies,
            "retain": retain, "dtype": dtype}


def bare_loop(flags: list[str], steps: int, warmup: int, dtype: str) -> dict:
    """Plain PyTorch: the same model and optimizer settings, eager cross-entropy. In bf16, the
    scheme loom's FSDP uses, written out: fp32 master weights, copied into a bf16 copy of the
    model each step; its gradients cast back to fp32 for clipping and AdamW."""
    import copy

    import torch
    import torch.nn.functional as F

    import loom.families  # noqa: F401  (registers loom's model families)
    from loom.config import parse_args
    from loom.models.llama.model import Transformer
    from loom.models.resolve import model_args
    from loom.parallel.init import init_weights

    cfg = parse_args([*flags, "--fp32"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(model_args(cfg))
    init_weights(model, 0, torch.device("cpu"))
    master = list(model.parameters())
    work_model = model
    if dtype == "bf16":
        work_model = copy.deepcopy(model)
        for param in work_model.parameters():
            param.data = param.data.bfloat16()
    work = list(work_model.parameters())
    opt = torch.optim.AdamW(master, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batch, seq, vocab = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size
    times = []
    for _ in range(steps):
        tokens = torch.randint(vocab, (batch, seq + 1))
        start = time.perf_counter()
        if work is not master:
            with torch.no_grad():
                torch._foreach_copy_(work, master)
        logits = work_model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        if work is not master:
            for m, w in zip(master, work, strict=True):
                m.grad, w.grad = w.grad.float(), None
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    dt = statistics.median(times[warmup:])
    return {"ranks": 1, "step_s": dt, "tokens_per_s": batch * seq / dt,
            "tokens_per_s_per_rank": batch * seq / dt}


def interleaved(jobs: dict[str, callable], rounds: int) -> dict[str, dict]:
    """Run every job once per round, A B A B; keep each one's best round (the least
    disturbed by other load) and every round's tokens/s."""
    runs: dict[str, list[dict]] = {name: [] for name in jobs}
    for r in range(rounds):
        for name, job in jobs.items():
            runs[name].append(job())
            print(f"  round {r + 1}: {name}: {runs[name][-1]['tokens_per_s']:,.0f} tok/s",
                  file=sys.stderr, flush=True)
    return {name: {**min(rs, key=lambda x: x["step_s"]),
                   "rounds_tokens_per_s": [x["tokens_per_s"] for x in rs]}
            for name, rs in runs.items()}


RATIOS = {"vs_bare": (False, False), "vs_bare_at_once": (True, False),
          "vs_bare_at_once_retained": (True, True)}
"""Ratio column: (as many bare loops at once as the row has ranks, with retained memory)."""


def with_ratios(results: dict[str, dict]) -> list[dict]:
    """Each row's tokens/s per rank over the one-process bare loop at its threads per process
    (`vs_bare`) and, where measured, over as many bare loops at once as it has ranks, with
    glibc's defaults and with loom's retained host memory."""
    bare = {(r["threads"], r.get("copies", 1), r.get("retain", False), r["dtype"]): r
            for n, r in results.items() if n.startswith("bare")}
    out = []
    for name, r in results.items():
        ratios = {}
        for key, (at_once, retain) in RATIOS.items():
            base = bare.get((r["threads"], r["ranks"] if at_once else 1, retain, r["dtype"]))
            if base and not name.startswith("bare"):
                ratios[key] = r["tokens_per_s_per_rank"] / base["tokens_per_s_per_rank"]
        out.append({**r, "config": name, **{key: ratios.get(key) for key in RATIOS}})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| configuration | ranks | step s | tok/s | tok/s/rank | vs bare | vs bare at once "
             "| vs bare at once, retained | MFU % | vs GEMM | peak mem GiB |",
             "| --- |" + " ---: |" * 10]
    for r in rows:
        opt = {k: (f"{r[k]:{f}}" if r.get(k) is not None else "-")
               for k, f in (("vs_bare", ".2f"), ("vs_bare_at_once", ".2f"),
                            ("vs_bare_at_once_retained", ".2f"), ("mfu", ".1f"),
                            ("vs_gemm", ".3f"), ("peak_mem_gib", ".2f"))}
        lines.append(f"| {r['config']} | {r['ranks']} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_rank']:,.0f} | "
                     f"{opt['vs_bare']} | {opt['vs_bare_at_once']} | "
                     f"{opt['vs_bare_at_once_retained']} | {opt['mfu']} | "
                     f"{opt['vs_gemm']} | {opt['peak_mem_gib']} |")
    return "\n".join(lines)


def layout_jobs(args: argparse.Namespace) -> dict[str, callable]:
    base = [*(args.model_flags or DEBUG), *(["--fp32"] if args.fp32 else [])]
    layouts = {name: LAYOUTS[name] for name in args.layouts}
    jobs = {}
    for layout, (nproc, flags) in layouts.items():
        for mode in args.modes:
            name = f"{layout}, {mode}"
            jobs[name] = (lambda n=name, p=nproc, f=[*base, *flags, *MODES[mode]]:
                          loom_job(n, p, f, args.steps, args.warmup))
    dtype = "fp32" if args.fp32 else auto_dtype()
    return {**jobs, **bare_jobs(base, {n for n, _ in layouts.values()}, args, dtype)}


def bare_jobs(flags: list[str], nprocs: set[int], args: argparse.Namespace, dtype: str
              ) -> dict[str, callable]:
    """The bare loop in `dtype` at each job size's threads per process: one process alone,
    and as many at once as the job has ranks, with glibc's defaults and with retained host
    memory."""
    jobs = {}
    for n in sorted(nprocs):
        threads = max(1, cores() // n)
        for copies, retain in sorted({(1, False), (n, False), (n, True)}):
            name = (f"bare loop, {dtype}, {threads} thread(s)"
                    + (f", {copies} at once" if copies > 1 else "")
                    + (", host memory retained" if retain else ""))
            jobs[name] = (lambda t=threads, c=copies, k=retain:
                          bare_job(flags, args.steps, args.warmup, t, c, k, dtype))
    return jobs


def peer_jobs(args: argparse.Namespace) -> dict[str, callable]:
    """The acceptance figure, fp32 for both: 2 ranks of this tree vs an old checkout, and this
    tree with gloo's own all-gather and reduce-scatter, or with glibc's default malloc. On a
    CPU where `--dtype auto` picks bf16, both trees' defaults (bf16) as well."""
    fp32 = [*PEER, "--dtype", "fp32"]
    jobs = {"loom (this tree, fp32), 2 ranks": lambda: loom_job("new", 2, fp32, args.steps,
                                                                args.warmup),
            "loom (this tree, fp32, gloo's collectives), 2 ranks": lambda: loom_job(
                "native", 2, fp32, args.steps, args.warmup,
                env={"LOOM_GLOO_COLLECTIVES": "native"}),
            "loom (this tree, fp32, --host-memory release), 2 ranks": lambda: loom_job(
                "release", 2, [*fp32, "--host-memory", "release"], args.steps, args.warmup)}
    if args.old_src:
        jobs["loom (old, --fp32), 2 ranks"] = lambda: loom_job(
            "old", 2, [*PEER, "--fp32"], args.steps, args.warmup, src=args.old_src)
    jobs.update(bare_jobs(PEER, {2}, args, "fp32"))
    if auto_dtype() == "bf16":
        jobs["loom (this tree, bf16 = auto), 2 ranks"] = lambda: loom_job(
            "new-bf16", 2, PEER, args.steps, args.warmup)
        if args.old_src:
            jobs["loom (old, bf16 = default), 2 ranks"] = lambda: loom_job(
                "old-bf16", 2, PEER, args.steps, args.warmup, src=args.old_src)
        jobs.update(bare_jobs(PEER, {2}, args, "bf16"))
    return jobs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="the peer config, 2 ranks")
    parser.add_argument("--old-src", help="src/ of another checkout to compare (--peer)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--fp32", action="store_true",
                        help="loom and the bare loop in fp32 (default: what --dtype auto picks)")
    parser.add_argument("--model-flags", type=json.loads, default=None,
                        help="JSON list of loom train flags for the model (default: debug)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--flags", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.bare:
        print(json.dumps(bare_loop(args.flags, args.steps, args.warmup, args.dtype)))
        return
    start = time.perf_counter()
    jobs = peer_jobs(args) if args.peer else layout_jobs(args)
    rows = with_ratios(interleaved(jobs, args.rounds))
    print(table(rows))
    load = os.getloadavg()[0]
    print(f"\n{time.perf_counter() - start:.0f} s; {cpu()}; {cores()} cores, load average "
          f"{load:.1f} at the end; best of {args.rounds} interleaved rounds, median of steps "
          f"{args.warmup + 1}..{args.steps} of each run")
    out = RESULTS / ("throughput_peer.json" if args.peer else
                     "throughput-fp32.json" if args.fp32 else "throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "cpu": cpu(), "cores": cores(),
                               "load_average_end": load,
                               "rounds": args.rounds, "steps": args.steps,
                               "warmup": args.warmup}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
