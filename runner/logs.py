"""Every logged value goes to two places with the same names: metrics.jsonl and TensorBoard.

Tags are `<split>/<key>` (train/loss, train/lr, train/samples_per_s,
train/loss_scale, train/skipped_steps, eval/top1, ...), identical for every
precision, so runs overlay in TensorBoard.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter


def json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: write them as strings so a diverged run's log stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class RunLogger:
    """Opens the run's logs at `start_step`: records a crashed run logged after its last
    checkpoint are dropped (the resumed run logs those steps again), in both sinks."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if start_step and json.loads(line)["step"] <= start_step] if path.exists() else []
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self.tb = SummaryWriter(log_dir=str(run_dir), purge_step=start_step + 1 if start_step else 0)
        self._jsonl = open(path, "a", encoding="utf-8")

    def log(self, step: int, split: str, values: dict[str, Any]) -> None:
        record = {"step": step, "split": split, **values}
        self._jsonl.write(json.dumps(json_safe(record)) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        self._jsonl.close()
        self.tb.close()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write to a temporary file and rename, so a crash never leaves a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(json_safe(obj), indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
