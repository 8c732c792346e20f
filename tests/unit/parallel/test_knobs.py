"""Activation checkpointing and per-block compile on one process: what is recomputed, what
stays unchanged (numerics, state-dict keys), and the config warnings around them."""

from __future__ import annotations

import copy
import logging
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from loom.compat import checkpoint_inside_compile_saves_mesh, torch_release
from loom.config import ConfigError, ParallelConfig, config_from_flags
from loom.models.llama.model import ModelArgs
from loom.models.llama.plan import dense_plan as loom_plan
from loom.models.spec import ModelPlan
from loom.parallel.checkpointing import apply_ac, checkpointed, op_policy_contexts
from loom.parallel.compile import apply_compile, compiler_settings
from loom.parallel.init import clean_name
from loom.runtime.scope import applied
from tests.one_rank import one_rank_group
from tests.tiny import tiny_model

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                 max_seq_len=32)


def tokens() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = tokens()
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {clean_name(n): p.grad for n, p in model.named_parameters()}


def count_calls(model: nn.Module, suffix: str) -> list[int]:
    """Counter of forward calls of the modules named `*suffix`, recomputations included.
    (Recompute stops once every saved tensor is back, so count a block's first matmuls.)"""
    calls = [0]

    def count(*_) -> None:
        calls[0] += 1

    for name, module in model.named_modules():
        if clean_name(name).endswith(suffix):
            module.register_forward_hook(count)
    return calls


def assert_same_numerics(model: nn.Module, reference: nn.Module, atol: float) -> None:
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = loss_and_grads(reference)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=atol)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("mode", "attention_calls", "ffn_calls"), [
    ("block", 2, 2), ("selective", 2, 1)])
def test_checkpointing_recomputes_in_backward_with_equal_gradients(mode, attention_calls,
                                                                   ffn_calls):
    model, reference = tiny_model(ARGS), tiny_model(ARGS)
    assert apply_ac(loom_plan(model), mode) == ARGS.n_layers
    attention, ffn = count_calls(model, "attention.wq"), count_calls(model, "feed_forward.w1")
    assert_same_numerics(model, reference, atol=1e-6)
    assert attention[0] == attention_calls * ARGS.n_layers
    assert ffn[0] == ffn_calls * ARGS.n_layers


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_checkpointing_keeps_state_dict_keys_and_logs_the_count(mode, caplog):
    model = tiny_model(ARGS)
    keys = list(model.state_dict())
    with caplog.at_level(logging.INFO, logger="loom"):
        apply_ac(loom_plan(model), mode)
    assert list(model.state_dict()) == keys
    assert f"wrapped {ARGS.n_layers} " in caplog.text


class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.attention(x), p=0.5, training=True) * x


class DropoutStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): DropoutBlock() for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def dropout_grads(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(5)
    model(torch.ones(4, 16)).sum().backward()
    return [p.grad for p in model.parameters()]


def test_checkpointing_restores_rng_state_for_recompute():
    torch.manual_seed(0)
    plain = DropoutStack()
    model, unsafe = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_ac(ModelPlan(model, model.layers), "block")
    for name, block in list(unsafe.layers.items()):  # control: recompute draws new masks
        unsafe.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    expected = dropout_grads(plain)
    for got in zip(dropout_grads(model), expected, strict=True):
        torch.testing.assert_close(*got, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(dropout_grads(unsafe), expected,
                                                     strict=True))


def test_selective_warns_when_no_block_has_attention(caplog):
    model = tiny_model(ARGS)
    for block in model.layers.values():
        del block.attention
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert apply_ac(loom_plan(model), "selective") == 0
    assert "found no attention modules to wrap" in caplog.text


def test_compile_in_place_keeps_state_dict_keys_and_numerics():
    model, reference = tiny_model(ARGS), tiny_model(ARGS)
    keys = list(model.state_dict())
    apply_compile(loom_plan(model), "default", backend="aot_eager")
    assert list(model.state_dict()) == keys
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert_same_numerics(model, reference, atol=1e-5)


def test_compile_passes_fullgraph_and_inductor_mode_only(monkeypatch):
    seen = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.append(kw))
    apply_compile(loom_plan(tiny_model(ARGS)), "max-autotune", backend="inductor")
    apply_compile(loom_plan(tiny_model(ARGS)), "max-autotune", backend="aot_eager")
    inductor, aot = seen[0], seen[-1]
    assert len(seen) == 2 * ARGS.n_layers
    assert inductor == dict(backend="inductor", fullgraph=True, mode="max-autotune")
    assert aot == dict(backend="aot_eager", fullgraph=True, mode=None)


def test_compile_fullgraph_rejects_a_graph_break():
    class Breaking(nn.Module):
        def forward(self, x, rope):
            torch._dynamo.graph_break()
            return x

    model = tiny_model(ARGS)
    model.layers["0"] = Breaking()
    apply_compile(loom_plan(model), "default", backend="aot_eager")
    with pytest.raises(Exception, match="graph_break|Graph break|graph break"):
        model(tokens())


