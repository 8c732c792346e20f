"""DeepSeek-V3 parity: the same seed and global batch on one process and under expert
parallel, tensor parallel (latent attention's heads split, its down-projections whole) and
their compositions give the same per-step losses, gradient norms, routing counts and final
parameters (fp32). Every layout replays the single process's routing and each token that
would have chosen otherwise must be a near tie (tests/routing.py, as the MoE parity tests
do; the group-limited router is a `TokenChoiceRouter`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.compat import v_schedules_send_to_own_rank
from tests.compare import assert_norms_close, assert_series_close, column
from tests.deepseek_folders import bias_routing, save_deepseek
from tests.harness import run_ranks
from tests.hf_models import corpus_sample
from tests.parity.test_moe_parity import (
    PARAM_NORM_RTOL,
    assert_losses_and_grad_norms_close,
    assert_same_run,
)

GLOBAL_BATCH = 4
COMMON = ["--model", "deepseek-v3-debug", "--dataset", "random", "--vocab-size", "512",
          "--seq-len", "64", "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3",
          "--warmup-steps", "0"]
MTP = ["--model", "deepseek-v3-mtp-debug"]
"""One multi-token prediction module: its loss joins the backward (a wrong scale of it under
data parallel moves the gradient norms) and is compared as its own metric."""
COMPILE = ["--compile", "--compile-backend", "aot_eager"]
LORA = ["--lora-rank", "4"]
"""Adapters on latent attention's per-head projections and the dense SwiGLU (the family's
targets), the base frozen: a wrong scale or a missed sync moves the losses and norms."""
LAYOUTS = {  # name: (world size, dp degree, flags)
    "single": (1, 1, []),
    "ep2": (2, 2, ["--ep", "2"]),
    "tp2": (2, 1, ["--tp", "2"]),
    "dp2": (2, 2, ["--dp-shard", "2"]),
    "mtp_single": (1, 1, MTP),
    "mtp_ep2": (2, 2, [*MTP, "--ep", "2"]),
    "mtp_tp2": (2, 1, [*MTP, "--tp", "2"]),
    "mtp_cp2": (2, 1, [*MTP, "--cp", "2"]),
    "lora_single": (1, 1, LORA),
    "lora_dp2": (2, 2, LORA),
}
SINGLES = ("single", "mtp_single", "lora_single")
SLOW_LAYOUTS = {
    "ep4": (4, 4, ["--ep", "4"]),
    "tp2_ep2": (4, 2, ["--tp", "2", "--ep", "2"]),
    "cp2": (4, 2, ["--cp", "2"]),
    "simple_fsdp_ep2": (4, 4, ["--data-parallel", "simple-fsdp", "--ep", "2"]),
    "tp2_ep2_etp2": (4, 2, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    "ep2_ac_compile": (2, 2, ["--ep", "2", "--ac", "block", *COMPILE]),
    "tp2_ep2_op_ac_compile": (2, 1, ["--tp", "2", "--ep", "2", "--ac", "op", *COMPILE]),
    "tp2_ep2_etp2_ac_compile": (4, 2, ["--tp", "2", "--ep", "2", "--etp", "2", "--ac",
                                       "block", *COMPILE]),
    "hsdp2x2": (4, 4, ["--dp-replicate", "2", "--dp-shard", "2"]),
    "mtp_tp2_ep2": (4, 2, [*MTP, "--tp", "2", "--ep", "2"]),
    "mtp_cp2_dp2": (4, 2, [*MTP, "--cp", "2"]),
}


def reference_of(layout: str) -> str:
    prefix = layout.partition("_")[0]
    return f"{prefix}_single" if prefix in ("mtp", "lora") else "single"


def launch(world: int, layouts: dict, root: Path, references: Path) -> None:
    runs = [{"argv": [*COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // dp), "--outdir",
                      str(root / name)],
             "routing": "record" if name in SINGLES else str(references / reference_of(name))}
            for name, (size, dp, flags) in layouts.items() if size == world]
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)],
                    timeout=1200)
    assert job.ok, job.describe()


@pytest.fixture(scope="module")
def deepseek_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deepseek_parity")
    launch(1, LAYOUTS, root, root)
    launch(2, LAYOUTS, root, root)
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in SINGLES])
def test_layout_matches_single_process(deepseek_runs: Path, layout: str) -> None:
    assert_matches_reference(deepseek_runs / layout, deepseek_runs / reference_of(layout))


def assert_matches_reference(run: Path, reference: Path) -> None:
    """The moe parity checks, and an MTP run's own metric too."""
    assert_same_run(run, reference)
    if reference.name.startswith("mtp_"):
        assert_series_close(column(run, "mtp/loss"), column(reference, "mtp/loss"),
                            rtol=1e-5, what="mtp/loss")


