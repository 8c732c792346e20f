"""A resumed run keeps its saved settings unless a flag is given again, and names those."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from loom.checkpoint.optimizer import set_optimizer
from loom.checkpoint.resume import (
    architecture,
    check_architecture,
    resume_after_restart,
    run_settings,
    saved_settings,
)
from loom.config import ConfigError, OptimConfig, parse_args
from loom.config.resolved import settled
from loom.models.resolve import model_args
from loom.runtime.distributed import rank_info
from loom.trainer.resolve import restarted as restarted_config


def test_saved_settings_hold_unless_given_again(caplog) -> None:
    saved = run_settings(parse_args(["--checkpoint-interval", "5", "--keep-checkpoints", "3",
                                     "--lr", "1e-3", "--lr-schedule", "cosine", "--seed", "7",
                                     "--max-steps", "10", "--dataset", "random"]))
    with caplog.at_level(logging.INFO, logger="loom"):
        flags = parse_args(["--resume", "--max-steps", "20", "--batch-size", "4",
                            "--dataset", "random"])
        kept = saved_settings(flags, {"settings": saved, "param_groups": [{}]}, Path("step-5"))
    assert "max_steps" not in kept and kept["seed"] == 7  # given again: the flag's stays
    cfg = settled(flags, **kept)
    assert (cfg.checkpoint.checkpoint_interval, cfg.checkpoint.keep_checkpoints) == (5, 3)
    assert (cfg.optim.lr, cfg.optim.lr_schedule, cfg.train.seed) == (1e-3, "cosine", 7)
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.data.dataset) == (20, 4, "random")
    (line,) = caplog.messages
    assert line.startswith("resume: restored from step-5: lr 0.001, max_grad_norm 1.0, "
                           "lr_schedule cosine, "), line
    assert "seed 7" in line and line.endswith("; given again: --max-steps 10 -> 20"), line


def test_a_different_model_is_named_by_its_field() -> None:
    def arch(*flags: str) -> dict:
        cfg = parse_args(["--model", "debug", *flags])
        return architecture(cfg, model_args(cfg))

    check_architecture(arch(), arch("--lr", "1"))
    for flags, message in [(["--dim", "64"], "checkpoint has dim 128, this run 64"),
                           (["--vocab-size", "99"], "checkpoint has vocab_size 32000, this run 99"),
                           (["--n-experts", "4"], "checkpoint has family llama, this run moe")]:
        with pytest.raises(ConfigError, match=message):
            check_architecture(arch(), arch(*flags))


def test_lr_given_again_rescales_the_loaded_schedule() -> None:
    def schedule(lr: float) -> tuple[torch.optim.Optimizer, LambdaLR]:
        optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=lr)
        return optimizer, LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))

    saved_optim, saved_sched = schedule(1e-3)
    for _ in range(3):
        saved_optim.step()
        saved_sched.step()
    optimizer, scheduler = schedule(2e-3)
    optimizer.load_state_dict(saved_optim.state_dict())
    scheduler.load_state_dict(saved_sched.state_dict())
    set_optimizer(optimizer, scheduler, OptimConfig(lr=2e-3))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 4 / 10, rel=1e-12)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 5 / 10, rel=1e-12)


def test_a_restarted_job_resumes_its_run_folder_unless_told_otherwise() -> None:
    """torchrun's restart count (or a Slurm requeue's) turns a plain command into --resume
    auto; the first attempt, an explicit --resume and a run without --outdir are left be."""
    flags = parse_args(["--model", "debug", "--outdir", "runs/a"])
    assert resume_after_restart(flags, 0) == (None, None)
    resume, note = resume_after_restart(flags, 2)
    assert resume == "auto" and "restart 2 of this job: continuing" in note
    restarted = restarted_config(flags, 2)
    assert restarted.checkpoint.resume == "auto" and note in restarted.warnings
    explicit = parse_args(["--model", "debug", "--outdir", "runs/a", "--resume", "runs/a/x"])
    assert resume_after_restart(explicit, 1) == (None, None)
    assert restarted_config(explicit, 1) == explicit
    nowhere = restarted_config(parse_args(["--model", "debug"]), 1)
    assert nowhere.checkpoint.resume is None
    assert any("pass --outdir" in w for w in nowhere.warnings)


def test_the_restart_count_comes_from_torchrun_or_slurm() -> None:
    assert rank_info({}).restarts == 0
    assert rank_info({"TORCHELASTIC_RESTART_COUNT": "3"}).restarts == 3
    assert rank_info({"SLURM_RESTART_COUNT": "1"}).restarts == 1
    retried = {"TORCHELASTIC_RESTART_COUNT": "0", "LOOM_LAUNCH_ATTEMPT": "2"}
    assert rank_info(retried).restarts == 2, "a retried launch's fresh agent counts from 0"
    assert rank_info({"TORCHELASTIC_USE_AGENT_STORE": "True"}).agent_store
