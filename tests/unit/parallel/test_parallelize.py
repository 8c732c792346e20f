"""The one parallelize recipe without a process group: each model's plan names the right
modules, compile takes routed experts into the compiled blocks (eager only for EP + AC),
and the steps run in the documented order."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo import lookup_backend, register_backend
from torch._dynamo.utils import counters

import loom.parallel.parallelize as recipe
from loom.config import ParallelConfig
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.moe.model import MoEArgs, MoETransformer
from loom.parallel.checkpointing import apply_ac
from loom.parallel.compile import apply_compile, compile_targets, compiler_settings
from loom.parallel.mesh import ParallelDims
from loom.parallel.model_plan import model_plan
from loom.runtime.scope import applied
from tests.tiny import tiny_model
from tests.unit.models.test_hf import tiny

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                 max_seq_len=16)
MOE_ARGS = MoEArgs(**vars(ARGS), n_experts=4, top_k=2, moe_hidden_dim=16, n_dense_layers=1)


def test_loom_plan_names_embedding_blocks_and_head_as_units() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    plan = model_plan(model)
    assert plan.fsdp_units() == [model.tok_embeddings, *model.layers.values(),
                                 [model.norm, model.output]]
    assert plan.lookups == [model.tok_embeddings]
    assert plan.experts == [] and plan.tensor_parallel is not None and plan.fullgraph


@pytest.mark.parametrize("ac", ["none", "block", "selective"])
def test_compile_targets_leave_only_the_eager_modules_out(ac: str) -> None:
    with torch.device("meta"):
        model = MoETransformer(MOE_ARGS)
    plan = model_plan(model)
    moe_block = model.layers["1"]
    assert plan.experts == [moe_block.moe.experts]
    apply_ac(plan, ac)
    targets = [t for block in plan.blocks() for t in compile_targets(block, set(plan.experts))]
    assert targets[0] is plan.blocks()[0], "a dense block compiles whole (wrapper included)"
    compiled = {id(m) for t in targets for m in t.modules()}
    assert id(moe_block.moe.experts) not in compiled
    assert id(moe_block.moe.experts.weights) not in compiled
    for name in ("attention", "attention_norm", "ffn_norm", "moe.router", "moe.shared_experts"):
        assert id(moe_block.get_submodule(name)) in compiled, name


def compiled_under(monkeypatch, caplog, ac: str, **flags: bool) -> tuple[nn.Module, dict]:
    """A meta MoE model after `apply_compile(**flags)`: {id(module): fullgraph} of every
    module inside a compile call (`Module.compile` recorded, not run)."""
    seen: dict[int, bool] = {}

    def record(module: nn.Module, **kwargs) -> None:
        seen.update({id(m): kwargs["fullgraph"] for m in module.modules()})

    monkeypatch.setattr(nn.Module, "compile", record)
    with torch.device("meta"):
        model = MoETransformer(MOE_ARGS)
    plan = model_plan(model)
    apply_ac(plan, ac)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loom"):
        apply_compile(plan, "default", backend="aot_eager", **flags)
    return model, seen


@pytest.mark.parametrize("whole_model", [False, True], ids=["fsdp2", "simple-fsdp"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep1", "ep2"])
def test_compile_takes_the_routed_experts_into_the_block(monkeypatch, caplog, whole_model: bool,
                                                         expert_parallel: bool) -> None:
    """Experts and their dispatch hooks sit inside a compiled block (SimpleFSDP: the whole
    model); only FSDP2 + EP gives up fullgraph, and only on MoE blocks, and says so once."""
    model, seen = compiled_under(monkeypatch, caplog, "none", whole_model=whole_model,
                                 expert_parallel=expert_parallel)
    experts = model.layers["1"].moe.experts
    assert id(experts) in seen and id(experts.weights) in seen
    breaks = expert_parallel and not whole_model
    assert seen[id(experts)] is not breaks
    assert seen[id(model.layers["0"])] is True, "a dense block stays fullgraph"
    assert (id(model) in seen) is whole_model
    assert "run eagerly" not in caplog.text
    lines = [r for r in caplog.records if "routed experts" in r.getMessage()]
    assert len(lines) == breaks


def test_compile_leaves_the_experts_eager_under_fsdp2_ep_and_ac_in_one_line(
        monkeypatch, caplog) -> None:
    model, seen = compiled_under(monkeypatch, caplog, "block", whole_model=False,
                                 expert_parallel=True, checkpointed=True)
    moe = model.layers["1"]._checkpoint_wrapped_module.moe
    assert id(moe.experts) not in seen and id(moe.experts.weights) not in seen
    assert id(moe.router) in seen and id(moe.shared_experts) in seen
    assert all(seen.values()), "what is compiled stays fullgraph"
    lines = [r for r in caplog.records if "routed experts" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "run eagerly" in lines[0].getMessage()


GRAPHS: list[torch.fx.GraphModule] = []


@register_backend
def loom_recording_aot_eager(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """aot_eager that keeps every graph Dynamo hands it, to look inside."""
    GRAPHS.append(gm)
    return lookup_backend("aot_eager")(gm, example_inputs)


def tiny_moe(seed: int = 0) -> MoETransformer:
    return tiny_model(MOE_ARGS, seed, MoETransformer)


def moe_loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = torch.randint(0, MOE_ARGS.vocab_size, (2, 16),
                          generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_compiled_moe_block_is_one_graph_with_the_experts_and_same_numerics() -> None:
    """fp32 takes the per-expert loop, whose `.tolist()` splits become unbacked sizes: the
    MoE block is still one graph, the experts' weights among its inputs, no graph break."""
    counters.clear()
    GRAPHS.clear()
    model, reference = tiny_moe(), tiny_moe()
    with applied(compiler_settings(ParallelConfig(compile=True))):  # capture_scalar_outputs
        apply_compile(model_plan(model), "default", backend="loom_recording_aot_eager")
        loss, grads = moe_loss_and_grads(model)
        ref_loss, ref_grads = moe_loss_and_grads(reference)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(GRAPHS) == 2, "one graph per block: the dense one and the MoE one"
    inputs = [str(n.target) for n in GRAPHS[1].graph.find_nodes(op="placeholder")]
    for w in ("w1", "w2", "w3"):
        assert any("experts" in i and i.endswith(f"{w}_") for i in inputs), (w, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_hf_plan_uses_the_models_blocks_and_checkpointing_and_has_no_tp() -> None:
    model = tiny("llama")
    plan = model_plan(model)
    assert plan.blocks() == list(model.hf.model.layers)
    assert plan.tensor_parallel is None and plan.own_ac is not None and not plan.fullgraph
    assert plan.fsdp_units() == plan.blocks()
    with pytest.raises(ValueError, match="runs at tp 1"):
        recipe.parallelize(model, ParallelDims(1, 1, 2, 2), ParallelConfig(),
                           loss_parallel=False, backend="gloo")


@pytest.mark.parametrize("torch_fails_ac_in_graph", [False, True])
def test_recipe_runs_tp_then_ac_then_compile_then_the_chosen_wrapper(
        monkeypatch, torch_fails_ac_in_graph: bool) -> None:
    """TP -> AC -> compile -> wrapper; where the torch in use fails a checkpoint inside a
    compiled DTensor graph (2.12-2.14, issue #55), SimpleFSDP's blocks are compiled one by
    one and then checkpointed whole (FSDP2 at tp 1 has no DTensor in its blocks: unchanged)."""
    monkeypatch.setattr(recipe, "checkpoint_inside_compile_saves_mesh",
                        lambda: torch_fails_ac_in_graph)
    seen: list[str] = []
    monkeypatch.setattr(recipe, "apply_ac", lambda plan, mode: seen.append(f"ac {mode}"))
    monkeypatch.setattr(recipe, "apply_compile",
                        lambda plan, *args, whole_model, **_: seen.append(
                            f"compile {whole_model}"))
    for name in recipe.STRATEGIES:
        monkeypatch.setitem(recipe.STRATEGIES, name, recipe.DataParallelStrategy(
            lambda plan, dims, cfg, backend, name=name: seen.append(name) or name,
            whole_graph=recipe.STRATEGIES[name].whole_graph))
    with torch.device("meta"):
        model = Transformer(ARGS)
    dims = ParallelDims(1, 1, 1, 1)
    monkeypatch.setattr(recipe, "model_plan", lambda m: plan)
    plan = model_plan(model)
    plan.tensor_parallel = lambda dims, loss_parallel: seen.append("tp")
    for data_parallel in ("fsdp2", "simple-fsdp"):
        cfg = ParallelConfig(data_parallel=data_parallel, compile=True,
                             activation_checkpoint="block", single_device="fsdp2")
        assert recipe.parallelize(model, dims, cfg, loss_parallel=False,
                                  backend="gloo") is model
    simple = (["tp", "compile False", "ac block", "simple-fsdp"] if torch_fails_ac_in_graph
              else ["tp", "ac block", "compile True", "simple-fsdp"])
    assert seen == ["tp", "ac block", "compile False", "fsdp2", *simple]

