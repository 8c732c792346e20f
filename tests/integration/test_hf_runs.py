"""Hugging Face models under `loom train`: tiny Llama and Qwen2 folders built with
`transformers` train on 2 ranks (dp 2) and 4 ranks (HSDP 2 x 2) with the same losses and
final weights as one process (fp32); --ac block, --compile and the reshard policy keep the
numerics; a hub id that cannot be reached fails in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_tensors_close, losses
from tests.harness import run_ranks
from tests.hf_models import corpus_sample, save_tiny_model

ARCHS = ("llama", "qwen2")
GLOBAL_BATCH = 4
LOSS_RTOL = 1e-5
PARAM_NORM_RTOL = 1e-3  # norm-wise per tensor after 5 AdamW steps; see test_parity.py
AC_ATOL = 1e-6
COMPILE_ATOL = 1e-4
LAYOUTS = {  # name: (world size, flags)
    "single": (1, []),
    "dp2": (2, ["--dp-shard", "2"]),
    "tp2_forced": (2, ["--tp", "2"]),  # a HF model runs tp 1: both ranks shard data
    "hsdp": (4, ["--dp-replicate", "2", "--dp-shard", "2"]),
}
KNOBS = {"ac": ["--ac", "block"], "compile": ["--compile"],
         "ac_compile": ["--ac", "block", "--compile"],
         "reshard_never": ["--reshard-after-forward", "never"]}
"""Run on the Llama folder at dp 2, against its plain dp 2 run."""
QWEN2_LAYOUTS = ("single", "dp2")
"""Qwen2 (attention biases) trains the layouts that differ by family: tp 2 is forced to 1
and HSDP wraps blocks whichever transformers class it is, so those run on Llama only."""


def layouts_of(arch: str) -> list[str]:
    return [n for n in LAYOUTS if arch == "llama" or n in QWEN2_LAYOUTS]


def run_args(root: Path, arch: str, name: str, flags: list[str], world: int) -> list[str]:
    common = ["--model", str(root / arch), "--model-impl", "transformers",
              "--dataset", str(root / "text.txt"), "--seq-len",
              "32", "--fp32", "--max-steps", "5", "--seed", "5", "--lr", "3e-3"]
    return [*common, *flags, "--batch-size", str(GLOBAL_BATCH // world),
            "--outdir", str(root / "runs" / f"{arch}-{name}")]


def launch(world: int, runs: list[list[str]], root: Path) -> str:
    env = {"LOOM_CACHE_DIR": str(root / "cache"), "LOOM_COMPILE_BACKEND": "aot_eager"}
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs), "--grads"],
                    timeout=1200, env=env)
    assert job.ok, job.describe()
    return job.ranks[0].stdout


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("hf")
    for arch in ARCHS:
        save_tiny_model(root / arch, arch)
    (root / "text.txt").write_text(corpus_sample())
    stdout = ""
    for world in (1, 2, 4):
        runs = [run_args(root, arch, name, flags, world) for name, (size, flags) in
                LAYOUTS.items() if size == world for arch in ARCHS if name in layouts_of(arch)]
        if world == 2:
            runs += [run_args(root, "llama", name, ["--dp-shard", "2", *flags], 2)
                     for name, flags in KNOBS.items()]
        stdout += launch(world, runs, root)
    return root / "runs", stdout


@pytest.mark.multirank
@pytest.mark.parametrize(("arch", "layout"), [(arch, name) for arch in ARCHS
                                              for name in layouts_of(arch) if name != "single"])
def test_layout_matches_single_process(hf_runs, arch: str, layout: str) -> None:
    runs, _ = hf_runs
    reference = losses(runs / f"{arch}-single")
    assert len(reference) == 5 and reference[-1] < reference[0], "training should progress"
    torch.testing.assert_close(losses(runs / f"{arch}-{layout}"), reference,
                               rtol=LOSS_RTOL, atol=0)
    assert_norms_close(torch.load(runs / f"{arch}-{layout}" / "params.pt"),
                       torch.load(runs / f"{arch}-single" / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 5 AdamW steps")


@pytest.mark.multirank
def test_reshard_policy_is_honoured_and_keeps_losses(hf_runs) -> None:
    runs, _ = hf_runs
    torch.testing.assert_close(losses(runs / "llama-reshard_never"), losses(runs / "llama-single"),
                               rtol=LOSS_RTOL, atol=0)
    config = json.loads((runs / "llama-reshard_never" / "config.json").read_text())
    assert config["parallel"]["reshard_after_forward"] == "never", config["parallel"]


@pytest.mark.multirank
def test_pretrained_weights_and_model_shape_are_used(hf_runs) -> None:
    """The run starts from the folder's weights (not loom's init) and takes the vocabulary
    from the model's config, not the smaller tokenizer."""
    runs, _ = hf_runs
    config = json.loads((runs / "llama-single" / "config.json").read_text())
    assert config["model"]["vocab_size"] == 328 and config["model"]["n_layers"] == 2
    assert config["train"]["seed"] == 5
    params = torch.load(runs / "llama-single" / "params.pt")
    assert params["hf.lm_head.weight"].shape == (328, 32)


