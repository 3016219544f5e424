"""The paper's diagnostics: where gradients sit in the FP16 range, and lost weight updates.

On sampled steps (`stats.enabled=true`: steps 1, 1+N, 1+2N, ... with N = `stats.every`;
step s is the s-th optimizer step, the number the logs show) the collector records

- weight gradients after unscaling (paper Figure 2b), all parameters together
  and, with `stats.per_layer`, per parameter tensor;
- activation gradients (paper Figure 3): the gradient with respect to the output
  of every leaf module (per module with `stats.per_layer`), seen by a tensor
  hook on that output. They carry the loss scale S of that step and are
  recorded as they are (`recorded_at_scale: S`); their scale-1 view is derived
  by shifting the exponents by log2 S. In mp/fp16 they are FP16 values (what
  FP16 kept); in pseudo_fp16 and FP32 modes, FP32 values (what FP16 would get);
- lost updates (paper 3.1): elements whose FP32 update is non-zero but vanishes
  when added in the low format, and the histogram of log2(|w| / |dw|). With FP32
  weights (master copies in mp / pseudo_fp16 / bf16, or amp's FP32 model) the
  add is simulated: fmt(w) + fmt(dw) == fmt(w), computed in fmt ("what FP16
  would have lost"). With weights stored in the low format (`fp16`) it is read
  off the step itself: weights that did not change although the update, computed
  in FP32 on throwaway copies of the weights and optimizer state, is non-zero
  ("what FP16 did lose"). fmt is the run's low format (FP16 unless bf16).

Histograms count floor(log2 |x|) in integer bins lo..hi (gradients -64..16).
The edge bins are open: values below 2^lo count in bin lo, values of 2^(hi+1)
and above in bin hi. Exact zeros and inf/NaN are counted separately
(`zero`, `nonfinite`), never in an exponent bin. Exponents come from
torch.frexp, so they are exact, also for subnormals.

FP16 regions of a value with exponent e = floor(log2 |x|) (after scaling):
  underflow (rounds to zero)  e <= -26   |x| < 2^-25
  subnormal                   -25 .. -15  2^-25 <= |x| < 2^-14
  normal                      -14 .. 15
  overflow                    e >= 16    |x| >= 2^16
Regions are decided per bin, so values that round across a boundary are
classed by their bin: exactly 2^-25 (rounds to zero) and [2^-14 - 2^-25, 2^-14)
(rounds up to the smallest normal) count as subnormal, [65520, 65536) (rounds to
inf) counts as normal. Fractions are of all elements, so
underflow + subnormal + normal + overflow + zero + nonfinite = 1. "At the loss
scale" shifts exponents by round(log2 S): exact for the power-of-two scales every
adaptive scaler produces, the nearest power of two for other fixed scales.

Cost: a non-sampled step runs no hooks and no tensor work (begin() tests the
step number, the other calls return at once). A sampled step does its work on
the device and reads the results to the host once, when the step ends.

The `auto` loss scaler reads its max|grad| from this collector every
`scaler.auto_every` steps, whether or not `stats.enabled` (see AutoScaler).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from runner.errors import UserError
from runner.logs import STATS, JsonlLog, tag as tb_tag
from runner.precision import BoundParams
from runner.scaling import dense_values, grad_abs_max
from runner.trees import map_tensors


@dataclass
class StatsConfig:
    """Knobs under the config key `stats`."""

    enabled: bool = False
    every: int = 100            # sample steps 0, every, 2*every, ...
    per_layer: bool = False     # also keep one histogram per parameter tensor / per module
    activations: bool = True    # activation-gradient histograms (module output hooks)
    lost_updates: bool = True   # measure weight updates the low format swallows

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise UserError(f"bad config: stats.every must be positive, got {self.every}")


@dataclass(frozen=True)
class Bins:
    """Exponent bins lo..hi, then one count of zeros and one of inf/NaN."""

    lo: int
    hi: int

    @property
    def exponents(self) -> int:
        return self.hi - self.lo + 1

    @property
    def zero(self) -> int:
        return self.exponents

    @property
    def nonfinite(self) -> int:
        return self.exponents + 1

    @property
    def size(self) -> int:
        return self.exponents + 2


GRAD_BINS = Bins(-64, 16)
RATIO_BINS = Bins(-16, 48)  # log2(|w| / |dw|); FP16 loses updates from 11 up

_F16 = torch.finfo(torch.float16)
FP16_ZERO_BELOW = round(math.log2(_F16.tiny * _F16.eps)) - 1   # -25: |x| < 2^-25 rounds to 0
FP16_NORMAL_FROM = round(math.log2(_F16.tiny))                 # -14: smallest normal 2^-14
FP16_OVERFLOW_FROM = math.floor(math.log2(_F16.max)) + 1       # 16: 65504 < 2^16
REGIONS = ("underflow", "subnormal", "normal", "overflow", "zero", "nonfinite")
_ALL = "all"


def lost_update_threshold_log2(dtype: torch.dtype) -> int:
    """log2 of the |w|/|dw| ratio above which an update is lost: 11 (2048) for FP16, 8 for bfloat16."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


