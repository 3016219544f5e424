"""Gradient statistics (runner/gradstats.py): histograms, FP16 regions, hooks, lost updates, engine wiring."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from runner.engine import check_run, train
from runner.errors import UserError
from runner.gradstats import GRAD_BINS, RATIO_BINS, GradStats, StatsConfig, fp16_regions, log2_histogram
from runner.logs import STATS
from runner.precision import BoundParams


def as_dict(counts: torch.Tensor, lo: int = GRAD_BINS.lo) -> dict[Any, int]:
    """Histogram vector -> {exponent: count, 'zero': n, 'nonfinite': n}, non-empty bins only."""
    values = counts.tolist()
    out: dict[Any, int] = {lo + i: c for i, c in enumerate(values[:-2]) if c}
    out.update({k: c for k, c in (("zero", values[-2]), ("nonfinite", values[-1])) if c})
    return out


def hist_json(counts: torch.Tensor) -> dict[str, Any]:
    """A histogram vector in the stats.jsonl layout."""
    values = counts.tolist()
    return {"counts": values[:GRAD_BINS.exponents], "zero": values[GRAD_BINS.zero],
            "nonfinite": values[GRAD_BINS.nonfinite]}


def test_histogram_counts_match_hand_computed_exponents() -> None:
    values = [0.0, -0.0, 1.0, 2.0, -3.0, 0.75, 2.0**-24, 2.0**-25, 3 * 2.0**-20, 2.0**-14, 65504.0, 2.0**16,
              2.0**-70, 2.0**20, float("inf"), float("-inf"), float("nan")]
    expected = {0: 1, 1: 2, -1: 1, -24: 1, -25: 1, -19: 1, -14: 1, 15: 1,
                -64: 1,          # 2^-70 is below the lowest bin: counted in the open edge bin
                16: 2,           # 2^16, and 2^20 above the highest bin in the open edge bin
                "zero": 2, "nonfinite": 3}
    hist = log2_histogram(torch.tensor(values))
    assert as_dict(hist) == expected
    n = len(values)
    regions = fp16_regions(hist_json(hist), 0)
    # subnormal: 2^-24, 3*2^-20 and 2^-25 (a tie that rounds to 0, classed by its bin; see the module docstring)
    assert regions == pytest.approx({"underflow": 1 / n, "subnormal": 3 / n, "normal": 6 / n,
                                     "overflow": 2 / n, "zero": 2 / n, "nonfinite": 3 / n})
    at_8 = fp16_regions(hist_json(hist), 3)  # x8: 65504 overflows; 2^-21, 2^-22 and 3*2^-17 are still subnormal
    assert at_8["subnormal"] == pytest.approx(3 / n) and at_8["overflow"] == pytest.approx(3 / n)


def test_histogram_is_exact_for_fp16_subnormals_and_accumulates() -> None:
    # every FP16 subnormal power of two, 2^-24 .. 2^-15, plus the largest subnormal (just below 2^-14)
    x = torch.tensor([2.0**e for e in range(-24, -14)] + [2.0**-14 - 2.0**-24], dtype=torch.float16)
    assert (x != 0).all()
    once = log2_histogram(x)
    assert as_dict(once) == {**{e: 1 for e in range(-24, -15)}, -15: 2}
    twice = log2_histogram(x, out=once.clone())
    assert torch.equal(twice, 2 * once)


def test_histogram_counts_only_where_mask_is_true() -> None:
    x = torch.tensor([1.0, 4.0, 0.0, float("nan")])
    assert as_dict(log2_histogram(x, where=torch.tensor([True, False, True, False]))) == {0: 1, "zero": 1}


def test_fp16_regions_match_casting_to_fp16() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(20000).uniform_(-40, 20, generator=g)) * torch.randn(20000, generator=g).sign()
    shifts = (0, 3, -5)
    # Regions are decided per bin; these slivers round across a bin's region boundary.
    slivers = [(65520.0, 65536.0), (2.0**-14 - 2.0**-25, 2.0**-14)]
    for shift in shifts:
        for start, stop in slivers:
            a = x.abs() * 2.0**shift
            x = x[(a < start) | (a >= stop)]
    x = torch.cat([x, torch.zeros(7), torch.tensor([float("nan")])])
    as_json = hist_json(log2_histogram(x))
    half, n = x.half(), x.numel()
    finite = torch.isfinite(x)
    for shift in shifts:
        regions = fp16_regions(as_json, shift)
        scaled = (x * 2.0**shift).half()
        assert regions["underflow"] == pytest.approx(int(((scaled == 0) & (x != 0)).sum()) / n)
        assert regions["overflow"] == pytest.approx(int((scaled.isinf() & finite).sum()) / n)
        subnormal = (scaled != 0) & (scaled.abs() < 2.0**-14)
        assert regions["subnormal"] == pytest.approx(int(subnormal.sum()) / n)
        assert regions["zero"] == pytest.approx(7 / n) and regions["nonfinite"] == pytest.approx(1 / n)
        assert sum(regions.values()) == pytest.approx(1.0)
    assert int((half == 0).sum()) > 7 and int(half.isinf().sum()) > 0  # the sample reaches both ends


def make_stats(tmp_path: Path, model: nn.Module, scaler_every: int = 0, low: torch.dtype | None = torch.float16,
               **cfg: Any) -> GradStats:
    stats = GradStats(StatsConfig(**{"enabled": True, "every": 1, **cfg}), model, tmp_path, low, scaler_every)
    stats.open(SummaryWriter(str(tmp_path)))
    return stats


def records(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]


class Net(nn.Module):
    """Leaf modules, a batch norm overwritten by an in-place ReLU, and a functional op between modules."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(inplace=True))
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) * 2)