@pytest.mark.multirank
def test_each_block_is_an_fsdp_unit_under_hsdp(hf_runs) -> None:
    _, stdout = hf_runs
    assert ("Hugging Face LlamaForCausalLM: 2 blocks, AC none, compile off; FSDP2 3 units "
            "over HSDP mesh (2, 2)") in stdout


@pytest.mark.multirank
def test_tp_is_forced_to_one_with_a_recorded_warning(hf_runs) -> None:
    runs, _ = hf_runs
    config = json.loads((runs / "llama-tp2_forced" / "config.json").read_text())
    assert config["parallel"]["tp"] == 1
    assert config["mesh"]["dp_shard"] == 2 and config["mesh"]["tp"] == 1
    assert sum("--tp 2 ignored" in w for w in config["warnings"]) == 1


@pytest.mark.multirank
@pytest.mark.parametrize("knob", ["ac", "ac_compile"])
def test_activation_checkpointing_keeps_losses_and_gradients(hf_runs, knob: str) -> None:
    runs, stdout = hf_runs
    plain, knobbed = runs / "llama-dp2", runs / f"llama-{knob}"
    atol = AC_ATOL if knob == "ac" else COMPILE_ATOL
    torch.testing.assert_close(losses(knobbed), losses(plain), rtol=0, atol=atol)
    ref_grads = torch.load(plain / "grads.pt")
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    assert_tensors_close(torch.load(knobbed / "grads.pt"), ref_grads, rtol=0, atol=atol,
                         what="gradients at the final weights")
    assert "AC block, compile aot_eager" in stdout


@pytest.mark.multirank
def test_compiled_blocks_keep_losses(hf_runs) -> None:
    runs, stdout = hf_runs
    torch.testing.assert_close(losses(runs / "llama-compile"), losses(runs / "llama-dp2"),
                               rtol=0, atol=COMPILE_ATOL)
    assert "AC none, compile aot_eager" in stdout


@pytest.mark.parametrize("env", [{"HF_ENDPOINT": "http://127.0.0.1:9"},
                                 {"HF_HUB_OFFLINE": "1"}], ids=["unreachable", "offline"])
def test_unreachable_hub_model_fails_in_one_line(tmp_path, env: dict[str, str]) -> None:
    """No network (a closed port) or offline mode with an empty cache: one line, exit 2,
    rather than retrying (the timeout catches retries; speed is not asserted under load)."""
    full_env = {**os.environ, "HF_HOME": str(tmp_path / "hf"),
                "LOOM_CACHE_DIR": str(tmp_path / "cache"), **env}
    proc = subprocess.run([sys.executable, "-m", "loom", "train", "--model",
                           "meta-llama/Llama-3.2-1B", "--max-steps", "1"], cwd=tmp_path,
                          env=full_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model meta-llama/Llama-3.2-1B")
