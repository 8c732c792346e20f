"""The one parallelize recipe without a process group: each model's plan names the right
modules, compile leaves routed experts eager, and the steps run in the documented order."""

from __future__ import annotations

import pytest
import torch

import loom.parallel.parallelize as recipe
from loom.config import ParallelConfig
from loom.mesh import ParallelDims
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.moe.model import MoEArgs, MoETransformer
from loom.parallel.checkpointing import apply_ac
from loom.parallel.compile import compile_targets
from loom.parallel.model_plan import model_plan
from tests.unit.test_hf import tiny

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
def test_compile_leaves_only_the_routed_experts_eager(ac: str) -> None:
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


def test_hf_plan_uses_the_models_blocks_and_checkpointing_and_has_no_tp() -> None:
    model = tiny("llama")
    plan = model_plan(model)
    assert plan.blocks() == list(model.hf.model.layers)
    assert plan.tensor_parallel is None and plan.own_ac is not None and not plan.fullgraph
    assert plan.fsdp_units() == plan.blocks()
    with pytest.raises(ValueError, match="runs at tp 1"):
        recipe.parallelize(model, ParallelDims(1, 1, 2, 2), ParallelConfig(),
                           loss_parallel=False, backend="gloo")


def test_recipe_runs_tp_then_ac_then_compile_then_the_chosen_wrapper(monkeypatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(recipe, "apply_ac", lambda plan, mode: seen.append(f"ac {mode}"))
    monkeypatch.setattr(recipe, "apply_compile",
                        lambda plan, *args, whole_model: seen.append(f"compile {whole_model}"))
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
                             activation_checkpoint="block")
        assert recipe.parallelize(model, dims, cfg, loss_parallel=False,
                                  backend="gloo") is model
    assert seen == ["tp", "ac block", "compile False", "fsdp2",
                    "tp", "ac block", "compile True", "simple-fsdp"]

