"""mpt-run as a user runs it: subprocess, overrides, sweeps, help, and every bad-input path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import TINY

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("HYDRA_FULL_ERROR", None)


def mpt_run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=600)


def test_run_as_subprocess_writes_a_run_dir(tmp_path):
    proc = mpt_run(*TINY, "precision=amp", f"out_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "resnet50" / "amp" / "seed0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"] == "amp" and summary["steps"] == 4
    assert (run_dir / ".hydra" / "overrides.yaml").exists() and (run_dir / ".hydra" / "config.yaml").exists()
    assert "top1=" in proc.stdout


def test_multirun_sweeps_precisions_into_aligned_run_dirs(tmp_path):
    proc = mpt_run("-m", *TINY, "trainer.max_steps=2", "precision=fp32,mp", "seed=0,1", f"out_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    found = sorted(str(p.parent.relative_to(tmp_path)) for p in tmp_path.rglob("summary.json"))
    assert found == ["resnet50/fp32/seed0", "resnet50/fp32/seed1", "resnet50/mp/seed0", "resnet50/mp/seed1"]


def test_help_lists_groups_and_options():
    proc = mpt_run("--help")
    assert proc.returncode == 0
    for word in ("model:", "precision:", "trainer:", "resnet50", "pseudo_fp16", "bf16_amp"):
        assert word in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["model=nope"], "unknown model 'nope'; choose one of: resnet50"),
    (["precision=fp8"], "unknown precision 'fp8'; choose one of: amp, bf16"),
    (["data=nope"], "unknown data 'nope'"),
    (["trainer.max_steps=abc"], "trainer.max_steps"),
    (["trainer.optimizer=lion"], "trainer.optimizer='lion'; choose one of"),
    (["model.width=wide"], "model.width"),
    (["model.colour=red"], "model.colour"),
    (["scale=8"], "precision=fp32 computes in FP32 and takes no loss scale"),
    (["precision=mp", "scale=0"], "must be a positive finite number"),
    (["precision=mp", "scale=-4"], "must be a positive finite number"),
    (["precision=mp", "scale=lots"], "is not a loss scale"),
    (["data=imagefolder", "data.root=/nonexistent/imagenet"], "data=synthetic_images"),
    (["out_root=/etc/passwd/x"], "cannot write to out_dir"),
    (["-m", "precision=fp32,nope"], "unknown precision 'nope'"),
    (["precision=mp", "scale=lognormal", "scaler.overflow_prob=0"], "scaler.overflow_prob=0.0 must be in (0, 1)"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 must be positive or null"),
    (["data.batch_size=0"], "data.batch_size=0"),
    (["model.depth=[1,1]"], "needs 4 stages"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    if not any(a.startswith("out_root") for a in args):
        args = [*args, f"out_root={tmp_path}"]
    proc = mpt_run(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("summary.json"))


def test_corrupt_checkpoint_is_reported_and_left_untouched(tmp_path):
    run_dir = tmp_path / "resnet50" / "fp32" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")
    proc = mpt_run(*TINY, f"out_root={tmp_path}")
    assert proc.returncode == 2
    assert "checkpoint" in proc.stderr and "unreadable" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert (run_dir / "checkpoint.pt").read_bytes() == b"not a checkpoint"


def test_imagefolder_data_trains_from_a_generated_tree(tmp_path):
    root = tmp_path / "imagenet"
    for split in ("train", "val"):
        for cls, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 30), colour).save(folder / f"{i}.jpg")
    model_only = [o for o in TINY if not o.startswith("data.")]
    proc = mpt_run(*model_only, "data=imagefolder", f"data.root={root}", "data.image_size=32", "data.batch_size=4",
                   "data.num_workers=0", f"out_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "resnet50" / "fp32" / "seed0" / "summary.json").read_text())
    assert summary["samples"] == 16 and summary["config"]["data"]["name"] == "imagefolder"