# --- device side ---------------------------------------------------------------------
def log2_histogram(x: torch.Tensor, bins: Bins = GRAD_BINS, out: torch.Tensor | None = None,
                   where: torch.Tensor | None = None) -> torch.Tensor:
    """Add the counts of floor(log2|x|) per bin (then zeros, then inf/NaN) to `out` and return it.

    Only elements where `where` is true are counted. `out` is an int64 device
    vector of bins.size; everything stays on the device (index_add_ into a fixed
    size; bincount and histc on CUDA read the data's extremes back to the host).
    """
    x = x.detach().reshape(-1).float()  # FP32 holds every FP16/BF16 value exactly: same exponents, one frexp dtype
    exponent = torch.frexp(x).exponent - 1  # x = m * 2^e with 0.5 <= |m| < 1, so floor(log2|x|) = e - 1
    idx = exponent.clamp_(bins.lo, bins.hi).sub_(bins.lo)
    idx.masked_fill_(x == 0, bins.zero)
    idx.masked_fill_(~torch.isfinite(x), bins.nonfinite)
    if out is None:
        out = torch.zeros(bins.size, dtype=torch.int64, device=x.device)
    counted = (torch.ones((), dtype=torch.int64, device=x.device).expand(idx.numel()) if where is None
               else where.reshape(-1).to(torch.int64))
    return out.index_add_(0, idx, counted)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All elements of `tensors` in one new 1-D tensor: one copy, then every op is one large kernel."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _running_max(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new.to(current.device))


