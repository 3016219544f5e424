"""The paper's DCGAN (section 4.6, Figure 6): two networks, two optimizers, one engine.

Architecture as the paper gives it: a generator of 7 fractionally-strided convolutions
(6 with leaky ReLU, the last with tanh) and a discriminator of 6 convolutions and 2 fully
connected layers with leaky ReLU, batch norm on every layer except the discriminator's last
fully connected one, whose logit the loss turns into the sigmoid probability. The paper
leaves the widths and kernels open; they follow Radford et al. 2016 (DCGAN): 4x4 kernels with
stride 2, channels doubling as the resolution halves (capped at 8x `width`), N(0, 0.02)
initialisation, leaky slope 0.2. At 128 px that is 1 + 5 + 1 generator convolutions
(project to 4x4, five doublings, a 3x3 output layer) and 1 + 5 discriminator convolutions
(3x3 input layer, five halvings) + 2 FC. `image_size` 32/64 drop doubling/halving layers
from the same builder, `width` narrows every layer, for CPU runs. `outer_bn=false` removes
the batch norm of G's output and D's input layer, as Radford et al. do (they found BN there
makes samples oscillate); the quick preset needs it (see configs/experiment/quick_dcgan.yaml).

Loss scaling with two losses: each optimizer ("disc", "gen") has its own loss scaler in the
engine, as torch.amp/apex users give each loss its own range; a skipped (overflowing)
discriminator step does not skip the generator step, nor the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.utils import make_grid

from data.dcgan_celeba import CelebAConfig, CelebAImages, check_celeba
from data.dcgan_faces import SyntheticFaces, SyntheticFacesConfig
from models.swd import SlicedWassersteinDistance
from runner.errors import UserError
from runner.task import Batch, EvalResult, ParamSpec, StepContext, Task

IMAGE_SIZES = (32, 64, 128)
SLOPE = 0.2          # leaky ReLU slope (Radford et al.)
INIT_STD = 0.02      # N(0, 0.02) weights; batch-norm scales N(1, 0.02)
GRID_ROWS = 8        # the sample grid is GRID_ROWS x GRID_ROWS fixed latent vectors
EVAL_NOISE_SEED = 1_000_003  # offset: eval latents never coincide with training noise draws


@dataclass
class DCGANConfig:
    name: str = "dcgan"
    image_size: int = 128           # 32 | 64 | 128 (the paper's); must equal data.image_size
    width: int = 64                 # channels at full resolution; x2 per halving, at most 8x
    latent_dim: int = 100           # size of the N(0, 1) noise vector
    swd_patches: int = 64           # 7x7 patches per image and pyramid level for the SWD metric
    # Batch norm on G's output layer and D's input layer: true is the paper's "every layer but
    # D's last"; false is Radford et al.'s DCGAN, which found that BN there makes samples
    # oscillate (G's output BN re-normalises every colour channel per batch before the tanh).
    outer_bn: bool = True

    def __post_init__(self) -> None:
        if self.image_size not in IMAGE_SIZES:
            raise UserError(f"bad config: model.image_size={self.image_size} must be one of "
                            f"{', '.join(map(str, IMAGE_SIZES))} (128 is the paper's)")
        for key in ("width", "latent_dim", "swd_patches"):
            if getattr(self, key) < 1:
                raise UserError(f"bad config: model.{key}={getattr(self, key)} must be 1 or more")


def channels(resolution: int, cfg: DCGANConfig) -> int:
    """Feature maps at a resolution: `width` at full size, doubling per halving, at most 8x."""
    return cfg.width * min(8, cfg.image_size // resolution)


def _block(conv: type[nn.Module], args: tuple[int, ...], activation: nn.Module, norm: bool = True) -> list[nn.Module]:
    """conv(*args) [+ batch norm] + activation; a convolution followed by batch norm needs no bias."""
    layer = conv(*args, bias=not norm)
    return [layer, nn.BatchNorm2d(args[1]), activation] if norm else [layer, activation]


def build_generator(cfg: DCGANConfig) -> nn.Sequential:
    """noise [N, latent_dim, 1, 1] -> image [N, 3, S, S] in [-1, 1]."""
    first = channels(4, cfg)
    layers = _block(nn.ConvTranspose2d, (cfg.latent_dim, first, 4, 1, 0), nn.LeakyReLU(SLOPE))
    resolution = 4
    while resolution < cfg.image_size:
        c_in, c_out = channels(resolution, cfg), channels(2 * resolution, cfg)
        layers += _block(nn.ConvTranspose2d, (c_in, c_out, 4, 2, 1), nn.LeakyReLU(SLOPE))
        resolution *= 2
    # The paper puts batch norm on this layer too (all layers but D's last FC); outer_bn=false drops it.
    layers += _block(nn.ConvTranspose2d, (channels(resolution, cfg), 3, 3, 1, 1), nn.Tanh(), cfg.outer_bn)
    return nn.Sequential(*layers)


def build_discriminator(cfg: DCGANConfig) -> nn.Sequential:
    """image [N, 3, S, S] -> one logit per image [N, 1] (the sigmoid lives in the loss)."""
    resolution = cfg.image_size
    first = channels(resolution, cfg)
    layers = _block(nn.Conv2d, (3, first, 3, 1, 1), nn.LeakyReLU(SLOPE), cfg.outer_bn)
    while resolution > 4:
        c_in, c_out = channels(resolution, cfg), channels(resolution // 2, cfg)
        layers += _block(nn.Conv2d, (c_in, c_out, 4, 2, 1), nn.LeakyReLU(SLOPE))
        resolution //= 2
    hidden = channels(4, cfg)
    layers += [nn.Flatten(), nn.Linear(hidden * 16, hidden, bias=False), nn.BatchNorm1d(hidden), nn.LeakyReLU(SLOPE),
               nn.Linear(hidden, 1)]
    return nn.Sequential(*layers)


def dcgan_init_(module: nn.Module) -> None:
    """Radford et al.'s initialisation: weights N(0, 0.02), batch-norm scales N(1, 0.02), biases 0."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            nn.init.normal_(m.weight, 0.0, INIT_STD)
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.normal_(m.weight, 1.0, INIT_STD)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


