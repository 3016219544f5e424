"""Sliced Wasserstein distance between two image sets on Laplacian-pyramid patches.

The weight-free GAN metric of Karras et al. 2018 ("Progressive Growing of GANs",
section 5 and their sliced_wasserstein.py): build a Laplacian pyramid of every image
down to 16 px, take random 7x7 neighbourhoods at every level, normalise them per colour
channel, and at each level compare the two sets of patch descriptors by the average over
random unit directions of the 1-D Wasserstein distance of their projections (sorted
projections, mean absolute difference). Reported x1e3 like the paper, per level and
averaged; lower is better, 0 for identical sets.

One deliberate difference: both sets are normalised with the *real* set's channel mean
and std (Karras normalises each set by its own), so that a colour or brightness shift of
the generated images counts against them instead of being normalised away.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PATCH = 7           # neighbourhood side (Karras: 7)
MIN_RESOLUTION = 16 # coarsest pyramid level (Karras: 16)
DIRECTIONS = 128    # random directions per repeat (Karras: 128)
REPEATS = 4         # independent sets of directions, averaged (Karras: 4)

_BINOMIAL = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0]) / 16  # the 5-tap Gaussian of the Laplacian pyramid


def _blur(images: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
    kernel = (_BINOMIAL[:, None] * _BINOMIAL[None, :] * gain).to(images)
    channels = images.shape[1]
    padded = F.pad(images, (2, 2, 2, 2), mode="reflect")
    return F.conv2d(padded, kernel.expand(channels, 1, 5, 5), groups=channels)


def _down(images: torch.Tensor) -> torch.Tensor:
    return _blur(images)[:, :, ::2, ::2]


def _up(images: torch.Tensor) -> torch.Tensor:
    n, c, h, w = images.shape
    spread = images.new_zeros(n, c, 2 * h, 2 * w)
    spread[:, :, ::2, ::2] = images
    return _blur(spread, gain=4.0)  # 4x: only one of every 4 pixels is non-zero


def laplacian_pyramid(images: torch.Tensor) -> list[torch.Tensor]:
    """Band-pass levels from full resolution down, the last one the low-pass residual at 16 px."""
    levels = []
    current = images.float()
    while current.shape[-1] > MIN_RESOLUTION:
        smaller = _down(current)
        levels.append(current - _up(smaller))
        current = smaller
    levels.append(current)
    return levels


def random_patches(level: torch.Tensor, per_image: int, generator: torch.Generator) -> torch.Tensor:
    """`per_image` random PATCH x PATCH neighbourhoods of each image -> [N * per_image, C, PATCH, PATCH]."""
    n, _, h, w = level.shape
    image = torch.arange(n).repeat_interleave(per_image)
    ys = torch.randint(h - PATCH + 1, (n * per_image,), generator=generator)[:, None] + torch.arange(PATCH)
    xs = torch.randint(w - PATCH + 1, (n * per_image,), generator=generator)[:, None] + torch.arange(PATCH)
    patches = level[image[:, None, None], :, ys[:, :, None], xs[:, None, :]]  # [M, PATCH, PATCH, C]
    return patches.permute(0, 3, 1, 2)


def sliced_wasserstein(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator) -> float:
    """Mean over REPEATS x DIRECTIONS random unit directions of the 1-D Wasserstein-1 distance
    between the projections of descriptor sets a and b ([M, D] each, same M)."""
    total = 0.0
    for _ in range(REPEATS):
        directions = F.normalize(torch.randn(a.shape[1], DIRECTIONS, generator=generator), dim=0)
        # [DIRECTIONS, M], sorted along the contiguous last dim: sorting [M, DIRECTIONS] along dim 0
        # (strided) is ~2x slower on a CPU, and the sorts are most of the metric's cost.
        proj_a, proj_b = (directions.T @ a.T).sort(dim=1).values, (directions.T @ b.T).sort(dim=1).values
        total += float((proj_a - proj_b).abs().mean())
    return total / REPEATS


class SlicedWassersteinDistance:
    """Accumulates patches of real and generated batches; `compute()` gives swd and swd_<res>."""

    def __init__(self, seed: int, patches_per_image: int = 64) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.per_image = patches_per_image
        self.real: list[list[torch.Tensor]] = []
        self.fake: list[list[torch.Tensor]] = []
        self.resolutions: list[int] = []  # side of each pyramid level, full resolution first

    def update(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        """Add a batch of each set ([N, C, H, W], same shape); patches sit at the same random places."""
        if real.shape != fake.shape:
            raise ValueError(f"real {tuple(real.shape)} and fake {tuple(fake.shape)} batches must match")
        state = self.generator.get_state()
        for store, images in ((self.real, real), (self.fake, fake)):
            self.generator.set_state(state)
            pyramid = laplacian_pyramid(images.cpu())
            store.append([random_patches(level, self.per_image, self.generator) for level in pyramid])
        self.resolutions = [level.shape[-1] for level in pyramid]

    def compute(self) -> dict[str, float]:
        if not self.real:
            raise ValueError("no images added")
        results = {}
        for depth in range(len(self.real[0])):
            real = torch.cat([levels[depth] for levels in self.real])
            fake = torch.cat([levels[depth] for levels in self.fake])
            # per-channel statistics of the real patches normalise both sets (see the module notes)
            mean = real.mean(dim=(0, 2, 3), keepdim=True)
            std = real.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-8)
            real, fake = ((x - mean) / std for x in (real, fake))
            results[f"swd_{self.resolutions[depth]}"] = 1e3 * sliced_wasserstein(real.flatten(1), fake.flatten(1),
                                                                    self.generator)
        results["swd"] = sum(results.values()) / len(results)
        return results
