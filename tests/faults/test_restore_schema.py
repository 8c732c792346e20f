"""Everything a checkpoint restores is checked before use: loop.json's keys, types, ranges
and choices, the RNG files, and settings that choose what the run reads (which must be what
the command line says)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from loom.checkpoint.schema import (
    SchemaError,
    check_loop,
    check_read_settings,
    check_rng,
)
from loom.checkpoint.trust import UnusableCheckpoint, read_loop
from loom.config import ConfigError
from loom.models.llama.model import ModelArgs
from loom.models.moe.model import MoEArgs
from tests.faults.test_checkpoint_trust import TINY, copy_run, loom, one_line, reseal


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("schema") / "run"
    proc = loom("train", *TINY, "--max-steps", "2", "--checkpoint-interval", "1",
                "--outdir", str(outdir))
    assert proc.returncode == 0, proc.stderr
    return outdir


def edit_loop(checkpoint: Path, change) -> None:
    loop = json.loads((checkpoint / "loop.json").read_text())
    change(loop)
    (checkpoint / "loop.json").write_text(json.dumps(loop))
    reseal(checkpoint)


def group(key: str, value):
    return lambda loop: loop["param_groups"][0].__setitem__(key, value)


def setting(key: str, value):
    return lambda loop: loop["settings"].__setitem__(key, value)


LOOP_CRAFTS = {
    "maximize": (group("maximize", True), "param_groups[0].maximize is True; loom's AdamW"),
    "unknown-group-key": (group("nesterov", True), "param_groups[0] has unknown key "
                                                   "'nesterov'"),
    "lr-string": (group("lr", "0.1"), "param_groups[0].lr is '0.1', not a finite number"),
    "lr-nan": (group("lr", float("nan")), "param_groups[0].lr is nan"),
    "betas-list-of-three": (group("betas", [0.9, 0.9, 0.9]), "betas is not a list of 2"),
    "negative-step": (lambda loop: loop.__setitem__("step", -5), "step is -5, not an integer"),
    "bool-step": (lambda loop: loop.__setitem__("step", True), "step is True, not an integer"),
    "float-samples": (lambda loop: loop.__setitem__("samples_seen", 1.5), "samples_seen is "
                                                                         "1.5"),
    "unknown-top-key": (lambda loop: loop.__setitem__("hook", "x"), "has unknown key 'hook'"),
    "missing-settings": (lambda loop: loop.pop("settings"), "loop.json lacks settings"),
    "unknown-setting": (setting("trust_remote_code_please", True), "unknown key "
                                                                  "'trust_remote_code_please'"),
    "zero-interval-type": (setting("checkpoint_interval", "x"), "settings.checkpoint_interval "
                                                               "is 'x', not a int"),
    "zero-epochs": (setting("epochs", 0), "settings.epochs is 0, not an integer in [1,"),
    "schedule-choice": (setting("lr_schedule", "$(touch x)"), "settings.lr_schedule is "
                                                              "'$(touch x)'; loom writes one of"),
    "dataset-list": (setting("dataset", ["/etc/passwd"]), "settings.dataset is ['/etc/passwd']"),
    "scheduler-lambda": (lambda loop: loop["scheduler"].__setitem__("lr_lambdas", [{"a": 1}]),
                         "scheduler.lr_lambdas[0] is {'a': 1}"),
    "scheduler-groups": (lambda loop: loop["scheduler"].__setitem__("base_lrs", [0.1, 0.1]),
                         "scheduler.base_lrs is not a list of 1"),
    "max-seq-len": (lambda loop: loop["model_args"].__setitem__("max_seq_len", 2**34),
                    "model_args.max_seq_len is 17179869184, not an integer"),
    "stream-position": (lambda loop: loop.__setitem__("stream_positions",
                                                      {"0": {"epoch": -1, "piece": 0,
                                                             "document": 0, "offset": 0}}),
                        "stream_positions.0.epoch is -1"),
    "architecture-kind": (lambda loop: loop["architecture"].__setitem__("kind", ["dense"]),
                          "architecture.kind is not one of"),
    "mixture-windows": (lambda loop: loop.__setitem__("mixture", {"policy": "restart", "sources": [
        {"name": "a", "weight": "1/2", "windows": -3}]}), "mixture.sources.0.windows is -3"),
    "mixture-name": (lambda loop: loop.__setitem__("mixture", {"policy": "restart", "sources": [
        {"name": ["a"], "weight": "1/2", "windows": 3}]}), "name and weight are not strings"),
}


@pytest.mark.parametrize("name", list(LOOP_CRAFTS))
def test_an_out_of_schema_loop_json_is_refused_naming_the_key(run: Path, tmp_path: Path,
                                                              name: str) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    change, message = LOOP_CRAFTS[name]
    edit_loop(checkpoint, change)
    with pytest.raises(UnusableCheckpoint) as error:
        read_loop(checkpoint)
    assert f"checkpoint {checkpoint} is unsafe: loop.json " in str(error.value)
    assert message in str(error.value), error.value


def test_the_saved_loop_json_is_in_schema(run: Path) -> None:
    for checkpoint in (run / "checkpoints").iterdir():
        read_loop(checkpoint)


def test_a_mixture_of_experts_model_args_are_in_schema(run: Path) -> None:
    """A MoE run's model_args carry exactly MoEArgs' fields; a value out of range or of
    the wrong kind is still refused, and a dense field missing or an unknown one too."""
    loop = json.loads((sorted((run / "checkpoints").iterdir())[-1] / "loop.json").read_text())
    args = {f.name: getattr(MoEArgs(**loop["model_args"]), f.name) for f in fields(MoEArgs)}
    loop = {**loop, "model_args": args, "architecture": {"family": "moe", **args}}
    check_loop(loop)
    for key, bad in (("score_func", "exec"), ("top_k", 0), ("route_norm", "yes"),
                     ("aux_loss_coeff", -1.0), ("moe_hidden_dim", 0)):
        with pytest.raises(SchemaError, match=f"model_args.{key}|{key} is"):
            check_loop({**loop, "model_args": {**args, key: bad},
                        "architecture": {**loop["architecture"], key: bad}})
    with pytest.raises(SchemaError, match="model_args lacks n_experts"):
        check_loop({**loop, "model_args": {k: v for k, v in args.items() if k != "n_experts"}})
    with pytest.raises(SchemaError, match="model_args has unknown key 'ffn_hidden_dim'"):
        check_loop({**loop, "model_args": {**args, "ffn_hidden_dim": 4}})


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["python"].__setitem__(0, 2), "rng.python is not [3, words, gauss]"),
    (lambda s: s["python"][1].pop(), "rng.python[1] is not a list of 625"),
    (lambda s: s["python"][1].__setitem__(-1, 10**6), "rng.python[1] position is past 624"),
    (lambda s: s["python"][1].__setitem__(0, -1), "rng.python[1][0] is -1"),
    (lambda s: s["torch"].__setitem__(3, 256), "rng.torch[3] is 256"),
    (lambda s: s["torch"].append(0), "rng.torch is not a list of"),
    (lambda s: s.__setitem__("numpy", []), "rng has unknown key 'numpy'"),
    (lambda s: s["python"].__setitem__(2, "x"), "rng.python[2] is 'x'"),
])
def test_an_out_of_schema_rng_file_is_refused(run: Path, change, message: str) -> None:
    state = json.loads((run / "checkpoints" / "step-2" / "rng-0.json").read_text())
    check_rng(state, torch.get_rng_state().numel(), None)
    change(state)
    with pytest.raises(SchemaError, match=message.replace("[", r"\[").replace("(", r"\(")):
        check_rng(state, torch.get_rng_state().numel(), None)


def test_what_the_run_reads_must_match_the_command_line() -> None:
    saved = {"dataset": "corpus.txt", "tokenizer_name": None, "hf_split": "train",
             "hf_text_column": "text", "trust_remote_code": False}
    path = Path("run/checkpoints/step-4")
    assert check_read_settings(saved, dict(saved), path, new_data=False) == []
    for name, now, shown in [("dataset", "/home/u/.ssh/id_rsa", "/home/u/.ssh/id_rsa"),
                             ("dataset", None, "not given"),
                             ("tokenizer_name", "tok", "tok"),
                             ("hf_text_column", "secret", "secret")]:
        with pytest.raises(ConfigError, match=rf"--{name.replace('_', '-')}: checkpoint "
                                              rf".*, this run {shown}; pass --resume-new-data"):
            check_read_settings(saved, {**saved, name: now}, path, new_data=False)
    assert check_read_settings(saved, {**saved, "dataset": "b.txt"}, path, new_data=True) == \
        ["--dataset: checkpoint corpus.txt, this run b.txt"]
    with pytest.raises(ConfigError, match="--trust-remote-code: checkpoint given, this run not "
                                          "given; give the same flag again"):
        check_read_settings({**saved, "trust_remote_code": True}, saved, path, new_data=True)


@pytest.mark.multirank
def test_a_maximizing_checkpoint_is_one_line_and_auto_falls_back(run: Path, tmp_path: Path
                                                                 ) -> None:
    outdir = copy_run(run, tmp_path)
    step1, step2 = outdir / "checkpoints" / "step-1", outdir / "checkpoints" / "step-2"
    edit_loop(step2, group("maximize", True))
    proc = loom("train", *TINY, "--max-steps", "2", "--outdir", str(outdir), "--resume",
                str(step2))
    assert proc.returncode == 2
    assert one_line(proc) == (f"error: checkpoint {step2} is unsafe: loop.json param_groups[0]"
                              ".maximize is True; loom's AdamW always has false; resume from "
                              f"step-1 with --resume {step1}")
    proc = loom("train", *TINY, "--max-steps", "2", "--outdir", str(outdir), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "--resume auto: skipping step-2 (checkpoint" in proc.stdout
    assert f"resumed from {step1} at step 1" in proc.stdout


@pytest.mark.multirank
def test_a_step_other_than_its_folder_s_is_refused(run: Path, tmp_path: Path) -> None:
    """A step-2 folder whose loop.json says 1000 would name later saves past every real
    one (the inverse of a negative step)."""
    outdir = copy_run(run, tmp_path)
    step2 = outdir / "checkpoints" / "step-2"
    edit_loop(step2, lambda loop: loop.__setitem__("step", 1000))
    proc = loom("train", *TINY, "--max-steps", "3", "--outdir", str(outdir), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "skipping step-2 (checkpoint " in proc.stdout and \
        "loop.json has step 1000, its folder step-2" in proc.stdout
    assert sorted(p.name for p in (outdir / "checkpoints").iterdir()) == ["step-2", "step-3"]


@pytest.mark.multirank
def test_a_checkpoint_that_reads_another_dataset_stops_in_one_line(run: Path, tmp_path: Path
                                                                   ) -> None:
    outdir = copy_run(run, tmp_path)
    step2 = outdir / "checkpoints" / "step-2"
    secret = tmp_path / "secret.txt"
    secret.write_text("not for training\n" * 100)
    edit_loop(step2, setting("dataset", str(secret)))
    proc = loom("train", *TINY, "--max-steps", "3", "--outdir", str(outdir), "--resume",
                str(step2))
    assert proc.returncode == 2
    assert one_line(proc) == (f"error: --resume {step2}: what the run reads differs from the "
                              f"checkpoint's: --dataset: checkpoint {secret}, this run random; "
                              "pass --resume-new-data to continue on other data")


def test_every_dense_model_field_is_in_schema(run: Path) -> None:
    """The record holds exactly ModelArgs' fields, architecture repeating model_args; an
    imported family's field of the wrong kind is refused."""
    loop = json.loads((sorted((run / "checkpoints").iterdir())[-1] / "loop.json").read_text())
    assert set(loop["model_args"]) == {f.name for f in fields(ModelArgs)}
    assert loop["architecture"] == {"family": "llama", **loop["model_args"]}
    for key, bad in (("qk_norm", 1), ("head_dim", -1), ("rope_factor", float("inf"))):
        with pytest.raises(SchemaError, match=f"model_args.{key}"):
            check_loop({**loop, "model_args": {**loop["model_args"], key: bad}})
    with pytest.raises(SchemaError, match="architecture.dim is 7, model_args.dim"):
        check_loop({**loop, "architecture": {**loop["architecture"], "dim": 7}})
