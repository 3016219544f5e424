"""Mixed precision through the engine must actually train, and train the right weights.

These tests fail if the mechanism breaks: a master copy never published into the
model (weights stay at their initial values), gradients never unscaled (updates
S times too large), a reduced mode that does not learn.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import TensorDataset

import models
from data.common import LoaderConfig
from runner.cli import compose_job
from runner.engine import Trainer
from runner.step import TrainStep
from runner.task import Batch, EvalResult, StepContext, Task

REDUCED = ["fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"]
LOW_STORAGE = {"fp16": torch.float16, "mp": torch.float16, "bf16": torch.bfloat16}  # model weight dtype


@dataclass
class BlobsModelConfig:
    name: str = "blobs"
    hidden: int = 32


@dataclass
class BlobsDataConfig(LoaderConfig):
    name: str = "blobs"
    num_train: int = 512
    batch_size: int = 32


class BlobsTask(Task):
    """Four Gaussian blobs in 8-D, an MLP with batch norm: learnable in a few dozen steps."""

    name = "blobs"
    metric_name = "accuracy"
    model_schema = BlobsModelConfig
    data_sources = {"blobs": BlobsDataConfig}

    def _data(self, n: int, offset: int) -> TensorDataset:
        g = torch.Generator().manual_seed(self.seed * 1000 + offset)
        centres = torch.randn(4, 8, generator=torch.Generator().manual_seed(self.seed)) * 2
        y = torch.randint(4, (n,), generator=g)
        return TensorDataset(centres[y] + torch.randn(n, 8, generator=g), y)

    def build_train_data(self) -> TensorDataset:
        return self._data(self.data_cfg.num_train, 1)

    def build_eval_data(self) -> TensorDataset:
        return self._data(128, 2)

    def build_model(self) -> nn.Module:
        h = self.model_cfg.hidden
        return nn.Sequential(nn.Linear(8, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, 4))

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(model(batch["input"]), batch["target"])
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        right = total = 0
        for b in batches:
            right += int((model(b["input"]).argmax(1) == b["target"]).sum())
            total += len(b["target"])
        return EvalResult({"accuracy": 100.0 * right / total})


@pytest.fixture
def blobs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setitem(models.TASKS, "blobs", BlobsTask)

    def make(run: str, *overrides: str) -> Any:
        cfg = compose_job(["trainer.optimizer=sgd", "trainer.momentum=0", "trainer.weight_decay=0",
                           "trainer.lr=0.1", "trainer.schedule=constant", "trainer.warmup_steps=0",
                           "trainer.log_every=1", "trainer.timing_warmup_steps=0", f"out_dir={tmp_path / run}",
                           *overrides])
        OmegaConf.set_struct(cfg, False)
        cfg.model = {"name": "blobs"}
        cfg.data = {"name": "blobs"}
        return cfg
    return make


def losses(trainer: Trainer) -> list[float]:
    import json
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize("precision", REDUCED)
def test_every_reduced_mode_learns_through_the_engine(blobs, precision: str) -> None:
    scale = "none" if precision.startswith("bf16") else "dynamic"
    trainer = Trainer(blobs(precision, f"precision={precision}", f"scale={scale}", "trainer.max_steps=30",
                            "scaler.init_scale=1024"))
    summary = trainer.run()
    curve = losses(trainer)
    # 4 classes start near ln 4 = 1.39; every mode must get well below a third of the start.
    assert sum(curve[-5:]) / 5 < 0.35 * sum(curve[:3]) / 3, curve
    assert summary["metric"] > 90.0 and not summary["diverged"]


@pytest.mark.parametrize("precision", ["mp", "bf16", "pseudo_fp16"])
def test_model_weights_are_the_rounded_master_after_every_step(blobs, monkeypatch, precision: str) -> None:
    checked = []
    original = TrainStep.step

    def step_and_check(self: TrainStep, name: str = "main") -> None:
        before = [p.detach().clone() for p in self.slots[name].params.model_params]
        original(self, name)
        bound = self.slots[name].params
        storage = bound.storage_dtype
        for p, m in zip(bound.model_params, bound.master_params):
            rounded = m.detach().to(storage or p.dtype).to(p.dtype)
            assert torch.equal(p.detach(), rounded), "model weights are not the rounded master weights"
        assert any(not torch.equal(b, p) for b, p in zip(before, bound.model_params)), "the model did not change"
        checked.append(name)

    monkeypatch.setattr(TrainStep, "step", step_and_check)
    Trainer(blobs(precision, f"precision={precision}", "trainer.max_steps=5")).run()
    assert len(checked) == 5


@pytest.mark.parametrize("precision", ["fp16", "mp", "amp", "pseudo_fp16"])
def test_a_loss_scale_does_not_change_the_update(blobs, precision: str) -> None:
    """One SGD step with S = 1024 applies the same update as S = 1: the gradients are unscaled.

    The tiny gradients are representable at both scales, so the two updates agree to FP16
    rounding; without unscaling the second would be 1024 times larger.
    """
    params = []
    for scale in ("none", "1024"):
        trainer = Trainer(blobs(f"{precision}-{scale}", f"precision={precision}", f"scale={scale}",
                                "trainer.max_steps=1"))
        start = [p.detach().float().clone() for p in trainer.model.parameters()]
        trainer.run()
        params.append([p.detach().float() - s for p, s in zip(trainer.model.parameters(), start)])
    for unscaled, scaled in zip(*params):
        torch.testing.assert_close(scaled, unscaled, rtol=0.02, atol=2e-3)
    assert max(float(d.abs().max()) for d in params[0]) > 1e-3  # the step did update the weights


@pytest.mark.parametrize("precision", sorted(LOW_STORAGE))
def test_reduced_modes_store_the_model_in_the_low_format(blobs, precision: str) -> None:
    trainer = Trainer(blobs(precision, f"precision={precision}", "trainer.max_steps=1"))
    linear_weights = [m.weight for m in trainer.model.modules() if isinstance(m, nn.Linear)]
    assert all(w.dtype == LOW_STORAGE[precision] for w in linear_weights)
    norms = [m.weight for m in trainer.model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert all(w.dtype == (torch.float16 if precision == "fp16" else torch.float32) for w in norms)
