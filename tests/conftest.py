"""Shared helpers: tiny configs composed through the real Hydra config tree, and mpt-run as a
user runs it (a subprocess) or in this process (for input that fails before any job runs)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from runner.cli import compose_job, main
from runner.errors import UserError

# A ResNet small enough for CPU tests, through the same code path as the real one.
TINY = ["model.width=0.125", "model.depth=[1,1,1,1]", "data.image_size=16", "data.num_train=256",
        "data.num_eval=64", "data.batch_size=8", "trainer.max_steps=4", "trainer.log_every=2",
        "trainer.warmup_steps=0", "trainer.timing_warmup_steps=1"]

# One thread per process: runs are bit-reproducible and parallel test processes do not fight.
ENV = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "PYTHONUNBUFFERED": "1",
       "OMP_NUM_THREADS": "1"}


def mpt_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "runner", *args]


def mpt_run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(mpt_command(*args), capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


@pytest.fixture
def tiny_cfg(tmp_path: Path):
    """compose(*overrides) -> a tiny run config writing under tmp_path."""
    def make(*overrides: str):
        return compose_job([*TINY, f"out_root={tmp_path}", *overrides])
    return make


@pytest.fixture
def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, list[str]]]:
    """run_main(*argv) -> (exit code, stderr lines) of mpt-run called in this process."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def call(*argv: str) -> tuple[int, list[str]]:
        monkeypatch.setattr(sys, "argv", ["mpt-run", *argv])
        with pytest.raises(SystemExit) as exit_:
            main()
        return exit_.value.code, capsys.readouterr().err.strip().splitlines()
    return call


def pytest_configure(config: pytest.Config) -> None:
    # tests/test_cuda.py: CUDA-only tests, skipped without a GPU; run them with `pytest -m cuda`.
    config.addinivalue_line("markers", "cuda: needs a CUDA device (tests/test_cuda.py); run with pytest -m cuda")


@contextmanager
def skip_if_cpu_lacks_kernel() -> Iterator[None]:
    """Some CPUs' oneDNN builds have no FP16/BF16 kernel for an op under autocast (LSTM on many):
    the engine then stops with a one-line UserError naming the modes that work, and a test of that
    mode on this CPU is skipped, saying so, instead of failing on the hardware."""
    try:
        yield
    except UserError as exc:
        if "oneDNN has no" not in str(exc):
            raise
        pytest.skip(str(exc))
