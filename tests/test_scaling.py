"""Loss scalers against torch.amp.GradScaler and hand-derived numbers."""
from __future__ import annotations

import inspect
import math
import random

import pytest
import torch

from runner.errors import UserError
from runner.scaling import DynamicScaler, LogNormalScaler, ScalerConfig, make_scaler, parse_scale

CPU = torch.device("cpu")
FP16_MAX = 65504.0


def reference_trajectory(overflows: list[bool], **kw) -> list[tuple[float, bool]]:
    """(scale after update, step skipped) per step, from torch.amp.GradScaler itself."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = torch.amp.GradScaler("cpu", **kw)
    out = []
    for overflow in overflows:
        gs.scale(p.sum())  # initialises the scale lazily, as in real use
        p.grad = torch.full((3,), float("inf") if overflow else 1.0)
        before = p.detach().clone()
        gs.step(opt)
        gs.update()
        out.append((gs.get_scale(), torch.equal(before, p.detach())))  # unchanged = skipped
    return out


def our_trajectory(overflows: list[bool], cfg: ScalerConfig) -> list[tuple[float, bool]]:
    s = DynamicScaler(0, cfg, FP16_MAX, CPU)
    out = []
    for step, overflow in enumerate(overflows):
        g = [torch.full((3,), float("inf") if overflow else 1.0) * s.scale]
        found = s.unscale_(g)
        s.update(found, None, step)
        out.append((float(s.scale), bool(found.item())))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_matches_gradscaler_on_random_overflows(seed):
    rng = random.Random(seed)
    overflows = [rng.random() < 0.3 for _ in range(60)]
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    cfg = ScalerConfig(init_scale=2.0**10, growth_interval=3)
    assert our_trajectory(overflows, cfg) == reference_trajectory(overflows, **kw)


def test_dynamic_defaults_equal_gradscaler_defaults():
    defaults = inspect.signature(torch.amp.GradScaler.__init__).parameters
    cfg = ScalerConfig()
    for key in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        assert getattr(cfg, key) == defaults[key].default, key


def test_growth_happens_exactly_on_nth_good_step():
    overflows = [False] * 7
    ours = our_trajectory(overflows, ScalerConfig(init_scale=4.0, growth_interval=3))
    assert [s for s, _ in ours] == [4, 4, 8, 8, 8, 16, 16]
    assert ours == reference_trajectory(overflows, init_scale=4.0, growth_interval=3)


def test_min_max_and_hysteresis():
    cfg = ScalerConfig(init_scale=8.0, growth_interval=1, max_scale=16.0, min_scale=2.0, hysteresis=2)
    traj = [s for s, _ in our_trajectory([False, False, True, True, True, True, False, True], cfg)]
    # grow to 16 (clamped), stay; 1st overflow only uses up hysteresis, 2nd halves, the counter stays
    # at 1 so the 3rd halves again, 4th hits min 2; a good step grows (and refills); next overflow waits.
    assert traj == [16, 16, 16, 8, 4, 2, 4, 4]


def test_lognormal_hand_derived():
    cfg = ScalerConfig(beta1=0.5, beta2=0.5, overflow_prob=0.001)
    s = LogNormalScaler(0, cfg, FP16_MAX, CPU)
    for x in (0.0, 2.0):  # log2 max|g| of two steps
        s.update(torch.tensor(0.0), torch.tensor(2.0**x), 0)
    # mu = (0.25*0 + 0.5*2) / (1 - 0.25) = 4/3;  E[x^2] = (0.5*4) / 0.75 = 8/3;  var = 8/3 - 16/9 = 8/9
    z = 3.090232306167813
    cutoff = 4 / 3 + z * math.sqrt(8 / 9)
    assert float(s.scale) == 2.0 ** math.floor(math.log2(FP16_MAX) - cutoff) == 2048.0


def test_lognormal_overflow_feeds_the_bound_not_two_to_the_16():
    cfg = ScalerConfig(beta1=0.0, beta2=0.0, init_scale=2.0**12)
    s = LogNormalScaler(0, cfg, FP16_MAX, CPU)
    s.update(torch.tensor(1.0), torch.tensor(float("inf")), 0)
    # The unscaled max is only known to exceed 65504 / 2^12, so x = log2(65504) - 12 ~ 4 and the
    # statistics propose S = 2^floor(15.9993 - 3.9993) = 2^12, the scale that just overflowed; the
    # back-off rule caps it at 2^12 * 0.5. OpenSeq2Seq fed x = 2^16 here, which would give S = 1.
    assert float(s.mean_hat) == pytest.approx(math.log2(FP16_MAX) - 12)
    assert float(s.scale) == 2.0**11


def test_lognormal_backs_off_on_every_overflow():
    s = LogNormalScaler(0, ScalerConfig(init_scale=2.0**16), FP16_MAX, CPU)
    trajectory = [float(s.scale)]
    for _ in range(4):  # repeated overflows: never propose the scale that just overflowed again
        s.update(torch.tensor(1.0), torch.tensor(float("inf")), 0)
        trajectory.append(float(s.scale))
    assert all(new <= old / 2 for old, new in zip(trajectory, trajectory[1:])), trajectory


@pytest.mark.parametrize("text,expected", [("none", ("none", 1.0)), ("dynamic", ("dynamic", 1.0)),
                                           (8, ("fixed", 8.0)), ("32768", ("fixed", 32768.0)),
                                           (0.5, ("fixed", 0.5))])
def test_parse_scale(text, expected):
    assert parse_scale(text) == expected


@pytest.mark.parametrize("bad", [0, -1, "abc", float("inf"), True])
def test_bad_scales_are_user_errors(bad):
    with pytest.raises(UserError):
        parse_scale(bad)


def test_unscale_flags_nan_and_inf_in_any_dtype_group():
    s = make_scaler(4.0, ScalerConfig(), FP16_MAX, CPU)
    g32, g16 = torch.tensor([4.0, 8.0]), torch.tensor([2.0], dtype=torch.float16)
    assert float(s.unscale_([g32, g16])) == 0.0
    assert g32.tolist() == [1.0, 2.0] and g16.tolist() == [0.5]
    assert float(s.unscale_([torch.tensor([1.0]), torch.tensor([float("nan")], dtype=torch.float16)])) == 1.0
