"""Precision policies: what is stored in which format and where arithmetic happens.

One policy object answers every dtype question the engine has, so the training
step has a single code path for all modes (no AMP / non-AMP branches):

    model = policy.prepare_model(model)          # cast weights, install hooks
    params = policy.bind(task_params)            # FP32 master copies or the model's own
    batch = policy.cast_inputs(batch)
    with policy.autocast(): loss = ...           # only amp modes autocast
    grads = params.grads_for_update()            # model grads -> master grads
    ... unscale, check, clip, optimizer.step() on params.optimizer_params ...
    params.publish()                             # master -> model (rounded)

| mode        | model weights      | activations/grads | arithmetic                 | master |
|-------------|--------------------|-------------------|----------------------------|--------|
| fp32        | fp32               | fp32              | fp32, TF32 off             | no     |
| tf32        | fp32               | fp32              | TF32 matmul/conv           | no     |
| fp16        | fp16 (BN too)      | fp16              | fp16 in, fp32 accumulate   | no     |
| mp          | fp16, BN fp32      | fp16              | fp16 in, fp32 accumulate   | yes    |
| amp         | fp32               | autocast per op   | torch.autocast lists       | no*    |
| pseudo_fp16 | fp32 holding fp16 values | rounded to fp16 at module boundaries | fp32 | yes |
| bf16        | as mp, bfloat16    |                   |                            | yes    |
| bf16_amp    | as amp, bfloat16   |                   |                            | no*    |
(* amp keeps FP32 weights, which play the role of the master copy.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from runner.errors import UserError

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every tensor inside nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def _float_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype) if t.is_floating_point() else t


class _RoundThroughHalf(torch.autograd.Function):
    """Identity that rounds values to FP16 going forward and gradients going back.

    This is the paper's "FP16 storage only" (section 4.3): arithmetic stays FP32,
    but every tensor that would be written to memory between layers carries only
    what FP16 can represent (including underflow to zero and overflow to inf).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float16).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(torch.float16).to(grad.dtype)


def round_through_half(t: torch.Tensor) -> torch.Tensor:
    return _RoundThroughHalf.apply(t) if t.is_floating_point() else t


@dataclass
class BoundParams:
    """The parameters one optimizer updates, with or without FP32 master copies."""

    model_params: list[nn.Parameter]
    master_params: list[nn.Parameter] | None
    storage_dtype: torch.dtype | None = None  # pseudo_fp16: grads and published weights rounded to this

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return self.master_params if self.master_params is not None else self.model_params

    def grads_for_update(self) -> list[torch.Tensor]:
        """The gradients the optimizer will read, copied to the master copy if there is one.

        Parameters without a gradient this step are left out (their master grad is
        None, so the optimizer skips them, as it would without master weights).
        """
        if self.master_params is None:
            return [p.grad for p in self.model_params if p.grad is not None]
        src, dst = [], []
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            src.append(p.grad if self.storage_dtype is None else p.grad.to(self.storage_dtype))
            dst.append(m.grad)
        if dst:
            torch._foreach_copy_(dst, src)  # one fused cast-and-copy, no per-tensor sync
        return dst

    def publish(self) -> None:
        """Round the updated master weights back into the model (no-op without master)."""
        if self.master_params is None:
            return
        with torch.no_grad():
            if self.storage_dtype is None:
                torch._foreach_copy_([p.data for p in self.model_params], self.master_params)
            else:  # the model is FP32 but must hold only FP16-representable values
                torch._foreach_copy_([p.data for p in self.model_params],
                                     [m.to(self.storage_dtype) for m in self.master_params])


