"""Run identity and file safety: directory names, result configs, the run lock, atomic writes,
append-only logs, graceful interruption and checkpoint loading."""
from __future__ import annotations

import errno
import json
import os
import signal
import threading

import pytest
import torch
from omegaconf import OmegaConf

from runner import checkpoint
from runner.cli import compose_job
from runner.errors import UserError
from runner.interrupt import GracefulInterrupt
from runner.logs import JsonlLog, RunLogger, write_json_atomic
from runner.rundir import (RunLock, atomic_write, config_differences, override_part, result_config, run_dir,
                           write_run_config)


# --- directory names -------------------------------------------------------------------------
def test_override_part_names_result_changing_overrides_sorted():
    assert override_part([]) == ""
    assert override_part(["trainer.lr=0.05", "data.batch_size=16"]) == "data.batch_size=16,trainer.lr=0.05"
    assert override_part(["experiment=quick_ssd"]) == "experiment=quick_ssd"
    assert override_part(["+trainer.optimizers.main.lr=1"]) == "+trainer.optimizers.main.lr=1"
    assert override_part(["data.batch_size=8", "data.batch_size=16"]) == "data.batch_size=16"  # the last one counts


@pytest.mark.parametrize("override", [
    "out_root=/tmp/x", "out_dir=/tmp/x", "device=cpu", "trainer.log_every=5", "trainer.eval_every=5",
    "trainer.eval_batches=2", "trainer.checkpoint_every=2", "trainer.checkpoint_minutes=5", "trainer.resume=never",
    "trainer.timing_warmup_steps=3", "hydra.verbose=true", "model=ssd", "precision=mp", "scale=8", "seed=3",
])
def test_keys_that_do_not_change_the_result_or_are_in_the_path_add_nothing(override):
    assert override_part([override]) == ""


@pytest.mark.parametrize("overrides", [
    ["data.root=/data/imagenet"],                       # '/' would make a directory level
    ["model.depth=[1,1,1,1]"],                          # brackets and commas inside a value
    ["data.root='a b'"],                                # quotes and a space
    ["data.batch_size=16", "data.num_train=512", "trainer.lr=0.05", "trainer.weight_decay=0.0005",
     "trainer.warmup_steps=50"],                        # longer than 80 characters
])
def test_long_or_unsafe_parts_become_a_stable_hash(overrides):
    part = override_part(overrides)
    assert part.startswith("overrides-") and len(part) == len("overrides-") + 12
    assert part == override_part(list(reversed(overrides)))  # order on the command line does not matter


def test_run_dir_layout():
    assert run_dir("outputs", "resnet50", "mp", "dynamic", 1, []) == "outputs/resnet50/mp-dynamic/seed1"
    assert run_dir("o", "ssd", "fp32", "none", 0, ["trainer.lr=0.01", "seed=0"]) == "o/ssd/fp32/trainer.lr=0.01/seed0"


def test_composed_configs_get_the_directory_of_their_overrides(tmp_path):
    base = compose_job([f"out_root={tmp_path}"]).out_dir
    assert base == f"{tmp_path}/resnet50/fp32/seed0"
    assert compose_job([f"out_root={tmp_path}", "trainer.log_every=3", "seed=0"]).out_dir == base
    assert compose_job([f"out_root={tmp_path}", "data.batch_size=8"]).out_dir == \
        f"{tmp_path}/resnet50/fp32/data.batch_size=8/seed0"
    assert compose_job(["out_dir=/elsewhere", "data.batch_size=8"]).out_dir == "/elsewhere"


# --- identity ----------------------------------------------------------------------------------
def test_result_config_is_flat_plain_and_without_neutral_keys(tiny_cfg, tmp_path):
    flat = result_config(tiny_cfg())
    assert flat["trainer.lr"] == 0.1 and flat["model.depth"] == [1, 1, 1, 1] and flat["seed"] == 0
    assert flat["trainer.optimizers"] == {} and flat["debug.nonfinite_steps"] == []
    assert not {"out_dir", "out_root", "device", "trainer.log_every", "trainer.resume"} & flat.keys()
    assert not any(k.startswith("hydra") for k in flat)
    torch.save({"config": flat}, tmp_path / "c.pt")  # a checkpoint holds it and loads with weights_only
    assert torch.load(tmp_path / "c.pt", weights_only=True)["config"] == flat


def test_config_differences_names_changed_added_and_removed_keys(tiny_cfg):
    stored = result_config(tiny_cfg())
    assert config_differences(stored, result_config(tiny_cfg("trainer.log_every=7", "device=cpu"))) == []
    changed = result_config(tiny_cfg("trainer.lr=0.05", "data.batch_size=4", "model.width=0.25"))
    assert config_differences(stored, changed) == ["data.batch_size", "model.width", "trainer.lr"]
    assert config_differences({"a": 1, "b": None}, {"a": 1, "c": None}) == ["b", "c"]


# --- the lock ----------------------------------------------------------------------------------
def test_run_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    with RunLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(UserError, match=rf"run directory {tmp_path} is in use by pid {os.getpid()} "
                                            r"\(started .+\); wait for it or choose another out_dir"):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):  # released on exit; the lock file stays
        pass


