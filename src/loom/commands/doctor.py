"""`loom doctor [--json]`: what this machine offers loom, on one screen.

A bug report needs the facts that decide how a run behaves here: torch and its accelerator
toolkit, the devices and their memory, whether the hardware computes in bf16 (and so what
`--dtype auto` picks), the peak FLOP/s MFU is measured against, the collective backends,
the launcher `loom launch` would use, and the free disk where loom writes. Each fact comes
from the code that acts on it (precision, flops, runtime, launch), so the report cannot
disagree with what a run does. `--json` prints the same report as one JSON object, the only
thing on stdout; the peak measurement's warnings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import loom
from loom.data.cache import default_cache_dir
from loom.errors import LaunchError
from loom.numerics.precision import cpu_bf16_support, resolve_precision, torch_dtype
from loom.observability import flops
from loom.runtime.distributed import pick_device
from loom.runtime.launch import parse_args as parse_launch_args
from loom.runtime.launch_commands import BUILDERS, choose_launcher, detect_host
from loom.runtime.logs import logging_scope

GiB = 1024**3
LAUNCHERS = {"local": "torch elastic agent, in this process", "slurm": "srun (Slurm job)",
             "pbs": "mpiexec (PBS job)"}
BACKENDS = ("gloo", "nccl", "xccl", "mpi", "ucc")


def toolkits() -> dict[str, str | None]:
    """Versions of the accelerator toolkits this torch was built with (None: not built)."""
    return {"cuda": torch.version.cuda, "rocm": getattr(torch.version, "hip", None),
            "xpu": getattr(torch.version, "xpu", None)}


def host_memory_gib() -> float | None:
    """Total RAM, from /proc/meminfo (None where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / GiB, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def devices() -> list[dict[str, Any]]:
    """Every accelerator torch sees, with its memory; the CPU when there is none."""
    found = []
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is None or not module.is_available():
            continue
        for i in range(module.device_count()):
            props = module.get_device_properties(i)
            found.append({"device": f"{kind}:{i}", "name": props.name,
                          "memory_gib": round(props.total_memory / GiB, 2)})
    if not found:
        found.append({"device": "cpu", "name": flops.cpu_model_name(),
                      "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count(), "memory_gib": host_memory_gib()})
    return found


def precision(device: torch.device) -> dict[str, Any]:
    """What `--dtype auto` picks on the device a run would get, and why."""
    picked = resolve_precision("auto", device)
    native = picked.dtype == "bf16"
    if device.type == "cpu":
        native, _ = cpu_bf16_support()
    return {"native_bf16": native, "auto_dtype": picked.dtype, "reason": picked.reason}


def cached_peaks(cache: Path) -> dict[str, Any]:
    """The clean peak measurements cached so far (empty when none or unreadable)."""
    try:
        known = json.loads((cache / flops.PEAK_CACHE).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def peak(device: torch.device, dtype: str, cache: Path) -> dict[str, Any]:
    """The peak MFU divides by: datasheet, or the matmul benchmark (cached once clean)."""
    key = flops.peak_cache_key(device, torch_dtype(dtype))
    was_cached = key in cached_peaks(cache)
    found = flops.peak_flops(device, torch_dtype(dtype), cache)
    source = found.source
    if found.source == "measured":
        source = ("cached measurement" if was_cached else "measured now, cached"
                  if key in cached_peaks(cache) else "measured now on a busy machine, not cached")
    return {"dtype": dtype, "tflops": round(found.flops / 1e12, 4), "source": source,
            "threads": torch.get_num_threads()}


def backends() -> dict[str, bool]:
    """Collective backends this torch build offers (a backend's own checks; gloo is CPU)."""
    if not dist.is_available():
        return dict.fromkeys(BACKENDS, False)
    return {name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
            for name in BACKENDS}


def launcher(environ: Mapping[str, str]) -> dict[str, Any]:
    """Which launcher `loom launch loom train` would use here, and the command it would run
    (the same builders as `loom launch --dry-run`)."""
    name = choose_launcher(environ)
    report: dict[str, Any] = {"launcher": name, "means": LAUNCHERS[name]}
    try:
        command = BUILDERS[name](parse_launch_args(["loom", "train"]), environ, detect_host())
        report["command"] = str(command)
        report["on_path"] = shutil.which(command.argv[0]) is not None
    except LaunchError as err:
        report["error"] = str(err)
    return report


def free_disk(path: Path) -> dict[str, Any]:
    """Free space of the filesystem that holds `path` (its nearest existing parent)."""
    existing = path.expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return {"path": str(path), "free_gib": round(shutil.disk_usage(existing).free / GiB, 1)}


def collect(environ: Mapping[str, str], cache: Path, outdir: Path) -> dict[str, Any]:
    device = pick_device(0)
    chosen = precision(device)
    return {
        "loom": loom.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "toolkits": toolkits(), "devices": devices(), "run_device": str(device),
        "precision": chosen, "peak": peak(device, chosen["auto_dtype"], cache),
        "backends": backends(), "launch": launcher(environ),
        "disk": {"cache": free_disk(cache), "outputs": free_disk(outdir)},
    }


def render(report: dict[str, Any]) -> str:
    """The report as one screen of text."""
    kits = ", ".join(f"{k} {v}" for k, v in report["toolkits"].items() if v) or "CPU only"
    lines = [f"loom {report['loom']}, torch {report['torch']} ({kits}), "
             f"Python {report['python']}, {report['platform']}"]
    for d in report["devices"]:
        extra = f", {d['cores']} cores" if "cores" in d else ""
        lines.append(f"device    {d['device']}: {d['name']}{extra}, {d['memory_gib']} GiB")
    p, k = report["precision"], report["peak"]
    lines.append(f"bf16      native: {'yes' if p['native_bf16'] else 'no'}; --dtype auto "
                 f"picks {p['auto_dtype']} ({p['reason']})")
    lines.append(f"peak      {k['tflops']:.4g} TFLOP/s {k['dtype']} ({k['source']}, "
                 f"{k['threads']} threads) on {report['run_device']}")
    lines.append("backends  " + ", ".join(f"{name} {'yes' if ok else 'no'}"
                                          for name, ok in report["backends"].items()))
    launch = report["launch"]
    detail = launch.get("command", launch.get("error", ""))
    lines.append(f"launch    {launch['launcher']}: {launch['means']}\n          {detail}")
    for name, disk in report["disk"].items():
        lines.append(f"disk      {name} {disk['path']}: {disk['free_gib']} GiB free")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="loom doctor",
                                     description="What this machine offers loom; paste the "
                                     "output into bug reports.")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--outdir", default="outputs", help="output folder to check [outputs]")
    try:
        options = parser.parse_args(list(argv))
    except SystemExit as exit_:  # --help or a usage error, already printed
        return int(exit_.code or 0)
    cache = Path(os.environ.get("LOOM_CACHE_DIR") or default_cache_dir()).expanduser()
    with logging_scope(0, stream=sys.stderr):  # stdout holds the report alone
        report = collect(os.environ, cache, Path(options.outdir))
    print(json.dumps(report, indent=1) if options.json else render(report))
    return 0
