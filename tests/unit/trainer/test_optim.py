import itertools
import math

import pytest
import torch

from loom.config import OptimConfig
from loom.trainer.optim import build_lr_scheduler, build_optimizer, lr_multiplier


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_warmup_then_schedule_ends_at_the_floor(schedule):
    cfg = OptimConfig(lr_schedule=schedule, warmup_steps=4, min_lr_ratio=0.1)
    values = [lr_multiplier(s, 40, cfg) for s in range(40)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert max(values) == 1.0
    assert math.isclose(values[-1], 1.0 if schedule == "constant" else 0.1)
    assert all(a >= b for a, b in itertools.pairwise(values[4:]))


def test_wsd_holds_the_peak_until_the_decay_fraction():
    cfg = OptimConfig(lr_schedule="wsd", decay_fraction=0.25)
    values = [lr_multiplier(s, 100, cfg) for s in range(100)]
    assert values[:75] == [1.0] * 75 and values[80] < 1.0


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(4, 4)
    cfg = OptimConfig(lr=1e-2, lr_schedule="linear", warmup_steps=2)
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(5e-3) and seen[1] == pytest.approx(1e-2)
    assert seen[-1] == pytest.approx(0.0)
