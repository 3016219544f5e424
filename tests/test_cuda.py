"""CUDA-only tests: what a CPU run cannot see. `pytest -m cuda` on a machine with a GPU.

Without CUDA every test here is skipped (CPU CI shows skips). They check:
- every model's tiny variant trains through the engine on CUDA in every precision mode x loss
  scaler (two iterations, finite losses), and a whole run (train + evaluate + checkpoint) per
  model and mode;
- real FP16 arithmetic: an FP16 matmul differs from the FP32 one and runs much faster (tensor
  cores); under `mp` the weights on the GPU are float16 (batch norm float32, master float32) and
  the activations too; under `amp` autocast computes convolutions in float16;
- the allocator: a tiny ResNet's peak allocated memory in `mp` is below `fp32`'s;
- host syncs: exactly one per optimizer step comes from the engine (the overflow-flag read for the
  skip decision), counted with torch.cuda.set_sync_debug_mode (bench/bench_syncs.py); the task's
  own syncs are printed (`pytest -m cuda -s`) and asserted to be none for ResNet.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from runner.cli import compose_job
from runner.engine import Trainer, train
from tests.conftest import TINY as RESNET_TINY
from tests.test_biglstm import TINY_OVERRIDES as BIGLSTM_TINY
from tests.test_dcgan import TINY as DCGAN_TINY
from tests.test_deepspeech import ENGINE_TINY as DEEPSPEECH_TINY

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_syncs import count_iteration_syncs  # noqa: E402
from common import host_batches  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")]

# Each model's tiny variant, as its own CPU tests define it (SSD: tests/test_ssd.py's engine test).
TINY: dict[str, list[str]] = {
    "resnet50": ["model=resnet50", *RESNET_TINY],
    "ssd": ["model=ssd", "data.num_train=4", "data.num_eval=2", "data.batch_size=2", "trainer.optimizer=sgd",
            "trainer.lr=1e-3", "trainer.warmup_steps=0", "trainer.timing_warmup_steps=1"],
    "biglstm": BIGLSTM_TINY,
    "dcgan": DCGAN_TINY,
    "deepspeech": DEEPSPEECH_TINY,
}
FP32_MODES = ["fp32", "tf32"]
REDUCED_MODES = ["fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"]
SCALES = ["none", "8", "dynamic", "lognormal", "auto"]
CASES = [(m, p, "none") for m in TINY for p in FP32_MODES] + \
        [(m, p, s) for m in TINY for p in REDUCED_MODES for s in SCALES]


def extra(model: str, precision: str) -> list[str]:
    # fp16 keeps Adam's state in FP16 (no master weights): Adam's eps 1e-8 rounds to 0 there, so
    # the DCGAN uses eps 1e-4, as tests/test_dcgan.py does.
    return ["trainer.eps=1e-4"] if model == "dcgan" and precision == "fp16" else []


def cuda_cfg(model: str, precision: str, scale: str, out: Path, *more: str) -> Any:
    return compose_job([*TINY[model], f"precision={precision}", f"scale={scale}", "device=cuda",
                        "trainer.resume=never", f"out_dir={out}", *extra(model, precision), *more])


def iterations(trainer: Trainer, n: int) -> list[dict[str, float]]:
    """n training iterations through the engine (Trainer.train_iteration: the task's train_step
    with the step context) on the engine's own batches; the logged values of each."""
    logs = []
    for host in host_batches(trainer, n):
        out, _ = trainer.train_iteration(trainer.to_device(host), measure_memory=not logs)
        trainer.step += 1
        logs.append({k: float(v) for k, v in out.items()})
    return logs


@pytest.mark.parametrize("model, precision, scale", CASES)
def test_two_steps_on_cuda_in_every_mode_and_scaler(tmp_path: Path, model: str, precision: str, scale: str) -> None:
    trainer = Trainer(cuda_cfg(model, precision, scale, tmp_path))
    assert trainer.device.type == "cuda"
    assert all(p.is_cuda for p in trainer.model.parameters())
    logs = iterations(trainer, 2)
    for values in logs:
        assert all(math.isfinite(v) for k, v in values.items() if "loss" in k), logs
    assert trainer.activation_bytes and trainer.activation_bytes > 0
    for slot in trainer.slots.values():
        assert slot.stepped and slot.scaler.scale.is_cuda
        assert math.isfinite(float(slot.scaler.scale)) and float(slot.scaler.scale) >= 1.0


