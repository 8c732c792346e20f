"""`loom plan` against torchtitan's published Llama 3.1 runs on H100.

Source: torchtitan's `benchmarks/llama3_h100_202412_torchtitan.md` (December 2024; torch
1963fc8, torchao eab345c, torchtitan 9dec370; H100 96 GB HBM2e, 500 W), whose memory column
is the caching allocator's reserved peak. Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch
2, selective (per-op) activation checkpointing; seq 8192 is torchtitan 9dec370's
`train_configs/llama3_8b.toml`; Table 3: the same on 128 GPUs. Table 4: 70B, 256 GPUs,
FSDP 32 x TP 8, local batch 16, full AC, torch.compile, Float8 (the "2D" row; "2D +
AsyncTP" is 876 tok/s, 67.6 GiB); seq 8192 from its `llama3_70b.toml`; loss parallel is
torchtitan's default under tp. Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, 1F1B against
interleaved 1F1B (TABLE_5); Table 6: the same model at TP 8 x PP 8 x CP 1-8, 1F1B, seq
32768-262144. The rows, planned values and the reasons for the misses are in
docs/planning.md.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from loom.config import JobConfig, parse_args
from loom.config.resolved import settled
from loom.losses import loss_impl_for
from loom.parallel.mesh import ParallelDims
from loom.plan.command import make_plan
from loom.plan.float8 import float8_linears
from loom.plan.fusion import unfused_seconds
from loom.plan.speed import _flops, comm_seconds, param_count, predict_step_time
from loom.plan.trace import fake_world

LLAMA3_8B = ["--dim", "4096", "--n-layers", "32", "--n-heads", "32", "--n-kv-heads", "8",
             "--hidden-dim", "14336", "--vocab-size", "128256", "--rope-theta", "500000",
             "--seq-len", "8192", "--max-seq-len", "8192", "--dtype", "bf16"]
TABLE_1 = [*LLAMA3_8B, "--batch-size", "2", "--ac", "op"]
LLAMA3_70B = ["--dim", "8192", "--n-layers", "80", "--n-heads", "64", "--n-kv-heads", "8",
              "--hidden-dim", "28672", "--vocab-size", "128256", "--rope-theta", "500000",
              "--seq-len", "8192", "--max-seq-len", "8192", "--dtype", "bf16"]
TABLE_4 = [*LLAMA3_70B, "--tp", "8", "--batch-size", "16", "--ac", "full",
           "--loss-impl", "loss-parallel", "--float8", "tensorwise"]
GiB = 2**30


def planned(argv: list[str], compile_: bool = False) -> JobConfig:
    """The run's config, --compile set on it as the published run had it."""
    cfg = parse_args(argv)
    cfg = replace(cfg, parallel=replace(cfg.parallel, compile=compile_))
    return settled(cfg, loss_impl=loss_impl_for(cfg))


def tokens_per_gpu(cfg: JobConfig, world_size: int, tmp_path: Path) -> float:
    with fake_world(world_size):
        step = predict_step_time(cfg, world_size, "H100", tmp_path)
    return cfg.train.batch_size * cfg.data.seq_len / step.seconds


@pytest.mark.parametrize(("world", "flags", "compile_", "published"), [
    (8, [], False, 5762), (8, [], True, 6667), (8, ["--float8", "tensorwise"], True, 8532),
    (128, [], False, 5605), (128, [], True, 6514), (128, ["--float8", "tensorwise"], True, 8380)],
    ids=["eager", "compiled", "compiled-float8", "128-eager", "128-compiled", "128-float8"])
def test_table_1_and_3_tokens_per_gpu_within_25_percent(world, flags, compile_, published,
                                                        tmp_path):
    """FLOPs over the bf16 peak at 0.4 efficiency; float8: the swapped linears at the
    float8 peak plus the casts' traffic (loom.plan.float8); eager: plus the pointwise
    traffic compile fuses away (loom.plan.fusion). Table 3 is Table 1's run on 128 GPUs
    (FSDP 128: its collectives cross nodes, still hidden behind the compute)."""
    planned_tps = tokens_per_gpu(planned([*TABLE_1, *flags], compile_), world, tmp_path)
    assert abs(planned_tps / published - 1) <= 0.25, planned_tps


def test_table_1_compile_speeds_the_step_by_the_fused_pointwise_traffic(tmp_path):
    """Published: compile is 16 % faster (6,667 / 5,762); the plan's eager step is longer
    by exactly the unfused norms', RoPE's and SwiGLU's traffic, 14 % here, from byte
    counts alone (no term fitted to the published rows)."""
    eager, compiled = planned(TABLE_1), planned(TABLE_1, True)
    with fake_world(8):
        steps = [predict_step_time(c, 8, "H100", tmp_path).seconds for c in (eager, compiled)]
    tokens = eager.train.batch_size * eager.data.seq_len
    assert steps[0] - steps[1] == pytest.approx(unfused_seconds(eager, tokens, 1, "H100"))
    assert abs(steps[0] / steps[1] / (6667 / 5762) - 1) <= 0.05, steps[0] / steps[1]


