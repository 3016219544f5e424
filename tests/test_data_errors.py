"""Bad data input is a one-line UserError that names the file or key, the bad value and the fix.

Trees are generated in tmp_path; every test breaks one thing and checks the message.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from omegaconf import OmegaConf
from PIL import Image
from torch.utils.data import DataLoader

from data.common import SCAN_DECODE
from data.imagefolder import ImageFolderConfig, build_imagefolder, check_imagefolder
from data.synthetic_detection import SyntheticDetectionConfig
from data.synthetic_images import SyntheticImagesConfig
from data.voc import VOC_CLASSES, VOCConfig, VOCDetection, check_voc
from models.resnet50 import ResNet50Task
from runner.errors import UserError
from tests.test_voc_data import _xml, write_voc_tree


def one_line_error(action: Callable[[], Any], *parts: str) -> str:
    """Run action; it must raise a one-line UserError containing every part."""
    with pytest.raises(UserError) as err:
        action()
    message = str(err.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


def _image(path: Path, shade: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (20, 16), (shade, 80, 160)).save(path)
    return path


def _truncate(path: Path) -> Path:
    """Cut a valid JPEG in half: the header still opens, the pixels no longer decode."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


# --- ImageFolder ---------------------------------------------------------------------------

CLASSES = ("cat", "dog")
PER_CLASS = 3  # more than SCAN_DECODE, so some files are only read during training


def imagefolder_tree(root: Path, splits: dict[str, tuple[str, ...]] | None = None) -> Path:
    for split, classes in (splits or {"train": CLASSES, "val": CLASSES}).items():
        for name in classes:
            for i in range(PER_CLASS):
                _image(root / split / name / f"{i}.jpg", shade=40 * i)
    return root


def _folder_cfg(root: Path) -> ImageFolderConfig:
    return ImageFolderConfig(root=str(root), image_size=16)


