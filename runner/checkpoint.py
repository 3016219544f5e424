"""Full training state in one file, written atomically, read with weights_only=True."""
from __future__ import annotations

import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import torch

from runner.errors import UserError
from runner.rundir import atomic_write

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, state: dict[str, Any]) -> None:
    """Replace the checkpoint atomically: the previous one survives any crash or a full disk."""
    atomic_write(path, lambda f: torch.save(state, f))


def load(path: Path) -> dict[str, Any]:
    """The checkpoint's state dict, or a UserError that says why it cannot be used (it is left untouched)."""
    try:
        # Python's random state is a tuple of ints: allowed by weights_only.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message advises weights_only=False; for a file that is not mpt's that would run
        # whatever it holds, so only the unpickler's own finding is passed on.
        finding = _first_line(str(exc).rsplit("WeightsUnpickler error:", 1)[-1], exc)
        if finding.startswith("Unsupported global"):  # mpt writes tensors and plain values only
            raise UserError(f"checkpoint {path} holds Python objects, not only tensors: it is not an mpt "
                            f"checkpoint and cannot be loaded safely; it was left untouched: move it aside or "
                            f"choose another out_dir") from None
        raise _unreadable(path, finding) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as exc:
        raise _unreadable(path, _first_line(str(exc), exc)) from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} holds a {type(state).__name__}, not an mpt checkpoint; it was left "
                        f"untouched: move it aside or choose another out_dir")
    return state


def _first_line(text: str, exc: BaseException) -> str:
    return (text.strip().splitlines() or [type(exc).__name__])[0]


def _unreadable(path: Path, reason: str) -> UserError:
    return UserError(f"checkpoint {path} is unreadable ({reason}); it was left untouched: move it aside "
                     f"or pass trainer.resume=never with another out_dir")