def test_float8_speeds_the_step_by_its_matmuls_less_its_casts(tmp_path):
    """On H100 the swapped linears run at twice the bf16 peak: the compiled step is faster,
    by less than 2x (attention and the head stay bf16, the casts cost traffic); eager casts
    (33 bytes an element, not 5) take more of it back, as torchao's guidance to compile
    float8 says."""
    bf16 = tokens_per_gpu(planned(TABLE_1, True), 8, tmp_path)
    fp8 = tokens_per_gpu(planned([*TABLE_1, "--float8", "tensorwise"], True), 8, tmp_path)
    eager_fp8 = tokens_per_gpu(planned([*TABLE_1, "--float8", "tensorwise"]), 8, tmp_path)
    assert bf16 < fp8 < 2 * bf16
    assert eager_fp8 < fp8


def test_table_1_peak_within_15_percent(tmp_path):
    """82.4 GiB reserved, eager FSDP with per-op SAC on 96 GiB."""
    cfg = planned(TABLE_1)
    with fake_world(8):
        plan = make_plan(cfg, 8, 96 * GiB, "H100", tmp_path)
    assert plan.fits
    assert abs(plan.peak_gib / 82.4 - 1) <= 0.15, plan.peak_gib


TABLE_4_RECORDED_ERROR = -0.491
"""docs/planning.md: the plan's 70B peak (36.61 GiB) is 49.1 % under torchtitan's 71.9 GiB.
Its loss upcasts the vocab-sharded logits to fp32 and peaks 16.9 GiB above loom's (traced);
the other 17.6 GiB is unexplained, the published figure being the allocator's reserved peak
on 256 ranks (loom's own compiled steps on one H200 are traced within 5 %:
tests/unit/plan/test_device_runs.py)."""


@pytest.mark.slow
def test_table_4_peak_is_the_recorded_difference_and_fits(tmp_path):
    """Through the planner's function. ~1 min: the float8 blocks traced at 256 fake ranks."""
    cfg = planned(TABLE_4, compile_=True)
    with fake_world(256):
        plan = make_plan(cfg, 256, 96 * GiB, "H100", tmp_path)
    assert plan.fits
    assert abs(plan.peak_gib / 71.9 - 1 - TABLE_4_RECORDED_ERROR) <= 0.02, plan.peak_gib
    assert abs(plan.tokens_per_s / 256 / 829 - 1) <= 0.25, plan.tokens_per_s / 256


LLAMA3_405B = ["--dim", "16384", "--n-layers", "126", "--n-heads", "128", "--n-kv-heads", "8",
               "--hidden-dim", "53248", "--vocab-size", "128256", "--rope-theta", "500000",
               "--seq-len", "8192", "--max-seq-len", "8192", "--dtype", "bf16"]
TABLE_5 = [*LLAMA3_405B, "--tp", "8", "--pp", "8", "--batch-size", "32", "--ac", "full",
           "--loss-impl", "chunked-backward", "--float8", "tensorwise", "--pp-microbatches", "8"]
"""Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32, full AC, compile, Float8,
async TP; seq 8192 from torchtitan 9dec370's `llama3_405b.toml`, 8 micro-batches (its
default: the pp degree) and 2 stages a rank under the interleaved schedule (its default
split for looped schedules). Loss: chunked-backward, as docs/planning.md's memory rows."""


@pytest.mark.parametrize(("schedule", "published"),
                         [("1f1b", 100), ("interleaved-1f1b", 128)])
def test_table_5_tokens_per_gpu_within_25_percent(schedule, published, tmp_path):
    """The bubble (p-1)/(v m + p-1) stretches each rank's compute and its share of the tp
    collectives: 7/15 of the 1F1B step, 7/23 of the interleaved one. torchtitan counts a
    rank's tokens over tp x pp (its non-data-parallel size)."""
    cfg = planned([*TABLE_5, "--pp-schedule", schedule], compile_=True)
    with fake_world(512):
        step = predict_step_time(cfg, 512, "H100", tmp_path)
    planned_tps = cfg.train.batch_size * cfg.data.seq_len / (8 * 8) / step.seconds
    assert abs(planned_tps / published - 1) <= 0.25, planned_tps


