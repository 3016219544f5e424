"""Engine overhead: mpt's training step vs a plain hand-written PyTorch loop.

Same model, same batches (pre-generated, already on the device), same precision,
in one process; the two loops alternate in rounds so machine noise hits both
alike, and the reported ratio is the median over rounds of
(engine time per step) / (plain time per step). Target: <= 1.05.

    python bench/bench_engine.py                        # tiny ResNet-50, fp32, CPU
    python bench/bench_engine.py --precision amp --scale dynamic
    python bench/bench_engine.py --width 1 --depth 3 4 6 3 --image-size 224 --batch 256   # on a GPU
    python bench/bench_engine.py --model biglstm        # the sequence row: quick_biglstm's LSTM LM

The biglstm row runs the task's own train_step in both loops (sampled softmax, carried
state, sparse embedding gradients); the plain loop hands it a context that does
backward + Adagrad step by hand, so only the engine's machinery differs.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_trainer, device_batches, device_label, engine_step, resnet_trainer, time_per_step  # noqa: E402


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


class PlainContext:
    """The hand-written loop's side of the step context: backward, step, no scaling or casting."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer, self.device = optimizer, device

    def cast(self, x):
        return x

    def fp32(self, *tensors):
        return contextlib.nullcontext(tensors[0] if len(tensors) == 1 else tensors)

    def optimize(self, loss: torch.Tensor, name: str = "main") -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def lstm_row(args: argparse.Namespace) -> tuple:
    """(engine Trainer, plain step, batches) for quick_biglstm's model in fp32."""
    engine = bench_trainer(["experiment=quick_biglstm", f"device={args.device}", "trainer.grad_clip=null"],
                           "/tmp/mpt-bench-engine-lstm")
    batches = device_batches(engine, args.steps)
    plain_model = engine.task.build_model().to(engine.device)
    plain_model.load_state_dict(engine.model.state_dict())
    ctx = PlainContext(torch.optim.Adagrad(plain_model.parameters(), lr=engine.t.lr,
                                           initial_accumulator_value=engine.t.initial_accumulator_value),
                       engine.device)
    return engine, (lambda batch: engine.task.train_step(plain_model, batch, ctx)), batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=["resnet50", "biglstm"])
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

    if args.model == "biglstm":
        if args.precision != "fp32":
            p.error("the biglstm row is fp32 only")
        engine, plain, batches = lstm_row(args)
        device = engine.device
    else:
        engine = resnet_trainer(args.precision, args.scale, args.width, args.depth, args.image_size, args.batch,
                                args.steps, args.device, "/tmp/mpt-bench-engine")
        device = engine.device
        batches = device_batches(engine, args.steps)
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
    shape = ("quick_biglstm LSTM LM (sampled softmax, sparse embedding)" if args.model == "biglstm" else
             f"ResNet-50 width={args.width} depth={args.depth} image={args.image_size} batch={args.batch}")
    print(f"device: {device_label(device)}; precision={args.precision} scale={args.scale}; {shape}; "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"engine step {statistics.median(engine_ms):.2f} ms, plain step {statistics.median(plain_ms):.2f} ms (medians)")
    print(f"engine/plain ratio: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
