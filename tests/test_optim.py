"""LR schedule: warm-up, cosine, step milestones in steps or epochs."""
from __future__ import annotations

import pytest

from runner.config import TrainerConfig
from runner.optim import lr_factor


def test_linear_warmup_then_cosine_to_zero():
    cfg = TrainerConfig(warmup_steps=4, schedule="cosine")
    assert [lr_factor(cfg, 14, 1, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(cfg, 14, 1, 9) == pytest.approx(0.5)
    assert lr_factor(cfg, 14, 1, 14) == pytest.approx(0.0)


def test_step_milestones_in_epochs():
    cfg = TrainerConfig(warmup_steps=0, schedule="step", milestones=[30, 60], gamma=0.1, schedule_unit="epochs")
    assert lr_factor(cfg, 900, 10, 299) == 1.0
    assert lr_factor(cfg, 900, 10, 300) == pytest.approx(0.1)
    assert lr_factor(cfg, 900, 10, 600) == pytest.approx(0.01)
