"""One `loom train` of a row, read back from its run folder.

Only the first and the last step log (--log-every past the run): the steps between do what
a long run's non-logging steps do (no host read, no health norms), and their times are
the ones measured. On CUDA loom times a step with device events from its first mark to its
last, read later; elsewhere by the host clock. The row's time is the median of steps
warmup+1 .. steps-1 (the last is a logging step), and of those only the ones before a
profiled row's profiler starts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from devcheck import proc
from devcheck.catalogue import Row

LOG_EVERY = 100_000


def train_argv(row: Row, ac: str, outdir: Path) -> list[str]:
    profile = ["--profile", "--profile-wait", str(row.profile_wait), "--profile-warmup", "1",
               "--profile-active", "3", "--profile-rank0-only"] if row.profile_wait else []
    return ["-m", "loom", "train", *row.flags, *profile, "--ac", ac, "--dtype", "bf16",
            "--dataset", "random", "--seed", "0", "--max-steps", str(row.steps),
            "--log-every", str(LOG_EVERY), "--outdir", str(outdir)]


def timed_steps(row: Row) -> range:
    """After the warm-up, before the last (logging) step and before the profiler starts."""
    end = min(row.steps, row.profile_wait + 1) if row.profile_wait else row.steps
    return range(row.warmup + 1, end)


def read_run(folder: Path, row: Row) -> dict:
    """The figures of a finished run: step time (median of the timed steps), tokens/s,
    FLOPs, loom's own peak (the datasheet's on a GPU), memory peaks."""
    lines = (folder / "metrics-0.jsonl").read_text().splitlines()
    rows = {r["train/iter"]: r for r in map(json.loads, lines)}
    config = json.loads((folder / "config.json").read_text())
    derived = config["derived"]
    timed = [rows[i]["train/dt"] for i in timed_steps(row) if i in rows]
    if not timed:
        raise ValueError(f"no timed steps among {sorted(rows)}")

    def peak(key: str) -> float | None:
        values = [r[key] for r in rows.values() if r.get(key) is not None]
        return max(values) if values else None

    step_s = statistics.median(timed)
    timings = json.loads((folder / "summary.json").read_text()).get("timings", {})
    return {"setup_s": timings.get("setup_s"), "train_s": timings.get("train_s"),
            "ac": config["parallel"]["activation_checkpoint"],
            "dtype": config["precision"]["dtype"], "device": config["device"],
            "batch": config["train"]["batch_size"], "seq_len": config["data"]["seq_len"],
            "loss_impl": config["loss"]["loss_impl"], "parameters": derived["parameters"],
            "flops_per_step": derived["flops_per_rank"], "flops_exact": derived["flops_exact"],
            "loom_peak_flops": derived["peak_flops"], "loom_peak_source": derived["peak_source"],
            "step_s": step_s, "timed_steps": len(timed), "step_s_min": min(timed),
            "step_s_max": max(timed), "first_step_s": rows[1]["train/dt"] if 1 in rows else None,
            "tokens_per_s": derived["tokens_per_step"] / step_s,
            "alloc_peak_gib": peak("train/mem_alloc_peak") or peak("train/mem_rss_peak"),
            "reserved_peak_gib": peak("train/mem_reserved_peak"),
            "loss_first": rows[min(rows)]["train/loss"], "loss_last": rows[max(rows)]["train/loss"],
            "model": {k: config["model"][k] for k in (
                "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim",
                "multiple_of", "ffn_dim_multiplier", "norm_eps", "rope_theta", "n_experts")}}


def run_loom(row: Row, ac: str, work: Path, timeout_s: float, env: dict[str, str]
             ) -> tuple[dict, proc.Child]:
    folder = work / row.name
    child = proc.run(train_argv(row, ac, folder), timeout_s, work / "logs" / row.name, env)
    if not child.ok:  # the run's last words say where a timed-out one was (compile, steps)
        return {"status": f"failed: {child.why()}", "stderr_tail": child.stderr_tail[-4:]}, child
    try:
        return {"status": "ok", **read_run(folder, row)}, child
    except (OSError, ValueError, KeyError) as e:
        return {"status": f"failed: unreadable run folder: {type(e).__name__}: {e}"}, child
