"""A resume applies or refuses what it is given (issue #68, items 1 and 2).

Applied: each Muon flag given again is listed in the "given again" line, recorded in the
resumed run's config.json and used by its optimizer (the groups its checkpoint saves are the
optimizer's own); a flag not given again is the checkpoint's optimizer's, in config.json
too. Refused in one line (exit 2, no traceback): another --optimizer, a model argument that
changes what the model computes without --resume-change-model, a changed mixture without
--resume-new-data, and a LoRA base whose weights changed since its adapters were trained
(resume and export, naming both digests)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

import loom
from loom.checkpoint.optimizer import MUON_GROUP, as_flag, same
from loom.checkpoint.resume import architecture, check_architecture
from loom.config import ConfigError, OptimConfig, parse_args
from loom.hf.lora_base import base_record
from loom.hf.run_checkpoint import frozen_base, run_model
from loom.models.resolve import model_args
from tests.corpora import WORDS, documents
from tests.faults.test_checkpoint_trust import loom as loom_process
from tests.faults.test_checkpoint_trust import one_line
from tests.hf_models import save_tiny_model

TINY = ["--model", "debug", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
        "--n-kv-heads", "1", "--dataset", "random", "--vocab-size", "64", "--seq-len", "16",
        "--fp32", "--seed", "3"]
MUON = [*TINY, "--optimizer", "muon"]
MUON_DEFAULTS = {**vars(OptimConfig()), "muon_lr": 0.0}


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def refused(proc: Any) -> str:
    """The one `error:` line of a refused command (exit 2, nothing else on stderr)."""
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert line.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return line


@pytest.fixture(scope="module")
def muon_step2(tmp_path_factory) -> Path:
    """A Muon run at momentum 0.9 and its own lr 0.01, checkpointed at step 2."""
    out = tmp_path_factory.mktemp("muon") / "run"
    loom.fit([*MUON, "--muon-momentum", "0.9", "--muon-lr", "0.01", "--max-steps", "2",
              "--checkpoint-interval", "2", "--outdir", str(out)])
    return out / "checkpoints" / "step-2"


def resume(step2: Path, outdir: Path, *flags: str) -> tuple[dict, dict, dict]:
    """Resume to step 3 in `outdir`: its config.json's optim table, its step-3 checkpoint's
    Muon group and AdamW group (what the optimizer held)."""
    loom.fit([*MUON, "--resume", str(step2), "--max-steps", "3", "--checkpoint-interval", "1",
              "--outdir", str(outdir), *flags])
    groups = read(outdir / "checkpoints" / "step-3" / "loop.json")["param_groups"]
    (muon,) = [g for g in groups if g.get("kind") == "muon"]
    (adamw,) = [g for g in groups if g.get("kind") is None]
    return read(outdir / "config.json")["optim"], muon, adamw


APPLIED = {  # each Muon flag given again, with the checkpoint's value it replaces
    "--muon-momentum": ("0.9", "0.5"),
    "--muon-lr": ("0.01", "0.02"),
    "--muon-ns-dtype": ("bf16", "fp32"),
    "--muon-nesterov": ("True", "False"),
    "--muon-adjust-lr": ("match-rms-adamw", "original"),
    "--muon-ns-steps": ("5", "3"),
    "--muon-ns-coefficients": ("3.4445,-4.775,2.0315", "3,-4,2"),
    "--muon-weight-decay": ("0.1", "0.05"),
}


def given(flag: str, value: str) -> list[str]:
    if value in ("True", "False"):
        return [flag if value == "True" else f"--no-{flag[2:]}"]
    return [flag, value]


def config_is_the_optimizer(optim: dict, muon: dict, adamw: dict) -> None:
    """config.json says what the optimizer used, flag by flag."""
    for name, key in MUON_GROUP.items():
        assert same(name, as_flag(name, muon[key]), optim[name]), name
    assert muon["initial_lr"] == optim["muon_lr"] and adamw["initial_lr"] == optim["lr"]


EVERY_MUON_FLAG = [part for flag, (_, value) in APPLIED.items() for part in given(flag, value)]


CHANGED_MODEL = ["--rope-theta", "20000", "--resume-change-model"]


@pytest.mark.parametrize("every", [False, True], ids=["lr", "every-muon-flag"])
def test_muon_settings_given_again_are_applied_recorded_and_listed(
        muon_step2: Path, tmp_path: Path, capsys: pytest.CaptureFixture, loom_logger_restored,
        every: bool) -> None:
    """Every Muon flag given again at once (and RoPE's base, asked for); or only --lr, which
    leaves every Muon setting the checkpoint's (not the flags' defaults), its own lr too
    (not rescaled)."""
    flags = [*EVERY_MUON_FLAG, *CHANGED_MODEL] if every else ["--lr", "0.02"]
    optim, muon, adamw = resume(muon_step2, tmp_path / "resumed", *flags)
    config_is_the_optimizer(optim, muon, adamw)
    out = capsys.readouterr().out
    line = next(t for t in out.splitlines() if "resume: restored" in t)
    for flag, (before, after) in APPLIED.items():
        name = flag[2:].replace("-", "_")
        assert same(name, optim[name], in_type(name, after if every else before)), flag
        assert (f"{flag} {before} -> {after}" in line) == every, (flag, line)
    lrs = (optim["lr"], muon["lr"], adamw["lr"])
    assert lrs == ((3e-3, 0.02, 3e-3) if every else (0.02, 0.01, 0.02)), lrs
    theta = 20000.0 if every else 10000.0
    loop = read(tmp_path / "resumed" / "checkpoints" / "step-3" / "loop.json")
    assert loop["architecture"]["rope_theta"] == theta
    assert read(tmp_path / "resumed" / "config.json")["model"]["rope_theta"] == theta
    assert ("resume: the model's arguments given again: rope_theta 10000.0 -> 20000.0"
            in out) == every


def in_type(name: str, text: str) -> object:
    value = MUON_DEFAULTS[name]
    return text == "True" if isinstance(value, bool) else type(value)(text)


@pytest.mark.multirank
@pytest.mark.parametrize(("flags", "says"), [
    (["--optimizer", "adamw"], "the checkpoint's optimizer is muon, this run's --optimizer "
                               "adamw; resume with --optimizer muon"),
    (["--optimizer", "muon", "--rope-theta", "20000"],
     "checkpoint has rope_theta 10000.0, this run 20000.0, which changes what the model "
     "computes; give the checkpoint's model flags, or pass --resume-change-model"),
], ids=["optimizer", "rope-theta"])
def test_a_resume_refuses_in_one_line(muon_step2: Path, tmp_path: Path, flags: list[str],
                                      says: str) -> None:
    proc = loom_process("train", *TINY, *flags, "--resume", str(muon_step2), "--max-steps",
                        "3", "--outdir", str(tmp_path / "resumed"))
    assert says in refused(proc)
    assert not (tmp_path / "resumed" / "checkpoints").exists()


@pytest.mark.parametrize("flag", ["--resume-change-model", "--resume-new-data"])
def test_a_resume_only_flag_without_resume_is_refused(flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag} needs --resume$"):
        parse_args([*TINY, flag])


def arch(*flags: str) -> dict[str, Any]:
    cfg = parse_args(list(flags))
    return architecture(cfg, model_args(cfg))


@pytest.mark.parametrize(("model", "field", "before", "after"), [
    ("debug", "rope_theta", [], ["--rope-theta", "20000"]),
    ("debug", "norm_eps", [], ["--norm-eps", "1e-6"]),
    ("moe-debug", "top_k", [], ["--top-k", "3"]),
    ("moe-debug", "score_func", [], ["--score-func", "softmax"]),
    ("moe-debug", "route_scale", [], ["--route-scale", "2.0"]),
    ("deepseek-v3-debug", "n_group", [], ["--n-group", "4"]),
    ("deepseek-v3-debug", "topk_group", ["--n-group", "4", "--topk-group", "2"],
     ["--n-group", "4", "--topk-group", "1"]),
])
def test_a_model_argument_that_changes_no_shape_needs_resume_change_model(
        model: str, field: str, before: list[str], after: list[str]) -> None:
    saved, current = arch("--model", model, *before), arch("--model", model, *after)
    assert saved[field] != current[field]
    with pytest.raises(ConfigError, match=f"checkpoint has {field} .* pass "
                                          "--resume-change-model"):
        check_architecture(saved, current)
    changes = check_architecture(saved, current, True)
    assert f"{field} {saved[field]} -> {current[field]}" in changes, changes


def test_a_training_weight_of_the_model_changes_and_is_listed() -> None:
    """The balancing step weighs the training, not what the model computes."""
    saved = arch("--model", "moe-debug")
    current = arch("--model", "moe-debug", "--load-balance-coeff", "0.5")
    assert check_architecture(saved, current) == ["load_balance_coeff 0.01 -> 0.5"]


@pytest.mark.parametrize(("saved", "now", "says"), [
    ("init:3", "init:5", "trained on the base loom's init from seed 3, this run's base is "
                         "loom's init from seed 5"),
    ("init:3", "sha256:ab", "loom's init from seed 3, this run's base is sha256:ab"),
    ("sha256:ab", "sha256:cd", "trained on the base sha256:ab, this run's base is sha256:cd"),
    (None, "sha256:cd", None),  # written before bases were recorded: nothing to compare
    ("sha256:ab", "sha256:ab", None),
])
def test_a_lora_base_is_the_checkpoint_s(saved: str | None, now: str, says: str | None
                                         ) -> None:
    lora = ["--model", "debug", "--lora-rank", "2"]
    record = arch(*lora)
    before = record if saved is None else {**record, "lora_base": saved}
    if says is None:
        assert check_architecture(before, {**record, "lora_base": now}) == []
        return
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_architecture(before, {**record, "lora_base": now})


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("mix")
    for name in ("a", "b"):
        (root / f"{name}.txt").write_text("\n\n".join(documents(WORDS, 30, name, (40, 40))))
    flags = [*TINY[:TINY.index("--dataset")], "--seq-len", "16", "--fp32", "--seed", "3"]
    loom.fit([*flags, "--dataset", f"{root / 'a.txt'}:0.5,{root / 'b.txt'}:0.5",
              "--max-steps", "2", "--checkpoint-interval", "2", "--outdir", str(root / "run")])
    return root, " ".join(flags)


@pytest.mark.multirank
def test_a_changed_mixture_continues_with_resume_new_data(mixture_run: tuple[Path, str],
                                                          tmp_path: Path) -> None:
    root, flags = mixture_run
    step2 = root / "run" / "checkpoints" / "step-2"
    new = f"{root / 'a.txt'}:0.75,{root / 'b.txt'}:0.25"
    common = [*flags.split(), "--dataset", new, "--resume", str(step2), "--max-steps", "3",
              "--checkpoint-interval", "1"]
    line = refused(loom_process("train", *common, "--outdir", str(tmp_path / "refused")))
    assert "pass --resume-new-data to continue on other data" in line
    loom.fit([*common, "--resume-new-data", "--outdir", str(tmp_path / "resumed")])
    loop = read(tmp_path / "resumed" / "checkpoints" / "step-3" / "loop.json")
    assert [s["weight"] for s in loop["mixture"]["sources"]] == ["3/4", "1/4"]
    assert read(tmp_path / "resumed" / "config.json")["data"]["dataset"] == new


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A LoRA run on a tiny Llama folder, checkpointed at step 2."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", "llama", seed=0, tokenizer=False)
    flags = ["--model", str(base), "--lora-rank", "2", "--dataset", "random", "--seq-len",
             "16", "--fp32", "--seed", "3"]
    loom.fit([*flags, "--max-steps", "2", "--checkpoint-interval", "2",
              "--outdir", str(root / "run")])
    return root, flags


@pytest.mark.multirank
def test_a_lora_checkpoint_refuses_a_base_that_changed(lora_run: tuple[Path, list[str]],
                                                       tmp_path: Path) -> None:
    root, flags = lora_run
    base, step2 = root / "base", root / "run" / "checkpoints" / "step-2"
    recorded = read(step2 / "loop.json")["architecture"]["lora_base"]
    assert recorded == base_record(str(base), 3) and recorded.startswith("sha256:")
    assert read(root / "run" / "config.json")["lora"]["lora_base"] == recorded
    frozen_base(run_model(step2))  # unchanged: export's reader takes it
    loom.fit([*flags, "--resume", str(step2), "--max-steps", "3",
              "--outdir", str(tmp_path / "unchanged")])
    shutil.copytree(base, tmp_path / "kept")
    try:
        save_tiny_model(base, "llama", seed=1, tokenizer=False)  # same shapes, new weights
        now = base_record(str(base), 3)
        assert now != recorded
        line = refused(loom_process("export", str(step2), str(tmp_path / "export")))
        assert f"changed since its adapters were trained: it is {now}, they were trained " \
               f"on {recorded}" in line
        assert not (tmp_path / "export").exists()
        line = refused(loom_process("train", *flags, "--resume", str(step2), "--max-steps",
                                    "3", "--outdir", str(tmp_path / "resumed")))
        assert f"trained on the base {recorded}, this run's base is {now}" in line
    finally:
        shutil.rmtree(base)
        shutil.copytree(tmp_path / "kept", base)
