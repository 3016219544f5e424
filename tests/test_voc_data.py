"""Pascal VOC reading on a tiny VOCdevkit tree written by the test."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from data.voc import VOC_CLASSES, VOCConfig, VOCDetection, check_voc, read_annotation
from models.ssd import SSDTask
from runner.errors import UserError

SIZE = 32  # the dataset's output size; images below are 64 x 48 (W x H)

# Per image: (width, height, objects as (class, xmin, ymin, xmax, ymax, difficult or None = no tag)).
IMAGES = {
    ("VOC2007", "000001"): (64, 48, [("dog", 5, 10, 30, 40, 0), ("person", 33, 1, 64, 48, 0), ("cat", 2, 2, 8, 8, 1)]),
    ("VOC2007", "000002"): (64, 48, [("car", 11, 11, 50, 30, 0), ("car", 20, 5, 40, 45, 0)]),
    ("VOC2012", "2008_000001"): (64, 48, [("bird", 1, 1, 16, 24, None)]),
}
SPLITS = {("VOC2007", "trainval"): ["000001"], ("VOC2007", "test"): ["000001", "000002"],
          ("VOC2012", "trainval"): ["2008_000001"]}


def _xml(width: int, height: int, objects: list) -> str:
    parts = [f"<annotation><size><width>{width}</width><height>{height}</height><depth>3</depth></size>"]
    for name, x1, y1, x2, y2, difficult in objects:
        tag = "" if difficult is None else f"<difficult>{difficult}</difficult>"
        parts.append(f"<object><name>{name}</name><truncated>0</truncated>{tag}<bndbox><xmin>{x1}</xmin>"
                     f"<ymin>{y1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox></object>")
    return "".join(parts) + "</annotation>"


def write_voc_tree(root: Path) -> Path:
    """The IMAGES / SPLITS tree above, as a VOCdevkit folder at root."""
    for (year, image_id), (w, h, objects) in IMAGES.items():
        for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
            (root / year / sub).mkdir(parents=True, exist_ok=True)
        (root / year / "Annotations" / f"{image_id}.xml").write_text(_xml(w, h, objects))
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / year / "JPEGImages" / f"{image_id}.jpg")
    for (year, split), ids in SPLITS.items():
        (root / year / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


@pytest.fixture
def voc_root(tmp_path: Path) -> Path:
    return write_voc_tree(tmp_path / "VOCdevkit")


def _cfg(root: Path, **kw: object) -> VOCConfig:
    return VOCConfig(root=str(root), **kw)


def _expected(image_key: tuple[str, str], keep_difficult: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VOC's 1-based inclusive boxes -> continuous [xmin - 1, ymin - 1, xmax, ymax], scaled to SIZE."""
    w, h, objects = IMAGES[image_key]
    kept = [o for o in objects if keep_difficult or not o[5]]
    scale = torch.tensor([SIZE / w, SIZE / h, SIZE / w, SIZE / h])
    boxes = torch.tensor([[x1 - 1, y1 - 1, x2, y2] for _, x1, y1, x2, y2, _ in kept], dtype=torch.float32) * scale
    labels = torch.tensor([VOC_CLASSES.index(o[0]) + 1 for o in kept])
    return boxes, labels, torch.tensor([bool(o[5]) for o in kept])


def test_annotation_parsing(voc_root: Path) -> None:
    boxes, labels, difficult = read_annotation(voc_root / "VOC2007" / "Annotations" / "000001.xml")
    assert boxes.tolist() == [[4, 9, 30, 40], [32, 0, 64, 48], [1, 1, 8, 8]]
    assert labels.tolist() == [12, 15, 8]  # dog, person, cat (1-based in VOC_CLASSES)
    assert difficult.tolist() == [False, False, True]
    _, _, no_tag = read_annotation(voc_root / "VOC2012" / "Annotations" / "2008_000001.xml")
    assert no_tag.tolist() == [False]


def test_eval_split_keeps_difficult_objects_flagged(voc_root: Path) -> None:
    ds = VOCDetection(_cfg(voc_root), "eval", SIZE)
    assert len(ds) == 2
    for index, key in enumerate([("VOC2007", "000001"), ("VOC2007", "000002")]):
        image, target = ds[index]
        assert image.shape == (3, SIZE, SIZE) and image.dtype == torch.float32
        assert 0 <= image.min() and image.max() <= 1
        boxes, labels, difficult = _expected(key, keep_difficult=True)
        torch.testing.assert_close(target["boxes"], boxes)
        assert torch.equal(target["labels"], labels) and torch.equal(target["difficult"], difficult)
        assert type(target["boxes"]) is torch.Tensor  # plain tensors, not tv_tensors, leave the dataset


def test_train_split_is_07_plus_12_without_difficult(voc_root: Path) -> None:
    ds = VOCDetection(_cfg(voc_root, augment=False), "train", SIZE)
    assert len(ds) == 2  # VOC2007 trainval + VOC2012 trainval
    _, target = ds[0]
    boxes, labels, _ = _expected(("VOC2007", "000001"), keep_difficult=False)
    torch.testing.assert_close(target["boxes"], boxes)
    assert torch.equal(target["labels"], labels) and not target["difficult"].any()
    with_difficult = VOCDetection(_cfg(voc_root, augment=False, train_difficult=True), "train", SIZE)
    assert with_difficult[0][1]["difficult"].tolist() == [False, False, True]


def test_augmented_training_items_stay_valid(voc_root: Path) -> None:
    torch.manual_seed(0)
    ds = VOCDetection(_cfg(voc_root, train_difficult=True), "train", SIZE)
    for _ in range(10):
        image, target = ds[0]
        boxes = target["boxes"]
        assert image.shape == (3, SIZE, SIZE)
        assert boxes.shape[0] == target["labels"].shape[0] == target["difficult"].shape[0] >= 1
        assert (boxes[:, 2:] > boxes[:, :2]).all() and boxes.min() >= 0 and boxes.max() <= SIZE
        assert set(target["labels"].tolist()) <= {8, 12, 15}


def test_task_batches_voc(voc_root: Path) -> None:
    task = SSDTask(OmegaConf.create({"name": "ssd"}), OmegaConf.create({"name": "voc", "root": str(voc_root)}), 0)
    task.check_data()
    ds = task.build_eval_data()
    batch = task.collate([ds[0], ds[1]])
    assert batch["input"].shape == (2, 3, task.image_size, task.image_size)
    assert [t["boxes"].shape[0] for t in batch["target"]] == [3, 2]
    assert len(task.class_names) == 20


@pytest.mark.parametrize("missing", ["root", "VOC2012", "VOC2007/ImageSets/Main/test.txt"])
def test_missing_voc_data_is_a_one_line_user_error(voc_root: Path, missing: str) -> None:
    root = voc_root.parent / "nowhere" if missing == "root" else voc_root
    if missing != "root":
        target = voc_root / missing
        if target.is_file():
            target.unlink()
        else:
            shutil.rmtree(target)
    with pytest.raises(UserError) as err:
        check_voc(_cfg(root))
    message = str(err.value)
    assert "\n" not in message and str(root) in message
    assert "ImageSets/Main" in message and "data=synthetic_detection" in message
    with pytest.raises(UserError):
        SSDTask(OmegaConf.create({"name": "ssd"}), OmegaConf.create({"name": "voc", "root": str(root)}), 0).check_data()


def test_bad_image_set_name(voc_root: Path) -> None:
    with pytest.raises(UserError, match="VOC<year>/<split>"):
        check_voc(_cfg(voc_root, eval_sets=["test"]))