# --- files -------------------------------------------------------------------------------------
def test_write_run_config_writes_once(tiny_cfg, tmp_path):
    write_run_config(tmp_path, tiny_cfg(), ["trainer.lr=0.1"])
    config = (tmp_path / ".hydra" / "config.yaml").read_bytes()
    assert OmegaConf.load(tmp_path / ".hydra" / "overrides.yaml") == ["trainer.lr=0.1"]
    assert OmegaConf.load(tmp_path / ".hydra" / "config.yaml").trainer.lr == 0.1
    write_run_config(tmp_path, tiny_cfg("trainer.lr=0.5"), ["trainer.lr=0.5"])
    assert (tmp_path / ".hydra" / "config.yaml").read_bytes() == config
    assert OmegaConf.load(tmp_path / ".hydra" / "overrides.yaml") == ["trainer.lr=0.1"]


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"one"))
    atomic_write(path, lambda f: f.write(b"two"))
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["f.bin"]


def _full_disk(f):
    f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / checkpoint.CHECKPOINT_NAME
    checkpoint.save(path, {"step": 1})
    before = path.read_bytes()
    monkeypatch.setattr(torch, "save", lambda state, f: _full_disk(f))
    with pytest.raises(UserError, match=f"disk full while writing {path}; the previous checkpoint.pt is intact; "
                                        f"free space and rerun to resume"):
        checkpoint.save(path, {"step": 2})
    assert path.read_bytes() == before and os.listdir(tmp_path) == [checkpoint.CHECKPOINT_NAME]


def test_full_disk_on_a_new_json_file_and_other_errors_leave_nothing(tmp_path):
    with pytest.raises(UserError, match="nothing was written"):
        atomic_write(tmp_path / "summary.json", _full_disk)
    with pytest.raises(ZeroDivisionError):  # not the user's fault: the error itself, untouched
        atomic_write(tmp_path / "summary.json", lambda f: 1 / 0)
    assert os.listdir(tmp_path) == []


def test_json_files_keep_non_finite_numbers_as_strings(tmp_path):
    write_json_atomic(tmp_path / "s.json", {"loss": float("nan"), "scale": float("inf")})
    assert json.loads((tmp_path / "s.json").read_text()) == {"loss": "nan", "scale": "inf"}


# --- append-only logs --------------------------------------------------------------------------
def test_jsonl_log_resumes_at_an_offset_and_drops_what_came_after(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = JsonlLog(path)
    log.write({"step": 1, "loss": float("inf")})
    kept = log.offset()
    assert kept == path.stat().st_size
    log.write({"step": 2})
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"step": 3, "lo')  # a crash in the middle of a record
    log = JsonlLog(path, kept)
    log.write({"step": 2, "again": True})
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == \
        [{"step": 1, "loss": "inf"}, {"step": 2, "again": True}]


def test_jsonl_log_starts_over_at_offset_zero(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 9}\n')  # a run killed before its first checkpoint
    JsonlLog(path).close()
    assert path.read_bytes() == b""


@pytest.mark.parametrize("content,found", [(None, "is missing"), (b"{}\n", "has 3 bytes")])
def test_jsonl_log_shorter_than_the_checkpoint_says_is_a_user_error(tmp_path, content, found):
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=f"{path} {found} but the checkpoint recorded 100"):
        JsonlLog(path, 100)
    assert (path.read_bytes() if path.exists() else None) == content


def test_run_logger_continues_metrics_at_its_offset(tmp_path):
    logger = RunLogger(tmp_path, 0, 0)
    logger.log(1, "train", {"loss": 1.0})
    offset = logger.jsonl.offset()
    logger.log(2, "train", {"loss": 2.0})
    logger.close()
    logger = RunLogger(tmp_path, 1, offset)
    logger.log(2, "train", {"loss": 3.0})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "split": "train", "loss": 1.0}, {"step": 2, "split": "train", "loss": 3.0}]


# --- checkpoints -------------------------------------------------------------------------------
class Payload:
    """Not a tensor or plain value: what weights_only refuses."""


@pytest.mark.parametrize("content,message", [
    (lambda p: torch.save({"x": Payload()}, p), "holds Python objects, not only tensors: it is not an mpt "
                                                "checkpoint and cannot be loaded safely"),
    (lambda p: torch.save(torch.zeros(2), p), "holds a Tensor, not an mpt checkpoint"),
    (lambda p: p.write_bytes(b"garbage"), "is unreadable"),
])
def test_checkpoints_that_cannot_be_used_are_user_errors(tmp_path, content, message):
    path = tmp_path / checkpoint.CHECKPOINT_NAME
    content(path)
    before = path.read_bytes()
    with pytest.raises(UserError) as info:
        checkpoint.load(path)
    assert message in str(info.value) and "weights_only" not in str(info.value)
    assert len(str(info.value).splitlines()) == 1 and path.read_bytes() == before


# --- interruption ------------------------------------------------------------------------------
def test_first_signal_sets_a_flag_second_exits(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with GracefulInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupt.requested == "SIGTERM" and interrupt.exit_code == 143
        with pytest.raises(SystemExit) as second:
            os.kill(os.getpid(), signal.SIGINT)
        assert second.value.code == 130
        with pytest.raises(SystemExit) as stopped:
            interrupt.stop(7)
    assert stopped.value.code == 143
    assert capsys.readouterr().err == ("mpt-run: interrupted by SIGTERM at step 7; checkpoint saved; "
                                       "rerun the same command to resume\n")
    assert signal.getsignal(signal.SIGTERM) is before


def test_interrupt_outside_the_main_thread_changes_nothing():
    seen = []

    def body() -> None:
        with GracefulInterrupt() as interrupt:
            seen.append((signal.getsignal(signal.SIGINT), interrupt.requested))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(signal.getsignal(signal.SIGINT), None)]