@pytest.mark.multirank
def test_lora_adapts_latent_attention_and_leaves_the_base_frozen(deepseek_runs: Path) -> None:
    """The family's default targets on the query-bottleneck preset: the up-projections and
    `wo` of every block and the dense SwiGLU carry trained adapters; at dp 2 each frozen
    base weight is bit for bit the single process's."""
    single = torch.load(deepseek_runs / "lora_single" / "params.pt")
    dp2 = torch.load(deepseek_runs / "lora_dp2" / "params.pt")
    adapted = {name.rpartition(".")[0] for name in single if ".lora_" in name}
    for layer in range(3):
        for linear in ("attention.wq_b", "attention.wkv_b", "attention.wo"):
            assert f"layers.{layer}.{linear}" in adapted, (layer, linear, adapted)
    assert "layers.0.feed_forward.w1" in adapted, adapted  # the dense block's SwiGLU
    assert all(single[name].abs().sum() > 0 for name in single if name.endswith("lora_B"))
    for name, ref in single.items():
        if ".lora_" not in name:
            assert torch.equal(dp2[name], ref), name


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_slow_layout_matches_single_process(deepseek_runs: Path, tmp_path: Path,
                                            layout: str) -> None:
    launch(SLOW_LAYOUTS[layout][0], {layout: SLOW_LAYOUTS[layout]}, tmp_path, deepseek_runs)
    assert_matches_reference(tmp_path / layout, deepseek_runs / reference_of(layout))


def assert_pp2_matches(tmp_path: Path, reference: Path, flags: list[str],
                       world: int = 2, dp: int = 1) -> None:
    """Two stages at `flags`: losses, gradient norms and final parameters. Routing is not
    replayed (a stage's routers see micro-batches, which the recorded whole-batch picks do
    not index), as in the MoE family's pp2 x ep2 test."""
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(
        [[*COMMON, *flags, "--pp", "2", "--batch-size", str(GLOBAL_BATCH // dp), "--outdir",
          str(tmp_path / "pp2")]])], timeout=1200)
    assert job.ok, job.describe()
    assert_losses_and_grad_norms_close(tmp_path / "pp2", reference)
    assert_norms_close(torch.load(tmp_path / "pp2" / "params.pt"),
                       torch.load(reference / "params.pt"), rtol=PARAM_NORM_RTOL,
                       what="parameters after 5 AdamW steps")


@pytest.mark.multirank
def test_pp2_matches_single_process(deepseek_runs: Path, tmp_path: Path) -> None:
    """The dense block and the first MoE block on one stage, the rest and the head on the
    other."""
    assert_pp2_matches(tmp_path, deepseek_runs / "single", [])


@pytest.mark.multirank
def test_mtp_pp2_matches_single_process(deepseek_runs: Path, tmp_path: Path) -> None:
    """The MTP module on the last stage, with the head: the first stage sends each depth's
    embedded shifted tokens below the hidden states (their gradient comes back to its
    embedding, a wrong one moves the norms), every stage is handed the micro-batch's ids,
    and each of the micro-batches weighs its MTP loss by its share of the batch."""
    assert_pp2_matches(tmp_path, deepseek_runs / "mtp_single", MTP)


@pytest.mark.multirank
@pytest.mark.slow
def test_slow_pp2_ep2_matches_single_process(deepseek_runs: Path, tmp_path: Path) -> None:
    """Two stages over dp_shard 2, each stage's routed experts split over its 2 ranks: each
    stage's micro-batches dispatched across ep."""
    assert_pp2_matches(tmp_path, deepseek_runs / "single", ["--ep", "2"], world=4, dp=2)


V_REFUSED = pytest.mark.skipif(v_schedules_send_to_own_rank(), reason="refused on this "
                               "torch (loom.config.compose.REFUSALS, tested there)")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved-1f1b",
                                      pytest.param("zero-bubble", marks=V_REFUSED),
                                      pytest.param("dualpipev", marks=V_REFUSED)])
def test_slow_pp2_schedule_matches_single_process(deepseek_runs: Path, tmp_path: Path,
                                                  schedule: str) -> None:
    """The looped schedules: the embedding, three blocks and the head cut into four stages,
    two per rank (V-shaped for the split-backward ones, whose weight gradients come in a
    later pass: one FSDP2 unit per stage, the routed experts inside it)."""
    assert_pp2_matches(tmp_path, deepseek_runs / "single", ["--pp-schedule", schedule])


@pytest.mark.multirank
@pytest.mark.slow
def test_slow_mtp_pp2_interleaved_matches_single_process(deepseek_runs: Path, tmp_path: Path,
                                                        ) -> None:
    """The MTP module on the last of the four stages, with the head, on the first rank."""
    assert_pp2_matches(tmp_path, deepseek_runs / "mtp_single",
                       [*MTP, "--pp-schedule", "interleaved-1f1b"])