class PrecisionPolicy:
    """Base policy = fp32. Subclasses override only what differs."""

    name = "fp32"
    low_dtype: torch.dtype | None = None      # the reduced format gradients live in
    param_dtype: torch.dtype = torch.float32  # model weight storage
    keep_norm_fp32: bool = False
    master_weights: bool = False
    autocast_dtype: torch.dtype | None = None
    allow_tf32: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.notes: list[str] = []

    # --- set-up ---------------------------------------------------------------------
    def configure_backends(self) -> None:
        # TF32 is an explicit choice (the paper's FP32 baseline has none), recorded in the summary.
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if self.param_dtype != torch.float32:
            model.to(self.param_dtype)
            if self.keep_norm_fp32:
                for m in model.modules():
                    if isinstance(m, _NORM_TYPES):
                        m.float()
        if self.low_dtype is not None:
            # Losses and softmax run in FP32 (paper 3.3): cast the model's outputs up.
            model.register_forward_hook(lambda _m, _i, out: map_tensors(out, _float_to(torch.float32)))
        return model

    def bind(self, params: Iterable[nn.Parameter]) -> BoundParams:
        params = [p for p in params if p.requires_grad]
        if not self.master_weights:
            return BoundParams(params, None)
        masters = [nn.Parameter(p.detach().clone().float()) for p in params]
        return BoundParams(params, masters)

    # --- per step -------------------------------------------------------------------
    def cast_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.param_dtype == torch.float32 or "input" not in batch:
            return batch
        return {**batch, "input": map_tensors(batch["input"], _float_to(self.param_dtype))}

    def autocast(self) -> ContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "low_dtype": None if self.low_dtype is None else str(self.low_dtype).removeprefix("torch."),
            "master_weights": self.master_weights,
            "autocast_dtype": None if self.autocast_dtype is None else str(self.autocast_dtype).removeprefix("torch."),
            "tf32": self.allow_tf32,
            "notes": self.notes,
        }


class TF32(PrecisionPolicy):
    name = "tf32"
    allow_tf32 = True


class FP16(PrecisionPolicy):
    """Everything FP16, the update applied to FP16 weights (paper Figure 2a baseline)."""

    name = "fp16"
    low_dtype = torch.float16
    param_dtype = torch.float16


class MixedPrecision(PrecisionPolicy):
    """The paper's recipe: FP16 model, FP32 batch norm, FP32 master weights."""

    name = "mp"
    low_dtype = torch.float16
    param_dtype = torch.float16
    keep_norm_fp32 = True
    master_weights = True


class BF16(MixedPrecision):
    name = "bf16"
    low_dtype = torch.bfloat16
    param_dtype = torch.bfloat16


class AMP(PrecisionPolicy):
    """torch.autocast over an FP32 model: today's common practice (apex O1)."""

    name = "amp"
    low_dtype = torch.float16
    autocast_dtype = torch.float16

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        if device.type == "cpu":
            self.notes.append(f"CPU autocast to {self.autocast_dtype} (oneDNN kernels; no tensor cores)")


class BF16AMP(AMP):
    name = "bf16_amp"
    low_dtype = torch.bfloat16
    autocast_dtype = torch.bfloat16


class PseudoFP16(PrecisionPolicy):
    """FP32 arithmetic with FP16 storage: weights, activations and grads rounded to FP16."""

    name = "pseudo_fp16"
    low_dtype = torch.float16
    master_weights = True

    def prepare_model(self, model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.float16))
        for module in model.modules():
            if not any(True for _ in module.children()):  # leaf modules = layer boundaries
                module.register_forward_hook(lambda _m, _i, out: map_tensors(out, round_through_half))
        return super().prepare_model(model)

    def bind(self, params: Iterable[nn.Parameter]) -> BoundParams:
        bound = super().bind(params)
        bound.storage_dtype = torch.float16
        return bound

    def cast_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        if "input" not in batch:
            return batch
        return {**batch, "input": map_tensors(batch["input"], round_through_half)}


POLICIES: dict[str, type[PrecisionPolicy]] = {
    cls.name: cls for cls in (PrecisionPolicy, TF32, FP16, MixedPrecision, AMP, PseudoFP16, BF16, BF16AMP)
}


def make_policy(name: str, device: torch.device) -> PrecisionPolicy:
    if name not in POLICIES:
        raise UserError(f"unknown precision '{name}'; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](device)