def saved_activation_bytes(model: nn.Module) -> int:
    """Bytes the forward keeps for backward (what a compiled block saves included)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens())
    logits.sum().backward()
    return total[0]


def compiled_saved_bytes(ac: str, budget: float) -> int:
    """Saved bytes of a fresh compile under a run's compiler settings at `budget` (read
    when the graph compiles, at the first call); restored afterwards."""
    model = tiny_model(ARGS)
    apply_ac(loom_plan(model), ac)
    with applied(compiler_settings(ParallelConfig(compile=True, act_mem_budget=budget))):
        apply_compile(loom_plan(model), "default", backend="aot_eager")
        return saved_activation_bytes(model)


def test_memory_budget_and_checkpointing_save_less_under_compile():
    plain = compiled_saved_bytes("none", 1.0)
    assert compiled_saved_bytes("none", 0.5) < plain
    assert compiled_saved_bytes("block", 1.0) < plain


def test_budget_without_compile_warns_and_with_compile_does_not():
    warned = config_from_flags({"act_mem_budget": 0.5}, environ={}).warnings
    assert any("--act-mem-budget has no effect without --compile" in w for w in warned)
    quiet = config_from_flags({"act_mem_budget": 0.5, "compile": True}, environ={}).warnings
    assert not any("act-mem-budget" in w for w in quiet)


@pytest.mark.parametrize(("ac", "tp", "refused"), [
    ("block", 2, False), ("op", 2, False), ("selective", 2, True), ("none", 2, False),
    ("selective", 1, False)])
def test_compile_with_checkpointing_under_tp(ac, tp, refused):
    """Block and op AC train compiled at tp 2 on every torch (on 2.12-2.14 each compiled
    block is checkpointed whole: `loom.parallel.parallelize.checkpoint_outside_compile`);
    selective AC, which has no such order, is refused in one line where the torch fails it
    (loom.config.compose), and accepted elsewhere."""
    flags = {"model": "debug", "compile": True, "activation_checkpoint": ac, "tp": tp}
    if refused and checkpoint_inside_compile_saves_mesh():
        with pytest.raises(ConfigError, match=f"fails in torch {torch_release()}'s compiled"):
            config_from_flags(flags, environ={})
    else:
        assert config_from_flags(flags, environ={}).parallel.activation_checkpoint == ac


def test_compile_backend_comes_from_the_environment_once():
    assert config_from_flags({}, environ={}).parallel.compile_backend == "inductor"
    env = {"LOOM_COMPILE_BACKEND": "AOT_EAGER"}
    assert config_from_flags({}, environ=env).parallel.compile_backend == "aot_eager"
    with pytest.raises(ConfigError, match="LOOM_COMPILE_BACKEND must be inductor or aot_eager"):
        config_from_flags({}, environ={"LOOM_COMPILE_BACKEND": "eager"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run while it is active (here: a backward, recompute included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> tuple[Counter, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    model = tiny_model(ARGS)
    apply_ac(loom_plan(model), mode)
    batch = tokens()
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    with OpCounter() as counter:
        loss.backward()
    return counter.counts, (loss.detach(), {clean_name(n): p.grad
                                            for n, p in model.named_parameters()})


def test_op_checkpointing_recomputes_every_other_matmul_and_no_attention():
    """--ac op: the backward redoes 3 of a block's 7 matmuls (wk, wo, w3) and never the
    attention kernel, where --ac block redoes 6 (all before w2, whose output no backward
    needs) and the attention; the loss and every
    gradient equal the un-checkpointed ones (fp32, one process)."""
    plain, (ref_loss, ref_grads) = backward_ops("none")
    op, (loss, grads) = backward_ops("op")
    block, _ = backward_ops("block")
    attention = [k for k in plain if "scaled_dot_product" in k and "backward" not in k]
    assert not attention, "no forward attention kernel in a plain backward"
    assert op["mm"] - plain["mm"] == 3 * ARGS.n_layers
    assert block["mm"] - plain["mm"] == 6 * ARGS.n_layers  # recompute stops before w2
    assert not [k for k in op if "scaled_dot_product" in k and "backward" not in k]
    assert [k for k in block if "scaled_dot_product" in k and "backward" not in k]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_op_checkpointing_recomputes_a_block_holding_a_nested_fsdp2_unit():
    """EP's routed experts are an FSDP2 unit of their own inside each checkpointed block.
    In the recompute FSDP2 opens one more profiler range than in the forward (the nested
    unit, the step's forward being over, takes itself for its root), and `--ac op` raised
    on that count ("invocation index 2 ... not found in storage") in every family's first
    backward at --ep > 1. The gradients are the unwrapped block's."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16)), nn.Tanh(),
                          nn.Linear(16, 16))
    reference = copy.deepcopy(block)
    x = torch.randn(4, 16)
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(block[1], mesh=mesh)  # the nested unit, as EP's experts
        model = nn.Sequential(checkpointed(block, op_policy_contexts))
        fully_shard(model, mesh=mesh)
        model(x).square().sum().backward()
        grads = {clean_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    reference(x).square().sum().backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[f"0.{name}"], p.grad, rtol=1e-6, atol=1e-7)
