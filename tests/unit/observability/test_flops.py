"""FLOP counting against the analytic formula, the probe fallback, peaks and the per-rank share."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from loom.config import parse_args
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.resolve import plain_model
from loom.observability import flops
from loom.observability.metrics import run_facts, step_flops
from loom.observability.metrics.facts import sample_flops
from loom.parallel.mesh import ParallelDims
from tests.hf_models import save_tiny_model

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
    ("NVIDIA GH200 480GB", torch.bfloat16, 989.4),
    ("NVIDIA H200", torch.float32, 66.9),
    ("AMD Instinct MI250X", torch.bfloat16, 191.5),
])
def test_datasheet_peak_picks_the_most_specific_name(name, dtype, tflops):
    assert flops.table_peak(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_device_has_no_datasheet_peak():
    assert flops.table_peak("Some Future Accelerator", torch.bfloat16) is None


CPU = torch.device("cpu")


class FakeBench:
    """Stands in for the matmul benchmark: the machine's load decides cleanliness, and
    tests must not depend on how busy this machine is."""

    def __init__(self, flops_: float, clean: bool):
        self.result = flops.PeakMeasurement(flops_, 1.0 if clean else 0.3, 2, clean)
        self.calls = 0

    def __call__(self, device: torch.device, dtype: torch.dtype) -> flops.PeakMeasurement:
        self.calls += 1
        return self.result


def test_clean_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    bench = FakeBench(5e10, clean=True)
    monkeypatch.setattr(flops, "measure_matmul_peak", bench)
    assert flops.measured_peak(CPU, torch.float32, tmp_path) == 5e10
    assert flops.peak_flops(CPU, torch.float32, tmp_path) == flops.Peak(5e10, "measured")
    cached = json.loads((tmp_path / flops.PEAK_CACHE).read_text())
    assert [e["flops"] for e in cached.values()] == [5e10], cached
    assert bench.calls == 1, f"measured {bench.calls} times, expected once then cached"


def test_busy_peak_is_used_but_never_cached(tmp_path, monkeypatch, caplog):
    bench = FakeBench(1e6, clean=False)
    monkeypatch.setattr(flops, "measure_matmul_peak", bench)
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert flops.measured_peak(CPU, torch.float32, tmp_path) == 1e6
        assert flops.measured_peak(CPU, torch.float32, tmp_path) == 1e6
    assert not (tmp_path / flops.PEAK_CACHE).exists()
    assert bench.calls == 2 and "not cached" in caplog.text


def test_old_cache_is_left_alone_and_a_malformed_entry_measured_again(tmp_path, monkeypatch):
    """main cached bare numbers in peak_flops.json, some from a busy moment: not read, and
    not rewritten either (an older loom sharing the cache folder still reads it)."""
    key = flops.peak_cache_key(CPU, torch.float32)
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: 6.4e8}))
    (tmp_path / flops.PEAK_CACHE).write_text(json.dumps({key: 6.4e8}))
    monkeypatch.setattr(flops, "measure_matmul_peak", FakeBench(5e10, clean=True))
    assert flops.measured_peak(CPU, torch.float32, tmp_path) == 5e10
    assert json.loads((tmp_path / "peak_flops.json").read_text()) == {key: 6.4e8}


@pytest.mark.parametrize(("rounds", "clean"), [
    ([(10.0, 1.0), (9.5, 0.95)], True),
    ([(10.0, 1.0), (5.0, 1.0)], False),  # the rounds disagree
    ([(10.0, 0.5), (9.9, 0.5)], False),  # other processes took half the CPU time
    ([(3.0, 1.0), (10.0, 0.99), (9.2, 0.97)], True),
])
def test_clean_needs_two_agreeing_rounds_with_the_cpu_to_ourselves(rounds, clean):
    assert flops.is_clean(rounds) is clean, rounds


def test_real_benchmark_reports_its_cpu_share():
    peak = flops.measure_matmul_peak(CPU, torch.float32, seconds=0.01, max_rounds=2)
    assert peak.flops > 1e8 and 0 < peak.cpu_share <= 1.5 and 1 <= peak.rounds <= 2, peak


def test_mfu_never_above_100_after_a_busy_cached_peak(tmp_path, monkeypatch, caplog):
    """A peak cached from a busy moment (100x too low) gives MFU > 100% until re-measured."""
    key = flops.peak_cache_key(CPU, torch.float32)
    busy = {"flops": 5e8, "cpu_share": 0.95, "rounds": 2, "measured": "then"}
    (tmp_path / flops.PEAK_CACHE).write_text(json.dumps({key: busy}))
    monkeypatch.setattr(flops, "measure_matmul_peak", FakeBench(5e10, clean=True))
    peak = flops.peak_flops(CPU, torch.float32, tmp_path)
    assert peak.flops == 5e8  # the cache is believed until a reading proves it wrong
    meter = flops.MfuMeter(2e9, peak, lambda: flops.peak_flops(
        CPU, torch.float32, tmp_path, remeasure=True))
    with caplog.at_level(logging.WARNING, logger="loom"):
        readings = [meter(seconds) for seconds in (0.1, 0.2, 0.01, 0.1)]
    assert readings[0] == pytest.approx(40.0) and readings[1] == pytest.approx(20.0), readings
    assert readings[2] is None, "400% must not be reported"
    assert caplog.text.count("MFU above 100%") == 1, caplog.text
    fixed = json.loads((tmp_path / flops.PEAK_CACHE).read_text())[key]["flops"]
    assert fixed == 5e10, "the re-measured peak replaces the busy one in the cache"


def test_datasheet_peak_is_not_remeasured(caplog):
    peak = flops.Peak(1e12, "datasheet")
    meter = flops.MfuMeter(1e12, peak, lambda: pytest.fail("a datasheet peak is not measured"))
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert meter(0.5) is None and meter(2.0) == pytest.approx(50.0)
    assert "the FLOP count or the datasheet entry is wrong" in caplog.text


def test_moe_flops_are_counted_exactly_with_grouped_mm():
    """Routed experts: 3 matmuls (w1, w3, w2) over tokens x top-k rows, forward + 2x backward,
    checked against the same model with one expert and top-1 (everything else equal)."""
    from loom.models.moe.model import MoEArgs, MoETransformer

    args = MoEArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                   n_experts=4, top_k=2, n_shared_experts=1, moe_hidden_dim=64,
                   n_dense_layers=1)
    dense_args = MoEArgs(**{**vars(args), "n_shared_experts": 1, "top_k": 1, "n_experts": 1})
    counted = flops.count_step_flops(lambda: MoETransformer(args), BATCH, 64)
    assert counted.exact, "MoE must not fall back to the probe"
    routed = 3 * 3 * 2 * BATCH * 64 * args.top_k * args.dim * args.moe_hidden_dim
    one_expert = flops.count_step_flops(lambda: MoETransformer(dense_args), BATCH, 64).flops
    routed_one = routed // args.top_k
    router_extra = 6 * BATCH * 64 * args.dim * (args.n_experts - 1)  # gate: E outputs, not 1
    assert counted.flops - routed == pytest.approx(one_expert - routed_one + router_extra,
                                                   rel=1e-9), (counted.flops, one_expert)


@pytest.mark.parametrize(("world", "flags"), [(4, ["--tp", "2"]), (4, ["--tp", "4"]),
                                              (8, ["--dp-replicate", "2", "--tp", "2"])])
def test_per_rank_flops_add_up_to_the_global_step(world, flags, tmp_path):
    cfg = parse_args(["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4",
                      "--vocab-size", "256", "--seq-len", "64", "--batch-size", "3",
                      "--cache-dir", str(tmp_path), *flags])
    p = cfg.parallel
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256)
    facts = run_facts(cfg, dims, torch.device("cpu"), 1, step_flops(cfg, plain_model))
    one_sample = flops.count_step_flops(lambda: Transformer(args), 1, 64).flops
    assert facts.flops_per_step == pytest.approx(one_sample * 3 * dims.dp_size)
    assert facts.flops_per_rank * world == pytest.approx(facts.flops_per_step)
    assert facts.tokens_per_step == 3 * dims.dp_size * 64


@pytest.mark.parametrize(("on_cpu", "waited", "clean"), [
    (0.30, 0.00, True),   # idle: every runnable moment was spent on a CPU
    (0.30, 0.01, True),   # a kernel thread's tick now and then
    (0.30, 0.30, False),  # another process held a CPU half the time
    (0.00, 0.00, True),   # nothing runnable at all (a round too short to be scheduled)
])
def test_cpu_share_is_read_from_run_queue_waits(on_cpu, waited, clean):
    share = flops.cpu_share(on_cpu, waited)
    assert (share >= flops.MIN_CPU_SHARE) is clean, share


class FakeScheduler:
    """Run-queue accounting of an idle 2-core machine whose bf16 kernel keeps one of its
    two threads busy: CPU time grows by one thread's worth a round, nothing ever waits."""

    def __init__(self, waited_per_read: float = 0.0):
        self.reads, self.waited_per_read = 0, waited_per_read

    def __call__(self) -> tuple[float, float]:
        self.reads += 1
        return 0.2 * self.reads, self.waited_per_read * self.reads


