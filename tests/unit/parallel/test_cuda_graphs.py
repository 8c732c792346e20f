"""--cuda-graphs: refused in one line wherever CUDA graphs cannot apply, and otherwise
compile's reduce-overhead mode, whose steps each mark their begin. The replay itself needs a
CUDA device (none in CI)."""

from __future__ import annotations

import sys

import pytest
import torch

from loom.config import parse_args
from loom.config.resolved import settled
from loom.parallel.cuda_graphs import cuda_graphs_refusal, graphs_compile_mode
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo
from loom.trainer.parity import layout_training
from tests.harness import run_process

BASE = ["--model", "debug", "--dataset", "random", "--cuda-graphs"]


def refusal(flags: list[str], world_size: int = 1, device: str = "cuda") -> str | None:
    cfg = parse_args([*BASE, *flags])
    return cuda_graphs_refusal(cfg, ParallelDims.from_config(cfg.parallel, world_size), device)


@pytest.mark.parametrize(("flags", "world_size", "device", "says"), [
    ([], 1, "cuda", "needs --compile"),
    (["--compile"], 1, "cpu", "needs a CUDA device; this run is on cpu"),
    (["--compile"], 2, "cuda", "single-device steps only; this run has 2 processes"),
    (["--compile", "--single-device", "fsdp2"], 1, "cuda", "plain single-device path"),
    (["--compile", "--data-parallel", "simple-fsdp"], 1, "cuda", "plain single-device path"),
    (["--compile", "--compile-backend", "aot_eager"], 1, "cuda", "inductor (not aot_eager)"),
    (["--compile", "--compile-mode", "max-autotune"], 1, "cuda", "--compile-mode max-autotune"),
    (["--compile", "--doc-mask"], 1, "cuda", "--doc-mask"),
], ids=["no-compile", "cpu", "dp2", "fsdp2-at-one", "simple-fsdp", "aot-eager",
        "max-autotune", "doc-mask"])
def test_refused_where_they_cannot_apply(flags, world_size, device, says) -> None:
    why = refusal(flags, world_size, device)
    assert why is not None and says in why and "\n" not in why


def test_a_static_single_device_compiled_step_gets_reduce_overhead() -> None:
    assert refusal(["--compile"]) is None
    cfg = parse_args([*BASE, "--compile"])
    cfg = settled(cfg, compile_mode=graphs_compile_mode(cfg.parallel))
    assert cfg.parallel.compile_mode == "reduce-overhead"
    assert graphs_compile_mode(parse_args(["--model", "debug"]).parallel) == "default"


def test_the_cli_refuses_on_the_cpu_in_one_line(tmp_path) -> None:
    out = run_process([sys.executable, "-m", "loom", "train", *BASE, "--compile",
                      "--max-steps", "1", "--outdir", str(tmp_path)],
                      timeout=300)
    assert out.returncode != 0
    assert out.stderr == "error: --cuda-graphs needs a CUDA device; this run is on cpu\n"


def marks_per_step(tmp_path, monkeypatch, flags: list[str]) -> list[int]:
    """`torch.compiler.cudagraph_mark_step_begin` calls in each step of a 3-step run."""
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin",
                        lambda: marks.__setitem__(-1, marks[-1] + 1))
    info = RankInfo(rank=0, world_size=1, local_rank=0, master_addr="localhost", master_port=0)
    with layout_training(["--model", "debug", "--n-layers", "1", "--dataset", "random",
                          "--vocab-size", "256", "--seq-len", "16", "--batch-size", "2",
                          "--fp32", "--max-steps", "3", "--outdir", str(tmp_path / "run"),
                          *flags], info, torch.device("cpu")) as trainer:
        step = trainer.train_step

        def counted(micro):
            marks.append(0)
            return step(micro)

        monkeypatch.setattr(trainer, "train_step", counted)
        trainer.fit()
    return marks


def test_each_reduce_overhead_step_marks_its_begin_once(tmp_path, monkeypatch,
                                                        process_group) -> None:
    """The compiled step in reduce-overhead mode (what --cuda-graphs asks for; aot_eager
    here, as no CPU records graphs) marks each step's begin once, before its first
    forward, also over accumulated micro-batches: without the mark, CUDA graph trees find
    the last step's outputs still live and re-record or fall back instead of replaying.
    Other modes never call it."""
    compiled = ["--compile", "--compile-backend", "aot_eager"]
    assert marks_per_step(tmp_path / "a", monkeypatch,
                          [*compiled, "--compile-mode", "reduce-overhead",
                           "--grad-accum-steps", "2"]) == [1, 1, 1]
    assert marks_per_step(tmp_path / "b", monkeypatch, compiled) == [0, 0, 0]


def test_each_evaluation_batch_in_reduce_overhead_mode_marks_its_begin(
        tmp_path, monkeypatch, process_group) -> None:
    """Validation batches replay the compiled forward too: each marks its begin (the
    previous batch's loss was already added up), so a validation between steps neither
    re-records the graphs nor reads an output a replay overwrote. Two batches per
    validation, one validation after each step: 1 + 2 marks a step."""
    compiled = ["--compile", "--compile-backend", "aot_eager", "--compile-mode",
                "reduce-overhead"]
    evals = ["--val-fraction", "0.5", "--eval-every", "1", "--eval-steps", "2"]
    assert marks_per_step(tmp_path / "a", monkeypatch, [*compiled, *evals]) == [3, 3, 3]
