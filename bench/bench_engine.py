"""Engine overhead: mpt's training step vs a plain hand-written PyTorch loop.

Same model, same batches (pre-generated, already on the device), same precision,
in one process; the two loops alternate in rounds so machine noise hits both
alike, and the reported ratio is the median over rounds of
(engine time per step) / (plain time per step). Target: <= 1.05.

    python bench/bench_engine.py                        # tiny ResNet-50, fp32, CPU
    python bench/bench_engine.py --precision amp --scale dynamic
    python bench/bench_engine.py --width 1 --depth 3 4 6 3 --image-size 224 --batch 256   # on a GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_batches, device_label, engine_step, resnet_trainer, time_per_step  # noqa: E402


def plain_step_fn(model, opt, device: torch.device, precision: str, scaler: torch.amp.GradScaler | None):
    """The loop a user would write by hand (torch.amp recipe for amp)."""
    use_amp = precision == "amp"

    def step(batch) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=use_amp):
            loss = F.cross_entropy(model(batch["input"]), batch["target"])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="fp32", choices=["fp32", "amp"])
    p.add_argument("--scale", default="none")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--depth", type=int, nargs=4, default=[1, 1, 1, 1])
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    if args.precision == "fp32" and args.scale != "none":
        p.error("fp32 takes no loss scale")

    engine = resnet_trainer(args.precision, args.scale, args.width, args.depth, args.image_size, args.batch,
                            args.steps, args.device, "/tmp/mpt-bench-engine")
    device = engine.device
    batches = device_batches(engine, args.steps, args.batch)

    plain_model = engine.task.build_model().to(device)
    plain_model.load_state_dict(engine.model.state_dict())
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=engine.t.lr, momentum=engine.t.momentum)
    plain_scaler = torch.amp.GradScaler(device.type) if args.scale == "dynamic" else None
    plain = plain_step_fn(plain_model, plain_opt, device, args.precision, plain_scaler)

    ours = engine_step(engine)
    for step in (ours, plain):  # warm-up: allocator, cudnn autotune, lazy optimizer state
        time_per_step(step, batches[:3], device)
    ratios, engine_ms, plain_ms = [], [], []
    for _ in range(args.rounds):
        e = time_per_step(ours, batches, device)
        q = time_per_step(plain, batches, device)
        ratios.append(e / q)
        engine_ms.append(e * 1e3)
        plain_ms.append(q * 1e3)
    print(f"device: {device_label(device)}; precision={args.precision} scale={args.scale}; ResNet-50 width={args.width} "
          f"depth={args.depth} image={args.image_size} batch={args.batch}; {args.rounds} rounds x {args.steps} steps")
    print(f"engine step {statistics.median(engine_ms):.2f} ms, plain step {statistics.median(plain_ms):.2f} ms (medians)")
    print(f"engine/plain ratio: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
