"""ImageNet-style ImageFolder data (root/train/<class>/*.jpg, root/val/<class>/*.jpg).

Training uses torchvision's standard ImageNet augmentation (RandomResizedCrop +
horizontal flip); evaluation resizes to image_size * 256/224 and center-crops,
as in the torchvision reference recipe the paper's ResNet-50 used.

`check_imagefolder` is the pre-flight scan: it lists both splits the way
torchvision's ImageFolder does (no extra file access per image), checks that the
class folders match and hold images, and decodes only the first SCAN_DECODE files
of each split. A damaged file found later is reported, with its path, when read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from data.common import (IMAGENET_MEAN, IMAGENET_STD, SCAN_DECODE, LoaderConfig, check_image_size, first_line,
                         read_rgb)
from runner.errors import UserError

LAYOUT = "expected <root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg"
SPLIT_FOLDERS = {"train": "train", "eval": "val"}
SHOWN = 3  # names listed in a message before "..."

# Splits that passed the scan in this process: a sweep checks every job's data in its
# pre-flight, and listing a million-image tree once is enough.
_scanned: set[Path] = set()


@dataclass
class ImageFolderConfig(LoaderConfig):
    name: str = "imagefolder"
    root: str = "???"
    image_size: int = 224
    batch_size: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        check_image_size(self.image_size, "the side of the square crop fed to the network; ResNet-50 uses 224")


def _split_dir(cfg: ImageFolderConfig, split: str) -> Path:
    return Path(cfg.root).expanduser().absolute() / SPLIT_FOLDERS[split]


def _some(names: list[str] | set[str]) -> str:
    """The first few names, sorted, for a one-line message."""
    ordered = sorted(names)
    return ", ".join(ordered[:SHOWN]) + (f" and {len(ordered) - SHOWN} more" if len(ordered) > SHOWN else "")


def _class_folders(cfg: ImageFolderConfig, folder: Path) -> list[str]:
    """Class folder names of one split, sorted (their order is the label order)."""
    if not folder.is_dir():
        raise UserError(f"no ImageFolder data: {folder} does not exist (data.root={cfg.root}); {LAYOUT}, "
                        f"or use the built-in set with data=synthetic_images")
    try:
        classes, _ = find_classes(folder)
    except FileNotFoundError:  # torchvision: "Couldn't find any class folder"
        raise UserError(f"no class folders in {folder}: {LAYOUT} (one folder per class)") from None
    return classes


def _scan_split(cfg: ImageFolderConfig, split: str) -> list[str]:
    """List one split as ImageFolder would, check every class has images, decode the first few."""
    folder = _split_dir(cfg, split)
    classes = _class_folders(cfg, folder)
    if folder in _scanned:
        return classes
    class_to_idx = {name: i for i, name in enumerate(classes)}
    samples = make_dataset(folder, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    empty = set(classes) - {classes[label] for _, label in samples}
    if empty:
        raise UserError(f"no images in class folder {_some({str(folder / name) for name in empty})}; add images "
                        f"({', '.join(IMG_EXTENSIONS[:3])}, ...) or remove the empty folders")
    for path, _ in samples[:SCAN_DECODE]:
        read_rgb(path)
    _scanned.add(folder)
    return classes


def check_imagefolder(cfg: ImageFolderConfig) -> None:
    """Pre-flight: both splits exist, hold the same 2+ classes with images, and their first files decode."""
    root = Path(cfg.root).expanduser().absolute()
    if not root.is_dir():
        raise UserError(f"no ImageFolder data: data.root={cfg.root} ({root}) is not a folder; {LAYOUT}, "
                        f"or use the built-in set with data=synthetic_images")
    train, val = (_scan_split(cfg, split) for split in SPLIT_FOLDERS)
    if train != val:
        # Labels are positions in the sorted class list, so any difference mislabels images.
        only_train, only_val = set(train) - set(val), set(val) - set(train)
        raise UserError(f"train and val class folders differ under {root}: only in train: {_some(only_train) or '-'}; "
                        f"only in val: {_some(only_val) or '-'}; both need the same class folders")
    if len(train) < 2:
        raise UserError(f"only one class folder ({train[0]}) under {root}/train; classification needs 2 or more")


def build_imagefolder(cfg: ImageFolderConfig, split: str) -> datasets.ImageFolder:
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if split == "train":
        tf = transforms.Compose([transforms.RandomResizedCrop(cfg.image_size), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), normalize])
    else:
        tf = transforms.Compose([transforms.Resize(round(cfg.image_size * 256 / 224)),
                                 transforms.CenterCrop(cfg.image_size), transforms.ToTensor(), normalize])
    folder = _split_dir(cfg, split)
    try:
        # read_rgb turns a damaged file met during training into a UserError that names it.
        ds = datasets.ImageFolder(str(folder), transform=tf, loader=read_rgb)
    except FileNotFoundError as exc:  # the tree changed since the pre-flight scan
        raise UserError(f"cannot use ImageFolder data at {folder}: {first_line(exc)} ({LAYOUT})") from None
    ds.num_classes = len(ds.classes)  # type: ignore[attr-defined]
    return ds
