"""The DCGAN task: paper architecture, data readers, the SWD metric, and two optimizers
through the engine (every precision mode, a skip in one optimizer, checkpoint and resume)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from omegaconf import OmegaConf
from PIL import Image
from torch import nn

import models
from data.dcgan_celeba import CelebAConfig, CelebAImages, check_celeba
from data.dcgan_faces import SyntheticFaces, SyntheticFacesConfig
from models.dcgan import DCGAN, DCGANConfig, DCGANTask
from models.swd import SlicedWassersteinDistance
from runner import checkpoint
from runner.cli import compose_job
from runner.engine import train
from runner.errors import UserError
from runner.task import Batch, StepContext

# A 32 px DCGAN at width 4 on 96 built-in faces: the paper's code path, tiny. The DCGAN
# recipe (Adam 2e-4, betas 0.5/0.999, no decay) is spelled out so the test does not depend
# on presets. One thread: on a loaded 2-core machine two OpenMP threads spin-wait for each
# other on these tiny convolutions (measured: the file took 135 s of CPU with the default).
TINY = ["threads=1", "model=dcgan", "model.image_size=32", "model.width=4", "model.swd_patches=8", "data.image_size=32",
        "data.num_train=96", "data.num_eval=32", "data.batch_size=16", "trainer.optimizer=adam",
        "trainer.lr=2e-4", "trainer.betas=[0.5,0.999]", "trainer.weight_decay=0", "trainer.schedule=constant",
        "trainer.warmup_steps=0", "trainer.log_every=1", "trainer.timing_warmup_steps=0"]
PRECISIONS = ["fp32", "tf32", "fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"]


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Every test here on one thread (as TINY's threads=1 does for runs); other test files get
    their process-wide thread count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(out_dir: Path, *overrides: str) -> Any:
    return compose_job([*TINY, f"out_dir={out_dir}", *overrides])


def _train_log(run_dir: Path, key: str) -> list[float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r[key] for r in records if r["split"] == "train"]


# --- architecture ------------------------------------------------------------------------------------
def test_paper_size_network_on_meta() -> None:
    with torch.device("meta"):
        model = DCGAN(DCGANConfig())
        images = model.G(torch.zeros(2, 100, 1, 1))
        logits = model.D(images)
    kinds = [type(m).__name__ for m in model.G]
    assert kinds.count("ConvTranspose2d") == 7 and kinds.count("BatchNorm2d") == 7
    assert kinds.count("LeakyReLU") == 6 and kinds[-1] == "Tanh"
    d_layers = [type(m).__name__ for m in model.D]
    assert d_layers.count("Conv2d") == 6 and d_layers.count("Linear") == 2
    assert d_layers.count("BatchNorm2d") + d_layers.count("BatchNorm1d") == 7  # all but the last FC
    assert d_layers[-1] == "Linear"
    assert tuple(images.shape) == (2, 3, 128, 128) and tuple(logits.shape) == (2, 1)
    # 128 px, width 64: G has 512, 512, 512, 256, 128, 64 channels at 4..128 px, D mirrors it and
    # ends in FC 8192 -> 512 -> 1 (counted by hand: conv/FC weights + BN scales and shifts + 1 bias).
    assert sum(p.numel() for p in model.G.parameters()) == 11_962_048 + 3_974
    assert sum(p.numel() for p in model.D.parameters()) == 15_337_665 + 4_992


def test_outer_bn_false_is_radford_dcgan() -> None:
    """outer_bn=false drops batch norm from G's output and D's input layer (Radford et al.); those
    two convolutions then get a bias, every other layer is unchanged."""
    paper, radford = DCGAN(DCGANConfig(image_size=32, width=4)), DCGAN(DCGANConfig(image_size=32, width=4, outer_bn=False))
    assert [type(m).__name__ for m in radford.G][-2:] == ["ConvTranspose2d", "Tanh"] and radford.G[-2].bias is not None
    assert [type(m).__name__ for m in radford.D][:2] == ["Conv2d", "LeakyReLU"] and radford.D[0].bias is not None
    assert paper.G[-3].bias is None and paper.D[0].bias is None
    norms = lambda m: sum(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules())  # noqa: E731
    assert norms(paper) - norms(radford) == 2


@pytest.mark.parametrize("size", [32, 64])
def test_cpu_sizes_share_the_builder(size: int) -> None:
    with torch.device("meta"):
        model = DCGAN(DCGANConfig(image_size=size, width=8))
        assert tuple(model.G(torch.zeros(2, 100, 1, 1)).shape) == (2, 3, size, size)


def test_bad_model_config_is_a_user_error() -> None:
    data = OmegaConf.create({"name": "synthetic_faces"})  # 128 px by default
    with pytest.raises(UserError, match="model.image_size=48"):
        DCGANTask(OmegaConf.create({"name": "dcgan", "image_size": 48}), data, 0)
    with pytest.raises(UserError, match="data.image_size=128 differs from model.image_size=32"):
        DCGANTask(OmegaConf.create({"name": "dcgan", "image_size": 32}), data, 0)


# --- the metric --------------------------------------------------------------------------------------
def _faces(split: str, n: int) -> torch.Tensor:
    ds = SyntheticFaces(SyntheticFacesConfig(image_size=32), split, seed=0)
    return torch.stack([ds[i][0] for i in range(n)])


def _swd(real: torch.Tensor, fake: torch.Tensor) -> float:
    metric = SlicedWassersteinDistance(seed=0, patches_per_image=16)
    metric.update(real, fake)
    return metric.compute()["swd"]


def test_swd_is_zero_for_identical_sets_and_grows_with_shift_and_blur() -> None:
    real, other = _faces("eval", 64), _faces("train", 64)
    assert _swd(real, real) == 0.0
    same_distribution = _swd(real, other)
    shifted = [_swd(real, (other + s).clamp(-1, 1)) for s in (0.1, 0.3)]
    blurred = [_swd(real, TF.gaussian_blur(other, [7, 7], [s, s])) for s in (0.7, 1.5)]
    assert same_distribution < shifted[0] < shifted[1]
    assert same_distribution < blurred[0] < blurred[1]


# --- data --------------------------------------------------------------------------------------------
def test_synthetic_faces_are_deterministic_varied_and_in_range() -> None:
    a, b = _faces("train", 8), _faces("train", 8)
    assert torch.equal(a, b) and a.shape == (8, 3, 32, 32)
    cached = SyntheticFaces(SyntheticFacesConfig(image_size=32), "train", seed=0)
    assert cached.cache is not None and torch.equal(cached[3][0], cached[3][0]) and torch.equal(cached[3][0], a[3])
    uncached = SyntheticFaces(SyntheticFacesConfig(image_size=128, num_train=100_000), "train", seed=0)
    assert uncached.cache is None  # 6 GB would not be kept
    assert a.min() >= -1 and a.max() <= 1
    assert not torch.allclose(a[0], a[1]) and not torch.allclose(a, _faces("eval", 8))


def _write_celeba(root: Path, n: int = 6, partition: bool = True) -> None:
    folder = root / "img_align_celeba"
    folder.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (36, 44), (40 * i, 100, 200)).save(folder / f"{i + 1:06d}.jpg")
    if partition:  # 4 train, 1 validation, 1 test
        parts = [0, 0, 0, 0, 1, 2]
        (root / "list_eval_partition.txt").write_text("".join(f"{i + 1:06d}.jpg {p}\n" for i, p in enumerate(parts)))


def test_celeba_reader_partitions_crop_and_range(tmp_path: Path) -> None:
    _write_celeba(tmp_path)
    cfg = CelebAConfig(root=str(tmp_path), image_size=32, crop=30)
    check_celeba(cfg)
    train_set, eval_set = CelebAImages(cfg, "train"), CelebAImages(cfg, "eval")
    assert len(train_set) == 4 and [p.name for p in eval_set.paths] == ["000006.jpg"]
    image, _ = train_set[1]
    assert image.shape == (3, 32, 32) and image.min() >= -1 and image.max() <= 1
    assert abs(float(image[0].mean()) - (40 / 255 * 2 - 1)) < 0.05  # the red level of image 2 survives


def test_plain_folder_fallback_holds_out_the_last_images(tmp_path: Path) -> None:
    _write_celeba(tmp_path, n=10, partition=False)
    cfg = CelebAConfig(root=str(tmp_path / "img_align_celeba"), image_size=16, crop=None, eval_fraction=0.2)
    assert len(CelebAImages(cfg, "train")) == 8
    assert [p.name for p in CelebAImages(cfg, "eval").paths] == ["000009.jpg", "000010.jpg"]


@pytest.mark.parametrize("damage, message", [
    ("missing", "does not exist"),
    ("malformed", "list_eval_partition.txt line 2"),
    ("unlisted", "lists 1 images missing"),
    ("corrupt", "cannot read image"),
])
def test_bad_celeba_data_is_a_user_error(tmp_path: Path, damage: str, message: str) -> None:
    _write_celeba(tmp_path)
    partition = tmp_path / "list_eval_partition.txt"
    root = tmp_path / "nowhere" if damage == "missing" else tmp_path
    if damage == "malformed":
        partition.write_text("000001.jpg 0\n000002.jpg train\n")
    elif damage == "unlisted":
        partition.write_text(partition.read_text() + "999999.jpg 2\n")
    elif damage == "corrupt":
        (tmp_path / "img_align_celeba" / "000001.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(UserError, match=message):
        check_celeba(CelebAConfig(root=str(root), image_size=32))


# --- through the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_through_the_engine_in_every_precision(tmp_path: Path, precision: str) -> None:
    scale = "none" if precision in ("fp32", "tf32") else "dynamic"
    # fp16 keeps Adam's state in FP16 (no master weights): eps = 1e-8 rounds to 0 there and the
    # second moment of small gradients underflows, so the first step divides by zero (measured:
    # NaN at step 1). 1e-4 is representable in FP16.
    eps = ["trainer.eps=1e-4"] if precision == "fp16" else []
    summary = train(_cfg(tmp_path, f"precision={precision}", f"scale={scale}", "scaler.init_scale=1024",
                         "trainer.max_steps=6", *eps))
    run_dir = Path(summary["run_dir"])
    d_loss = _train_log(run_dir, "d_loss")
    # Learning signal: D starts near 2 ln 2 = 1.386 (it cannot tell real from fake) and learns to
    # separate the faces from the untrained generator's output (fp32 measured: 1.414 -> 1.248).
    assert d_loss[-1] < 0.93 * d_loss[0], d_loss
    assert not summary["diverged"] and summary["metric"] > 0
    assert set(summary["optimizers"]) == {"disc", "gen"}
    assert (run_dir / "samples_step6.png").is_file()


class _Instrumented(DCGANTask):
    """DCGANTask with test hooks: D's loss made inf at chosen iterations, D never updated, or a crash."""

    inf_disc_at: set[int] = set()
    no_disc_update = False
    crash_at: int | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.iteration = 0

    def disc_loss(self, logits: torch.Tensor, target: float) -> torch.Tensor:
        loss = super().disc_loss(logits, target)
        return loss * float("inf") if self.iteration in self.inf_disc_at else loss

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        self.iteration += 1
        if self.iteration == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().train_step(model, batch, _WithoutDisc(ctx) if self.no_disc_update else ctx)