class DCGAN(nn.Module):
    """G and D as submodules; the task calls them directly. forward(noise) samples images."""

    def __init__(self, cfg: DCGANConfig) -> None:
        super().__init__()
        self.G = build_generator(cfg)
        self.D = build_discriminator(cfg)
        dcgan_init_(self)

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.G(noise)


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    """Binary cross-entropy of sigmoid(logits) against a constant label, from the logits
    (numerically safe, and allowed where CUDA autocast refuses BCE after a sigmoid)."""
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class DCGANTask(Task):
    name = "dcgan"
    metric_name = "swd"
    higher_is_better = False
    optimizer_names = ("disc", "gen")
    count_unit = "images"
    model_schema = DCGANConfig
    data_sources = {"synthetic_faces": SyntheticFacesConfig, "celeba": CelebAConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        if self.data_cfg.image_size != self.model_cfg.image_size:
            raise UserError(f"bad config: data.image_size={self.data_cfg.image_size} differs from "
                            f"model.image_size={self.model_cfg.image_size}; set both to the same size")

    def check_data(self) -> None:
        if isinstance(self.data_cfg, CelebAConfig):
            check_celeba(self.data_cfg)

    def _dataset(self, split: str) -> torch.utils.data.Dataset:
        if isinstance(self.data_cfg, CelebAConfig):
            return CelebAImages(self.data_cfg, split)
        return SyntheticFaces(self.data_cfg, split, self.seed)

    def build_train_data(self) -> torch.utils.data.Dataset:
        return self._dataset("train")

    def build_eval_data(self) -> torch.utils.data.Dataset:
        return self._dataset("eval")

    def build_model(self) -> nn.Module:
        return DCGAN(self.model_cfg)

    def optimizer_params(self, model: nn.Module) -> Mapping[str, ParamSpec]:
        return {"disc": model.D.parameters(), "gen": model.G.parameters()}

    def noise(self, n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
        """FP32 N(0, 1) latent vectors [n, latent_dim, 1, 1] (the caller casts them)."""
        shape = (n, self.model_cfg.latent_dim, 1, 1)
        if generator is None:
            return torch.randn(shape, device=device)  # the global RNG: checkpointed, so resumes repeat it
        return torch.randn(shape, generator=generator).to(device)

    def disc_loss(self, logits: torch.Tensor, target: float) -> torch.Tensor:
        """The discriminator's loss on one half (real or fake) of its batch (tests override it)."""
        return bce(logits, target)

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        real = batch["input"]
        n = real.shape[0]
        fake = model.G(ctx.cast(self.noise(n, ctx.device)))
        # D sees real and fake images in ONE batch: with batch norm on every layer but the last
        # FC, separate real and fake batches are each normalised to the same statistics, so the
        # batch-mean logit barely differs and D hardly learns (measured: D loss 1.388 -> 1.387 in
        # 8 steps with separate batches, 1.416 -> 1.197 with one). Hence one D backward of the sum.
        with ctx.fp32(model.D(torch.cat([real, fake.detach()]))) as logits:
            real_loss, fake_loss = self.disc_loss(logits[:n], 1.0), self.disc_loss(logits[n:], 0.0)
        ctx.optimize(real_loss + fake_loss, "disc")
        # G: the non-saturating loss -log D(G(z)) through the updated D, judged in the same mixed
        # batch D trained on; gradients go into G's parameters only.
        with ctx.fp32(model.D(torch.cat([real, fake]))[n:]) as logits:
            g_loss = bce(logits, 1.0)
        ctx.optimize(g_loss, "gen")
        d_loss = (real_loss + fake_loss).detach()
        return {"loss": d_loss + g_loss.detach(), "d_loss": d_loss, "g_loss": g_loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        """SWD between the held-out real images and as many generated ones, and a sample grid;
        both use latents fixed by the seed, the same in every precision mode."""
        generator = torch.Generator().manual_seed(self.seed + EVAL_NOISE_SEED)
        grid_noise = self.noise(GRID_ROWS ** 2, ctx.device, generator)
        swd = SlicedWassersteinDistance(self.seed, self.model_cfg.swd_patches)
        for batch in batches:
            fake = model.G(ctx.cast(self.noise(batch["input"].shape[0], ctx.device, generator)))
            with ctx.fp32(batch["input"], fake) as (real, fake):
                swd.update(real, fake)
        with ctx.fp32(model.G(ctx.cast(grid_noise))) as samples:
            grid = make_grid(samples.cpu() * 0.5 + 0.5, nrow=GRID_ROWS).clamp(0, 1)
        return EvalResult(swd.compute(), images={"samples": grid})
