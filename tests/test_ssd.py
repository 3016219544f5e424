"""The SSD task: architecture, training steps in FP32 and MP, evaluation, synthetic data."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchvision.models.detection import ssd300_vgg16

import models
from data.synthetic_detection import CLASSES, SyntheticDetection, SyntheticDetectionConfig
from models.ssd import SSDConfig, SSDTask, _vgg16_layers, build_ssd
from runner.cli import compose_job
from runner.engine import train
from runner.errors import UserError
from runner.precision import make_policy

SMALL_DATA = {"name": "synthetic_detection", "num_train": 4, "num_eval": 4, "batch_size": 2}


def _task(model: dict | None = None, data: dict | None = None) -> SSDTask:
    return SSDTask(OmegaConf.create({"name": "ssd", **(model or {})}), OmegaConf.create(data or SMALL_DATA), 0)


def _batch(task: SSDTask, split: str = "train", n: int = 2) -> dict:
    ds = task.build_train_data() if split == "train" else task.build_eval_data()
    return task.collate([ds[i] for i in range(n)])


class _SGDContext:
    """A plain-SGD stand-in for the engine's step context (keeps the gradients for inspection)."""

    def __init__(self, model: nn.Module) -> None:
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.losses: list[torch.Tensor] = []

    def optimize(self, loss: torch.Tensor, name: str = "main") -> None:
        assert name == "main"
        self.losses.append(loss.detach())
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def test_ssd300_variant_is_torchvisions_ssd300() -> None:
    # On the meta device: shapes only, no memory, no arithmetic.
    with torch.device("meta"):
        ours = build_ssd(SSDConfig(variant="ssd300"), num_classes=20)
        theirs = ssd300_vgg16(weights=None, weights_backbone=None, num_classes=21)
        grids = [tuple(f.shape[-2:]) for f in ours.backbone(torch.zeros(1, 3, 300, 300)).values()]
    assert grids == [(38, 38), (19, 19), (10, 10), (5, 5), (3, 3), (1, 1)]
    per_location = ours.anchor_generator.num_anchors_per_location()
    assert sum(h * w * k for (h, w), k in zip(grids, per_location)) == 8732  # the SSD paper's SSD300 count
    shapes = sorted(tuple(p.shape) for p in ours.parameters())
    assert shapes == sorted(tuple(p.shape) for p in theirs.parameters())


def test_tiny_forward_shapes() -> None:
    task = _task()
    model = task.build_model()
    out = model(_batch(task)["input"])
    anchors = task._anchors_on(torch.device("cpu"))
    assert anchors.dtype == torch.float32
    assert out["bbox_regression"].shape == (2, anchors.shape[0], 4)
    assert out["cls_logits"].shape == (2, anchors.shape[0], 4)  # 3 classes + background


def test_training_steps_fp32() -> None:
    torch.manual_seed(0)
    task = _task()
    model = task.build_model()
    batch = _batch(task)
    ctx = _SGDContext(model)
    losses = ctx.losses
    for _ in range(3):
        logs = task.train_step(model, batch, ctx)
    assert set(logs) == {"loss", "bbox_loss", "cls_loss"}
    assert len(losses) == 3 and all(torch.isfinite(x) for x in losses)
    assert not logs["loss"].requires_grad
    torch.testing.assert_close(logs["loss"], logs["bbox_loss"] + logs["cls_loss"])


def test_training_steps_with_fp16_model() -> None:
    # What precision=mp does to the model and the batch: FP16 weights and inputs, FP32 outputs.
    torch.manual_seed(0)
    task = _task()
    policy = make_policy("mp", torch.device("cpu"))
    model = policy.prepare_model(task.build_model())
    batch = policy.cast_inputs(_batch(task))
    assert batch["input"].dtype == torch.float16 and batch["target"][0]["boxes"].dtype == torch.float32
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model(batch["input"])["cls_logits"].dtype == torch.float32
    ctx = _SGDContext(model)
    losses = ctx.losses
    for _ in range(2):
        task.train_step(model, batch, ctx)
    assert all(x.dtype == torch.float32 and torch.isfinite(x) for x in losses)
    assert all(p.grad is not None and p.grad.dtype == torch.float16 for p in model.parameters())


def test_fp16_l2_norm_of_all_zero_features_is_finite() -> None:
    # Biases start at 0, so a black image gives all-zero conv4_3 features: 0/0 unless the norm runs in FP32.
    backbone = build_ssd(SSDConfig(), num_classes=3).backbone.half()
    features = backbone(torch.zeros(1, 3, 128, 128, dtype=torch.float16))
    assert all(torch.isfinite(f).all() for f in features.values())


class _PerfectHead(nn.Module):
    """Outputs that decode exactly to the ground truth of one fixed batch."""

    def __init__(self, task: SSDTask, targets: list[dict]) -> None:
        super().__init__()
        anchors = task._anchors_on(torch.device("cpu"))
        regression = torch.zeros(len(targets), anchors.shape[0], 4)
        logits = torch.zeros(len(targets), anchors.shape[0], len(task.class_names) + 1)
        logits[..., 0] = 20.0  # background everywhere ...
        for i, t in enumerate(targets):
            matched = task._match(anchors, t["boxes"])
            fg = matched >= 0  # ... except on the default boxes SSD matches to an object
            regression[i, fg] = task._ssd.box_coder.encode_single(t["boxes"][matched[fg]], anchors[fg])
            logits[i, fg, 0] = 0.0
            logits[i, fg, t["labels"][matched[fg]]] = 20.0
        self.out = {"bbox_regression": regression, "cls_logits": logits}

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.out