def test_good_imagefolder_tree_passes_the_scan(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data")
    check_imagefolder(_folder_cfg(root))
    task = ResNet50Task(OmegaConf.create({"name": "resnet50"}),
                        OmegaConf.create({"name": "imagefolder", "root": str(root), "image_size": 16}), 0)
    task.check_data()
    assert len(task.build_train_data()) == 2 * PER_CLASS


def test_missing_root(tmp_path: Path) -> None:
    one_line_error(lambda: check_imagefolder(_folder_cfg(tmp_path / "nowhere")),
                   str(tmp_path / "nowhere"), "data.root=", "<root>/train/<class>", "data=synthetic_images")


@pytest.mark.parametrize("split", ["train", "val"])
def test_missing_split_folder(tmp_path: Path, split: str) -> None:
    root = imagefolder_tree(tmp_path / "data")
    shutil.rmtree(root / split)
    one_line_error(lambda: check_imagefolder(_folder_cfg(root)), str(root / split), "does not exist", "<root>/val")


def test_split_without_class_folders(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data", {"train": CLASSES})
    (root / "val").mkdir()
    _image(root / "val" / "loose.jpg")  # images directly in val/, not in class folders
    one_line_error(lambda: check_imagefolder(_folder_cfg(root)), f"no class folders in {root / 'val'}",
                   "one folder per class")


def test_class_folder_without_images(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data")
    (root / "train" / ".ipynb_checkpoints").mkdir()      # an empty hidden folder is a class to torchvision
    (root / "train" / "dog" / "notes.txt").write_text("") # not an image extension
    for jpg in (root / "train" / "dog").glob("*.jpg"):
        jpg.unlink()
    message = one_line_error(lambda: check_imagefolder(_folder_cfg(root)), str(root / "train" / "dog"),
                             str(root / "train" / ".ipynb_checkpoints"), "no images in class folder",
                             "remove the empty folders")
    assert "Found no valid file" not in message  # torchvision's message is replaced, not passed on


def test_class_sets_must_match(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data", {"train": CLASSES, "val": (*CLASSES, "owl")})
    one_line_error(lambda: check_imagefolder(_folder_cfg(root)), "only in val: owl", "only in train: -",
                   "same class folders")


def test_a_single_class_is_not_a_classification_task(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data", {"train": ("cat",), "val": ("cat",)})
    one_line_error(lambda: check_imagefolder(_folder_cfg(root)), "only one class folder (cat)", "2 or more")


@pytest.mark.parametrize("damage", ["truncated", "not an image"])
def test_scan_decodes_the_first_files(tmp_path: Path, damage: str) -> None:
    root = imagefolder_tree(tmp_path / "data")
    bad = root / "val" / "cat" / "1.jpg"  # the second file of val: inside the scan
    if damage == "truncated":
        _truncate(bad)
    else:
        bad.write_bytes(b"<html>404 not found</html>")
    one_line_error(lambda: check_imagefolder(_folder_cfg(root)), f"cannot read image {bad}", "replace or delete")


def test_scan_does_not_decode_every_file(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data")
    late = _truncate(root / "train" / "dog" / "2.jpg")  # the last file: past the scan
    check_imagefolder(_folder_cfg(root))
    # ...and found, with its path, when training reads it.
    ds = build_imagefolder(_folder_cfg(root), "train")
    index = [path for path, _ in ds.samples].index(str(late))
    assert index >= SCAN_DECODE
    one_line_error(lambda: ds[index], f"cannot read image {late}")


def test_damaged_image_in_a_loader_worker_keeps_the_message_on_the_last_line(tmp_path: Path) -> None:
    # torch re-raises a worker's exception as UserError("Caught UserError in DataLoader worker
    # process 0.\nOriginal Traceback ...\nrunner.errors.UserError: <message>"): the CLI must
    # show the last line. This pins that format so a torch change is noticed.
    root = imagefolder_tree(tmp_path / "data")
    late = _truncate(root / "val" / "dog" / "2.jpg")
    ds = build_imagefolder(_folder_cfg(root), "eval")
    with pytest.raises(UserError) as err:
        list(DataLoader(ds, batch_size=2, num_workers=1))
    lines = str(err.value).strip().splitlines()
    assert lines[0] == "Caught UserError in DataLoader worker process 0."
    assert lines[-1].startswith(f"runner.errors.UserError: cannot read image {late}: ")


def test_tree_emptied_after_the_scan(tmp_path: Path) -> None:
    root = imagefolder_tree(tmp_path / "data")
    check_imagefolder(_folder_cfg(root))
    for jpg in (root / "train" / "cat").glob("*.jpg"):
        jpg.unlink()
    one_line_error(lambda: build_imagefolder(_folder_cfg(root), "train"), str(root / "train"),
                   "Found no valid file for the classes cat")


# --- Pascal VOC ---------------------------------------------------------------------------------


@pytest.fixture
def voc_root(tmp_path: Path) -> Path:
    return write_voc_tree(tmp_path / "VOCdevkit")


def _voc_cfg(root: Path, **kw: Any) -> VOCConfig:
    return VOCConfig(root=str(root), **kw)


def _annotation(root: Path, image_id: str = "000002") -> Path:
    return root / "VOC2007" / "Annotations" / f"{image_id}.xml"


def test_good_voc_tree_passes_the_scan(voc_root: Path) -> None:
    check_voc(_voc_cfg(voc_root))


def test_missing_year_folder_is_named(voc_root: Path) -> None:
    shutil.rmtree(voc_root / "VOC2012")
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), f"{voc_root / 'VOC2012'} does not exist",
                   "data=synthetic_detection")


def test_empty_image_set(voc_root: Path) -> None:
    image_set = voc_root / "VOC2007" / "ImageSets" / "Main" / "test.txt"
    image_set.write_text("\n")
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), f"image set {image_set} is empty", "one image id per line")


@pytest.mark.parametrize("folder, suffix", [("Annotations", ".xml"), ("JPEGImages", ".jpg")])
def test_listed_id_without_its_file(voc_root: Path, folder: str, suffix: str) -> None:
    image_set = voc_root / "VOC2007" / "ImageSets" / "Main" / "test.txt"
    image_set.write_text("000001\n000002\n009999\n")
    for other in ({"Annotations", "JPEGImages"} - {folder}):  # the id's other file is there
        source = next((voc_root / "VOC2007" / other).iterdir())
        shutil.copy(source, source.with_stem("009999"))
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), f"VOC2007/test lists 1 image id(s) with no file in {folder}",
                   f"{voc_root / 'VOC2007' / folder / f'009999{suffix}'} is missing", f"remove the ids from {image_set}")


def test_malformed_xml(voc_root: Path) -> None:
    path = _annotation(voc_root)
    path.write_text(path.read_text()[:-20])  # cut off mid-tag
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), f"bad annotation {path}: not valid XML",
                   "fix or replace the file")


def _one_object(root: Path, name: str = "car", box: str = "<xmin>1</xmin><ymin>2</ymin><xmax>9</xmax><ymax>9</ymax>",
                extra: str = "") -> Path:
    path = _annotation(root)
    path.write_text(f"<annotation><object><name>{name}</name>{extra}<bndbox>{box}</bndbox></object></annotation>")
    return path


def test_unknown_class_names_class_file_and_known_classes(voc_root: Path) -> None:
    path = _one_object(voc_root, name="dinosaur")
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), "unknown class 'dinosaur'", str(path),
                   ", ".join(VOC_CLASSES))


@pytest.mark.parametrize("box, shown", [
    ("<xmin>1</xmin><ymin>2</ymin><xmax>9</xmax>", "ymax=None"),                  # missing
    ("<xmin>1</xmin><ymin>2</ymin><xmax>nine</xmax><ymax>9</ymax>", "xmax='nine'"),  # not a number
    ("<xmin>1</xmin><ymin>nan</ymin><xmax>9</xmax><ymax>9</ymax>", "ymin='nan'"),   # not a finite number
    ("<xmin>12</xmin><ymin>2</ymin><xmax>9</xmax><ymax>9</ymax>", "xmin=12 ymin=2 xmax=9"),  # empty
])
def test_bad_box(voc_root: Path, box: str, shown: str) -> None:
    path = _one_object(voc_root, box=box)
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), f"bad annotation {path}: object 'car'", shown)


