"""Shared pieces of the benchmarks: a tiny-ResNet trainer and interleaved timing."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from runner.cli import compose_job
from runner.engine import Trainer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resnet_trainer(precision: str, scale: str, width: float, depth: list[int], image_size: int, batch: int,
                   steps: int, device: str, out_dir: str) -> Trainer:
    """A Trainer over the synthetic image set with exactly `steps` distinct training batches."""
    cfg = compose_job([
        f"precision={precision}", f"scale={scale}", f"model.width={width}",
        f"model.depth=[{','.join(map(str, depth))}]", f"data.image_size={image_size}",
        f"data.batch_size={batch}", f"data.num_train={batch * steps}", "data.num_eval=8",
        f"device={device}", "trainer.warmup_steps=0", "trainer.schedule=constant", "trainer.weight_decay=0",
        "trainer.resume=never", f"out_dir={out_dir}"])
    return Trainer(cfg)


def device_batches(trainer: Trainer, steps: int, batch: int) -> list[dict[str, Any]]:
    """Pre-generated batches, already on the device and cast: timing excludes data work."""
    ds = trainer.train_set
    return [trainer.to_device(trainer.task.collate([ds[i * batch + j] for j in range(batch)])) for i in range(steps)]


def engine_step(trainer: Trainer) -> Callable[[dict[str, Any]], None]:
    def step(batch: dict[str, Any]) -> None:
        trainer.train_iteration(batch, measure_memory=False)
        trainer.step += 1
    return step


def time_per_step(step: Callable[[Any], None], batches: list[Any], device: torch.device) -> float:
    """Seconds per step over `batches`, device-synchronised at both ends."""
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    sync(device)
    return (time.perf_counter() - t0) / len(batches)


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
