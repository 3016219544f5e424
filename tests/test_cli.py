"""mpt-run as a user runs it: subprocess runs, sweeps, help, run directories, config sources,
recipes, an installed copy, and every bad-input path (in this process where it fails before
any job runs, which is where the pre-flight catches it)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from runner import cli
from runner.cli import Command, compose_job, parse_command, user_message
from runner.errors import UserError
from runner.precision import POLICIES
from tests.conftest import ENV, TINY, mpt_run

def test_run_as_subprocess_writes_its_predicted_run_dir(tmp_path):
    args = [*TINY, "precision=amp", f"out_root={tmp_path}"]
    proc = mpt_run(*args)
    assert proc.returncode == 0, proc.stderr
    run_dir = Path(compose_job(args).out_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"] == "amp" and summary["steps"] == 4
    assert (run_dir / ".hydra" / "overrides.yaml").exists() and (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "mpt.log").exists()
    assert "top1=" in proc.stdout


def test_sweep_puts_every_job_in_its_predicted_directory(tmp_path):
    common = [*TINY, "trainer.max_steps=2", f"out_root={tmp_path}"]
    proc = mpt_run("-m", *common, "precision=fp32,mp", "data.batch_size=4,8")
    assert proc.returncode == 0, proc.stderr
    predicted = {compose_job([*common, f"precision={p}", f"data.batch_size={b}"]).out_dir
                 for p in ("fp32", "mp") for b in (4, 8)}
    found = {str(p.parent) for p in tmp_path.rglob("summary.json")}
    assert found == predicted and len(found) == 4


def test_submitit_local_sweep_runs_jobs_in_their_predicted_directories(tmp_path):
    """hydra/launcher=submitit_local (the cluster extra) runs the sweep as separate local jobs, after the
    same pre-flight (a colliding sweep is still refused up front) and with the same run directories."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    common = ["hydra/launcher=submitit_local", *TINY, "trainer.max_steps=2", "data.num_eval=16", f"out_root={tmp_path}"]
    refused = mpt_run("-m", *common, "trainer.log_every=1,2")
    assert refused.returncode == 2 and "would both write" in refused.stderr and not list(tmp_path.iterdir())
    proc = mpt_run("-m", *common, "seed=0,1")
    assert proc.returncode == 0, proc.stderr
    predicted = {compose_job([*TINY, "trainer.max_steps=2", "data.num_eval=16", f"out_root={tmp_path}",
                              f"seed={s}"]).out_dir for s in (0, 1)}
    found = {str(p.parent) for p in tmp_path.rglob("summary.json")}
    assert found == predicted
    assert len(list(tmp_path.glob("multirun/*/.submitit/*/*_log.out"))) == 2  # two jobs, each its own process


def test_result_neutral_keys_do_not_change_the_directory(tmp_path):
    base = compose_job([*TINY, f"out_root={tmp_path}"]).out_dir
    for neutral in ("trainer.log_every=1", "trainer.checkpoint_every=2", "device=cpu", "trainer.resume=never"):
        assert compose_job([*TINY, f"out_root={tmp_path}", neutral]).out_dir == base
    assert compose_job([*TINY, f"out_root={tmp_path}", "trainer.lr=0.05"]).out_dir != base


def test_help_lists_groups_options_and_the_config():
    proc = mpt_run("--help")
    assert proc.returncode == 0
    for word in ("model:", "precision:", "trainer:", "resnet50", "pseudo_fp16", "bf16_amp", "checkpoint_minutes"):
        assert word in proc.stdout


def test_precision_options_are_the_policies(run_main):
    code, err = run_main("precision=fp8")
    assert code == 2 and err == [f"mpt-run: error: unknown precision 'fp8'; choose one of: {', '.join(sorted(POLICIES))}"]


