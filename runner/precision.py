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
import re
from dataclasses import dataclass
from typing import Any, ContextManager, Iterable, Iterator, Sequence

import torch
from torch import nn

from runner.errors import UserError
from runner.trees import map_floats, to_dtype

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


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
    return _RoundThroughHalf.apply(t)


def param_groups(spec: Iterable[nn.Parameter] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A task's parameters or torch-style groups -> groups of trainable parameters (options kept)."""
    items = list(spec)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]


@dataclass
class BoundParams:
    """The parameters one optimizer updates, with or without FP32 master copies.

    `groups` are the task's parameter groups over the model's parameters; the
    optimizer is built on `optimizer_groups`, the same groups (same options) over
    the master copies where there are any. Sparse gradients stay sparse: they are
    coalesced (so unscaling and clipping can work on their values) and, with a
    master copy, cast to a sparse FP32 master gradient.
    """

    groups: list[dict[str, Any]]
    master_groups: list[dict[str, Any]] | None
    storage_dtype: torch.dtype | None = None  # pseudo_fp16: grads and published weights rounded to this

    @property
    def model_params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g["params"]]

    @property
    def master_params(self) -> list[nn.Parameter] | None:
        return None if self.master_groups is None else [p for g in self.master_groups for p in g["params"]]

    @property
    def optimizer_groups(self) -> list[dict[str, Any]]:
        return self.master_groups if self.master_groups is not None else self.groups

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer_groups for p in g["params"]]

    def grads_for_update(self) -> list[torch.Tensor]:
        """The gradients the optimizer will read, copied to the master copy if there is one.

        Parameters without a gradient this step are left out (their master grad is
        None, so the optimizer skips them, as it would without master weights).
        """
        model = self.model_params
        for p in model:
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.coalesce()
        if self.master_groups is None:
            return [p.grad for p in model if p.grad is not None]
        src, dst, sparse = [], [], []
        for p, m in zip(model, self.master_params):
            if p.grad is None:
                m.grad = None
            elif p.grad.is_sparse:
                g = p.grad
                values = g._values() if self.storage_dtype is None else g._values().to(self.storage_dtype)
                m.grad = torch.sparse_coo_tensor(g._indices(), values.float(), g.shape, is_coalesced=True)
                sparse.append(m.grad)
            else:
                if m.grad is None or m.grad.is_sparse:
                    m.grad = torch.empty_like(m)
                src.append(p.grad if self.storage_dtype is None else p.grad.to(self.storage_dtype))
                dst.append(m.grad)
        if dst:
            torch._foreach_copy_(dst, src)  # one fused cast-and-copy, no per-tensor sync
        return dst + sparse

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients held right now: the model's and, where there is one, the master's."""
        masters = self.master_params or []
        return [p.grad for p in [*self.model_params, *masters] if p.grad is not None]

    def clear_grads(self) -> None:
        """Drop the model's gradients of these parameters (the next backward starts from zero)."""
        for p in self.model_params:
            p.grad = None

    def publish(self) -> None:
        """Round the updated master weights back into the model (no-op without master)."""
        if self.master_groups is None:
            return
        with torch.no_grad():
            model = [p.data for p in self.model_params]
            if self.storage_dtype is None:
                torch._foreach_copy_(model, self.master_params)
            else:  # the model is FP32 but must hold only FP16-representable values
                torch._foreach_copy_(model, [m.to(self.storage_dtype) for m in self.master_params])


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
            model.register_forward_hook(lambda _m, _i, out: to_dtype(out, torch.float32))
        return model

    def bind(self, spec: Iterable[nn.Parameter] | Sequence[dict[str, Any]]) -> BoundParams:
        groups = param_groups(spec)
        if not self.master_weights:
            return BoundParams(groups, None)
        masters = [{**g, "params": [nn.Parameter(p.detach().clone().float()) for p in g["params"]]} for g in groups]
        return BoundParams(groups, masters)

    # --- per step -------------------------------------------------------------------
    def cast(self, x: Any) -> Any:
        """Floating tensors in x to what the model computes in (its weights' dtype)."""
        return x if self.param_dtype == torch.float32 else to_dtype(x, self.param_dtype)

    def cast_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {**batch, "input": self.cast(batch["input"])} if "input" in batch else batch

    def autocast(self) -> ContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @contextlib.contextmanager
    def fp32(self, *tensors: Any) -> Iterator[Any]:
        """Autocast off, floating tensors cast to FP32: for losses and reductions (paper 3.3)."""
        with torch.autocast(self.device.type, enabled=False):
            cast = to_dtype(tensors, torch.float32)
            yield cast[0] if len(cast) == 1 else cast

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

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """torch.autocast; on a CPU whose oneDNN build has no low-precision kernel for one of the
        model's operations (LSTM on many CPUs), a one-line error naming the modes that work."""
        try:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                yield
        except RuntimeError as exc:
            if self.device.type == "cpu" and "could not create a primitive descriptor" in str(exc):
                op = re.search(r"for the (\w+)", str(exc))
                dtype = str(self.autocast_dtype).removeprefix("torch.")
                raise UserError(f"precision={self.name}: this CPU's oneDNN has no {dtype} kernel for this model's "
                                f"{op.group(1) if op else 'operations'}; use precision=pseudo_fp16, mp or bf16 here, "
                                f"or a GPU") from None
            raise


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
                module.register_forward_hook(lambda _m, _i, out: map_floats(out, round_through_half))
        return super().prepare_model(model)

    def bind(self, spec: Iterable[nn.Parameter] | Sequence[dict[str, Any]]) -> BoundParams:
        bound = super().bind(spec)
        bound.storage_dtype = torch.float16
        return bound

    def cast(self, x: Any) -> Any:
        return map_floats(x, round_through_half)


POLICIES: dict[str, type[PrecisionPolicy]] = {
    cls.name: cls for cls in (PrecisionPolicy, TF32, FP16, MixedPrecision, AMP, PseudoFP16, BF16, BF16AMP)
}


def make_policy(name: str, device: torch.device) -> PrecisionPolicy:
    if name not in POLICIES:
        raise UserError(f"unknown precision '{name}'; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](device)