def _fp32_update(opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """The update opt.step() is about to apply, computed in FP32 on throwaway copies: id(param) -> update.

    load_state_dict casts the copied state to the copies' dtype (FP32) and
    restores every hyper-parameter, including the scheduler's current LR. The
    state is cloned first because load_state_dict keeps `step` counters as the
    same tensor objects, which the throwaway step would otherwise advance.
    """
    originals = [p for group in opt.param_groups for p in group["params"]]
    copies = []
    for p in originals:
        c = nn.Parameter(p.detach().to(torch.float32, copy=True))
        c.grad = None if p.grad is None else p.grad.detach().float()
        copies.append(c)
    groups, start = [], 0
    for group in opt.param_groups:
        groups.append({"params": copies[start:start + len(group["params"])]})
        start += len(group["params"])
    shadow = type(opt)(groups)
    shadow.load_state_dict(map_tensors(opt.state_dict(), lambda t: t.clone()))
    shadow.step()
    return {id(p): (c.detach() - p.detach().float()) for p, c in zip(originals, copies) if p.grad is not None}


@dataclass
class _Sample:
    """Device-side accumulators of one sampled step."""

    full: bool         # histograms and lost updates (stats.enabled)
    for_scaler: bool   # the auto scaler reads max|grad| at this step
    weight: dict[str, torch.Tensor] = field(default_factory=dict)
    act: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_max: torch.Tensor | None = None
    act_max: torch.Tensor | None = None  # scaled by the step's loss scale
    elements: int = 0                     # parameter elements measured for lost updates
    applied: bool = False                 # lost updates read off low-format weights, not simulated
    updated_lost: torch.Tensor | None = None  # [updated, lost]
    ratio: torch.Tensor | None = None


class GradStats:
    """Collects the statistics of sampled steps; see the module docstring.

    Per step, from the engine:
        begin(step)                       # hooks on module outputs, only if sampled
        ... forward, backward ...
        weight_grads(bound)               # after unscale_
        with measure_update(bound, opt):  # around opt.step()
            opt.step()
        scaler_max = end(step, scale)     # writes stats.jsonl / TensorBoard; auto's max|grad| or None
    """

    def __init__(self, cfg: StatsConfig, model: nn.Module, run_dir: Path,
                 low_dtype: torch.dtype | None, scaler_every: int = 0) -> None:
        self.cfg = cfg
        self.path = run_dir / "stats.jsonl"
        self.update_dtype = low_dtype or torch.float16  # FP32 runs: what FP16 would lose
        self.scaler_every = scaler_every
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        # Leaf modules are the layer boundaries; containers would count their last child's gradient twice.
        self.layers = [(name, m) for name, m in model.named_modules() if next(m.children(), None) is None]
        self._sample: _Sample | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._log: JsonlLog | None = None
        self._backward_ratio: torch.Tensor | None = None
        self._tb: SummaryWriter | None = None
        self._tag_prefix = STATS

    # --- lifecycle -----------------------------------------------------------------
    def open(self, tb: SummaryWriter, offset: int = 0, model: str = "") -> None:
        """Start writing stats.jsonl at `offset` bytes (a resumed run's checkpoint value); nothing
        is created when stats are off. TensorBoard tags: train_stats/<model>/... (runner/logs.py)."""
        if self.cfg.enabled:
            self._tb = tb
            self._tag_prefix = tb_tag(STATS, model)
            self._log = JsonlLog(self.path, offset)

    def offset(self) -> int:
        """Bytes of stats.jsonl written so far, for the checkpoint."""
        return 0 if self._log is None else self._log.offset()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def begin(self, step: int) -> None:
        """step: the 1-based number of the iteration about to run; steps 1, 1+N, 1+2N ... are sampled."""
        full = self.cfg.enabled and (step - 1) % self.cfg.every == 0
        for_scaler = self.scaler_every > 0 and (step - 1) % self.scaler_every == 0
        if not (full or for_scaler):
            return
        self._sample = _Sample(full, for_scaler)
        if for_scaler or self.cfg.activations:
            self._hooks = [m.register_forward_hook(partial(self._on_forward, name)) for name, m in self.layers]

    def end(self, step: int, scale: torch.Tensor) -> torch.Tensor | None:
        """Finish the step; returns the unscaled max|grad| (weights and activations) on the auto scaler's steps."""
        s, self._sample = self._sample, None
        if s is None:
            return None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if s.full:
            self._write(step, s, scale)
        if not s.for_scaler:
            return None
        # Auto takes the max over activation and weight gradients: S * max must stay below the format's
        # max for every gradient backward writes in FP16 (see AutoScaler), not only for the weights'.
        unscaled = [m for m in (s.weight_max, None if s.act_max is None else s.act_max / scale) if m is not None]
        return torch.stack([m.to(scale.device) for m in unscaled]).max() if unscaled else None

    # --- hooks and engine calls ----------------------------------------------------
    def _on_forward(self, name: str, _module: nn.Module, _inputs: Any, output: Any) -> None:
        map_tensors(output, partial(self._watch, name))

    def _watch(self, name: str, t: torch.Tensor) -> torch.Tensor:
        # A tensor hook fires with the gradient of this version of the tensor, even when a later
        # in-place op (ReLU(inplace=True)) modifies it, so every module's own output gradient is seen.
        if t.requires_grad:
            t.register_hook(partial(self._on_activation_grad, name))
        return t

    @property
    def sampling(self) -> bool:
        """Whether the step in progress is sampled (hooks installed); False costs nothing."""
        return self._sample is not None

    def backward_scale(self, ratio: torch.Tensor | None) -> None:
        """The backward about to run is scaled by ratio x the step's reference scale (the first
        optimizer's, which end() receives); None: by the reference scale itself. With several
        optimizers (a GAN) each loss has its own scale: activation gradients are brought to the
        reference scale before they are recorded, so one histogram and max hold one scale."""
        self._backward_ratio = ratio

    def _on_activation_grad(self, name: str, grad: torch.Tensor) -> None:
        s = self._sample
        if s is None or grad.numel() == 0:
            return
        if self._backward_ratio is not None:
            grad = grad / self._backward_ratio
        s.act_max = _running_max(s.act_max, grad.detach().abs().amax().float())
        if s.full and self.cfg.activations:  # the hooks may be there only for the auto scaler
            key = name if self.cfg.per_layer else _ALL
            s.act[key] = log2_histogram(grad, GRAD_BINS, s.act.get(key))

    def weight_grads(self, bound: BoundParams) -> None:
        """Record the gradients the optimizer will read; call after the scaler unscaled them."""
        s = self._sample
        if s is None:
            return
        # A sparse gradient contributes its stored values (the rows that received gradient).
        pairs = [(self.param_names[id(mp)], dense_values([p.grad])[0])
                 for mp, p in zip(bound.model_params, bound.optimizer_params) if p.grad is not None]
        if not pairs:
            return
        s.weight_max = _running_max(s.weight_max, grad_abs_max([g for _, g in pairs]))
        if not s.full:
            return
        if self.cfg.per_layer:
            for name, g in pairs:
                s.weight[name] = log2_histogram(g, GRAD_BINS, s.weight.get(name))
        else:  # one histogram over all of them: a few large kernels instead of a few per tensor
            s.weight[_ALL] = log2_histogram(_flat([g for _, g in pairs]), GRAD_BINS, s.weight.get(_ALL))

    def measure_update(self, bound: BoundParams, opt: torch.optim.Optimizer) -> ContextManager[None]:
        """Wrap opt.step(): on sampled steps, count the updates the low format loses."""
        s = self._sample
        if s is None or not s.full or not self.cfg.lost_updates:
            return contextlib.nullcontext()
        params = [p for p in bound.optimizer_params if p.grad is not None]  # the ones opt.step() updates
        return self._measure_update(s, params, opt) if params else contextlib.nullcontext()

    @contextlib.contextmanager
    def _measure_update(self, s: _Sample, params: list[nn.Parameter], opt: torch.optim.Optimizer) -> Iterator[None]:
        fmt = self.update_dtype
        applied = all(p.dtype == fmt for p in params)  # weights stored in the low format (precision=fp16)
        before = _flat(params)
        if applied:
            updates = _fp32_update(opt)
            dw = _flat([updates[id(p)] for p in params])
        yield
        if applied:  # did the step change the stored weight?
            lost = _flat(params) == before
        else:        # would fmt(w) + fmt(dw), added in fmt, differ from fmt(w)?
            dw = _flat(params).float() - before.float()
            w_low = before.to(fmt)
            lost = (w_low + dw.to(fmt)) == w_low
        updated = dw != 0
        counts = torch.stack([updated.sum(), (updated & lost).sum()])
        s.updated_lost = counts if s.updated_lost is None else s.updated_lost + counts
        s.elements += before.numel()
        s.applied = applied
        s.ratio = log2_histogram(before.float().abs() / dw.abs(), RATIO_BINS, s.ratio, where=updated)

    # --- host side -----------------------------------------------------------------
    def _write(self, step: int, s: _Sample, scale: torch.Tensor) -> None:
        singles = {"scale": scale, "weight_max": s.weight_max, "act_max": s.act_max,
                   "updated_lost": s.updated_lost, "ratio": s.ratio}
        host = _to_host(scale.device, {"weight": s.weight, "act": s.act,
                                       "single": {k: v for k, v in singles.items() if v is not None}})
        single = host["single"]
        loss_scale = single["scale"][0]
        record: dict[str, Any] = {"step": step, "loss_scale": loss_scale, "grad_bins": [GRAD_BINS.lo, GRAD_BINS.hi]}
        if s.weight:
            record["weight_grad"] = _grad_summary(host["weight"], 1.0, loss_scale, single["weight_max"][0])
        if s.act:
            record["act_grad"] = _grad_summary(host["act"], loss_scale, loss_scale,
                                               single["act_max"][0] / loss_scale)
        if s.updated_lost is not None:
            updated, lost = (int(v) for v in single["updated_lost"])
            record["lost_updates"] = {
                "how": "applied" if s.applied else "simulated",
                "format": str(self.update_dtype).removeprefix("torch."),
                "threshold_log2": lost_update_threshold_log2(self.update_dtype),
                "elements": s.elements, "updated": updated, "lost": lost,
                "lost_frac": lost / updated if updated else 0.0,
                "ratio_bins": [RATIO_BINS.lo, RATIO_BINS.hi],
                "ratio_hist": _hist_json(single["ratio"], RATIO_BINS),
            }
        self._log.write(record)
        _log_tensorboard(self._tb, record, self._tag_prefix)


def _to_host(device: torch.device, groups: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, list[float]]]:
    """Read groups of device tensors with one host sync: concatenate, .tolist(), split back."""
    flat = [(g, k, t.detach().reshape(-1).to(device, torch.float64)) for g, ts in groups.items() for k, t in ts.items()]
    values = torch.cat([t for _, _, t in flat]).tolist()
    out: dict[str, dict[str, list[float]]] = {g: {} for g in groups}
    start = 0
    for g, k, t in flat:
        out[g][k] = values[start:start + t.numel()]
        start += t.numel()
    return out