def test_every_model_has_its_own_recipe_and_the_command_line_wins():
    ssd = compose_job(["model=ssd"]).trainer
    assert (ssd.optimizer, ssd.momentum, ssd.lr, ssd.weight_decay, ssd.warmup_steps, ssd.grad_clip) == \
        ("sgd", 0.9, 0.01, 5e-4, 50, 10.0)
    resnet = compose_job([]).trainer
    assert (resnet.lr, resnet.weight_decay, resnet.warmup_steps, resnet.grad_clip) == (0.1, 1e-4, 10, None)
    paper = compose_job(["experiment=paper_ssd"]).trainer
    assert (paper.lr, paper.warmup_steps, paper.grad_clip) == (1e-3, 1000, None)  # experiments win over recipes
    assert compose_job(["model=ssd", "trainer.lr=0.05"]).trainer.lr == 0.05
    assert compose_job(["experiment=quick_ssd", "trainer.warmup_steps=7"]).trainer.warmup_steps == 7


def test_config_dir_and_config_name_are_honoured_by_the_preflight(tmp_path, run_main):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 3\n")
    (tmp_path / "myroot.yaml").write_text("defaults:\n  - config\n  - _self_\nseed: 5\n")
    command = parse_command(["--config-dir", str(tmp_path), "-cn", "myroot", "experiment=mine"])
    cli.preflight(command)
    cfg = compose_job(command.overrides, command)
    assert (cfg.trainer.max_steps, cfg.seed) == (3, 5)
    code, err = run_main("experiment=mine")  # without --config-dir it is unknown
    assert code == 2 and "unknown experiment 'mine'" in err[0]


