"""LoRA (`--lora-rank`) on a tiny Hugging Face Llama folder: 20 steps at dp 2, at tp 2 and
compiled at tp 2 give the single process's losses, a run resumed from step 10 continues as
the straight one, only the adapters train and hold optimizer state (by count), and the
checkpoint exports as a merged model transformers checks and as a PEFT adapter folder
`peft` loads with loom's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.hf.export import export, export_peft
from loom.hf.peft import WEIGHTS_FILE
from loom.hf.run_checkpoint import load_run_model
from tests.compare import column
from tests.harness import run_ranks
from tests.hf_models import save_tiny_model

STEPS = 20
RANK = 8
COMMON = ["--dataset", "random", "--seq-len", "32", "--fp32", "--max-steps", str(STEPS),
          "--seed", "7", "--lr", "1e-2", "--lora-rank", str(RANK), "--lora-alpha", "16"]
SEEDED = ["--model", "debug", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
          "--n-kv-heads", "2", "--vocab-size", "128", "--seq-len", "16", "--dataset", "random",
          "--fp32", "--max-steps", "3", "--batch-size", "2", "--lora-rank", "4",
          "--checkpoint-interval", "3"]
"""A LoRA run on loom's own init: its checkpoint's base is drawn from the seed again."""
LOSS_RTOL = 1e-5
PARAM_NORM_RTOL = 1e-3
"""As tests/parity/test_parity.py: per tensor, after AdamW steps (measured worst 1.2e-4 at tp2)."""
LAYOUTS = {"dp2": ["--dp-shard", "2", "--batch-size", "2"],
           "tp2": ["--tp", "2", "--batch-size", "4"],
           "tp2_compiled": ["--tp", "2", "--batch-size", "4", "--compile",
                            "--compile-backend", "aot_eager"]}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> Path:
    """The single process (checkpoints at steps 10 and 20), a run resumed from its step 10
    and a short one whose base is loom's own init, then the layouts in one 2-rank job."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", "llama")
    common = ["--model", str(base), *COMMON, "--checkpoint-interval", "10"]
    single = [[*common, "--batch-size", "4", "--outdir", str(root / "single")],
              [*common, "--batch-size", "4", "--outdir", str(root / "resumed"),
               "--resume", str(root / "single" / "checkpoints" / "step-10")],
              [*SEEDED, "--outdir", str(root / "seeded")]]
    job = run_ranks(1, ["tests/workers/lora_worker.py", json.dumps(single)], timeout=600)
    assert job.ok, job.describe()
    runs = [[*common, *flags, "--outdir", str(root / name)] for name, flags in LAYOUTS.items()]
    job = run_ranks(2, ["tests/workers/lora_worker.py", json.dumps(runs)], timeout=900)
    assert job.ok, job.describe()
    return root


def counts(run: Path) -> dict:
    return json.loads((run / "lora.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_single_process(lora_runs: Path, layout: str) -> None:
    reference, got = column(lora_runs / "single"), column(lora_runs / layout)
    assert len(reference) == STEPS and reference[STEPS] < reference[1], "no progress"
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=LOSS_RTOL), f"{layout} step {step}"
    ref_params = torch.load(lora_runs / "single" / "params.pt")
    params = torch.load(lora_runs / layout / "params.pt")
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        if "lora_" not in name:  # frozen: bit for bit the base folder's
            assert torch.equal(params[name], ref), name
            continue
        diff = (params[name] - ref).norm() / ref.norm()
        assert diff <= PARAM_NORM_RTOL, f"{layout} {name}: {diff:.2e}"
    assert counts(lora_runs / layout) == counts(lora_runs / "single")


@pytest.mark.multirank
def test_only_the_adapters_train_or_hold_optimizer_state(lora_runs: Path) -> None:
    """By count: 2 blocks x 7 linears x r (in + out) adapter elements train; AdamW holds
    two states of each; no other parameter is in the optimizer."""
    got = counts(lora_runs / "single")
    dim, hidden, kv = 32, 64, 2 * 8  # tests/hf_models.py SHAPE: 2 kv heads of width 8
    per_block = RANK * ((dim + dim) * 2 + (dim + kv) * 2 + (dim + hidden) * 3)
    assert sum(got["trainable"].values()) == 2 * per_block
    assert set(got["trainable"]) == {n for n in got["trainable"] if n.endswith(
        (".lora_A", ".lora_B"))} and len(got["trainable"]) == 2 * 7 * 2
    assert got["optimizer_params"] == sorted(got["trainable"])
    assert got["optimizer_state"] == 2 * 2 * per_block
    assert got["total"] > 5 * 2 * per_block  # the frozen base is most of the model


@pytest.mark.multirank
def test_a_resumed_lora_run_continues_as_the_straight_one(lora_runs: Path) -> None:
    """The checkpoint holds what resume needs: the adapters and their AdamW state."""
    straight, resumed = column(lora_runs / "single"), column(lora_runs / "resumed")
    assert sorted(resumed) == list(range(11, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=LOSS_RTOL), step


def tokens() -> torch.Tensor:
    return torch.randint(300, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.multirank
def test_merged_export_passes_the_transformers_check(lora_runs: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    step = lora_runs / "single" / "checkpoints" / f"step-{STEPS}"
    written = export(step, tmp_path / "merged")
    assert "checked: transformers' logits match loom's" in written
    ours, _ = load_run_model(step)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(lora_runs / "base").eval()
    with torch.no_grad():
        want = ours.eval()(tokens())
        got, before = merged(input_ids=tokens()).logits, base(input_ids=tokens()).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert (before - want).abs().max() > 1e-2 * want.abs().max(), "the adapters did nothing"


@pytest.mark.multirank
def test_peft_folder_loads_in_peft_with_loom_logits(lora_runs: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    step = lora_runs / "single" / "checkpoints" / f"step-{STEPS}"
    written = export_peft(step, tmp_path / "adapter", "fp32", verify=True)
    assert "checked: peft's logits match loom's" in written
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == 16.0
    assert config["base_model_name_or_path"] == str(lora_runs / "base")
    with safe_open(str(tmp_path / "adapter" / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
    assert len(keys) == 2 * 7 * 2
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    base = AutoModelForCausalLM.from_pretrained(lora_runs / "base")
    with torch.no_grad():
        before = base.eval()(input_ids=tokens()).logits
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ours, _ = load_run_model(step)
    with torch.no_grad():
        want, got = ours.eval()(tokens()), model(input_ids=tokens()).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert (before - want).abs().max() > 1e-2 * want.abs().max(), "the adapters did nothing"


@pytest.mark.multirank
@pytest.mark.parametrize("run, step", [("single", STEPS), ("seeded", 3)])
def test_checkpoint_holds_the_adapters_and_readers_take_the_base_from_the_source(
        lora_runs: Path, run: str, step: int) -> None:
    """No frozen weight is saved; `loom export`'s reader rebuilds the trained model bit for
    bit from the checkpoint and the run's source (its Hugging Face folder, or the seed)."""
    folder = lora_runs / run / "checkpoints" / f"step-{step}"
    saved = json.loads((folder / "metadata.json").read_text())["tensors"]
    model_keys = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    model, _ = load_run_model(folder)
    trained = torch.load(lora_runs / run / "params.pt")
    state = model.state_dict()
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