def _hist_json(values: list[float], bins: Bins) -> dict[str, Any]:
    counts = [int(v) for v in values]
    return {"counts": counts[:bins.exponents], "zero": counts[bins.zero], "nonfinite": counts[bins.nonfinite]}


def _add_hists(hists: list[dict[str, Any]]) -> dict[str, Any]:
    return {"counts": [sum(c) for c in zip(*(h["counts"] for h in hists))],
            "zero": sum(h["zero"] for h in hists), "nonfinite": sum(h["nonfinite"] for h in hists)}


def _grad_summary(layers: dict[str, list[float]], recorded_at: float, loss_scale: float,
                  max_abs: float) -> dict[str, Any]:
    """One gradient kind of a record: total histogram, per-layer ones, FP16 regions at scale 1 and at S."""
    hists = {name: _hist_json(v, GRAD_BINS) for name, v in layers.items()}
    total = _add_hists(list(hists.values()))
    to_scale_1 = -scale_shift(recorded_at)
    summary: dict[str, Any] = {
        "recorded_at_scale": recorded_at,
        "max_abs": max_abs,  # unscaled
        "hist": total,
        "regions": {"scale_1": fp16_regions(total, to_scale_1),
                    "loss_scale": fp16_regions(total, to_scale_1 + scale_shift(loss_scale))},
    }
    if set(hists) != {_ALL}:
        summary["layers"] = hists
    return summary