BAD_INPUT = [
    (["model=nope"], "unknown model 'nope'; choose one of: "),
    (["data=nope"], "unknown data 'nope'"),
    (["trainer.max_steps=abc"], "bad config: trainer.max_steps=abc must be an integer"),
    (["trainer.max_step=5"], "bad config: unknown key trainer.max_step; did you mean trainer.max_steps?"),
    (["data.batch_sise=5"], "bad config: unknown key data.batch_sise; did you mean data.batch_size?"),
    (["sed=1"], "bad config: unknown key sed; did you mean seed?"),
    (["threads=0"], "bad config: threads=0 must be positive or null"),
    (["model.colour=red"], "bad config: unknown key model.colour; model has: name, width, depth"),
    (["trainer.optimizers.main.lr=1"], "trainer.optimizers has no key main yet; new keys need a leading +"),
    (["trainer.optimizer=lion"], "trainer.optimizer='lion'; choose one of"),
    (["model.width=wide"], "bad config: model.width=wide must be a number"),
    (["model.depth=3"], "bad config: model.depth must be a list, e.g. model.depth=[1,2]"),
    (["trainer.nesterov=maybe"], "bad config: trainer.nesterov=maybe must be true or false"),
    (["scale=8"], "precision=fp32 computes in FP32 and takes no loss scale"),
    (["precision=mp", "scale=0"], "must be a positive finite number"),
    (["precision=mp", "scale=-4"], "must be a positive finite number"),
    (["precision=mp", "scale=lots"], "is not a loss scale"),
    (["data=imagefolder", "data.root=/nonexistent/imagenet"], "data=synthetic_images"),
    (["precision=mp", "scale=lognormal", "scaler.overflow_prob=0"], "scaler.overflow_prob=0.0 must be in (0, 1)"),
    (["precision=mp", "scale=dynamic", "scaler.min_scale=8", "scaler.max_scale=2"],
     "scaler.min_scale=8.0 is above scaler.max_scale=2.0"),
    (["scaler.init_scale=inf"], "scaler.init_scale=inf must be positive"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 must be positive or null"),
    (["trainer.checkpoint_minutes=0"], "trainer.checkpoint_minutes=0.0 must be positive or null"),
    (["debug.nonfinite_steps=[0,3]"], "debug.nonfinite_steps=[0, 3] must be step numbers of 1 or more"),
    (["seed=-1"], "seed=-1 must be in [0, 2^32)"),
    (["data.batch_size=0"], "data.batch_size=0"),
    (["model.depth=[1,1]"], "needs 4 stages"),
    (["device=cuda:abc"], "device='cuda:abc'; use auto, cpu, cuda or cuda:N"),
    (["device=tpu"], "device='tpu'; use auto, cpu, cuda or cuda:N"),
    (["trainer.lr='0.1"], "cannot parse overrides"),
    (["-m", "precision=fp32,nope"], "unknown precision 'nope'"),
    (["-m", "seed=0,0"], "job 1 (seed=0) and job 2 (seed=0) would both write"),
    # a preset's hydra.sweeper.params are jobs too: checked before any job runs
    (["-m", "experiment=sweep_batch", 'hydra.sweeper.params.precision="fp32,bogus"'], "unknown precision 'bogus'"),
    (["-m", "trainer.log_every=5,10"], "job 1 (trainer.log_every=5) and job 2 (trainer.log_every=10) would both write"),
    (["--config-dir", "/nonexistent/configs"], "--config-dir /nonexistent/configs: no such directory"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(tmp_path, run_main, args, message):
    code, err = run_main(*args, f"out_root={tmp_path}")
    assert code == 2 and len(err) == 1 and message in err[0], err
    if "did you mean" in message:
        assert "+" not in err[0]  # a typo is fixed by the right name, not by adding a new key
    assert list(tmp_path.iterdir()) == []  # refused before anything was created


@pytest.mark.parametrize("key", ["out_dir", "hydra.run.dir"])
def test_unwritable_output_directory_exits_2_with_one_line(tmp_path, run_main, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = run_main(f"{key}={blocker}/run")
    assert code == 2 and err == [f"mpt-run: error: cannot write to out_dir {blocker}/run (Not a directory); "
                                 f"pass out_root=<a writable directory> or out_dir=<path>"]


def test_bad_input_in_a_real_process_is_one_line_without_traceback(tmp_path):
    proc = mpt_run("trainer.max_step=5", f"out_root={tmp_path}")
    assert proc.returncode == 2 and proc.stderr == ("mpt-run: error: bad config: unknown key trainer.max_step; "
                                                    "did you mean trainer.max_steps?\n")


def test_errors_that_are_not_the_users_keep_their_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(cli, "compose", broken)
    monkeypatch.setattr(sys, "argv", ["mpt-run"])
    with pytest.raises(ZeroDivisionError):
        cli.main()


def test_ctrl_c_before_the_run_exits_130_quietly(monkeypatch, capsys):
    def interrupted(command: Command) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "preflight", interrupted)
    monkeypatch.setattr(sys, "argv", ["mpt-run"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 130 and capsys.readouterr().err == ""


class Refusing(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        raise UserError("cannot read image x.jpg (truncated); replace or delete it")


def test_user_error_from_a_dataloader_worker_is_shown_as_its_own_message():
    with pytest.raises(UserError) as info:
        next(iter(DataLoader(Refusing(), num_workers=1)))
    assert "Original Traceback" in str(info.value)
    assert user_message(info.value) == "cannot read image x.jpg (truncated); replace or delete it"


def test_imagefolder_data_trains_from_a_generated_tree(tmp_path):
    root = tmp_path / "imagenet"
    for split in ("train", "val"):
        for cls, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 30), colour).save(folder / f"{i}.jpg")
    args = [*(o for o in TINY if not o.startswith("data.")), "data=imagefolder", f"data.root={root}",
            "data.image_size=32", "data.batch_size=4", "data.num_workers=0", f"out_root={tmp_path}"]
    proc = mpt_run(*args)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((Path(compose_job(args).out_dir) / "summary.json").read_text())
    assert summary["samples"] == 16 and summary["config"]["data"]["name"] == "imagefolder"


def test_an_installed_copy_finds_its_configs(tmp_path):
    """`pip install .` (not editable): the YAML tree ships as package data and is found from any directory."""
    source, site = tmp_path / "source", tmp_path / "site"
    root = Path(__file__).resolve().parents[1]
    for part in ("runner", "models", "data", "configs"):  # a copy, so the build leaves the checkout alone
        shutil.copytree(root / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", source)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, timeout=600)
    env = {**ENV, "PYTHONPATH": str(site)}
    code = "import runner, configs; print(runner.__file__); print(configs.__file__)"
    where = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    proc = subprocess.run([sys.executable, "-m", "runner", "model=ssd", "trainer.max_step=1"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 2 and "did you mean trainer.max_steps?" in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists()
