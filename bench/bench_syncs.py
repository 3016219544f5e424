"""Host synchronisations per training iteration on CUDA, counted and attributed.

The engine's design allows one host sync per optimizer step: reading the overflow flag
(`found_inf.item()` in runner/step.py) to decide whether to skip. This counts every
synchronising CUDA call of an iteration with `torch.cuda.set_sync_debug_mode("warn")`
(each one warns "called a synchronizing CUDA operation"; torch documents that not every
sync is covered, e.g. torch.sparse ops) and attributes it to the innermost frame of this
project on the Python stack: runner/ (the engine), models/ or data/ (the task), with the
innermost frame overall (e.g. torch/nn/functional.py) beside it. The batch's transfer to
the device happens before the counted region, as in the engine's loop.

    python bench/bench_syncs.py                                         # every model, tiny, 4 modes
    python bench/bench_syncs.py --model resnet50 --size paper --modes fp32 mp amp bf16_amp

Prints, per model and mode: syncs per iteration, optimizer steps per iteration, the engine's
syncs that are not the overflow-flag read (the target: none), and where the task's syncs are.
tests/test_cuda.py uses `SyncCounter` for its assertions.
"""
from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_precision import MODELS, SIZES, base_overrides, scale_for  # noqa: E402
from common import bench_trainer, host_batches  # noqa: E402

from runner.engine import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROJECT_DIRS = ("runner", "models", "data")
SYNC_MESSAGE = "called a synchronizing CUDA operation"
ALLOWED = "found_inf.item()"  # the one sync per optimizer step the design allows (runner/step.py)


@dataclass(frozen=True)
class Sync:
    """Where one synchronising call came from."""

    owner: str   # "runner", "models", "data", or "other" (no project frame on the stack)
    where: str   # innermost project frame: path:line  source
    inner: str   # innermost frame overall: path:line

    @property
    def allowed(self) -> bool:
        return self.owner == "runner" and self.where.endswith(ALLOWED)


def _attribute(stack: list[traceback.FrameSummary]) -> Sync:
    inner = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "?"
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PROJECT_DIRS:
            rel = path.relative_to(ROOT)
            return Sync(rel.parts[0], f"{rel}:{frame.lineno}  {(frame.line or '').strip()}", inner)
    return Sync("other", "?", inner)


class SyncCounter:
    """Context manager: every synchronising CUDA call inside it becomes a `Sync` in `.syncs`.

    Other warnings pass through to the previous handler unchanged.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.syncs: list[Sync] = []

    def __enter__(self) -> "SyncCounter":
        torch.cuda.synchronize(self.device)  # work queued before the region is not counted
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")     # every occurrence, not once per code location
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(kind, exc, tb)

    def _record(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                file: Any = None, line: str | None = None) -> None:
        if SYNC_MESSAGE in str(message):
            # the stack minus warnings' own frames and this method
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            self.syncs.append(_attribute(stack))
        else:
            self._show(message, category, filename, lineno, file, line)

    def by_owner(self) -> Counter[str]:
        return Counter("allowed" if s.allowed else s.owner for s in self.syncs)


@dataclass
class IterationSyncs:
    """Syncs counted over some training iterations of one Trainer."""

    iterations: int
    optimizer_steps: int
    syncs: list[Sync] = field(default_factory=list)

    @property
    def allowed(self) -> int:
        return sum(s.allowed for s in self.syncs)

    def unexpected(self, owners: tuple[str, ...]) -> Counter[str]:
        return Counter(f"{s.where}  [{s.inner}]" for s in self.syncs if not s.allowed and s.owner in owners)


def count_iteration_syncs(trainer: Trainer, batches: list[dict[str, Any]], warmup: int = 2) -> IterationSyncs:
    """Run `warmup` uncounted iterations (lazy state, cuDNN autotuning), then count the syncs of
    one iteration per batch; the transfer to the device is outside the counted region."""
    for i in range(warmup):
        trainer.train_iteration(trainer.to_device(batches[i % len(batches)]), measure_memory=False)
        trainer.step += 1
    result = IterationSyncs(len(batches), 0)
    for host in batches:
        batch = trainer.to_device(host)
        with SyncCounter(trainer.device) as counter:
            trainer.train_iteration(batch, measure_memory=False)
        result.syncs += counter.syncs
        result.optimizer_steps += sum(slot.stepped for slot in trainer.slots.values())
        trainer.step += 1
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--modes", nargs="+", default=["fp32", "mp", "amp", "bf16"])
    p.add_argument("--scale", default="dynamic", help="loss scale of the FP16 modes (bf16 modes: none)")
    p.add_argument("--steps", type=int, default=4, help="counted iterations")
    p.add_argument("--out-root", default="/tmp/mpt-bench-syncs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_syncs: needs a CUDA device (set_sync_debug_mode counts CUDA synchronisations)", file=sys.stderr)
        sys.exit(2)
    args.experiment, args.paper_size, args.threads, args.set, args.device = None, False, 0, [], "cuda"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"size {args.size}; {args.steps} counted iterations after 2 warm-up iterations")
    print("| model | mode | scale | syncs/iter | optimizer steps/iter | overflow-flag reads | other engine syncs | task syncs |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.model:
        base = base_overrides(model, args)
        batches = None
        for mode in args.modes:
            scale = scale_for(mode, args.scale)
            trainer = bench_trainer([*base, f"precision={mode}", f"scale={scale}"], f"{args.out_root}/{model}/{mode}")
            batches = batches or host_batches(trainer, args.steps)
            r = count_iteration_syncs(trainer, batches)
            engine, task = r.unexpected(("runner",)), r.unexpected(("models", "data", "other"))
            fmt = lambda c: "; ".join(f"{n}x {w}" for w, n in c.most_common()) or "none"  # noqa: E731
            print(f"| {model} | {mode} | {scale} | {len(r.syncs) / r.iterations:.2f} | "
                  f"{r.optimizer_steps / r.iterations:.2f} | {r.allowed / r.iterations:.2f} | {fmt(engine)} | "
                  f"{fmt(task)} |", flush=True)
            del trainer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