class _WithoutDisc:
    """A step context that drops the discriminator's backward and step (its forwards still run)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx, name)

    def backward(self, loss: torch.Tensor, name: str = "main") -> None:
        if name != "disc":
            self.ctx.backward(loss, name)

    def step(self, name: str = "main") -> None:
        if name != "disc":
            self.ctx.step(name)

    def optimize(self, loss: torch.Tensor, name: str = "main") -> None:
        self.backward(loss, name)
        self.step(name)


def _instrumented(monkeypatch: pytest.MonkeyPatch, **hooks: Any) -> None:
    monkeypatch.setitem(models.TASKS, "dcgan", type("Hooked", (_Instrumented,), hooks))


def _checkpoint(run_dir: Path) -> dict[str, Any]:
    return checkpoint.load(run_dir / checkpoint.CHECKPOINT_NAME)


def test_a_skipped_disc_step_leaves_the_gen_update_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["precision=mp", "scale=dynamic", "scaler.init_scale=1024", "trainer.max_steps=1"]
    _instrumented(monkeypatch, inf_disc_at={1})
    skipped = train(_cfg(tmp_path / "skipped", *common))
    _instrumented(monkeypatch, no_disc_update=True)
    reference = train(_cfg(tmp_path / "reference", *common))
    assert skipped["optimizers"]["disc"]["skipped_steps"] == 1 and skipped["optimizers"]["gen"]["skipped_steps"] == 0
    assert skipped["optimizers"]["disc"]["scale_final"] == 512 and skipped["optimizers"]["gen"]["scale_final"] == 1024
    # The overflowing D step changed nothing, and G took exactly the step it takes against an un-updated D.
    got, want = _checkpoint(tmp_path / "skipped")["model"], _checkpoint(tmp_path / "reference")["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    torch.manual_seed(0)
    initial = DCGAN(DCGANConfig(image_size=32, width=4)).half().state_dict()
    assert not torch.equal(got["G.0.weight"], initial["G.0.weight"]), "G did not step"
    assert torch.equal(got["D.0.weight"], initial["D.0.weight"]), "D stepped although its loss was inf"
    assert reference["optimizers"]["disc"]["skipped_steps"] == 0


def test_checkpoint_holds_both_optimizers_and_resume_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["precision=mp", "scale=dynamic", "scaler.init_scale=1024", "trainer.max_steps=4",
              "trainer.checkpoint_every=2"]
    train(_cfg(tmp_path / "straight", *common))
    _instrumented(monkeypatch, crash_at=3)  # dies in iteration 3, after the checkpoint at step 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(_cfg(tmp_path / "resumed", *common))
    assert _checkpoint(tmp_path / "resumed")["step"] == 2
    monkeypatch.setitem(models.TASKS, "dcgan", DCGANTask)
    train(_cfg(tmp_path / "resumed", *common))

    straight, resumed = _checkpoint(tmp_path / "straight"), _checkpoint(tmp_path / "resumed")
    assert set(straight["slots"]) == {"disc", "gen"}
    assert resumed["step"] == 4
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    for name in ("disc", "gen"):
        a, b = straight["slots"][name], resumed["slots"][name]
        assert a["skipped_steps"] == b["skipped_steps"] and a["scaler"].keys() == b["scaler"].keys()
        assert all(torch.equal(a["scaler"][k], b["scaler"][k]) for k in a["scaler"])
        assert all(torch.equal(x, y) for x, y in zip(a["master"], b["master"]))
        for index, state in a["optimizer"]["state"].items():
            assert all(torch.equal(state[k], b["optimizer"]["state"][index][k]) for k in state)
