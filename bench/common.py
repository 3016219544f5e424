"""Shared pieces of the benchmarks: Trainers composed like `mpt-run`, the engine's own batches, timing."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from runner.cli import compose_job
from runner.engine import Trainer
from runner.loader import train_batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resnet_trainer(precision: str, scale: str, width: float, depth: list[int], image_size: int, batch: int,
                   steps: int, device: str, out_dir: str) -> Trainer:
    """A Trainer over the synthetic image set with exactly `steps` distinct training batches."""
    return bench_trainer([
        f"precision={precision}", f"scale={scale}", f"model.width={width}",
        f"model.depth=[{','.join(map(str, depth))}]", f"data.image_size={image_size}",
        f"data.batch_size={batch}", f"data.num_train={batch * steps}", "data.num_eval=8",
        f"device={device}", "trainer.warmup_steps=0", "trainer.schedule=constant", "trainer.weight_decay=0"],
        out_dir)


def bench_trainer(overrides: list[str], out_dir: str) -> Trainer:
    """A Trainer composed exactly as `mpt-run <overrides>` would be, writing (nothing much) under out_dir."""
    return Trainer(compose_job([*overrides, "trainer.resume=never", f"out_dir={out_dir}"]))


def host_batches(trainer: Trainer, steps: int) -> list[dict[str, Any]]:
    """The first `steps` training batches of the engine's own stream (the task's epoch plan and
    collate, seeded like a run), on the host: the same batches for every precision mode."""
    stream = train_batches(trainer.train_set, trainer.epoch_plan, 0, trainer.task.collate, trainer.root.seed, 0,
                           trainer.task.reset_state)
    return [next(stream) for _ in range(steps)]


def device_batches(trainer: Trainer, steps: int) -> list[dict[str, Any]]:
    """Pre-generated batches, already on the device and cast: timing excludes data work."""
    return [trainer.to_device(b) for b in host_batches(trainer, steps)]


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
