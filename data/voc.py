"""Pascal VOC detection data as users have it (VOCdevkit/VOC2007, VOCdevkit/VOC2012).

Layout: <root>/VOC<year>/ImageSets/Main/<split>.txt (one image id per line),
<root>/VOC<year>/Annotations/<id>.xml and <root>/VOC<year>/JPEGImages/<id>.jpg.
The paper's SSD trains on VOC2007 trainval + VOC2012 trainval and tests on VOC2007 test.

Boxes are returned in continuous pixel coordinates of the resized image: VOC's
1-based inclusive [xmin, xmax] becomes [xmin - 1, xmax]. In these coordinates the
VOC devkit's "+1" box areas are plain areas, and IoU is unchanged by resizing, so
models/voc_map.py evaluates exactly as the devkit does.

`difficult` objects: kept out of the training targets by default
(`train_difficult: false`, as ssd.pytorch does); the original Caffe SSD recipe
trains on them (ssd_pascal.py: train_on_diff_gt = True), set `train_difficult:
true` for that. Evaluation always keeps them, flagged, so the metric ignores
them as the devkit does.
"""
from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from data.common import SCAN_DECODE, LoaderConfig, first_line, read_rgb, require
from runner.errors import UserError

VOC_CLASSES = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)
LABELS = {name: i + 1 for i, name in enumerate(VOC_CLASSES)}  # 0 is the background
# Zoom-out fills the canvas with the mean pixel (the Caffe SSD recipe's mean values, RGB).
MEAN_PIXEL = (123, 117, 104)
LAYOUT = ("expected <root>/VOC2007 and <root>/VOC2012 with ImageSets/Main/<split>.txt, Annotations/<id>.xml, "
          "JPEGImages/<id>.jpg")
COORDINATES = ("xmin", "ymin", "xmax", "ymax")


@dataclass
class VOCConfig(LoaderConfig):
    name: str = "voc"
    root: str = "data/VOCdevkit"
    train_sets: list[str] = field(default_factory=lambda: ["VOC2007/trainval", "VOC2012/trainval"])
    eval_sets: list[str] = field(default_factory=lambda: ["VOC2007/test"])
    train_difficult: bool = False   # see the module docstring
    augment: bool = True            # SSD's training augmentation
    batch_size: int = 32
    num_workers: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, example in (("train_sets", "[VOC2007/trainval, VOC2012/trainval]"), ("eval_sets", "[VOC2007/test]")):
            sets = list(getattr(self, key))
            require(bool(sets) and all(map(_is_set_name, sets)), key, sets,
                    "a list of one or more image sets written as VOC<year>/<split>", f"e.g. {example}")


def _is_set_name(image_set: str) -> bool:
    """"VOC2007/trainval": a year folder and a split name."""
    year_dir, sep, split = image_set.partition("/")
    return bool(year_dir and sep and split)


def _set_dirs(cfg: VOCConfig, image_set: str) -> tuple[Path, str]:
    """"VOC2007/trainval" -> (<root>/VOC2007, "trainval"), with every path it needs checked."""
    year_dir, _, split = image_set.partition("/")  # the form is checked by VOCConfig
    root = Path(cfg.root).expanduser().absolute()
    base = root / year_dir
    for path in (root, base, base / "ImageSets" / "Main" / f"{split}.txt", base / "Annotations", base / "JPEGImages"):
        if not path.exists():
            raise UserError(f"no Pascal VOC data: {path} does not exist (data.root={cfg.root}); {LAYOUT}; "
                            f"or use the built-in set with data=synthetic_detection")
    return base, split


def _read_ids(base: Path, split: str) -> list[str]:
    """The image ids an ImageSets/Main/<split>.txt lists (one per line)."""
    path = base / "ImageSets" / "Main" / f"{split}.txt"
    try:
        ids = path.read_text().split()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read image set {path}: {first_line(exc)}") from None
    if not ids:
        raise UserError(f"image set {path} is empty; it should list one image id per line (e.g. 000005)")
    return ids


def _image_ids(cfg: VOCConfig, image_sets: list[str]) -> list[tuple[Path, str]]:
    ids = []
    for image_set in image_sets:
        base, split = _set_dirs(cfg, image_set)
        ids.extend((base, image_id) for image_id in _read_ids(base, split))
    return ids


def _check_files_exist(base: Path, split: str, ids: list[str], folder: str, suffix: str) -> None:
    """Every listed id has <base>/<folder>/<id><suffix>: one directory listing, no per-file access."""
    present = set(os.listdir(base / folder))
    missing = [image_id for image_id in ids if image_id + suffix not in present]
    if missing:
        raise UserError(f"{base.name}/{split} lists {len(missing)} image id(s) with no file in {folder}, e.g. "
                        f"{base / folder / (missing[0] + suffix)} is missing; add the files or remove the ids from "
                        f"{base / 'ImageSets' / 'Main' / f'{split}.txt'}")


def check_voc(cfg: VOCConfig) -> None:
    """Pre-flight: every image set's folders exist, every listed id has its XML and JPEG, and the
    first SCAN_DECODE items of each set parse and decode (later bad files are reported when read)."""
    for image_set in dict.fromkeys([*cfg.train_sets, *cfg.eval_sets]):  # each set once, in order
        base, split = _set_dirs(cfg, image_set)
        ids = _read_ids(base, split)
        _check_files_exist(base, split, ids, "Annotations", ".xml")
        _check_files_exist(base, split, ids, "JPEGImages", ".jpg")
        for image_id in ids[:SCAN_DECODE]:
            read_annotation(base / "Annotations" / f"{image_id}.xml")
            read_rgb(base / "JPEGImages" / f"{image_id}.jpg")