def scale_shift(scale: float) -> int:
    """Exponent shift a loss scale gives: log2 S, rounded for scales that are not powers of two."""
    return round(math.log2(scale))


def fp16_region(exponent: int) -> str:
    """Where a value with floor(log2|x|) = exponent lands in FP16."""
    if exponent < FP16_ZERO_BELOW:
        return "underflow"
    if exponent < FP16_NORMAL_FROM:
        return "subnormal"
    if exponent < FP16_OVERFLOW_FROM:
        return "normal"
    return "overflow"


def fp16_regions(hist: dict[str, Any], shift: int, lo: int = GRAD_BINS.lo) -> dict[str, float]:
    """Fractions of all elements per FP16 region after multiplying the values by 2^shift."""
    counts = dict.fromkeys(REGIONS, 0)
    counts["zero"], counts["nonfinite"] = hist["zero"], hist["nonfinite"]
    for i, c in enumerate(hist["counts"]):
        counts[fp16_region(lo + i + shift)] += c
    total = sum(counts.values())
    return {k: v / total if total else 0.0 for k, v in counts.items()}


def _log_histogram(tb: SummaryWriter, tag: str, hist: dict[str, Any], lo: int, shift: int, step: int) -> None:
    """A pre-binned exponent histogram as a TensorBoard histogram of log2|x| (zeros and inf/NaN left out)."""
    used = [i for i, c in enumerate(hist["counts"]) if c]
    if not used:
        return
    exps = list(range(lo + used[0] + shift, lo + used[-1] + shift + 1))
    counts = hist["counts"][used[0]:used[-1] + 1]
    centres = [e + 0.5 for e in exps]
    tb.add_histogram_raw(tag, min=exps[0], max=exps[-1] + 1, num=sum(counts),
                         sum=sum(c * x for c, x in zip(counts, centres)),
                         sum_squares=sum(c * x * x for c, x in zip(counts, centres)),
                         bucket_limits=[e + 1 for e in exps], bucket_counts=counts, global_step=step)


def _log_tensorboard(tb: SummaryWriter, record: dict[str, Any], prefix: str = STATS) -> None:
    """Histograms at scale 1 and the derived scalars, all under `prefix` (train_stats/<model>).
    The loss scale is not repeated here: the train group logs it (train/<model>/loss_scale)."""
    step, lo = record["step"], record["grad_bins"][0]
    for kind in ("weight_grad", "act_grad"):
        summary = record.get(kind)
        if summary is None:
            continue
        to_scale_1 = -scale_shift(summary["recorded_at_scale"])
        _log_histogram(tb, f"{prefix}/{kind}/log2_abs", summary["hist"], lo, to_scale_1, step)
        for layer, hist in summary.get("layers", {}).items():
            _log_histogram(tb, f"{prefix}/{kind}_layers/{layer}", hist, lo, to_scale_1, step)
        if summary["max_abs"] is not None:
            tb.add_scalar(f"{prefix}/{kind}/max_abs", summary["max_abs"], step)
        for where, fractions in summary["regions"].items():
            for region, value in fractions.items():
                if region != "normal":
                    tb.add_scalar(f"{prefix}/{kind}/{where}/{region}", value, step)
    lost = record.get("lost_updates")
    if lost is not None:
        tb.add_scalar(f"{prefix}/lost_updates/lost_frac", lost["lost_frac"], step)
        _log_histogram(tb, f"{prefix}/lost_updates/log2_w_over_dw", lost["ratio_hist"], lost["ratio_bins"][0], 0, step)