@pytest.mark.parametrize(("cp", "published"), [(1, 76), (2, 47), (4, 31), (8, 16)])
def test_table_6_tokens_per_gpu_within_25_percent(cp, published, tmp_path):
    """Table 6: 405B, 512 GPUs, TP 8 x PP 8 x CP cp x FSDP 8/cp, 1F1B, local batch 8, seq
    32768 x cp (8 micro-batches of one sample), full AC, compile, Float8, async TP; tokens
    per GPU over tp x pp x cp."""
    seq = str(32768 * cp)
    cfg = planned([*TABLE_5, "--pp-schedule", "1f1b", "--batch-size", "8", "--cp", str(cp),
                   "--seq-len", seq, "--max-seq-len", seq], compile_=True)
    with fake_world(512):
        step = predict_step_time(cfg, 512, "H100", tmp_path)
    planned_tps = cfg.train.batch_size * cfg.data.seq_len / (8 * 8 * cp) / step.seconds
    assert abs(planned_tps / published - 1) <= 0.25, planned_tps


def test_pipeline_rank_waits_on_its_own_layers_tp_collectives():
    """A pipeline rank runs 1/pp of the blocks: their sequence-parallel collectives, not
    the whole model's, stretched by its bubble like its compute."""
    cfg = parse_args([*LLAMA3_8B, "--batch-size", "4", "--tp", "2", "--pp", "4",
                      "--pp-microbatches", "4"])
    dims = ParallelDims.from_config(cfg.parallel, 8)
    sends = comm_seconds(cfg, dims, "H100", share=0.0)[1]
    whole = comm_seconds(cfg, dims, "H100")[1] - sends
    quarter = comm_seconds(cfg, dims, "H100", share=0.25)[1] - sends
    stretched = comm_seconds(cfg, dims, "H100", share=0.25, stretch=7 / 4)[1] - sends
    assert sends > 0 and whole > 0
    assert quarter == pytest.approx(whole / 4) and stretched == pytest.approx(quarter * 7 / 4)


def test_float8_plan_on_a_device_without_float8_cores_is_the_bf16_plan(tmp_path):
    """An A100 (as the CPU) has no float8 tensor cores: `--float8-emulate` runs there at
    bf16 speed, and the estimate keeps the bf16 matmuls."""
    small = ["--model", "debug", "--dtype", "bf16", "--seq-len", "128"]
    cfg, fp8 = planned(small), planned([*small, "--float8", "tensorwise"])
    with fake_world(2):
        times = [predict_step_time(c, 2, "A100", tmp_path).compute_s for c in (cfg, fp8)]
    assert times[0] == times[1]


def test_tensorwise_float8_gathers_weights_and_tp_activations_in_one_byte():
    """FSDP2 gathers tensorwise float8 weights in 1 byte (rowwise ones in --dtype); torchao's
    tp styles all-gather float8 activations, the reduce-scatters stay bf16: 6 of 8 units."""
    base = [*LLAMA3_8B, "--batch-size", "1", "--tp", "2", "--reshard-after-forward", "always",
            "--reduce-dtype", "fp32"]  # per weight: gathered twice (2 x 2 bytes), reduced (4)
    dims = ParallelDims.from_config(parse_args(base).parallel, 16)
    plain, tensorwise, rowwise = (
        comm_seconds(parse_args([*base, *flags]), dims, "H100")
        for flags in ([], ["--float8", "tensorwise"], ["--float8", "rowwise"]))
    assert tensorwise[0] < plain[0] == rowwise[0]
    linears = float8_linears(parse_args(base).model)
    everything, _ = param_count(parse_args(base).model)
    # a swapped weight moves 2 x 1 + 4 bytes of the 8
    assert tensorwise[0] == pytest.approx(plain[0] * (1 - linears.weights / everything / 4))
    assert tensorwise[1] == pytest.approx(plain[1] * 6 / 8) and rowwise[1] == plain[1]


AGPT_2B = ["--model", "agpt-2b", "--dtype", "bf16", "--batch-size", "2"]
MAX_1550_PEAK = 298.2e12
"""The Max 1550 stack's bf16 peak in loom's table, the one the published MFU figures use
(loom.observability.devices)."""
RECIPE = [*AGPT_2B, "--seq-len", "7320", "--loss-impl", "compiled", "--act-mem-budget", "0.5"]
"""The torchtitan-matching agpt-2b recipe (../shared/spec/figures.md, "Parity with
torchtitan"): 24 Max 1550 stacks, dp 24, --compile."""
RECIPE_STEP_S = 2 * 7320 / 7180
"""Published ~7,180 tokens/s per rank (issue 65; figures.md: ~7,300 for torchtitan, the
ezpz example within noise) at 2 x 7,320 tokens a rank: 2.04 s a step."""
RECIPE_RECORDED_ERROR = -0.320
"""docs/planning.md: the plan's 1.386 s is 32.0 % under 2.04 s. Its FLOPs agree with the
published ~79 TFLOP/s a rank (1.600e14 counted against 1.61e14); FSDP's 0.91 s of gathers and
reductions hide behind 1.39 s of compute; the rest is the matmul efficiency: the plan's
assumed 0.40 of the peak against the 0.265 this run reached."""


