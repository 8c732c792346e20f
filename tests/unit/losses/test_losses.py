"""Every --loss-impl against eager on the same inputs (one process; tp 2 is in
tests/integration/test_losses_multirank.py): loss, gradients of the hidden states and of
the output weight, ignored tokens, a chunk that does not divide the rows, bf16 inputs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import ConfigError, JobConfig, LossConfig, config_from_flags
from loom.config.resolved import settled
from loom.losses import (
    IGNORE_INDEX,
    build_loss,
    eager_cross_entropy,
    effective_loss_impl,
    fused_linear_cross_entropy,
    logits_criterion,
    loss_impl_for,
    vocab_parallel_cross_entropy,
)
from loom.models.context import ForwardContext
from loom.models.llama.model import ModelArgs
from tests.tiny import tiny_model

SEQ, DIM, VOCAB, CHUNK = 38, 16, 101, 8  # 8 does not divide the 38 rows
MODES = ["chunked", "chunked-backward", "compiled", "fused-linear"]
ARGS = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=VOCAB, multiple_of=32,
                 max_seq_len=SEQ)


def make_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, SEQ, DIM, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, DIM, generator=gen) * 0.5).to(dtype)
    labels = torch.randint(VOCAB, (1, SEQ), generator=gen)
    labels[:, ::5] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(mode: str, hidden, weight, labels) -> tuple[torch.Tensor, ...]:
    """The mode's loss of `hidden @ weight.T`, and the gradients of hidden and weight."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if mode == "fused-linear":
        loss = fused_linear_cross_entropy(h, w, labels, CHUNK)
    else:
        loss = logits_criterion(mode, CHUNK)(h @ w.T, labels)
    loss.backward()
    return loss.detach().float(), h.grad.float(), w.grad.float()