def output_grads(model: Net, x: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """Every leaf module's output gradient, computed independently (no hooks, no in-place op)."""
    a0 = model.body[0](x)
    a1 = model.body[1](a0)
    a2 = torch.relu(a1)
    out = model.head(a2 * 2)
    grads = torch.autograd.grad(out.square().sum() * scale, [a0, a1, a2, out])
    return dict(zip(["body.0", "body.1", "body.2", "head"], grads))


def test_activation_hooks_see_every_module_output_gradient(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, scale = Net(), torch.randn(4, 6), 2.0**5
    expected = output_grads(model, x, scale)
    stats = make_stats(tmp_path, model, per_layer=True, lost_updates=False)
    stats.begin(1)
    (model(x).square().sum() * scale).backward()
    stats.weight_grads(BoundParams([{"params": list(model.parameters())}], None))
    stats.end(1, torch.tensor(scale))
    act = records(tmp_path)[0]["act_grad"]
    assert set(act["layers"]) == set(expected)
    for name, grad in expected.items():  # body.1's own gradient, not the ReLU's, though the ReLU overwrote it
        assert act["layers"][name] == hist_json(log2_histogram(grad)), name
    assert act["recorded_at_scale"] == scale
    assert act["max_abs"] == pytest.approx(max(float(g.abs().max()) for g in expected.values()) / scale)
    weight = records(tmp_path)[0]["weight_grad"]
    assert set(weight["layers"]) == {name for name, _ in model.named_parameters()}
    assert not any(m._forward_hooks for m in model.modules())  # end() removed the hooks


def test_unsampled_steps_install_nothing(tmp_path: Path) -> None:
    model = Net()
    stats = make_stats(tmp_path, model, every=4)
    stats.begin(3)
    assert not any(m._forward_hooks for m in model.modules())
    model(torch.randn(4, 6)).sum().backward()
    stats.weight_grads(BoundParams([{"params": list(model.parameters())}], None))
    assert stats.end(3, torch.tensor(1.0)) is None
    assert (tmp_path / "stats.jsonl").read_text() == ""


def test_auto_scaler_max_comes_from_the_collector_on_its_steps_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, scale = Net(), torch.randn(4, 6), 2.0**5
    expected = output_grads(model, x, scale)
    stats = GradStats(StatsConfig(enabled=False), model, tmp_path, torch.float16, scaler_every=2)
    for step in (1, 2):
        model.zero_grad()
        stats.begin(step)
        (model(x).square().sum() * scale).backward()
        for p in model.parameters():
            p.grad /= scale  # what the scaler's unscale_ does
        stats.weight_grads(BoundParams([{"params": list(model.parameters())}], None))
        got = stats.end(step, torch.tensor(scale))
        if step == 2:
            assert got is None
            continue
        act_max = max(float(g.abs().max()) for g in expected.values()) / scale
        weight_max = max(float(p.grad.abs().max()) for p in model.parameters())
        assert float(got) == pytest.approx(max(act_max, weight_max))
    assert not (tmp_path / "stats.jsonl").exists()


def lost_update_record(tmp_path: Path, dtype: torch.dtype, optimizer: type = torch.optim.SGD) -> dict[str, Any]:
    """One SGD step (lr 1) on weights 1.0 with chosen updates; returns the lost-update record."""
    updates = torch.tensor([0.99 * 2.0**-11,  # |w|/|dw| just above 2048: lost
                            1.01 * 2.0**-11,  # just below 2048: rounds up to the next FP16 value, kept
                            2.0**-4,          # kept
                            2.0**-20,         # FP32 keeps it, FP16 loses it
                            0.0])             # no update at all: not counted
    w = nn.Parameter(torch.ones(5, dtype=dtype))
    w.grad = (-updates).to(dtype)
    opt = torch.optim.SGD([w], lr=1.0, momentum=0.0)
    bound = BoundParams([{"params": [w]}], None)
    model = nn.Module()
    model.w = w
    stats = make_stats(tmp_path, model, activations=False)
    stats.begin(1)
    with stats.measure_update(bound, opt):
        opt.step()
    stats.end(1, torch.tensor(1.0))
    return records(tmp_path)[0]["lost_updates"]


@pytest.mark.parametrize("dtype, how", [(torch.float32, "simulated"), (torch.float16, "applied")])
def test_lost_update_fraction_on_a_constructed_case(tmp_path: Path, dtype: torch.dtype, how: str) -> None:
    lost = lost_update_record(tmp_path, dtype)
    assert (lost["how"], lost["format"], lost["threshold_log2"]) == (how, "float16", 11)
    assert (lost["elements"], lost["updated"], lost["lost"]) == (5, 4, 2)
    assert lost["lost_frac"] == 0.5
    ratio = {RATIO_BINS.lo + i: c for i, c in enumerate(lost["ratio_hist"]["counts"]) if c}
    assert ratio == {11: 1, 10: 1, 4: 1, 20: 1}


def test_fp32_shadow_step_leaves_the_real_optimizer_untouched(tmp_path: Path) -> None:
    """In fp16 the intended update comes from a throwaway FP32 step; training must not notice it."""
    torch.manual_seed(0)
    grads = [torch.randn(8).half() for _ in range(3)]
    runs = []
    for measured in (False, True):
        w = nn.Parameter(torch.ones(8, dtype=torch.float16))
        opt = torch.optim.Adam([w], lr=1e-3)
        model = nn.Module()
        model.w = w
        stats = make_stats(tmp_path / str(measured), model, activations=False, every=1 if measured else 10**6)
        for step, g in enumerate(grads, start=1):
            w.grad = g.clone()
            stats.begin(step)
            with stats.measure_update(BoundParams([{"params": [w]}], None), opt):
                opt.step()
            stats.end(step, torch.tensor(1.0))
        runs.append((w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}))
    (w0, s0), (w1, s1) = runs
    assert torch.equal(w0, w1) and s0.keys() == s1.keys()
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_stats_off_by_default_and_bad_every_is_a_user_error(tiny_cfg) -> None:
    assert check_run(tiny_cfg()).root.stats == StatsConfig()
    with pytest.raises(UserError, match="stats.every must be positive"):
        check_run(tiny_cfg("stats.enabled=true", "stats.every=0"))


def read_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


def test_end_to_end_stats_on_and_off(tiny_cfg, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ("trainer.max_steps=3", "precision=mp", "scale=8", "trainer.eval_batches=1")
    summary_on = train(tiny_cfg(*common, "stats.enabled=true", "stats.every=2"))
    summary_off = train(tiny_cfg(*common, "out_root=" + str(tmp_path / "off")))
    on, off = Path(summary_on["run_dir"]), Path(summary_off["run_dir"])
    assert not (off / "stats.jsonl").exists()
    # observing must not change training, nor the activation memory the engine measures at step 1
    assert read_losses(on) == read_losses(off) and summary_on["metric"] == summary_off["metric"]
    assert summary_on["memory"]["activation_bytes"] == summary_off["memory"]["activation_bytes"]
    recs = [json.loads(line) for line in (on / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 3]
    for r in recs:
        assert r["loss_scale"] == 8.0
        assert r["act_grad"]["recorded_at_scale"] == 8.0 and r["weight_grad"]["recorded_at_scale"] == 1.0
        assert 0 < r["lost_updates"]["updated"] <= r["lost_updates"]["elements"]
        assert sum(r["weight_grad"]["regions"]["loss_scale"].values()) == pytest.approx(1.0)
    events = EventAccumulator(str(on), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    group = f"{STATS}/{summary_on['model']}"  # after the headline groups eval/ and train/ (runner/logs.py)
    assert {f"{group}/weight_grad/log2_abs", f"{group}/act_grad/log2_abs",
            f"{group}/lost_updates/log2_w_over_dw"} <= set(events.Tags()["histograms"])
    assert f"{group}/act_grad/scale_1/underflow" in events.Tags()["scalars"]
    assert [e.step for e in events.Scalars(f"{group}/lost_updates/lost_frac")] == [1, 3]
    # the loss scale is charted once, with the train values (stats.jsonl keeps its own copy)
    assert not [t for t in events.Tags()["scalars"] if t.startswith(STATS) and t.endswith("/loss_scale")]
    assert f"train/{summary_on['model']}/loss_scale" in events.Tags()["scalars"]


def test_auto_scale_without_stats_uses_collector_max(tiny_cfg) -> None:
    summary = train(tiny_cfg("precision=mp", "scale=auto", "scaler.auto_every=2", "trainer.max_steps=2",
                             "trainer.eval_batches=1"))
    assert not (Path(summary["run_dir"]) / "stats.jsonl").exists()
    # chosen from max|grad| at step 0 (2^16 start would leave no headroom under the 1/8 margin)
    scale = summary["scale_final"]
    assert scale != 2.0**16 and scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