def test_one_pixel_box_is_valid(voc_root: Path) -> None:
    # VOC pixels are inclusive: xmin == xmax is one pixel wide ([4, 5) in continuous coordinates).
    _one_object(voc_root, box="<xmin>5</xmin><ymin>2</ymin><xmax>5</xmax><ymax>9</ymax>")
    check_voc(_voc_cfg(voc_root))


def test_bad_difficult_flag(voc_root: Path) -> None:
    path = _one_object(voc_root, extra="<difficult>yes</difficult>")
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), str(path), "<difficult> is 'yes', must be 0 or 1")


def test_damaged_voc_jpeg(voc_root: Path) -> None:
    bad = _truncate(voc_root / "VOC2012" / "JPEGImages" / "2008_000001.jpg")
    one_line_error(lambda: check_voc(_voc_cfg(voc_root)), f"cannot read image {bad}")


def test_bad_item_past_the_scan_is_reported_when_read(voc_root: Path) -> None:
    extra = [f"00001{i}" for i in range(SCAN_DECODE + 1)]
    for image_id in extra:
        _annotation(voc_root, image_id).write_text(_xml(20, 16, [("car", 1, 1, 9, 9, 0)]))
        _image(voc_root / "VOC2007" / "JPEGImages" / f"{image_id}.jpg")
    (voc_root / "VOC2007" / "ImageSets" / "Main" / "test.txt").write_text("\n".join(extra))
    late = _annotation(voc_root, extra[-1])
    late.write_text("<annotation><object>")
    check_voc(_voc_cfg(voc_root))  # the scan parses only the first SCAN_DECODE of each set
    ds = VOCDetection(_voc_cfg(voc_root), "eval", 32)
    one_line_error(lambda: ds[len(extra) - 1], f"bad annotation {late}: not valid XML")


# --- config ranges ------------------------------------------------------------------------------

RANGES = [
    (SyntheticImagesConfig, "num_classes", 1), (SyntheticImagesConfig, "num_classes", 0),
    (SyntheticImagesConfig, "image_size", 4), (SyntheticImagesConfig, "image_size", 0),
    (SyntheticImagesConfig, "image_size", 100_000), (SyntheticImagesConfig, "num_train", 0),
    (SyntheticImagesConfig, "num_eval", 0), (SyntheticImagesConfig, "num_train", 20_000_000),
    (SyntheticImagesConfig, "noise", -0.1), (SyntheticImagesConfig, "noise", math.nan),
    (SyntheticImagesConfig, "batch_size", 0), (SyntheticImagesConfig, "eval_batch_size", 0),
    (SyntheticImagesConfig, "num_workers", -1),
    (SyntheticDetectionConfig, "num_classes", 0), (SyntheticDetectionConfig, "num_classes", 9),
    (SyntheticDetectionConfig, "num_eval", 0), (SyntheticDetectionConfig, "max_objects", 0),
    (SyntheticDetectionConfig, "max_objects", 1000), (SyntheticDetectionConfig, "min_size", 0.01),
    (SyntheticDetectionConfig, "max_size", 1.5), (SyntheticDetectionConfig, "min_size", 0.6),  # > max_size 0.5
    (SyntheticDetectionConfig, "max_overlap", -0.1), (SyntheticDetectionConfig, "max_overlap", 1.5),
    (SyntheticDetectionConfig, "colour_jitter", -1.0), (SyntheticDetectionConfig, "batch_size", 0),
    (ImageFolderConfig, "image_size", 0), (ImageFolderConfig, "batch_size", -1),
    (VOCConfig, "eval_sets", []), (VOCConfig, "train_sets", []), (VOCConfig, "num_workers", -2),
]


@pytest.mark.parametrize("schema, key, value", RANGES, ids=[f"{s.__name__}.{k}={v}" for s, k, v in RANGES])
def test_config_out_of_range(schema: type, key: str, value: Any) -> None:
    message = one_line_error(lambda: schema(**{key: value}), f"bad config: data.{key}={value} must be ")
    assert message.endswith(")")  # the hint in parentheses says what the key means


def test_config_errors_surface_through_the_task() -> None:
    data = OmegaConf.create({"name": "synthetic_images", "num_eval": 0})
    one_line_error(lambda: ResNet50Task(OmegaConf.create({"name": "resnet50"}), data, 0),
                   "bad config: data.num_eval=0 must be between 1 and")


def test_defaults_are_valid() -> None:
    for schema in (SyntheticImagesConfig, SyntheticDetectionConfig, ImageFolderConfig, VOCConfig):
        schema()

