"""ImageNet-style ImageFolder data (root/train/<class>/*.jpg, root/val/<class>/*.jpg).

Training uses torchvision's standard ImageNet augmentation (RandomResizedCrop +
horizontal flip); evaluation resizes to image_size * 256/224 and center-crops,
as in the torchvision reference recipe the paper's ResNet-50 used.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchvision import datasets, transforms

from data.common import LoaderConfig
from runner.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ImageFolderConfig(LoaderConfig):
    name: str = "imagefolder"
    root: str = "???"
    image_size: int = 224
    batch_size: int = 256


def _split_dir(cfg: ImageFolderConfig, split: str) -> Path:
    return Path(cfg.root).expanduser() / ("train" if split == "train" else "val")


def check_imagefolder(cfg: ImageFolderConfig) -> None:
    for split in ("train", "eval"):
        folder = _split_dir(cfg, split)
        if not folder.is_dir() or not any(p.is_dir() for p in folder.iterdir()):
            raise UserError(
                f"no ImageFolder data at {folder} (data.root={cfg.root}); expected "
                f"<root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg, "
                f"or use the built-in set with data=synthetic_images")


def build_imagefolder(cfg: ImageFolderConfig, split: str) -> datasets.ImageFolder:
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if split == "train":
        tf = transforms.Compose([transforms.RandomResizedCrop(cfg.image_size), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), normalize])
    else:
        tf = transforms.Compose([transforms.Resize(round(cfg.image_size * 256 / 224)),
                                 transforms.CenterCrop(cfg.image_size), transforms.ToTensor(), normalize])
    ds = datasets.ImageFolder(str(_split_dir(cfg, split)), transform=tf)
    ds.num_classes = len(ds.classes)  # type: ignore[attr-defined]
    return ds
