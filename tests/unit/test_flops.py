"""FLOP counting against the analytic formula, the probe fallback, peaks and the per-rank share."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from loom import flops
from loom.config import parse_args
from loom.mesh import ParallelDims
from loom.metrics import run_facts
from loom.models.llama import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
BATCH, SEQ = 2, 256


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a matmul: all but the embedding table and norm weights."""
    return sum(p.numel() for n, p in model.named_parameters()
               if not n.startswith("tok_embeddings") and "norm" not in n)


def analytic(args: ModelArgs, batch: int, seq: int, attended: int) -> tuple[float, float]:
    """(6 N tokens, attention): per layer QK^T and PV are 2 matmuls of 2 B T S dim FLOPs
    forward, twice that backward, over S = `attended` keys (full, no causal discount)."""
    with torch.device("meta"):
        n = matmul_params(Transformer(args))
    return 6 * n * batch * seq, 12 * args.n_layers * batch * seq * attended * args.dim


def test_counted_flops_match_6_n_tokens_plus_full_attention():
    counted = flops.count_step_flops(lambda: Transformer(ARGS), BATCH, SEQ)
    dense, attention = analytic(ARGS, BATCH, SEQ, attended=SEQ)
    assert counted.exact
    assert attention > 0.1 * dense, "the shape must make attention matter to the check"
    assert counted.flops == pytest.approx(dense + attention, rel=0.02)


class DataDependent(nn.Module):
    """Reads a value on the host, which fake tensors cannot do."""

    def __init__(self):
        super().__init__()
        self.inner = Transformer(ARGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.max().item() < 0:
            raise AssertionError("unreachable")
        return self.inner(tokens)


def test_fallback_probe_warns_and_scales_by_tokens(caplog):
    with caplog.at_level(logging.WARNING, logger="loom"):
        counted = flops.count_step_flops(DataDependent, BATCH, SEQ)
    assert not counted.exact
    assert "MFU is a lower bound" in caplog.text
    dense, probe_attention = analytic(ARGS, BATCH, SEQ, attended=flops.PROBE_TOKENS)
    assert counted.flops == pytest.approx(dense + probe_attention, rel=0.02)
    assert counted.flops < sum(analytic(ARGS, BATCH, SEQ, attended=SEQ))


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H100 NVL", torch.float32, 60.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5),
    ("AMD Instinct MI300X", torch.bfloat16, 1307.4),
    ("Intel(R) Data Center GPU Max 1550", torch.bfloat16, 298.2),
])
def test_datasheet_peak_picks_the_most_specific_name(name, dtype, tflops):
    assert flops.table_peak(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_device_has_no_datasheet_peak():
    assert flops.table_peak("Some Future Accelerator", torch.bfloat16) is None


def test_cpu_peak_is_measured_once_and_cached(tmp_path):
    cpu = torch.device("cpu")
    first = flops.measured_peak(cpu, torch.float32, tmp_path)
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [first] and first > 1e9
    assert flops.measured_peak(cpu, torch.float32, tmp_path) == first  # a new timing would differ
    peak = flops.peak_flops(cpu, torch.float32, tmp_path)
    assert (peak.flops, peak.source) == (first, "measured")


@pytest.mark.parametrize(("world", "flags"), [(4, ["--tp", "2"]), (4, ["--tp", "4"]),
                                              (8, ["--dp-replicate", "2", "--tp", "2"])])
def test_per_rank_flops_add_up_to_the_global_step(world, flags, tmp_path):
    cfg = parse_args(["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4",
                      "--vocab-size", "256", "--seq-len", "64", "--batch-size", "3",
                      "--cache-dir", str(tmp_path), *flags])
    p = cfg.parallel
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256)
    with torch.device("meta"):
        model = Transformer(args)
    facts = run_facts(cfg, dims, torch.device("cpu"), model, lambda: Transformer(args), world)
    one_sample = flops.count_step_flops(lambda: Transformer(args), 1, 64).flops
    assert facts.flops_per_step == pytest.approx(one_sample * 3 * dims.dp_size)
    assert facts.flops_per_rank * world == pytest.approx(facts.flops_per_step)
    assert facts.tokens_per_step == 3 * dims.dp_size * 64