def test_evaluate_perfect_predictions_give_100_map() -> None:
    task = _task(data={**SMALL_DATA, "num_classes": 5})
    task.build_model()
    batch = _batch(task, "eval", n=4)
    result = task.evaluate(_PerfectHead(task, batch["target"]), [batch], _SGDContext(nn.Linear(1, 1)))
    present = {task.class_names[int(c) - 1] for t in batch["target"] for c in t["labels"]}
    assert result.metrics["mAP"] == pytest.approx(100.0)
    assert {k for k in result.metrics if k.startswith("AP_")} == {f"AP_{name}" for name in present}


def test_backbone_weights_load_from_a_local_file(tmp_path: Path) -> None:
    layers = _vgg16_layers(8)
    path = tmp_path / "vgg16.pth"
    torch.save({f"features.{k}": v for k, v in layers.state_dict().items()}, path)
    ssd = build_ssd(SSDConfig(backbone_weights=str(path)), num_classes=3)
    torch.testing.assert_close(ssd.backbone.conv4[0].weight, layers[0].weight)

    wrong_width = tmp_path / "wrong.pth"
    torch.save({f"features.{k}": v for k, v in _vgg16_layers(4).state_dict().items()}, wrong_width)
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint")
    for bad in (wrong_width, corrupt, tmp_path / "missing.pth"):
        with pytest.raises(UserError, match="model.backbone_weights") as err:
            build_ssd(SSDConfig(backbone_weights=str(bad)), num_classes=3)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("model, data, match", [
    ({"variant": "huge"}, SMALL_DATA, "model.variant"),
    ({"ap_version": "coco"}, SMALL_DATA, "model.ap_version"),
    ({}, {"name": "synthetic_images"}, "cannot use data=synthetic_images"),
    ({}, {**SMALL_DATA, "num_classes": 9}, "data.num_classes"),
    ({}, {**SMALL_DATA, "min_size": 0.6}, "min_size"),
])
def test_bad_config_is_a_user_error(model: dict, data: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        _task(model, data)


def test_synthetic_set_is_deterministic_by_seed() -> None:
    cfg = SyntheticDetectionConfig()

    def item(seed: int, split: str, index: int) -> tuple[torch.Tensor, dict]:
        return SyntheticDetection(cfg, split, 64, seed)[index]

    first, again = item(0, "train", 5), item(0, "train", 5)
    assert torch.equal(first[0], again[0])
    assert all(torch.equal(first[1][k], again[1][k]) for k in first[1])
    assert not torch.equal(first[0], item(1, "train", 5)[0])
    assert not torch.equal(first[0], item(0, "eval", 5)[0])
    assert not torch.equal(first[0], item(0, "train", 6)[0])


def test_synthetic_boxes_are_exact() -> None:
    # One object, no colour jitter: its pixels are exactly the class colour; the box must bound them tightly.
    cfg = SyntheticDetectionConfig(num_classes=5, max_objects=1, colour_jitter=0.0)
    ds = SyntheticDetection(cfg, "train", 64, seed=0)
    for index in range(10):
        image, target = ds[index]
        (label,) = target["labels"].tolist()
        colour = torch.tensor(CLASSES[label - 1][1]).view(3, 1, 1)
        ys, xs = (image == colour).all(dim=0).nonzero(as_tuple=True)
        assert target["boxes"][0].tolist() == [xs.min().item(), ys.min().item(), xs.max().item() + 1,
                                               ys.max().item() + 1]


def test_synthetic_items_have_several_valid_objects() -> None:
    ds = SyntheticDetection(SyntheticDetectionConfig(num_classes=5), "train", 64, seed=0)
    counts = []
    for index in range(20):
        image, target = ds[index]
        boxes = target["boxes"]
        assert image.shape == (3, 64, 64) and 0 <= image.min() and image.max() <= 1
        assert (boxes[:, 2:] > boxes[:, :2]).all() and boxes.min() >= 0 and boxes.max() <= 64
        assert target["labels"].min() >= 1 and target["labels"].max() <= 5 and not target["difficult"].any()
        counts.append(len(boxes))
    assert max(counts) >= 3 and min(counts) >= 1


@pytest.mark.parametrize("precision, scale", [("fp32", "none"), ("mp", "8")])
def test_engine_trains_and_evaluates_ssd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         precision: str, scale: str) -> None:
    monkeypatch.setitem(models.TASKS, "ssd", SSDTask)
    cfg = compose_job(["model=ssd", f"precision={precision}", f"scale={scale}", "data.num_train=4",
                       "data.num_eval=2", "data.batch_size=2", "trainer.max_steps=2", "trainer.log_every=1",
                       "trainer.optimizer=sgd", "trainer.lr=1e-3", "trainer.warmup_steps=0",
                       "trainer.timing_warmup_steps=1", f"out_root={tmp_path}"])
    summary = train(cfg)
    assert summary["metric_name"] == "mAP" and summary["steps"] == 2 and summary["skipped_steps"] == 0
    assert 0.0 <= summary["metric"] <= 100.0