@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_eager_fp32(mode: str) -> None:
    inputs = make_inputs(torch.float32)
    for got, want in zip(loss_and_grads(mode, *inputs), loss_and_grads("eager", *inputs),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_eager_bf16(mode: str) -> None:
    """bf16 inputs: within a few bf16 roundings of eager's bf16 result (relative norm)."""
    inputs = make_inputs(torch.bfloat16)
    got, want = loss_and_grads(mode, *inputs), loss_and_grads("eager", *inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert ((g - w).norm() / w.norm()).item() < 1e-2


class MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matrix product dispatched inside."""

    PRODUCTS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.mm.out,
                          torch.ops.aten.addmm.default,
                          torch.ops.aten.addmm_.default, torch.ops.aten.bmm.default})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_under_autocast_every_mode_matches_eager_with_bf16_products(mode: str) -> None:
    """fp32 master weight and hidden states under bf16 autocast (the one-process step):
    fused-linear's chunk products (forward and its gradient GEMMs) run in bf16 like the
    others' projection, and every mode gives eager's loss within 1e-3 relative and its
    gradients within 1e-2 of their norm (bf16's 2^-8 per rounding, a few roundings), and
    fp32's loss within 1e-2."""
    inputs = make_inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes() as products:
        got = loss_and_grads(mode, *inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads("eager", *inputs)
    assert products.seen and all(set(d) == {torch.bfloat16} for d in products.seen), \
        products.seen
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=0)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert ((g - w).norm() / w.norm()).item() < 1e-2
    fp32 = loss_and_grads("eager", *inputs)
    torch.testing.assert_close(got[0], fp32[0], rtol=1e-2, atol=0)


@pytest.mark.parametrize("mode", [*MODES, "eager"])
def test_ignored_tokens_add_nothing(mode: str) -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    kept = labels[0] != IGNORE_INDEX
    loss, grad_h, grad_w = loss_and_grads(mode, hidden, weight, labels)
    ref_loss, ref_h, ref_w = loss_and_grads(
        "eager", hidden[:, kept], weight, labels[:, kept])
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_w, ref_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_h[:, kept], ref_h, rtol=0, atol=1e-6)
    assert grad_h[:, ~kept].abs().max() == 0


@pytest.mark.parametrize("mode", MODES)
def test_built_loss_through_the_model_matches_eager(mode: str) -> None:
    """build_loss on loom's Transformer: same loss and parameter gradients as eager."""
    reference = tiny_model(ARGS)
    model = copy.deepcopy(reference)
    tokens = torch.randint(VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[:, :3] = IGNORE_INDEX
    losses = [build_loss(LossConfig(m, CHUNK), net)(net, inputs, labels)
              for m, net in (("eager", reference), (mode, model))]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if mode == "fused-linear":  # the fused head still projects when given no labels
        hidden = model(inputs, ctx=ForwardContext(hidden=True))
        torch.testing.assert_close(model.output(hidden), reference(inputs))


@pytest.mark.parametrize(("mode", "tp", "hf", "effective"), [
    ("loss-parallel", 1, False, "compiled"),
    ("loss-parallel", 2, False, "loss-parallel"),
    ("fused-linear", 1, True, "compiled"),
    ("fused-linear", 2, False, "fused-linear"),
    ("eager", 1, True, "eager"),
])
def test_fallbacks(mode: str, tp: int, hf: bool, effective: str) -> None:
    got, reason = effective_loss_impl(mode, tp, hf)
    assert got == effective and (reason is None) == (got == mode)


def test_fallback_is_recorded_in_the_config_with_one_warning(caplog) -> None:
    cfg = config_from_flags({"loss_impl": "loss-parallel", "model": "debug"}, environ={})
    with caplog.at_level(logging.WARNING, logger="loom"):
        resolved = settled(cfg, loss_impl=loss_impl_for(cfg))
    assert resolved.loss.loss_impl == "compiled"
    assert resolved.to_dict()["loss"]["loss_impl"] == "compiled"
    assert [r.getMessage() for r in caplog.records] == [
        "--loss-impl loss-parallel needs --tp > 1; using compiled"]


def test_unknown_modes_are_errors() -> None:
    with pytest.raises(ConfigError, match="unknown --loss-impl"):
        loss_impl_for(JobConfig(loss=LossConfig("fast")))
    with pytest.raises(ValueError, match="'fast'"):
        build_loss(LossConfig("fast"), tiny_model(ARGS))


def test_loss_parallel_refuses_unsharded_logits() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="sharded on the vocabulary"):
        vocab_parallel_cross_entropy(hidden @ weight.T, labels, CHUNK)


def test_eager_is_plain_cross_entropy() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    logits = (hidden @ weight.T)[0]
    kept = labels[0] != IGNORE_INDEX
    manual = (logits.logsumexp(-1) - logits.gather(1, labels[0].clamp(0)[:, None])[:, 0])[kept]
    torch.testing.assert_close(eager_cross_entropy(hidden @ weight.T, labels), manual.mean())


def test_logits_probe_logs_the_first_step_once(caplog) -> None:
    cfg = config_from_flags({"loss_impl": "fused-linear"}, environ={"LOOM_DEBUG_LOGITS": "1"})
    assert cfg.loss.debug_logits
    model = tiny_model(ARGS)
    tokens = torch.randint(VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    expected = model(tokens).abs().max().item()
    loss_fn = build_loss(cfg.loss, model)
    with caplog.at_level(logging.INFO, logger="loom"):
        for _ in range(2):
            loss_fn(model, tokens, tokens)
    probes = [r.getMessage() for r in caplog.records if "logits probe" in r.getMessage()]
    assert probes == [f"logits probe (first step): {SEQ * VOCAB} of {SEQ * VOCAB} finite, "
                      f"max |logit| {expected:.4g}"]
    with pytest.raises(ConfigError, match="LOOM_DEBUG_LOGITS"):
        config_from_flags({}, environ={"LOOM_DEBUG_LOGITS": "yes"})


def test_fused_linear_under_no_grad_gives_the_loss_alone() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    w = weight.clone().requires_grad_()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, w, labels, CHUNK)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, eager_cross_entropy(hidden @ weight.T, labels))
