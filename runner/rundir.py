"""A run's directory: its name, its owner, its identity and how files in it are written.

Name: `<out_root>/<model>/<precision>[-<scale>]/[<k=v,k=v>/]seed<seed>`. The optional part
holds the job's command-line overrides that change the result and are not already in the
path (Hydra's `override_dirname` idea), so two jobs of one sweep that differ only in, say,
data.batch_size never share a directory. The same function names the directory for the
pre-flight, for Hydra's job directory and for `cfg.out_dir` (configs/config.yaml feeds it).

Owner: `RunLock` lets one process at a time write a run directory.
Identity: `result_config` is what a checkpoint records, so a resume with a different
configuration is refused by `config_differences` instead of silently mixing two runs.
Files: `atomic_write` replaces a file whole or not at all.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError

# Keys that never change what a run computes (where it writes, how often it logs, evaluates or
# checkpoints, whether it may resume): left out of the directory name and of result_config.
RESULT_NEUTRAL: tuple[str, ...] = (
    "out_root", "out_dir", "device",
    "trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "trainer.checkpoint_every",
    "trainer.checkpoint_minutes", "trainer.resume", "trainer.timing_warmup_steps",
)
IN_PATH: tuple[str, ...] = ("model", "precision", "scale", "seed")  # named by the path already
MAX_PART = 80  # a longer override part becomes a hash, so paths stay readable and short
_SAFE_PART = re.compile(r"[A-Za-z0-9._=+,-]+")  # no '/', spaces, quotes, brackets or shell globs


def _neutral(key: str) -> bool:
    return key in RESULT_NEUTRAL or key == "hydra" or key.startswith(("hydra.", "hydra/"))


def scale_suffix(scale: Any) -> str:
    """'' for scale none, else '-8', '-dynamic', ..."""
    return "" if str(scale) == "none" else f"-{scale}"


def override_part(overrides: Sequence[str]) -> str:
    """The directory level for a job's overrides: '' when none changes the result, else
    'k=v,k=v' (sorted), or 'overrides-<hash>' when that would be long or unsafe in a path."""
    last: dict[str, str] = {}  # a key given twice counts once, with its last value, as in a sweep
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if not (override.key_or_group in IN_PATH or _neutral(override.key_or_group)):
            last[override.get_key_element()] = override.get_value_element_as_str()
    if not last:
        return ""
    items = [f"{key}={value}" for key, value in last.items()]
    part = ",".join(sorted(items))
    if len(part) <= MAX_PART and _SAFE_PART.fullmatch(part):
        return part
    return "overrides-" + hashlib.sha256("\n".join(sorted(items)).encode()).hexdigest()[:12]


def run_dir(out_root: str, model: str, precision: str, scale: Any, seed: int, overrides: Sequence[str]) -> str:
    """The run directory of a job (configs/config.yaml's out_dir)."""
    part = override_part(overrides)
    return "/".join([str(out_root), str(model), f"{precision}{scale_suffix(scale)}",
                     *([part] if part else []), f"seed{seed}"])


# --- identity -------------------------------------------------------------------------------
def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = node  # lists and empty dicts are values: their presence is part of the config


def result_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as {dotted key: value}, without the keys that do not change the result.

    Stored in the checkpoint; plain Python values only, so weights_only loading accepts it."""
    flat: dict[str, Any] = {}
    _flatten(OmegaConf.to_container(cfg, resolve=True), "", flat)
    return {k: v for k, v in flat.items() if not _neutral(k)}


def config_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Sorted keys whose values differ; a key present on one side only differs too."""
    missing = object()
    return sorted(k for k in stored.keys() | current.keys() if stored.get(k, missing) != current.get(k, missing))


# --- files -----------------------------------------------------------------------------------
def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace `path` with what `write` writes, whole or not at all.

    The temporary name is unique per process, so two writers never share it; it is removed
    whatever goes wrong. A full disk is the user's to fix, so it is a UserError."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the file
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if _disk_full(exc):
            kept = f"the previous {path.name} is intact" if path.exists() else "nothing was written"
            raise UserError(f"disk full while writing {path}; {kept}; free space and rerun to resume") from None
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power cut


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_run_config(run_dir: Path, cfg: DictConfig, overrides: list[str]) -> None:
    """`<run_dir>/.hydra/config.yaml` (resolved) and `overrides.yaml`, written once: a resumed or
    finished run keeps the record of the command that started it."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    for name, node in (("config.yaml", cfg), ("overrides.yaml", OmegaConf.create(list(overrides)))):
        path = hydra_dir / name
        if not path.exists():
            text = OmegaConf.to_yaml(node, resolve=True).encode("utf-8")
            atomic_write(path, lambda f, text=text: f.write(text))


# --- ownership -------------------------------------------------------------------------------
class RunLock:
    """Exclusive, non-blocking `flock` on `<run_dir>/.lock` for a run's lifetime.

    The kernel drops the lock when the process dies (kill -9 included), so a stale lock file
    never blocks a rerun; the file is kept, as deleting it would let two processes lock two
    different files of the same name."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(f"run directory {self.run_dir} is in use by {holder}; "
                            f"wait for it or choose another out_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        return f"pid {holder['pid']} (started {holder['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"  # it has locked the file but not written its pid yet