def steady_rounds(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Real timed rounds whose FLOP/s are replaced by one figure, so that only the CPU share
    decides cleanliness (real rounds on this shared machine may disagree); returns the
    list the rounds' arguments are appended to."""
    calls: list[tuple] = []
    real_round = flops.timed_round

    def steady(*args: object) -> tuple[float, float]:
        calls.append(args)
        return 1e11, real_round(*args)[1]

    monkeypatch.setattr(flops, "timed_round", steady)
    return calls


def test_one_busy_thread_of_two_on_an_idle_machine_is_clean(monkeypatch):
    """The false 'busy machine' of issue 34: CPU time / (wall x 2 threads) read 50%."""
    monkeypatch.setattr(flops, "scheduler_times", FakeScheduler())
    steady_rounds(monkeypatch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    peak = flops.measure_matmul_peak(CPU, torch.float32, seconds=0.01, max_rounds=4)
    assert peak.cpu_share == 1.0 and peak.clean, peak


def test_threads_queued_behind_other_processes_are_busy(monkeypatch):
    monkeypatch.setattr(flops, "scheduler_times", FakeScheduler(waited_per_read=0.2))
    steady_rounds(monkeypatch)
    peak = flops.measure_matmul_peak(CPU, torch.float32, seconds=0.01, max_rounds=2)
    assert peak.cpu_share == pytest.approx(0.5) and not peak.clean, peak


@pytest.mark.parametrize(("cpu_seconds", "wall", "threads", "share"), [
    (1.0, 1.0, 1, 1.0), (1.0, 1.0, 2, 0.5), (0.0, 0.0, 2, 1.0)])
def test_fallback_share_without_run_queue_accounting(cpu_seconds, wall, threads, share):
    assert flops.fallback_share(cpu_seconds, wall, threads) == share


def test_idle_bf16_machine_caches_its_peak_and_does_not_measure_again(tmp_path, monkeypatch):
    """Acceptance of issue 34: the second bf16 run reads the cache, no round is timed."""
    monkeypatch.setattr(flops, "scheduler_times", FakeScheduler())
    rounds = steady_rounds(monkeypatch)
    first = flops.measured_peak(CPU, torch.bfloat16, tmp_path)
    measured = len(rounds)
    assert measured >= 2 and (tmp_path / flops.PEAK_CACHE).exists()
    assert flops.measured_peak(CPU, torch.bfloat16, tmp_path) == first
    assert len(rounds) == measured, "the second run measured the peak again"


@pytest.mark.parametrize("model", ["debug", "moe-debug"])
def test_a_step_counts_its_samples_times_one_sample_and_reuses_the_count(model, tmp_path):
    """`step_flops` counts one sample once per process and scales it; that is exact only if
    every operator's FLOPs are linear in the batch, which this checks against a count of the
    whole batch (a quadratic-in-batch term or a per-batch constant would show)."""
    cfg = parse_args(["--model", model, "--seq-len", "64", "--batch-size", "3",
                      "--grad-accum-steps", "2", "--cache-dir", str(tmp_path)])
    whole = flops.count_step_flops(lambda: plain_model(cfg), 6, 64)
    hits = sample_flops.cache_info().hits
    first, again = step_flops(cfg, plain_model), step_flops(cfg, plain_model)
    assert first == again == whole
    assert sample_flops.cache_info().hits >= hits + 1


def test_a_model_that_reads_values_on_the_host_is_still_counted_exactly(tmp_path, caplog):
    """transformers' modules call `.item()`, which the meta device refuses: the count falls
    back to fake tensors (exact, no warning), not to the under-counting probe."""
    save_tiny_model(tmp_path / "qwen2", "qwen2")
    cfg = parse_args(["--model", str(tmp_path / "qwen2"), "--model-impl", "transformers",
                      "--seq-len", "32", "--batch-size", "2", "--cache-dir", str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="loom"):
        counted = step_flops(cfg, plain_model)
    assert counted.exact and "lower bound" not in caplog.text
    assert counted.flops == flops.count_step_flops(lambda: plain_model(cfg), 2, 32).flops
