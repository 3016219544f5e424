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
import time

import torch
import torch.nn.functional as F

from runner.cli import compose_job
from runner.engine import Trainer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def time_steps(step, batches, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    sync(device)
    return (time.perf_counter() - t0) / len(batches)


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

    cfg = compose_job([
        f"precision={args.precision}", f"scale={args.scale}", f"model.width={args.width}",
        f"model.depth=[{','.join(map(str, args.depth))}]", f"data.image_size={args.image_size}",
        f"data.batch_size={args.batch}", f"data.num_train={args.batch * args.steps}", "data.num_eval=8",
        f"device={args.device}", "trainer.warmup_steps=0", "trainer.schedule=constant", "trainer.weight_decay=0",
        "trainer.resume=never", "out_dir=/tmp/mpt-bench-engine"])
    engine = Trainer(cfg)
    device = engine.device
    batches = [engine.to_device(engine.task.collate([engine.train_set[i * args.batch + j] for j in range(args.batch)]))
               for i in range(args.steps)]

    plain_model = engine.task.build_model().to(device)
    plain_model.load_state_dict(engine.model.state_dict())
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=cfg.trainer.lr, momentum=cfg.trainer.momentum)
    plain_scaler = torch.amp.GradScaler(device.type) if args.scale == "dynamic" else None
    plain = plain_step_fn(plain_model, plain_opt, device, args.precision, plain_scaler)

    def engine_step(batch) -> None:
        engine.train_iteration(batch, record_activations=False)
        engine.step += 1

    for step in (engine_step, plain):  # warm-up: allocator, cudnn autotune, lazy optimizer state
        time_steps(step, batches[:3], device)
    ratios, engine_ms, plain_ms = [], [], []
    for _ in range(args.rounds):
        e = time_steps(engine_step, batches, device)
        q = time_steps(plain, batches, device)
        ratios.append(e / q)
        engine_ms.append(e * 1e3)
        plain_ms.append(q * 1e3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device: {name}; precision={args.precision} scale={args.scale}; ResNet-50 width={args.width} "
          f"depth={args.depth} image={args.image_size} batch={args.batch}; {args.rounds} rounds x {args.steps} steps")
    print(f"engine step {statistics.median(engine_ms):.2f} ms, plain step {statistics.median(plain_ms):.2f} ms (medians)")
    print(f"engine/plain ratio: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
