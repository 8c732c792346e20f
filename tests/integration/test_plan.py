"""`loom plan`: predicted per-rank peaks against real gloo ranks; the 671B preset at 2048
ranks without allocating; bad input."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from loom.plan.command import main as plan_main
from loom.plan.command import parse_size
from tests.harness import run_ranks
from tests.plan_accuracy import compare

BASE = ["--model", "debug", "--fp32", "--dataset", "random", "--seq-len", "128",
        "--batch-size", "2", "--max-steps", "2"]
HSDP = ["--dp-replicate", "2", "--ac", "block", "--loss-impl", "chunked"]
TP_FUSED = ["--tp", "2", "--loss-impl", "fused-linear", "--ac", "selective"]
PP = ["--pp", "2", "--batch-size", "4"]  # 1F1B, 4 micro-batches: rank 0 holds two
INTERLEAVED = ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--batch-size", "4"]
CP = ["--cp", "2"]
DEEP = ["--n-layers", "8", "--vocab-size", "512"]  # blocks outweigh the head
ACCUMULATE = ["--grad-accum-steps", "2", *DEEP]  # unreduced gradients held, per block
ACCUMULATE_SHARDED = [*ACCUMULATE, "--accum-reduce", "micro-batch"]  # nothing held
DEEP_PP = [*PP, *DEEP]  # 4 blocks a stage, extrapolated from 1 and 2
EP = ["--model", "moe-debug", "--dtype", "bf16", "--ep", "2"]  # traced as balanced routing
COMPILED = ["--compile", "--act-mem-budget", "0.5", "--loss-impl", "compiled", "--seq-len",
            "512", "--batch-size", "4", "--vocab-size", "2048"]
FLOAT8 = ["--dtype", "bf16", "--float8", "tensorwise"]  # emulated on CPU; float8 all-gather
MUON = ["--optimizer", "muon"]  # one momentum buffer per block matrix, AdamW's two elsewhere
RUNS = [[], HSDP, ["--tp", "2", "--loss-impl", "loss-parallel"], TP_FUSED]
TOLERANCE = 0.10


@pytest.mark.multirank
def test_predicted_peaks_within_ten_percent_of_measured_on_2_ranks(tmp_path):
    """HSDP + block AC + chunked loss, tp + fused-linear + selective AC, pipeline parallel
    (per-stage traces, in-flight micro-batches, receive buffers), context parallel (the
    gathered K/V), expert parallel, float8 (torchao's linears as they run, emulated, and
    FSDP2's float8 all-gather) and Muon's state: one launch."""
    assert_predictions_close(tmp_path, 2, [HSDP, TP_FUSED, PP, CP, EP, FLOAT8, MUON])


@pytest.mark.multirank
@pytest.mark.slow
def test_accumulation_and_a_deeper_stage_predicted_within_ten_percent_on_2_ranks(tmp_path):
    """Gradient accumulation, reduced per step and per micro-batch, and a deeper pipeline
    stage (what the first micro-batch leaves unreduced): one launch."""
    assert_predictions_close(tmp_path, 2, [ACCUMULATE, ACCUMULATE_SHARDED, DEEP_PP])


@pytest.mark.multirank
@pytest.mark.slow
def test_predicted_peaks_within_ten_percent_of_measured_on_4_ranks(tmp_path):
    """FSDP, HSDP + block AC + chunked loss, tp + loss-parallel, tp + fused-linear +
    selective AC, on 4 ranks: one launch measures all four."""
    assert_predictions_close(tmp_path, 4, RUNS)


@pytest.mark.multirank
def test_compiled_blocks_and_loss_predicted_within_ten_percent(tmp_path):
    """--compile at budget 0.5 with the compiled loss, measured at the CPU allocator: the
    partitioner's saved set and the fused loss, which the eager trace only stands in for.
    A shape where the blocks' activations outweigh the loss, so the budget shows.

    The default one-process path: unwrapped, model and loss one compiled graph, whose
    backward writes the logits' gradient into the logits' own (donated) storage. Before the
    trace modelled that donation it planned this step at 95.36 MiB against 82.65 measured
    (+15 %); now 81.35 (Intel Xeon, torch 2.13). Under FSDP2 at one process
    ($LOOM_SINGLE_DEVICE=fsdp2) the loss compiles apart and 95.36 is its peak."""
    assert_predictions_close(tmp_path, 1, [COMPILED])


@pytest.mark.multirank
def test_interleaved_pipeline_predicted_within_ten_percent(tmp_path):
    """Two stages a rank, their micro-batches alive in torch's interleaved order (the head
    stage's logits only while its own micro-batch is in flight), measured at the allocator
    (the tracker follows one FSDP root)."""
    assert_predictions_close(tmp_path, 2, [INTERLEAVED])


def assert_predictions_close(tmp_path, ranks: int, runs: list[list[str]],
                             env: dict[str, str] | None = None) -> None:
    argv = [[*BASE, *flags, "--outdir", str(tmp_path / str(i))] for i, flags in enumerate(runs)]
    job = run_ranks(ranks, ["-m", "tests.plan_measure", json.dumps(argv)], timeout=600,
                    env={"LOOM_METRICS": "0", **(env or {})})
    assert job.ok, job.describe()
    rows = compare(ranks, [[*BASE, *flags] for flags in runs], [r.stdout for r in job.ranks])
    table = "\n".join(f"{' '.join(r.flags[len(BASE):]) or 'FSDP':<50} predicted "
                      f"{r.predicted_mib:.2f} MiB measured {r.measured_mib:.2f} MiB "
                      f"error {100 * r.error:+.1f}%" for r in rows)
    worst = max(rows, key=lambda r: abs(r.error))
    assert all(r.measured_mib > 0 for r in rows), table
    assert abs(worst.error) <= TOLERANCE, f"worst {100 * worst.error:+.1f}%:\n{table}"


@pytest.mark.slow
def test_671b_moe_at_2048_ranks_plans_without_allocating():
    """~5 s here (traced with FSDP's own collectives, as on H100s; gloo's pairwise exchange
    took 110 s at 2048 fake ranks); the model would need ~1.3 TB of weights alone."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run([sys.executable, "-m", "loom", "plan", "--model", "moe-671b",
                          "--world-size", "2048", "--device-memory", "80GiB", "--device",
                          "H100", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(plan) >= {"peak_gib", "fits", "breakdown", "step_time_s"}, plan
    assert plan["breakdown"]["optimizer"] > 0 and plan["step_time_s"] > 0, plan
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert rss_gib < 4 or before / 2**20 >= 4, f"plan process peaked at {rss_gib:.1f} GiB RSS"


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "4", "--device-memory", "lots"], "is not a size"),
    (["--world-size", "3", "--device-memory", "8GiB", "--tp", "2"], "world size 3"),
    (["--world-size", "4", "--device-memory", "8GiB", "--model", "moe-debug", "--fp32"],
     "fp32 experts"),
    (["--world-size", "2", "--device-memory", "8GiB", "--model", "moe-debug", "--pp", "2"],
     "mixture-of-experts"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_sizes():
    assert parse_size("64GiB") == 64 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("512MiB") == 512 * 2**20


@pytest.mark.slow
def test_search_lines_fit_when_planned_exactly():
    """--search scales each phase of a micro-batch-1 trace, which over-counts temporaries
    that do not grow with the batch: the exact plan of its first line must fit, and the
    search's figure may be at most 10 % under it (never optimistic) and 50 % over."""
    argv = ["--model", "debug", "--fp32", "--seq-len", "128", "--world-size", "2",
            "--device-memory", "300MiB"]
    out = subprocess.run([sys.executable, "-m", "loom", "plan", *argv, "--search", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert found, out.stdout
    train_flags = found[0]["command"].split(" loom train ", 1)[1].split()
    exact = subprocess.run([sys.executable, "-m", "loom", "plan", *train_flags,
                            "--world-size", "2", "--device-memory", "300MiB", "--json"],
                           capture_output=True, text=True, timeout=600)
    assert exact.returncode == 0, exact.stderr[-3000:]
    plan = json.loads(exact.stdout.strip().splitlines()[-1])
    assert plan["fits"], plan
    error = found[0]["peak_gib"] / plan["peak_gib"] - 1
    assert -0.10 <= error <= 0.50, f"search {found[0]['peak_gib']:.4f} GiB vs exact " \
                               f"{plan['peak_gib']:.4f} GiB ({100 * error:+.1f}%)"


def test_pipeline_plans_with_the_fused_head_and_interleaved_stages(capsys):
    """The last stage's fused head runs outside the stage's forward, once per traced
    micro-batch; interleaved ranks hold two stages: both plan, with receive buffers."""
    base = ["--model", "debug", "--fp32", "--seq-len", "128", "--batch-size", "4",
            "--world-size", "2", "--device-memory", "1GiB", "--json", "--pp", "2"]
    for flags in (["--loss-impl", "fused-linear"], ["--pp-schedule", "interleaved-1f1b"]):
        assert plan_main([*base, *flags]) == 0, capsys.readouterr().err
        plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert plan["breakdown"]["pipeline_buffers"] > 0 and plan["layout"]["pp"] == 2, plan


def test_op_checkpointing_plans_between_block_and_attention_only(capsys):
    """--ac op keeps the attention and every other matmul's output: the plan (which traces
    the checkpointed blocks under fake tensors) puts its activations between --ac block's
    (a block's input only) and --ac selective's (all but the attention)."""
    activations = {}
    for ac in ("block", "op", "selective"):
        argv = ["--model", "debug", "--fp32", "--seq-len", "512", "--batch-size", "4",
                "--n-layers", "8", "--world-size", "1", "--device-memory", "8GiB",
                "--ac", ac, "--json"]
        assert plan_main(argv) == 0
        plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        activations[ac] = plan["breakdown"]["activations"]
    assert activations["block"] < activations["op"] < activations["selective"], activations
