"""Hugging Face checkpoints trained natively: tiny Llama (3.1 RoPE scaling, tied), Qwen3 and
Qwen3-MoE folders built locally by transformers load into loom's families with transformers'
logits, train under tp x pp, tp x cp and ep with the losses of one process, and export back
to folders transformers loads: bit-identical after 0 steps, same logits after training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom.config import parse_args
from loom.trainer.resolve import resolve_model
from tests.compare import losses
from tests.harness import REPO, run_ranks
from tests.hf_models import corpus_sample, save_tiny_model
from tests.native_import import assert_logits_equal_transformers, imported

transformers = pytest.importorskip("transformers")

LOGITS_RTOL = 1e-5
LOSS_RTOL = 1e-5
GLOBAL_BATCH = 4
LAYOUTS = {  # arch: {layout: (world size, flags)}
    "llama31": {"tp2_pp2": (4, ["--tp", "2", "--pp", "2"])},
    "qwen3": {"tp2_cp2": (4, ["--tp", "2", "--cp", "2"])},
    "qwen3_moe": {"ep2": (2, ["--ep", "2"])},
}


@pytest.mark.parametrize("arch", ["llama", "llama31", "qwen3", "qwen3_moe"])
def test_imported_logits_equal_transformers(tmp_path: Path, arch: str) -> None:
    folder = save_tiny_model(tmp_path / arch, arch)
    cfg, model = imported(folder)
    assert cfg.model.model_impl == "native" and cfg.model.family in arch.replace("_", "-")
    assert_logits_equal_transformers(model, folder, LOGITS_RTOL)


def test_architecture_without_native_family_takes_transformers_path(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "qwen2", "qwen2")
    cfg = resolve_model(parse_args(["--model", str(folder)]))
    assert cfg.model.model_impl == "transformers"
    assert "no native family serves Qwen2ForCausalLM" in cfg.model.model_impl_reason


def loom(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={"PYTHONPATH": str(REPO / "src"),
                                                      "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("case", ["native_unserved", "shape_mismatch", "missing_shard"])
def test_bad_checkpoints_fail_in_one_line(tmp_path: Path, case: str) -> None:
    arch = "qwen2" if case == "native_unserved" else "llama"
    folder = save_tiny_model(tmp_path / arch, arch)
    if case == "shape_mismatch":
        config = json.loads((folder / "config.json").read_text())
        config["intermediate_size"] = 48
        (folder / "config.json").write_text(json.dumps(config))
    if case == "missing_shard":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                "lm_head.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "text.txt").write_text(corpus_sample(20_000))
    proc = loom("train", "--model", str(folder), "--model-impl", "native", "--dataset",
                str(tmp_path / "text.txt"), "--seq-len", "32", "--max-steps", "1",
                "--outdir", str(tmp_path / "run"), cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    expected = {"native_unserved": "no native family serves Qwen2ForCausalLM",
                "shape_mismatch": "but its config.json makes",
                "missing_shard": "is missing"}[case]
    assert expected in lines[-1], lines[-1]
    assert not any((tmp_path / "run").glob("checkpoints/*"))


def run_args(root: Path, arch: str, name: str, flags: list[str], world: int) -> list[str]:
    common = ["--model", str(root / arch), "--dataset", str(root / "text.txt"), "--seq-len",
              "32", "--fp32", "--max-steps", "4", "--seed", "5", "--lr", "1e-3",
              "--checkpoint-interval", "4"]
    return [*common, *flags, "--batch-size", str(GLOBAL_BATCH // dp(flags, world)),
            "--outdir", str(root / "runs" / f"{arch}-{name}")]


def dp(flags: list[str], world: int) -> int:
    """The data-parallel degree of a layout: what the other degrees leave of the world."""
    other = 1
    for flag in ("--tp", "--pp", "--cp"):
        if flag in flags:
            other *= int(flags[flags.index(flag) + 1])
    return world // other


@pytest.fixture(scope="module")
def native_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("native")
    for arch in (*LAYOUTS, "qwen2"):
        save_tiny_model(root / arch, arch)
    (root / "text.txt").write_text(corpus_sample())
    env = {"LOOM_CACHE_DIR": str(root / "cache")}
    by_world: dict[int, list[list[str]]] = {1: [run_args(root, a, "single", [], 1)
                                                for a in LAYOUTS]}
    for arch, layouts in LAYOUTS.items():
        for name, (world, flags) in layouts.items():
            by_world.setdefault(world, []).append(run_args(root, arch, name, flags, world))
    by_world[1].append(run_args(root, "llama31", "zero", ["--lr", "0"], 1))
    by_world[1].append(run_args(root, "qwen2", "single", [], 1))  # transformers' path
    for world, runs in sorted(by_world.items()):
        job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)],
                        timeout=1200, env=env)
        assert job.ok, job.describe()
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("arch,layout", [(a, n) for a, ls in LAYOUTS.items() for n in ls])
def test_native_import_trains_like_one_process(native_runs: Path, arch: str,
                                               layout: str) -> None:
    runs = native_runs / "runs"
    config = json.loads((runs / f"{arch}-{layout}" / "config.json").read_text())
    assert config["model"]["model_impl"] == "native", config["model"]
    assert config["model"]["family"] == arch.replace("_", "-").replace("llama31", "llama")
    reference = losses(runs / f"{arch}-single")
    assert len(reference) == 4
    torch.testing.assert_close(losses(runs / f"{arch}-{layout}"), reference,
                               rtol=LOSS_RTOL, atol=0)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.multirank
def test_import_zero_steps_export_gives_every_tensor_back(native_runs: Path,
                                                          tmp_path: Path) -> None:
    step = native_runs / "runs" / "llama31-zero" / "checkpoints" / "step-4"
    proc = loom("export", str(step), str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "LlamaForCausalLM" in proc.stdout and "checked" in proc.stdout, proc.stdout
    source = read_safetensors(native_runs / "llama31")
    exported = read_safetensors(tmp_path / "out")
    assert set(exported) == set(source), set(exported) ^ set(source)
    unequal = [n for n in source if not torch.equal(source[n], exported[n])]
    assert not unequal, unequal
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]


@pytest.mark.multirank
@pytest.mark.parametrize("arch", [pytest.param("llama31", marks=pytest.mark.slow),
                                  pytest.param("qwen3", marks=pytest.mark.slow), "qwen3_moe",
                                  "qwen2"])
def test_trained_export_generates_as_loom_does(native_runs: Path, tmp_path: Path,
                                               arch: str) -> None:
    step = native_runs / "runs" / f"{arch}-single" / "checkpoints" / "step-4"
    out = tmp_path / "out"
    proc = loom("export", str(step), str(out), "--max-shard-bytes", "20000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors.index.json").is_file()
    prompt = ["--prompt", "It is a truth", "--max-new-tokens", "32"]
    ours = loom("generate", str(step), *prompt, cwd=tmp_path)
    theirs = loom("generate", str(out), *prompt, cwd=tmp_path)
    assert ours.returncode == theirs.returncode == 0, (ours.stderr, theirs.stderr)
    assert ours.stdout == theirs.stdout and len(ours.stdout) > len("It is a truth")
