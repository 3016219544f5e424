"""What gradient statistics cost: step time with stats off, on but not sampled, and on a sampled step.

One process, one model, one batch; the three conditions are interleaved in a
shuffled order every repetition so machine noise hits them alike, and each is
compared with the "off" step of the same repetition (median of the paired
ratios). On CPU the process's CPU time is reported next to wall time: on a
shared machine it is far less disturbed by other processes. Also times the
collector's own calls on a non-sampled step in isolation, which is all that
"on but not sampled" adds over "off".

    python bench/bench_stats.py                     # tiny ResNet, mp, CPU if no GPU
    python bench/bench_stats.py --width 1 --depth 3,4,6,3 --image-size 224 --batch-size 64 --device cuda
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import timeit

import torch
from torch.utils.tensorboard import SummaryWriter

from runner.cli import compose_job
from runner.engine import Trainer
from runner.gradstats import GradStats, StatsConfig
from runner.loader import train_batches

CONDITIONS = ("off", "on, not sampled", "on, sampled")


def build(args: argparse.Namespace, out_root: str) -> Trainer:
    return Trainer(compose_job([
        f"model.width={args.width}", f"model.depth=[{args.depth}]", f"data.image_size={args.image_size}",
        f"data.batch_size={args.batch_size}", f"data.num_train={4 * args.batch_size}", "data.num_eval=64",
        f"precision={args.precision}", f"scale={args.scale}", f"device={args.device}", f"out_root={out_root}"]))


def time_iteration(trainer: Trainer, batch: dict, step: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one training iteration at `step`."""
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    trainer.step = step
    sync()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    trainer.train_iteration(batch, measure_memory=False)
    sync()
    return (time.perf_counter() - wall0) * 1e3, (time.process_time() - cpu0) * 1e3


def collector_call_us(trainer: Trainer, collector: GradStats) -> float:
    """The four collector calls of one non-sampled step, in microseconds."""
    slot = trainer.slots["main"]
    bound, opt = slot.params, slot.optimizer

    def calls() -> None:  # step 2: not sampled (steps 1, 1 + every, ... are)
        collector.begin(2)
        collector.weight_grads(bound)
        with collector.measure_update(bound, opt):
            pass
        collector.end(2, slot.scaler.scale)

    n = 20000
    return min(timeit.repeat(calls, number=n, repeat=5)) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="mp")
    parser.add_argument("--scale", default="8")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--depth", default="1,1,1,1")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as out_root:
        trainer = build(args, out_root)
        batch = trainer.to_device(next(train_batches(trainer.train_set, trainer.epoch_plan, 0,
                                                     trainer.task.collate, 0, 0, lambda: None)))
        off = GradStats(StatsConfig(enabled=False), trainer.model, trainer.run_dir, trainer.policy.low_dtype)
        on = GradStats(StatsConfig(enabled=True, every=2), trainer.model, trainer.run_dir, trainer.policy.low_dtype)
        writer = SummaryWriter(out_root)
        on.open(writer)
        # trainer.step is the number of steps done: step 0 runs step 1, which every=2 samples
        setups = {"off": (off, 1), "on, not sampled": (on, 1), "on, sampled": (on, 0)}
        times: dict[str, list[tuple[float, float]]] = {c: [] for c in CONDITIONS}
        order = list(CONDITIONS)
        for rep in range(args.warmup + args.reps):
            random.shuffle(order)
            for cond in order:
                collector, step = setups[cond]
                trainer.stats = trainer.ctx.stats = collector
                measured = time_iteration(trainer, batch, step)
                if rep >= args.warmup:
                    times[cond].append(measured)
        call_us = collector_call_us(trainer, on)
        on.close()
        writer.close()

    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"device: {trainer.device.type} ({torch.get_num_threads()} threads); precision={args.precision} "
          f"scale={args.scale}; ResNet width={args.width} depth=[{args.depth}] ({params / 1e6:.2f}M params); "
          f"batch {args.batch_size} x {args.image_size}x{args.image_size}; {args.reps} interleaved repetitions")
    for clock, i in (("wall", 0), ("cpu", 1)):
        base = [t[i] for t in times["off"]]
        for cond in CONDITIONS:
            t = [x[i] for x in times[cond]]
            q = statistics.quantiles(t, n=4)
            paired = statistics.median(a / b for a, b in zip(t, base))
            print(f"  {clock:4s} {cond:16s} median {statistics.median(t):8.2f} ms (IQR {q[0]:.2f}-{q[2]:.2f})  "
                  f"paired vs off {100 * (paired - 1):+6.1f}%")
    print(f"  collector calls on a non-sampled step: {call_us:.2f} us "
          f"({100 * call_us / 1e3 / statistics.median(t[0] for t in times['off']):.5f}% of a step)")


if __name__ == "__main__":
    main()
