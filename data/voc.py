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

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from data.common import LoaderConfig
from runner.errors import UserError

VOC_CLASSES = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)
# Zoom-out fills the canvas with the mean pixel (the Caffe SSD recipe's mean values, RGB).
MEAN_PIXEL = (123, 117, 104)
LAYOUT = ("expected <root>/VOC2007 and <root>/VOC2012 with ImageSets/Main/<split>.txt, Annotations/<id>.xml, "
          "JPEGImages/<id>.jpg")


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


def _set_dirs(cfg: VOCConfig, image_set: str) -> tuple[Path, str]:
    """"VOC2007/trainval" -> (<root>/VOC2007, "trainval"), with every path it needs checked."""
    year_dir, sep, split = image_set.partition("/")
    if not sep or not year_dir or not split:
        raise UserError(f"bad config: data image set {image_set!r}; write it as VOC<year>/<split>, "
                        f"e.g. VOC2007/trainval")
    root = Path(cfg.root).expanduser().absolute()
    base = root / year_dir
    for path in (root, base / "ImageSets" / "Main" / f"{split}.txt", base / "Annotations", base / "JPEGImages"):
        if not path.exists():
            raise UserError(f"no Pascal VOC data: {path} does not exist (data.root={cfg.root}); {LAYOUT}; "
                            f"or use the built-in set with data=synthetic_detection")
    return base, split


def check_voc(cfg: VOCConfig) -> None:
    for image_set in [*cfg.train_sets, *cfg.eval_sets]:
        _set_dirs(cfg, image_set)


def _image_ids(cfg: VOCConfig, image_sets: list[str]) -> list[tuple[Path, str]]:
    ids = []
    for image_set in image_sets:
        base, split = _set_dirs(cfg, image_set)
        lines = (base / "ImageSets" / "Main" / f"{split}.txt").read_text().split()
        ids.extend((base, image_id) for image_id in lines)
    return ids


def read_annotation(xml_path: Path) -> tuple[Tensor, Tensor, Tensor]:
    """Boxes (N, 4) in continuous pixels, labels (N,) in 1..20, difficult (N,) from one VOC XML file."""
    boxes, labels, difficult = [], [], []
    for obj in ET.parse(xml_path).getroot().iter("object"):
        box = obj.find("bndbox")
        x1, y1, x2, y2 = (float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
        boxes.append([x1 - 1, y1 - 1, x2, y2])
        labels.append(VOC_CLASSES.index(obj.findtext("name").strip()) + 1)
        difficult.append(int(obj.findtext("difficult", "0")) == 1)  # some VOC2012 files omit the tag
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
        with Image.open(base / "JPEGImages" / f"{image_id}.jpg") as jpeg:
            # PIL, not torchvision.io: torchvision 0.29 deprecates its decoders.
            image = v2.functional.pil_to_tensor(jpeg.convert("RGB"))
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=image.shape[-2:]),
                  "labels": labels, "difficult": difficult}
        image, target = self.transform(tv_tensors.Image(image), target)
        return image.as_subclass(Tensor), {k: v.as_subclass(Tensor) for k, v in target.items()}