def _bad_annotation(xml_path: Path, problem: str) -> UserError:
    return UserError(f"bad annotation {xml_path}: {problem}; fix or replace the file")


def _label(name: str, xml_path: Path) -> int:
    if name not in LABELS:
        raise _bad_annotation(xml_path, f"unknown class {name!r}, the known classes are {', '.join(VOC_CLASSES)}")
    return LABELS[name]


def _number(text: str | None) -> float | None:
    """A finite coordinate, or None for a missing tag or anything else."""
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _box(obj: ET.Element, name: str, xml_path: Path) -> list[float]:
    """VOC's 1-based inclusive pixel box -> continuous [xmin - 1, ymin - 1, xmax, ymax]."""
    texts = [obj.findtext(f"bndbox/{k}") for k in COORDINATES]
    numbers = [_number(t) for t in texts]
    if None in numbers:
        shown = ", ".join(f"{k}={t!r}" for k, t in zip(COORDINATES, texts))
        raise _bad_annotation(xml_path, f"object {name!r} needs numeric bndbox xmin, ymin, xmax, ymax, has {shown}")
    x1, y1, x2, y2 = numbers  # type: ignore[misc]
    # Inclusive pixels: xmax == xmin is a box one pixel wide; only xmax < xmin is empty.
    if x2 < x1 or y2 < y1:
        raise _bad_annotation(xml_path, f"object {name!r} has an empty box xmin={x1:g} ymin={y1:g} xmax={x2:g} "
                                        f"ymax={y2:g} (xmax must be >= xmin and ymax >= ymin)")
    return [x1 - 1, y1 - 1, x2, y2]


def _difficult(obj: ET.Element, xml_path: Path) -> bool:
    text = (obj.findtext("difficult") or "0").strip()  # some VOC2012 files omit the tag
    if text not in ("0", "1"):
        raise _bad_annotation(xml_path, f"<difficult> is {text!r}, must be 0 or 1")
    return text == "1"


def read_annotation(xml_path: Path) -> tuple[Tensor, Tensor, Tensor]:
    """Boxes (N, 4) in continuous pixels, labels (N,) in 1..20, difficult (N,) from one VOC XML file.

    Any problem with the file is a UserError naming it.
    """
    try:
        objects = list(ET.parse(xml_path).getroot().iter("object"))
    except ET.ParseError as exc:
        raise _bad_annotation(xml_path, f"not valid XML ({exc})") from None
    except OSError as exc:
        raise UserError(f"cannot read annotation {xml_path}: {first_line(exc)}") from None
    boxes, labels, difficult = [], [], []
    for obj in objects:
        name = (obj.findtext("name") or "").strip()
        labels.append(_label(name, xml_path))
        boxes.append(_box(obj, name, xml_path))
        difficult.append(_difficult(obj, xml_path))
    return (torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), torch.tensor(labels, dtype=torch.int64),
            torch.tensor(difficult, dtype=torch.bool))


def _per_box_fields(sample: tuple[Tensor, dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """What SanitizeBoundingBoxes must drop along with a box (a function: workers may pickle it)."""
    return sample[1]["labels"], sample[1]["difficult"]


def ssd_transform(image_size: int, augment: bool) -> v2.Transform:
    """SSD's augmentation (photometric distortion, zoom out, IoU crop, flip) + resize to a square."""
    resize = [v2.Resize((image_size, image_size), antialias=True)]
    to_float = [v2.ToDtype(torch.float32, scale=True)]
    if not augment:
        return v2.Compose(resize + to_float)
    return v2.Compose([
        v2.RandomPhotometricDistort(p=0.5),
        v2.RandomZoomOut(fill=MEAN_PIXEL, side_range=(1.0, 4.0), p=0.5),
        v2.RandomIoUCrop(),
        v2.RandomHorizontalFlip(p=0.5),
        *resize,
        v2.SanitizeBoundingBoxes(labels_getter=_per_box_fields),  # drops the boxes the crop cut away
        *to_float,
    ])


class VOCDetection(Dataset):
    """Items: (image (3, S, S) float in [0, 1], {"boxes", "labels", "difficult"})."""

    def __init__(self, cfg: VOCConfig, split: str, image_size: int) -> None:
        self.train = split == "train"
        self.ids = _image_ids(cfg, cfg.train_sets if self.train else cfg.eval_sets)
        self.keep_difficult = cfg.train_difficult or not self.train
        self.transform = ssd_transform(image_size, augment=self.train and cfg.augment)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        base, image_id = self.ids[index]
        boxes, labels, difficult = read_annotation(base / "Annotations" / f"{image_id}.xml")
        if not self.keep_difficult:
            boxes, labels, difficult = boxes[~difficult], labels[~difficult], difficult[~difficult]
        # PIL, not torchvision.io: torchvision 0.29 deprecates its decoders.
        image = v2.functional.pil_to_tensor(read_rgb(base / "JPEGImages" / f"{image_id}.jpg"))
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=image.shape[-2:]),
                  "labels": labels, "difficult": difficult}
        image, target = self.transform(tv_tensors.Image(image), target)
        return image.as_subclass(Tensor), {k: v.as_subclass(Tensor) for k, v in target.items()}