@pytest.mark.parametrize("model", list(TINY))
@pytest.mark.parametrize("precision", FP32_MODES + REDUCED_MODES)
def test_whole_run_on_cuda(tmp_path: Path, model: str, precision: str) -> None:
    """train(): steps, evaluation (on CUDA), checkpoint and summary with the GPU's numbers."""
    scale = "none" if precision in FP32_MODES else "dynamic"
    summary = train(cuda_cfg(model, precision, scale, tmp_path, "trainer.max_steps=2", "trainer.log_every=1",
                             "trainer.timing_warmup_steps=0"))
    assert summary["device"] == "cuda" and summary["steps"] == 2 and not summary["diverged"], summary["diverged_reason"]
    assert summary["metric"] is not None and math.isfinite(summary["metric"])
    assert summary["step_time_ms_p50"] > 0  # CUDA events were recorded and read
    memory = summary["memory"]
    assert memory["peak_allocated_bytes"] > 0 and memory["peak_reserved_bytes"] >= memory["peak_allocated_bytes"]
    losses = [r["loss"] for r in map(json.loads, (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "train"]
    assert losses and all(math.isfinite(x) for x in losses)
    assert (Path(summary["run_dir"]) / "checkpoint.pt").is_file()


# --- real FP16 arithmetic -----------------------------------------------------------------------
def _matmul_ms(a: torch.Tensor, b: torch.Tensor, reps: int = 10) -> float:
    torch.matmul(a, b)  # cuBLAS handle, heuristics
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def test_fp16_matmul_is_real_fp16_on_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the FP32 reference is true FP32
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", generator=g)
    b = torch.randn(4096, 4096, device="cuda", generator=g)
    exact = a.double() @ b.double()
    c32, c16 = a @ b, a.half() @ b.half()
    assert c16.dtype == torch.float16
    err32 = float(((c32.double() - exact).abs().max() / exact.abs().max()))
    err16 = float(((c16.double() - exact).abs().max() / exact.abs().max()))
    # FP16 inputs keep 11 significant bits: the result differs from FP32's, by FP16's rounding
    # (inputs rounded to 2^-11 relative; FP32 accumulation), and FP32's is far closer.
    assert not torch.equal(c16.float(), c32)
    assert err16 > 10 * err32 and err16 < 1e-2, (err16, err32)
    # Tensor cores: FP16 GEMMs run several times faster than FP32 without TF32 (V100 ~8x, A100/H100
    # more); a GPU without them (or an FP16 path emulated in FP32) would not be 2x faster.
    fp32_ms, fp16_ms = _matmul_ms(a, b), _matmul_ms(a.half(), b.half())
    print(f"\n4096^3 GEMM on {torch.cuda.get_device_name()}: fp32 (no TF32) {fp32_ms:.2f} ms, fp16 {fp16_ms:.2f} ms")
    assert fp16_ms * 2 < fp32_ms, (fp16_ms, fp32_ms)


def _first(model: nn.Module, kind: type[nn.Module]) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, kind))


def test_mp_weights_and_activations_are_float16_on_the_gpu(tmp_path: Path) -> None:
    trainer = Trainer(cuda_cfg("resnet50", "mp", "dynamic", tmp_path))
    conv, bn = _first(trainer.model, nn.Conv2d), _first(trainer.model, nn.BatchNorm2d)
    assert conv.weight.dtype == torch.float16 and conv.weight.is_cuda
    assert bn.weight.dtype == torch.float32  # batch norm stays FP32 in mp
    masters = trainer.slots["main"].params.master_params
    assert masters and all(m.dtype == torch.float32 and m.is_cuda for m in masters)
    seen: dict[str, torch.dtype] = {}
    conv.register_forward_hook(lambda _m, _i, out: seen.setdefault("conv", out.dtype))
    logs = iterations(trainer, 1)
    assert seen["conv"] == torch.float16 and math.isfinite(logs[0]["loss"])
    assert conv.weight.dtype == torch.float16  # the update was rounded back into FP16 weights


