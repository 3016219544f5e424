"""Precision policies: hand-derived FP16 facts from the paper, checked through the real code."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.errors import UserError
from runner.precision import make_policy
from runner.scaling import ScalerConfig, make_scaler

CPU = torch.device("cpu")


def one_weight(policy_name: str, w: float):
    """A 1-weight linear model prepared and bound by a policy, with SGD(lr=1) on what it binds."""
    policy = make_policy(policy_name, CPU)
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(w)
    model = policy.prepare_model(model)
    bound = policy.bind(model.parameters())
    opt = torch.optim.SGD(bound.optimizer_params, lr=1.0)
    return policy, model, bound, opt


def sgd_step(policy, model, bound, opt, scaler, loss_weight: float) -> None:
    """loss = loss_weight * (w * 1): dloss/dw = loss_weight."""
    x = policy.cast_inputs({"input": torch.ones(1, 1)})["input"]
    loss = model(x).sum() * loss_weight
    scaler.scale_loss(loss).backward()
    grads = bound.grads_for_update()
    assert not scaler.unscale_(grads).item()
    opt.step()
    bound.publish()
    model.zero_grad(set_to_none=True)


def test_mp_keeps_fp32_master_and_fp16_model_with_fp32_batchnorm():
    policy = make_policy("mp", CPU)
    model = policy.prepare_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(2, 2)))
    bound = policy.bind(model.parameters())
    assert model[0].weight.dtype == torch.float16 and model[2].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in bound.optimizer_params)
    assert all(m is not p for m, p in zip(bound.optimizer_params, model.parameters()))
    out = model(torch.randn(1, 3, 4, 4, dtype=torch.float16))
    assert out.dtype == torch.float32  # losses are computed in FP32


def test_fp16_loses_an_update_smaller_than_weight_over_2048_and_mp_keeps_it():
    # |w| / |update| = 1 / 2^-12 = 4096 > 2048: w + dw rounds back to w in FP16 (paper 3.1).
    none = make_scaler("none", ScalerConfig(), 65504.0, CPU)
    fp16 = one_weight("fp16", 1.0)
    mp = one_weight("mp", 1.0)
    for _ in range(16):
        sgd_step(*fp16, none, loss_weight=2.0**-12)
        sgd_step(*mp, none, loss_weight=2.0**-12)
    assert fp16[1].weight.item() == 1.0                     # every update lost
    master = mp[2].master_params[0].item()
    assert master == 1.0 - 16 * 2.0**-12                     # FP32 master accumulated all 16
    assert mp[1].weight.item() == 1.0 - 2.0**-8              # and the FP16 copy now shows it


def test_update_ratio_below_1024_survives_in_fp16():
    none = make_scaler("none", ScalerConfig(), 65504.0, CPU)
    fp16 = one_weight("fp16", 1.0)
    sgd_step(*fp16, none, loss_weight=2.0**-9)  # ratio 512
    assert fp16[1].weight.item() == 1.0 - 2.0**-9


def test_gradient_below_2_to_minus_24_vanishes_without_scaling_and_survives_with_it():
    tiny = 2.0**-26  # below FP16's smallest subnormal: rounds to zero (paper 3.2)
    for scale, expected in (("none", 0.0), (1024.0, tiny)):
        policy, model, bound, _ = one_weight("mp", 1.0)
        scaler = make_scaler(scale, ScalerConfig(), 65504.0, CPU)
        x = policy.cast_inputs({"input": torch.ones(1, 1)})["input"]
        scaler.scale_loss(model(x).sum() * tiny).backward()
        grads = bound.grads_for_update()
        scaler.unscale_(grads)
        assert grads[0].item() == expected, scale


def test_pseudo_fp16_rounds_weights_activations_and_grads_but_computes_fp32():
    policy = make_policy("pseudo_fp16", CPU)
    model = policy.prepare_model(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model.weight.fill_(1.0 + 2.0**-13)  # not representable in FP16
    bound = policy.bind(model.parameters())
    bound.publish()
    assert model.weight.dtype == torch.float32
    assert model.weight.item() == 1.0                        # stored value rounded to FP16
    assert bound.master_params[0].item() == 1.0 + 2.0**-13   # master keeps FP32
    out = model(torch.full((1, 1), 3.0 + 2.0**-11))
    assert out.item() == torch.tensor(3.0 + 2.0**-11).half().float().item()
    (out.sum() * 2.0**-26).backward()                        # activation grad underflows in FP16
    assert model.weight.grad.item() == 0.0


def test_amp_autocasts_and_keeps_fp32_weights():
    policy = make_policy("amp", CPU)
    model = policy.prepare_model(nn.Linear(4, 4))
    with policy.autocast():
        out = model(torch.randn(2, 4))
    assert model.weight.dtype == torch.float32
    assert out.dtype == torch.float32  # the output hook casts autocast's fp16 result up for the loss
    assert policy.bind(model.parameters()).master_params is None


def test_bf16_is_mp_with_bfloat16():
    policy = make_policy("bf16", CPU)
    model = policy.prepare_model(nn.Linear(2, 2))
    assert model.weight.dtype == torch.bfloat16
    assert policy.bind(model.parameters()).master_params[0].dtype == torch.float32


def test_tf32_flag_is_explicit():
    make_policy("tf32", CPU).configure_backends()
    assert torch.backends.cuda.matmul.allow_tf32
    make_policy("fp32", CPU).configure_backends()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_a_missing_cpu_autocast_kernel_is_one_line_naming_modes_that_work():
    policy = make_policy("bf16_amp", torch.device("cpu"))
    with pytest.raises(UserError, match=r"^precision=bf16_amp: this CPU's oneDNN has no bfloat16 kernel for this "
                                        r"model's LSTM; use precision=pseudo_fp16, mp or bf16 here, or a GPU$"):
        with policy.autocast():  # what oneDNN raises where it has no such LSTM primitive
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive. "
                               "Run workload with environment variable ONEDNN_VERBOSE=all")
    with pytest.raises(RuntimeError, match="something else"):  # any other error stays a bug with its traceback
        with policy.autocast():
            raise RuntimeError("something else")
