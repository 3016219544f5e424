"""Shared helpers: tiny configs composed through the real Hydra config tree."""
from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli import compose_job

# A ResNet small enough for CPU tests, through the same code path as the real one.
TINY = ["model.width=0.125", "model.depth=[1,1,1,1]", "data.image_size=16", "data.num_train=256",
        "data.num_eval=64", "data.batch_size=8", "trainer.max_steps=4", "trainer.log_every=2",
        "trainer.warmup_steps=0", "trainer.timing_warmup_steps=1"]


@pytest.fixture
def tiny_cfg(tmp_path: Path):
    """compose(*overrides) -> a tiny run config writing under tmp_path."""
    def make(*overrides: str):
        return compose_job([*TINY, f"out_root={tmp_path}", *overrides])
    return make
