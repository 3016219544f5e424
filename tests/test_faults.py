"""Fault injection: a run that is killed, interrupted, started twice, resumed with another config,
rerun after it finished or fed bad input never loses work, never mixes two runs and never lies.

Real `python -m runner` processes on a tiny ResNet (12 steps, a checkpoint every 2), compared with
one uninterrupted run: final weights bit for bit, metrics.jsonl record for record (timing aside).
Input that fails before any job runs is checked in this process (the pre-flight is the same code).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from runner.rundir import RunLock
from tests.conftest import ENV, TINY, mpt_command, mpt_run

RUN = [*TINY, "trainer.max_steps=12", "trainer.checkpoint_every=2", "trainer.log_every=1", "trainer.eval_every=6"]
TIMING = ("samples_per_s",)  # differs between any two runs, interrupted or not


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(mpt_command(*RUN, f"out_dir={run_dir}", *extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def logged_step(run_dir: Path) -> int:
    """The last step metrics.jsonl shows (a record being written is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            pass
    return max(steps)


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 300
    while proc.poll() is None and logged_step(run_dir) < step and time.monotonic() < deadline:
        time.sleep(0.002)


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def assert_same_result(run_dir: Path, reference: Path) -> None:
    ours, theirs = weights(run_dir), weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert records(run_dir) == records(reference)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12


def snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime, except the lock (each holder writes its pid) and Hydra's
    appended job log."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in (".lock", "mpt.log")}


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run every faulty one must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = mpt_run(*RUN, f"out_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.fixture
def finished(reference: Path, tmp_path: Path) -> Path:
    """A copy of the finished reference run, to rerun or damage."""
    run_dir = tmp_path / "finished"
    shutil.copytree(reference, run_dir)
    return run_dir


def test_kill_9_at_random_points_then_rerun_matches_an_uninterrupted_run(reference, tmp_path):
    run_dir, rng, killed_at = tmp_path / "run", random.Random(), []
    for _ in range(2):
        proc = start(run_dir)
        # past what the previous segment logged, so its stale records cannot trigger the kill
        wait_for_step(run_dir, proc, logged_step(run_dir) + rng.randint(1, 4))
        proc.kill()
        proc.wait()
        killed_at.append(logged_step(run_dir))
    proc = mpt_run(*RUN, f"out_dir={run_dir}")
    assert proc.returncode == 0, (killed_at, proc.stderr)
    assert_same_result(run_dir, reference)


def test_sigterm_checkpoints_exits_143_with_one_line_then_rerun_matches(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for_step(run_dir, proc, 5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    line = one_line(stderr)
    stopped = re.fullmatch(r"mpt-run: interrupted by SIGTERM at step (\d+); checkpoint saved; "
                           r"rerun the same command to resume", line)
    assert stopped, line
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == int(stopped.group(1))
    rerun = mpt_run(*RUN, f"out_dir={run_dir}")
    assert rerun.returncode == 0, rerun.stderr
    assert_same_result(run_dir, reference)


def test_a_second_process_on_a_run_in_use_exits_2_naming_the_pid(finished):
    before = snapshot(finished)
    with RunLock(finished):  # what the first process holds for its lifetime; this one's pid is in it
        proc = mpt_run(*RUN, f"out_dir={finished}")
    assert proc.returncode == 2
    assert re.fullmatch(rf"mpt-run: error: run directory {finished} is in use by pid {os.getpid()} \(started .+\); "
                        r"wait for it or choose another out_dir", one_line(proc.stderr))
    assert snapshot(finished) == before


def test_resume_with_another_result_config_is_refused_and_touches_nothing(finished):
    before = snapshot(finished)
    proc = mpt_run(*RUN, "trainer.lr=0.05", "data.batch_size=4", "model.width=0.25", f"out_dir={finished}")
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert "data.batch_size, model.width, trainer.lr differ" in line and str(finished) in line, line
    assert snapshot(finished) == before


def test_a_finished_run_is_never_retrained_even_without_its_checkpoint(finished):
    before = snapshot(finished)
    proc = mpt_run(*RUN, f"out_dir={finished}")
    assert proc.returncode == 0, proc.stderr
    assert snapshot(finished) == before
    (finished / "checkpoint.pt").unlink()
    del before["checkpoint.pt"]
    proc = mpt_run(*RUN, f"out_dir={finished}")
    assert proc.returncode == 0, proc.stderr
    assert snapshot(finished) == before


def test_a_sweep_whose_jobs_collide_is_refused_before_any_job_runs(tmp_path, run_main):
    code, err = run_main("-m", *RUN, "seed=0,0", f"out_root={tmp_path}")
    assert code == 2 and len(err) == 1 and "job 1 (seed=0) and job 2 (seed=0) would both write" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [
    "trainer.max_step=5",      # unknown key
    "trainer.max_steps=abc",   # wrong type
    "trainer.lr=-1",           # bad range
    "device=cuda:abc",         # bad device
    "out_dir=/dev/null/run",   # unwritable output directory
])
def test_bad_input_exits_2_with_one_line_and_leaves_the_run_untouched(finished, run_main, bad):
    before = snapshot(finished)
    code, err = run_main(*RUN, f"out_dir={finished}", bad)
    assert code == 2 and len(err) == 1 and err[0].startswith("mpt-run: error: "), err
    assert snapshot(finished) == before


def test_a_corrupt_checkpoint_exits_2_with_one_line_and_is_left_untouched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    before = snapshot(run_dir)
    proc = mpt_run(*RUN, f"out_dir={run_dir}")
    assert proc.returncode == 2
    assert "checkpoint" in one_line(proc.stderr) and "unreadable" in proc.stderr
    assert snapshot(run_dir) == before
