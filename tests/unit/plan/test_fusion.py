"""loom.plan.fusion: the eager step's unfused pointwise traffic."""

from __future__ import annotations

from dataclasses import replace

from loom.config import parse_args
from loom.plan.fusion import unfused_seconds

SMALL = ["--dim", "256", "--n-layers", "4", "--n-heads", "4", "--n-kv-heads", "2",
         "--vocab-size", "512", "--seq-len", "128", "--dtype", "bf16"]


def seconds(*flags: str, device: str = "H100", tp: int = 1) -> float:
    return unfused_seconds(parse_args([*SMALL, *flags]), 4096, tp, device)


def test_compile_and_devices_without_a_bandwidth_entry_have_none():
    cfg = parse_args(SMALL)
    compiled = replace(cfg, parallel=replace(cfg.parallel, compile=True))
    assert seconds() > 0
    assert unfused_seconds(compiled, 4096, 1, "H100") == 0.0
    assert seconds(device="cpu") == 0.0


def test_recomputed_chains_add_their_forward_traffic():
    """block and op recompute every chain, selective only RoPE: none < selective < op."""
    none, selective, op, block = (seconds("--ac", mode)
                                  for mode in ("none", "selective", "op", "block"))
    assert none < selective < op == block


def test_tensor_parallel_ranks_move_their_share_and_the_device_sets_the_pace():
    assert seconds(tp=2) == seconds() / 2
    assert seconds(device="H200") < seconds(device="H100")
