"""Per-step time and memory of precision modes on the same model, in one process.

Each mode gets its own Trainer over identical batches; modes are timed in
interleaved rounds (fp32, mp, amp, fp32, mp, amp, ...) and the medians are
compared with fp32, so machine noise hits every mode alike. Activation bytes
(saved for backward) are measured on one step per mode; on a GPU the allocator's
peak over the timed steps is reported too.

    python bench/bench_precision.py                                  # tiny ResNet-50 on this CPU
    python bench/bench_precision.py --modes fp32 tf32 mp amp --width 1 --depth 3 4 6 3 \\
        --image-size 224 --batch 256 --steps 20 --rounds 3          # the paper's ResNet-50 on a GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_batches, device_label, engine_step, resnet_trainer, time_per_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["fp32", "mp", "amp"])
    p.add_argument("--scale", default="dynamic", help="loss scale for the reduced modes")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--depth", type=int, nargs=4, default=[1, 1, 1, 1])
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="auto")
    args = p.parse_args()

    trainers, batches, activation = {}, {}, {}
    for mode in args.modes:
        scale = "none" if mode in ("fp32", "tf32") else args.scale
        t = resnet_trainer(mode, scale, args.width, args.depth, args.image_size, args.batch, args.steps,
                           args.device, f"/tmp/mpt-bench-precision/{mode}")
        trainers[mode], batches[mode] = t, device_batches(t, args.steps, args.batch)
        t.train_iteration(batches[mode][0], measure_memory=True)  # also warms up
        activation[mode] = t.activation_bytes
    device = next(iter(trainers.values())).device

    times: dict[str, list[float]] = {m: [] for m in args.modes}
    peaks: dict[str, int] = {}
    for _ in range(args.rounds):
        for mode, t in trainers.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[mode].append(time_per_step(engine_step(t), batches[mode], device) * 1e3)
            if device.type == "cuda":
                peaks[mode] = max(peaks.get(mode, 0), torch.cuda.max_memory_allocated(device))

    base = statistics.median(times[args.modes[0]])
    print(f"device: {device_label(device)}; ResNet-50 width={args.width} depth={args.depth} "
          f"image={args.image_size} batch={args.batch}; scale={args.scale}; {args.rounds} rounds x {args.steps} steps")
    print(f"| mode | step ms (median) | speed-up vs {args.modes[0]} | activation MiB | act. ratio | peak GPU MiB |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        ms = statistics.median(times[mode])
        peak = f"{peaks[mode] / 2**20:.0f}" if mode in peaks else "–"
        print(f"| {mode} | {ms:.1f} | {base / ms:.2f}x | {activation[mode] / 2**20:.1f} | "
              f"{activation[mode] / activation[args.modes[0]]:.2f} | {peak} |")


if __name__ == "__main__":
    main()