def test_amp_computes_convolutions_in_float16(tmp_path: Path) -> None:
    trainer = Trainer(cuda_cfg("resnet50", "amp", "dynamic", tmp_path))
    conv = _first(trainer.model, nn.Conv2d)
    assert conv.weight.dtype == torch.float32  # amp keeps FP32 weights
    seen: dict[str, torch.dtype] = {}
    conv.register_forward_hook(lambda _m, _i, out: seen.setdefault("conv", out.dtype))
    iterations(trainer, 1)
    assert seen["conv"] == torch.float16


# --- allocator peaks --------------------------------------------------------------------------------
def _peak_step_bytes(make: Callable[[], Trainer]) -> int:
    """Peak bytes allocated by one Trainer alone on the GPU in steady state: after two warm-up
    iterations (cuDNN's autotuning tries workspaces of any size there), over two more. The peak
    counts what stays allocated (weights, master copies, optimizer state) and each step's
    activations and gradients."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    trainer = make()
    iterations(trainer, 2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # the peak restarts from what is allocated now
    iterations(trainer, 2)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del trainer
    torch.cuda.empty_cache()
    return peak


def test_mp_peak_allocated_memory_is_below_fp32(tmp_path: Path) -> None:
    # Activations dominate at this size (batch 64 of 64 px), as they do at the paper's size; at the
    # unit tests' 16 px the FP32 master copy and momentum would weigh as much as the activations.
    size = ["model.width=0.25", "data.image_size=64", "data.batch_size=64", "data.num_train=512"]
    peaks = {p: _peak_step_bytes(lambda p=p: Trainer(cuda_cfg("resnet50", p, "none" if p == "fp32" else "dynamic",
                                                                tmp_path / p, *size)))
             for p in ("fp32", "mp")}
    print(f"\npeak allocated, ResNet width 0.25, 64 px, batch 64: fp32 {peaks['fp32'] / 2**20:.1f} MiB, "
          f"mp {peaks['mp'] / 2**20:.1f} MiB ({peaks['mp'] / peaks['fp32']:.2f}x)")
    assert peaks["mp"] < peaks["fp32"], peaks


# --- host synchronisations --------------------------------------------------------------------------
@pytest.mark.parametrize("model", list(TINY))
@pytest.mark.parametrize("precision, scale", [("fp32", "none"), ("mp", "dynamic"), ("amp", "dynamic"),
                                              ("pseudo_fp16", "8"), ("bf16", "none"), ("mp", "lognormal")])
def test_engine_syncs_once_per_optimizer_step(tmp_path: Path, model: str, precision: str, scale: str) -> None:
    trainer = Trainer(cuda_cfg(model, precision, scale, tmp_path))
    r = count_iteration_syncs(trainer, host_batches(trainer, 3))
    task = r.unexpected(("models", "data", "other"))
    print(f"\n{model} {precision} scale={scale}: {len(r.syncs)} syncs in {r.iterations} iterations, "
          f"{r.optimizer_steps} optimizer steps; task syncs: {dict(task) or 'none'}")
    assert r.optimizer_steps == r.iterations * len(trainer.slots)
    assert r.allowed == r.optimizer_steps                 # one overflow-flag read per optimizer step
    assert not r.unexpected(("runner",))                  # and no other sync in the engine
    if model == "resnet50":                               # a task that adds none: one sync per step in all
        assert len(r.syncs) == r.optimizer_steps, task


def test_sync_counter_sees_an_item_call() -> None:
    """The counting mechanism itself: a .item() inside the counter is one sync, attributed here."""
    from bench_syncs import SyncCounter
    x = torch.ones(3, device="cuda")
    with SyncCounter() as counter:
        y = x * 2          # no sync
        float(y.sum().item())
    assert len(counter.syncs) == 1 and counter.syncs[0].owner == "other"
    assert counter.syncs[0].inner.startswith(__file__), counter.syncs
