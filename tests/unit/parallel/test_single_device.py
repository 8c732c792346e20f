"""One process: the model stays a plain module (no FSDP2), bf16 comes from autocast over
fp32 weights, and under --compile the whole model is one graph that training never
recompiles nor breaks, for the llama, qwen3 and MoE families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import profile

import loom.parallel.parallelize as recipe
from loom.config import ParallelConfig, parse_args
from loom.models.llama.model import ModelArgs, OutputHead, Transformer
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo
from loom.trainer.executor import head_in_graph, loss_in_graph
from loom.trainer.parity import layout_training

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                 max_seq_len=16)
FAMILIES = {"llama": ["--model", "debug"],
            "qwen3": ["--model", "debug", "--family", "qwen3", "--qk-norm"],
            "moe": ["--model", "moe-debug"]}


def test_one_process_leaves_the_model_unwrapped() -> None:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    recipe.parallelize(model, ParallelDims(1, 1, 1, 1), ParallelConfig(dtype="fp32"),
                       loss_parallel=False, backend="gloo")
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert "forward" not in vars(model), "fp32: the forward is the class's own"


def test_bf16_computes_under_autocast_over_fp32_weights(process_group) -> None:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    dims = ParallelDims(1, 1, 1, 1)
    dims.build_mesh("cpu")
    recipe.parallelize(model, dims, ParallelConfig(dtype="bf16"), loss_parallel=False,
                       backend="gloo")
    seen: list[torch.dtype] = []
    model.layers["0"].attention.wq.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model(torch.randint(ARGS.vocab_size, (1, 8))).float().sum().backward()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_compiled_model_is_one_graph_without_breaks_or_recompiles(
        tmp_path: Path, process_group, family: str) -> None:
    """10 training steps: Dynamo compiles one graph (embedding to head and the loss) at the
    first and nothing after (a recompile would raise), and never breaks a graph; a step's
    forward is that one compiled region."""
    info = RankInfo(rank=0, world_size=1, local_rank=0, master_addr="localhost", master_port=0)
    with layout_training([*FAMILIES[family], "--dataset", "random", "--vocab-size", "256",
                          "--seq-len", "32", "--batch-size", "2", "--fp32", "--compile",
                          "--max-steps", "10", "--log-every", "5",
                          "--outdir", str(tmp_path / "run")], info,
                         torch.device("cpu")) as trainer:
        counters = torch._dynamo.utils.counters
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):  # a config module
            trainer.fit()
        assert trainer.loop.step == 10
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        with profile() as prof:  # inside the run's settings, whose graphs it reuses
            trainer.executor.forward_backward([next(iter(trainer.loader))], lambda: None)
    names = [e.name for e in prof.events()]
    assert sum(n.startswith("Torch-Compiled Region") for n in names) == 1
    assert "aten::_log_softmax" not in names, "the loss ran outside the graph"


@pytest.mark.parametrize("flags, in_graph", [
    (["--compile"], True), (["--compile", "--loss-impl", "compiled"], True), ([], False),
    (["--compile", "--loss-impl", "fused-linear"], False),
    (["--compile", "--loss-impl", "chunked"], False),
    (["--compile", "--debug-logits"], False),
    (["--compile", "--single-device", "fsdp2"], False)])
def test_the_loss_joins_the_graph_only_where_it_traces_whole(flags: list[str],
                                                              in_graph: bool) -> None:
    cfg = parse_args(["--model", "debug", *flags])
    assert loss_in_graph(cfg, ParallelDims(1, 1, 1, 1)) is in_graph
    assert not loss_in_graph(cfg, ParallelDims(1, 2, 1, 2)), "two ranks: FSDP2's units"


@pytest.mark.parametrize("flags, world, in_graph", [
    (["--compile"], 2, True), (["--compile", "--loss-impl", "compiled"], 2, True),
    (["--compile"], 1, False), (["--compile", "--single-device", "fsdp2"], 1, True),
    ([], 2, False), (["--compile", "--loss-impl", "fused-linear"], 2, False),
    (["--compile", "--loss-impl", "chunked"], 2, False),
    (["--compile", "--debug-logits"], 2, False),
    (["--compile", "--data-parallel", "simple-fsdp"], 2, False)])
def test_the_head_and_loss_are_one_graph_under_fsdp2(flags: list[str], world: int,
                                                     in_graph: bool) -> None:
    """Where FSDP2's hooks split the model, the head and the loss still compile together
    (one process unwrapped: the whole step is one graph instead, `loss_in_graph`)."""
    cfg = parse_args(["--model", "debug", *flags])
    dims = ParallelDims(1, world, 1, world)
    head = OutputHead(8, 16, bias=False)
    assert head_in_graph(cfg, dims, head) is in_graph
    assert not head_in_graph(cfg, dims, nn.Linear(8, 16, bias=False)), "no apply= on the head"
    assert not head_in_graph(cfg, dims, None), "a stage without the head"
    tp = parse_args(["--model", "debug", "--tp", "2", *flags])
    assert not head_in_graph(tp, ParallelDims(1, 1, 2, 2), head), "tp: a DTensor head"
