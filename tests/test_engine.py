"""The shared engine end to end on tiny ResNets: learning, outputs, skips, resume, all modes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runner.engine import Trainer, train

SUMMARY_KEYS = {"model", "precision", "scale", "device", "device_name", "torch_version", "steps", "samples",
                "metric_name", "metric", "metrics", "samples_per_s", "step_time_ms_p50", "step_time_ms_p90",
                "memory", "skipped_steps", "diverged", "wall_s", "oom", "world_size", "machine"}
MEMORY_KEYS = {"peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes", "param_bytes", "grad_bytes",
               "optimizer_state_bytes", "master_weight_bytes", "activation_bytes"}


def records(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_learns_the_synthetic_set_above_chance(tiny_cfg):
    summary = train(tiny_cfg("model.width=0.25", "data.image_size=32", "data.batch_size=32",
                             "data.num_train=2048", "trainer.max_steps=60", "trainer.log_every=10",
                             "trainer.warmup_steps=5"))
    losses = [r["loss"] for r in records(Path(summary["run_dir"]), "train")]
    assert losses[-1] < 0.8 * losses[0]
    assert summary["metric"] > 25.0  # chance is 10% on 10 classes


def test_outputs_carry_the_contract(tiny_cfg):
    summary = train(tiny_cfg("precision=mp", "scale=dynamic"))
    run_dir = Path(summary["run_dir"])
    # <model>/<precision>-<scale>/<the tiny overrides, hashed: too long for a name>/seed<seed>
    assert run_dir.parts[-4:-2] == ("resnet50", "mp-dynamic") and run_dir.parts[-1] == "seed0"
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= on_disk.keys() and MEMORY_KEYS <= on_disk["memory"].keys()
    assert on_disk["metric_name"] == "top1" and on_disk["metric"] == on_disk["metrics"]["top1"]
    assert on_disk["oom"] is False and on_disk["world_size"] == 1
    assert on_disk["memory"]["peak_allocated_bytes"] is None  # CPU
    masters = torch.load(run_dir / "checkpoint.pt", weights_only=True)["slots"]["main"]["master"]
    assert on_disk["memory"]["master_weight_bytes"] == sum(4 * m.numel() for m in masters)
    for r in records(run_dir, "train"):
        assert {"step", "loss", "lr", "samples_per_s", "loss_scale", "overflow", "skipped_steps"} <= r.keys()
    assert records(run_dir, "eval")[-1]["top1"] == on_disk["metric"]
    assert (run_dir / "checkpoint.pt").exists()


def test_tensorboard_has_the_same_tags_for_every_precision(tiny_cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = []
    for precision in ("fp32", "amp"):
        run_dir = Path(train(tiny_cfg(f"precision={precision}"))["run_dir"])
        acc = EventAccumulator(str(run_dir))
        acc.Reload()
        tags.append(set(acc.Tags()["scalars"]))
    assert tags[0] == tags[1]
    assert {"train/resnet50/loss", "train/resnet50/lr", "train/resnet50/samples_per_s", "train/resnet50/loss_scale",
            "train/resnet50/skipped_steps", "eval/resnet50/top1", "eval/resnet50/top5"} <= tags[0]


def test_thread_count_is_applied_recorded_and_bit_reproducible(tiny_cfg, tmp_path):
    previous = torch.get_num_threads()
    try:
        first = train(tiny_cfg("threads=1", f"out_dir={tmp_path}/a"))
        assert torch.get_num_threads() == 1 and first["threads"] == 1
        assert first["result_config"]["threads"] == 1  # it changes the numbers, so it names the result
        second = train(tiny_cfg("threads=1", f"out_dir={tmp_path}/b"))
    finally:
        torch.set_num_threads(previous)
    # the same command twice: bit-identical losses and metric (issue 14: same seed, same result)
    assert records(tmp_path / "a", "train") == [
        {**r, "samples_per_s": a["samples_per_s"]} for r, a in zip(records(tmp_path / "b", "train"),
                                                                   records(tmp_path / "a", "train"))]
    assert first["metric"] == second["metric"]


def test_skipped_step_changes_no_weight_optimizer_state_or_schedule(tiny_cfg, tmp_path):
    """Steps 1, 2 then an injected overflow at step 3 == steps 1, 2 alone, bit for bit."""
    common = ("precision=mp", "scale=64", "trainer.schedule=cosine", "trainer.max_steps=3")
    skipped = Trainer(tiny_cfg(*common, "debug.nonfinite_steps=[3]", f"out_dir={tmp_path / 'skip'}"))
    skipped.run()
    reference = Trainer(tiny_cfg(*common, f"out_dir={tmp_path / 'ref'}"))
    reference.total_steps = 2
    reference.run()
    a, b = skipped.slots["main"], reference.slots["main"]
    assert a.skipped_steps == 1 and b.skipped_steps == 0
    for x, y in zip(a.params.master_params, b.params.master_params):
        assert torch.equal(x, y)
    for x, y in zip(skipped.model.parameters(), reference.model.parameters()):
        assert torch.equal(x, y)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["momentum_buffer"], sb[k]["momentum_buffer"]) for k in sa)
    assert a.scheduler.last_epoch == b.scheduler.last_epoch == 2


def test_resume_reproduces_the_uninterrupted_scale_trajectory(tiny_cfg, tmp_path):
    common = ("precision=mp", "scale=dynamic", "scaler.init_scale=1024", "scaler.growth_interval=2",
              "debug.nonfinite_steps=[2,6]", "trainer.schedule=constant", "trainer.log_every=1")
    whole = train(tiny_cfg(*common, "trainer.max_steps=8", "out_dir=" + str(tmp_path / "whole")))
    train(tiny_cfg(*common, "trainer.max_steps=4", "out_dir=" + str(tmp_path / "split")))
    resumed = train(tiny_cfg(*common, "trainer.max_steps=8", "trainer.resume=force",
                             "out_dir=" + str(tmp_path / "split")))
    assert resumed["resume_forced"] == ["trainer.max_steps"]
    assert json.loads((tmp_path / "split" / "summary.step4.json").read_text())["steps"] == 4  # kept
    scales = lambda d: [(r["step"], r["loss_scale"]) for r in records(tmp_path / d, "train")]  # noqa: E731
    assert scales("split") == scales("whole")
    assert [s for _, s in scales("whole")] == [1024, 512, 512, 1024, 1024, 512, 512, 1024]
    assert resumed["skipped_steps"] == whole["skipped_steps"] == 2
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_finished_run_is_not_retrained_or_overwritten(tiny_cfg):
    cfg = tiny_cfg()
    first = train(cfg)
    again = train(cfg)
    assert again == json.loads(json.dumps(first))


def test_abort_after_consecutive_skips_marks_diverged_and_keeps_results(tiny_cfg):
    summary = train(tiny_cfg("precision=mp", "scale=8", "trainer.max_steps=10", "trainer.abort_after_skips=3",
                             "debug.nonfinite_steps=[3,4,5,6,7]"))
    run_dir = Path(summary["run_dir"])
    assert summary["diverged"] and "3 consecutive" in summary["diverged_reason"]
    assert summary["steps"] == 5 and summary["skipped_steps"] == 3
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "metrics.jsonl").exists()
    rerun = train(tiny_cfg("precision=mp", "scale=8", "trainer.max_steps=10", "trainer.abort_after_skips=3",
                           "debug.nonfinite_steps=[3,4,5,6,7]"))
    assert rerun == json.loads(json.dumps(summary))  # an ended run is reported, not retrained


def test_mp_activation_memory_is_about_half_of_fp32(tiny_cfg):
    fp32 = train(tiny_cfg("model.width=0.25", "data.image_size=32"))["memory"]["activation_bytes"]
    mp = train(tiny_cfg("model.width=0.25", "data.image_size=32", "precision=mp"))["memory"]["activation_bytes"]
    assert 0.45 < mp / fp32 < 0.6


MODES = ["fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"]
SCALES = ["none", "8", "dynamic", "lognormal", "auto"]


@pytest.mark.parametrize("precision", MODES)
@pytest.mark.parametrize("scale", SCALES)
def test_every_precision_and_scaler_trains(tiny_cfg, precision, scale):
    summary = train(tiny_cfg(f"precision={precision}", f"scale={scale}", "trainer.max_steps=3",
                             "scaler.auto_every=2", "trainer.eval_batches=1"))
    assert summary["steps"] == 3 and not summary["diverged"]
    assert summary["metric"] is not None


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_full_precision_modes_train(tiny_cfg, precision):
    summary = train(tiny_cfg(f"precision={precision}", "trainer.max_steps=3"))
    assert summary["precision_details"]["tf32"] == (precision == "tf32")


def test_evaluation_pictures_go_to_tensorboard_and_png(tiny_cfg, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from models.resnet50 import ResNet50Task
    from runner.task import EvalResult

    original = ResNet50Task.evaluate
    grid = torch.linspace(0, 1, 3 * 8 * 8).reshape(3, 8, 8)

    def with_picture(self, model, batches, ctx):
        return EvalResult(original(self, model, batches, ctx).metrics, images={"samples": grid})

    monkeypatch.setattr(ResNet50Task, "evaluate", with_picture)
    run_dir = Path(train(tiny_cfg("trainer.max_steps=2"))["run_dir"])
    assert (run_dir / "samples_step2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acc = EventAccumulator(str(run_dir), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["eval/resnet50/samples"]


def test_out_of_memory_ends_the_run_cleanly_as_oom_and_a_rerun_tries_again(tiny_cfg, monkeypatch):
    """A batch-size sweep goes on past a job that does not fit: the job's summary says oom (not
    diverged), with its batch size, and a rerun (on a larger GPU, say) trains instead of reporting it."""
    from models import TASKS

    cls = TASKS["resnet50"]
    original = cls.train_step

    def too_big(self, model, batch, ctx):
        if ctx.step_number == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, model, batch, ctx)

    monkeypatch.setattr(cls, "train_step", too_big)
    cfg = tiny_cfg("data.batch_size=16")
    summary = train(cfg)
    run_dir = Path(summary["run_dir"])
    assert summary["oom"] is True and summary["diverged"] is False and summary["batch_size"] == 16
    assert summary["steps"] == 1 and summary["metric"] is None
    assert json.loads((run_dir / "summary.json").read_text())["oom"] is True
    monkeypatch.setattr(cls, "train_step", original)
    again = train(cfg)
    assert again["oom"] is False and again["steps"] == 4 and again["metric"] is not None