@pytest.mark.multirank
@pytest.mark.slow
def test_slow_mtp_pp2_tp2_matches_single_process(deepseek_runs: Path, tmp_path: Path,
                                                 ) -> None:
    """As at pp 2, each stage's activations and MTP embeddings sequence-sharded over tp."""
    assert_pp2_matches(tmp_path, deepseek_runs / "mtp_single", [*MTP, "--tp", "2"], world=4)


@pytest.mark.multirank
def test_imported_folder_trains_at_tp2_ep2_like_one_process(tmp_path: Path) -> None:
    """A transformers-built DeepseekV3ForCausalLM folder (biased routing, YaRN, a query
    bottleneck) trained natively at --tp 2 --ep 2 (the experts over the tp ranks) gives the
    single process's losses, gradient norms, routing counts and parameters. Asked for
    natively by name (`--model-impl native`), which was refused before the folder's shape
    was read (issue #65)."""
    train_imported(tmp_path, [(1, "single", [], True),
                              (2, "tp2_ep2", ["--tp", "2", "--ep", "2", "--model-impl",
                                              "native"], True)])
    config = json.loads((tmp_path / "tp2_ep2" / "config.json").read_text())
    assert config["model"]["family"] == "deepseek-v3", config["model"]
    assert_same_run(tmp_path / "tp2_ep2", tmp_path / "single")


def train_imported(tmp_path: Path, layouts: list[tuple[int, str, list[str], bool]]) -> None:
    """Train the biased-routing transformers-built folder at each (world, name, flags,
    replay the single process's routing) layout, from the same text."""
    folder = save_deepseek(tmp_path / "ds")
    bias_routing(folder)
    (tmp_path / "text.txt").write_text(corpus_sample(20_000))
    common = ["--model", str(folder), "--dataset", str(tmp_path / "text.txt"), "--seq-len",
              "32", "--fp32", "--max-steps", "5", "--seed", "5", "--lr", "1e-3",
              "--batch-size", "4"]
    for world, name, flags, replay in layouts:
        run = {"argv": [*common, *flags, "--outdir", str(tmp_path / name)],
               "routing": "record" if world == 1 else str(tmp_path / "single")}
        job = run_ranks(world, ["tests/workers/parity_worker.py",
                                json.dumps([run] if replay else [run["argv"]])],
                        timeout=1200, env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
        assert job.ok, job.describe()


IMPORTED_MTP = {"plain": [], "fresh_mtp": ["--mtp-layers", "1"]}
"""The folder as it is, and with an MTP module it holds no weights of (transformers writes
none): drawn as a fresh run draws it, on the last stage under pp."""


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("mtp", list(IMPORTED_MTP))
def test_slow_imported_folder_trains_at_pp2_like_one_process(tmp_path: Path, mtp: str) -> None:
    """The imported folder's dense block and first MoE block on one stage, the rest and
    the head on the other: losses, gradient norms and parameters (routing not replayed:
    stages see micro-batches), and `mtp/loss`."""
    flags = IMPORTED_MTP[mtp]
    train_imported(tmp_path, [(1, "single", flags, True),
                              (2, "pp2", [*flags, "--pp", "2"], False)])
    assert_losses_and_grad_norms_close(tmp_path / "pp2", tmp_path / "single")
    assert_norms_close(torch.load(tmp_path / "pp2" / "params.pt"),
                       torch.load(tmp_path / "single" / "params.pt"), rtol=PARAM_NORM_RTOL,
                       what="parameters after 5 AdamW steps")
    assert_mtp_loss_matches(tmp_path / "pp2", tmp_path / "single", mtp)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("mtp", list(IMPORTED_MTP))
def test_slow_imported_folder_trains_at_cp2_like_one_process(tmp_path: Path, mtp: str) -> None:
    """The imported folder (YaRN, latent keys' RoPE part) with each sequence split over two
    ranks: the single process's losses, gradient norms, routing counts and parameters, and
    `mtp/loss`."""
    flags = IMPORTED_MTP[mtp]
    train_imported(tmp_path, [(1, "single", flags, True), (2, "cp2", [*flags, "--cp", "2"],
                                                           True)])
    assert_same_run(tmp_path / "cp2", tmp_path / "single")
    assert_mtp_loss_matches(tmp_path / "cp2", tmp_path / "single", mtp)


def assert_mtp_loss_matches(run: Path, reference: Path, mtp: str) -> None:
    """An MTP run's own metric within 1e-5 of the single process's; none without one."""
    if mtp == "plain":
        assert '"mtp/loss"' not in (run / "metrics-0.jsonl").read_text()
        return
    assert_series_close(column(run, "mtp/loss"), column(reference, "mtp/loss"), rtol=1e-5,
                        what="mtp/loss")
