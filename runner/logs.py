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

from runner.errors import UserError
from runner.rundir import atomic_write


def json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: write them as strings so a diverged run's log stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class JsonlLog:
    """An append-only JSON-lines file that a resumed run continues where its checkpoint left it.

    `offset()` is the byte length of what has been written (and synced); the checkpoint stores
    it, and `JsonlLog(path, offset)` cuts the file back to it with `os.truncate` before
    appending: records of steps after the checkpoint (which the resumed run logs again) and a
    damaged tail from a crash disappear without the file ever being read or rewritten."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        """Open at `offset` bytes: 0 starts a new log, a checkpoint's offset continues one."""
        if offset:
            size = path.stat().st_size if path.exists() else None
            if size is None or size < offset:
                found = "is missing" if size is None else f"has {size} bytes"
                raise UserError(f"{path} {found} but the checkpoint recorded {offset}; it was changed outside "
                                f"mpt: restore it, or start the run again in another out_dir")
        self.path = path
        self._file = open(path, "ab")
        os.truncate(path, offset)  # after open: a missing file has been created by then
        self._offset = offset

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(json_safe(record)) + "\n").encode("utf-8")
        self._file.write(data)
        self._file.flush()  # a killed process loses no record that was logged
        self._offset += len(data)

    def offset(self) -> int:
        """Bytes written so far, synced to disk: a checkpoint storing it never points past the file's end."""
        os.fsync(self._file.fileno())
        return self._offset

    def close(self) -> None:
        self._file.close()


class RunLogger:
    """metrics.jsonl and TensorBoard, opened where the run's checkpoint left them: `start_step`
    (TensorBoard drops later events of a crashed segment with purge_step) and `start_offset`
    (metrics.jsonl is cut back to it; the checkpoint stores `jsonl.offset()`). A new run passes 0 and 0."""

    def __init__(self, run_dir: Path, start_step: int, start_offset: int) -> None:
        self.run_dir = run_dir
        self.jsonl = JsonlLog(run_dir / "metrics.jsonl", start_offset)
        self.tb = SummaryWriter(log_dir=str(run_dir), purge_step=start_step + 1 if start_step else 0)

    def log(self, step: int, split: str, values: dict[str, Any]) -> None:
        self.jsonl.write({"step": step, "split": split, **values})
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()


def write_json_atomic(path: Path, obj: Any) -> None:
    """A JSON file that a crash never leaves half-written."""
    text = (json.dumps(json_safe(obj), indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(text))
