"""--cuda-graphs: a static single-device compiled step recorded once as CUDA graphs and
replayed, so the host launches one graph where it launched every kernel.

They are inductor's reduce-overhead mode (CUDA graph trees), asked for the whole-model
graph and the loss that `loom.parallel.single` and the executor compile. A graph replays
fixed shapes on one device's stream with no host work inside it, which rules out the
cases `cuda_graphs_refusal` names; each is refused before the model is built."""

from __future__ import annotations

from loom.config import JobConfig, ParallelConfig
from loom.parallel.mesh import ParallelDims
from loom.parallel.single import runs_plain


def cuda_graphs_refusal(cfg: JobConfig, dims: ParallelDims, device_type: str) -> str | None:
    """The one-line reason --cuda-graphs cannot apply to this run, or None."""
    p = cfg.parallel
    if not p.compile:
        return "--cuda-graphs needs --compile (the graphs are recorded from compiled code)"
    if device_type != "cuda":
        return f"--cuda-graphs needs a CUDA device; this run is on {device_type}"
    if dims.world_size > 1:
        return (f"--cuda-graphs runs single-device steps only; this run has {dims.world_size} "
                "processes (collectives and FSDP2's hooks sit between graphs)")
    if not runs_plain(dims, p):
        return ("--cuda-graphs needs the plain single-device path (drop --single-device "
                "fsdp2 / --data-parallel simple-fsdp: their hooks run between graphs)")
    if p.compile_backend != "inductor":
        return f"--cuda-graphs needs --compile-backend inductor (not {p.compile_backend})"
    if p.compile_mode not in ("default", "reduce-overhead"):
        return (f"--cuda-graphs with --compile-mode {p.compile_mode}: the graphs are "
                "reduce-overhead mode; drop one of them")
    if cfg.data.doc_mask:
        return ("--cuda-graphs with --doc-mask: the document mask is rebuilt from every "
                "batch's data, untested under graph replay; drop one of them")
    return None


def graphs_compile_mode(p: ParallelConfig) -> str:
    """The compile mode that records CUDA graphs under --cuda-graphs (once checked; a fact
    for the resolver), else the one asked for."""
    return "reduce-overhead" if p.cuda_graphs else p.compile_mode
