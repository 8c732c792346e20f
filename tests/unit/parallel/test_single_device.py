"""One process: the model stays a plain module (no FSDP2), bf16 comes from autocast over
fp32 weights, and under --compile the whole model is one graph that training never
recompiles nor breaks, for the llama, qwen3 and MoE families."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import profile

import loom.parallel.parallelize as recipe
from loom.config import LossConfig, ParallelConfig, parse_args
from loom.losses import IGNORE_INDEX, build_criterion
from loom.models.llama.model import ModelArgs, RMSNorm, Transformer
from loom.parallel.init import init_weights
from loom.parallel.mesh import ParallelDims
from loom.parallel.single import step_autocast
from loom.runtime.distributed import RankInfo
from loom.trainer.executor import build_executor, head_in_forward, loss_in_graph
from loom.trainer.parity import layout_training
from tests.families.gpt2 import GPT2, GPT2Args

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                 max_seq_len=16)
FAMILIES = {"llama": ["--model", "debug"],
            "qwen3": ["--model", "debug", "--family", "qwen3"],
            "moe": ["--model", "moe-debug"]}
COMPILED = [*(f for f in FAMILIES if f != "qwen3"),
            pytest.param("qwen3", marks=pytest.mark.slow)]  # llama's graph with q/k norms


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
    executor = build_executor([model], parse_args(["--model", "debug", "--dtype", "bf16"]),
                              dims, torch.device("cpu"))
    tokens = torch.randint(ARGS.vocab_size, (1, 8))
    executor.forward_backward([{"input": tokens, "labels": tokens}], lambda: None)
    assert seen == [torch.bfloat16], "the step's autocast"
    assert "forward" not in vars(model) and type(model) is Transformer, "the model untouched"
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())


@pytest.mark.parametrize("family", COMPILED)
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


def test_fused_linear_runs_inside_the_forward_where_the_family_takes_it() -> None:
    """Handed to the forward (`ctx.head_apply`), fused-linear gives the loss it gives on the
    returned hidden states; only with the whole model and logits on the rank, and for a
    model whose forward takes a context (the GPT-2 example's does)."""
    cfg = parse_args(["--model", "debug"])
    dims = ParallelDims(1, 2, 1, 2)
    with torch.device("meta"):
        model = Transformer(ARGS)
    init_weights(model, 0, torch.device("cpu"))
    assert head_in_forward(cfg, dims, model)
    inputs, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    labels[0, :3] = IGNORE_INDEX
    loss = LossConfig(loss_impl="fused-linear", loss_chunk_size=4)
    inside = build_criterion(loss, model.output, in_forward=True)
    outside = build_criterion(loss, model.output)
    assert inside.in_forward and not outside.in_forward
    got = inside.model_sums(model, inputs, labels)
    want = outside.model_sums(model, inputs, labels)
    assert (labels != IGNORE_INDEX).sum() == 13
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not build_criterion(LossConfig(), model.output, in_forward=True).in_forward
    tp = parse_args(["--model", "debug", "--tp", "2"])
    assert not head_in_forward(tp, ParallelDims(1, 1, 2, 2), model), "tp: a DTensor head"
    cp = parse_args(["--model", "debug", "--cp", "2"])
    assert not head_in_forward(cp, ParallelDims(1, 1, 1, 2, cp=2), model), "cp's hooks"
    simple = parse_args(["--model", "debug", "--compile", "--data-parallel", "simple-fsdp"])
    assert not head_in_forward(simple, dims, model), "one compiled graph"
    assert head_in_forward(cfg, dims, GPT2(GPT2Args(32, 2, 4, 64, 16))), "its ctx"
    model.output = None  # a pipeline stage without the head
    assert not head_in_forward(cfg, dims, model)


def saved_activations(model: torch.nn.Module, tokens: torch.Tensor, autocast
                      ) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every floating tensor one forward saves for its backward, but the
    parameters and buffers themselves (views of them included: the rope table's rows)."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in held:
            saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        out = model(tokens)
    out.float().sum().backward()
    return saved


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_bf16_saves_bf16_activations_over_fp32_weights(process_group, qk_norm: bool) -> None:
    """Under bf16 autocast every activation saved for backward is bf16 (the residual
    stream and the norms' outputs included) but the fp32 statistics, which are one value
    per row: each RMSNorm's (B, T, 1) root mean square and its inverse, and attention's
    (B, H, T) log-sum-exp. The weights stay fp32 and get fp32 gradients."""
    torch.manual_seed(0)
    args = ModelArgs(**{**vars(ARGS), "qk_norm": qk_norm})
    model = Transformer(args)
    dims = ParallelDims(1, 1, 1, 1)
    dims.build_mesh("cpu")
    recipe.parallelize(model, dims, ParallelConfig(dtype="bf16"), loss_parallel=False,
                       backend="gloo")
    batch, seq = 2, 8
    saved = saved_activations(model, torch.randint(args.vocab_size, (batch, seq)),
                              step_autocast(dims, ParallelConfig(dtype="bf16"), "cpu"))
    fp32 = [shape for dtype, shape in saved if dtype == torch.float32]
    rows = batch * seq * args.n_heads  # a statistic per row (per head under qk-norm)
    assert all(math.prod(shape) <= rows for shape in fp32), fp32
    assert {dtype for dtype, _ in saved} == {torch.bfloat16, torch.float32}
    full = [shape for dtype, shape in saved if shape[-1] == args.dim]
    assert full and all(d == torch.bfloat16 for d, s in saved if s[-1] == args.dim)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())


def test_fp32_rmsnorm_is_the_plain_expression() -> None:
    """Off autocast the norm is bit for bit the fp32 formula."""
    norm = RMSNorm(16, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 16)
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm.weight
    assert torch.equal(norm(x), want)


def test_bf16_rmsnorm_matches_fp32_within_bf16() -> None:
    """A bf16 input (FSDP2's mixed precision, or autocast's stream) is normed to within
    bf16's rounding of the fp32 result, returned in bf16."""
    norm = RMSNorm(64, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 7, 64).bfloat16()
    got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), norm(x.float()), rtol=2 ** -7, atol=1e-6)