def test_agpt_2b_recipe_on_max_1550_is_the_recorded_difference(tmp_path):
    """Planned from the Max 1550 record's own figures (no CPU fallback: 15.2 s before)."""
    cfg = planned(RECIPE, compile_=True)
    with fake_world(24):
        step = predict_step_time(cfg, 24, "Max 1550", tmp_path)
    assert abs(_flops(cfg) / (79e12 * RECIPE_STEP_S) - 1) <= 0.05  # the FLOPs term agrees
    assert step.exposed_comm_s == 0.0  # FSDP's traffic hides behind the compute
    assert abs(step.seconds / RECIPE_STEP_S - 1 - RECIPE_RECORDED_ERROR) <= 0.02, step


EZPZ = [*AGPT_2B, "--vocab-size", "128000", "--seq-len", "8192"]
"""The ezpz example past the OOM cliff (figures.md): agpt-2b at vocab 128,000, seq 8192,
batch 2, dp 24 on Max 1550 stacks, --compile."""
EZPZ_MFU = {"compiled": 0.334, "fused-linear": 0.288}
"""figures.md's MFU per loss mode; the step time is the counted FLOPs over MFU x the peak
(1.58 s and 1.84 s: issue 65's figures, derived the same way)."""
EZPZ_RECORDED_ERROR = {"fused-linear": -0.280}
"""docs/planning.md: the plan prices the loss modes alike (the same FLOPs at 0.40); the
published fused-linear step ran at 0.288 of the peak, 14 % below the compiled one's 0.334."""


@pytest.mark.parametrize("loss", list(EZPZ_MFU))
def test_ezpz_compiled_and_fused_linear_steps(loss, tmp_path):
    cfg = planned([*EZPZ, "--loss-impl", loss], compile_=True)
    with fake_world(24):
        step = predict_step_time(cfg, 24, "Max 1550", tmp_path)
    published = _flops(cfg) / (EZPZ_MFU[loss] * MAX_1550_PEAK)
    assert published == pytest.approx({"compiled": 1.58, "fused-linear": 1.84}[loss], abs=0.01)
    error = step.seconds / published - 1
    if loss in EZPZ_RECORDED_ERROR:
        assert abs(error - EZPZ_RECORDED_ERROR[loss]) <= 0.02, step
    else:
        assert abs(error) <= 0.20, step


SWEEP_ROW = [*AGPT_2B, "--seq-len", "8192", "--loss-impl", "compiled", "--act-mem-budget",
             "0.5"]
"""figures.md's batch / loss / budget sweep: batch 2, compiled loss, budget 0.5 fits (~44
GiB): the published peak beside the recipe (no peak is published at seq 7,320)."""
SWEEP_ROW_RECORDED_ERROR = -0.388
"""docs/planning.md: the plan's 26.9 GiB is 38.8 % under ~44 GiB; the 17.1 GiB gap is the
loss-mode gap of the seq-2048 table (the published compiled loss held 2.9-4.4 GiB more than
loom's at 4,096 tokens, about one fp32 logits tensor) at four times the tokens (11.6-17.6)."""


@pytest.mark.slow
def test_agpt_2b_sweep_row_peak_is_the_recorded_difference(tmp_path):
    """~1 min: agpt-2b traced at 24 fake ranks."""
    cfg = planned(SWEEP_ROW, compile_=True)
    with fake_world(24):
        plan = make_plan(cfg, 24, 64 * GiB, "Max 1550", tmp_path)
    assert plan.fits
    assert abs(plan.peak_gib / 44 - 1 - SWEEP_ROW_RECORDED_ERROR) <= 0.03, plan.peak_gib


@pytest.mark.slow
def test_ezpz_fused_linear_holds_less_than_the_compiled_loss(tmp_path):
    """The published rows' relation (1.50 against 8.76 GiB allocated after the step; loom
    plans the step's peak, docs/planning.md): fused-linear's peak is the lower, by the
    logits-sized buffers it never makes. ~2 min."""
    peaks = {}
    for loss in EZPZ_MFU:
        cfg = planned([*EZPZ, "--loss-impl", loss], compile_=True)
        with fake_world(24):
            peaks[loss] = make_plan(cfg, 24, 64 * GiB, "Max 1550", tmp_path).peak_gib
    logits_gib = 2 * 8192 * 128000 * 2 / GiB  # bf16
    assert peaks["compiled"] - peaks["fused-linear"] >= logits_gib, peaks
