"""RunLogger's tag scheme and the run-summary records for incomplete summaries (no TensorBoard server)."""
from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

from runner.logs import SUMMARY_EVENTS, WHOLE_RUN, RunLogger, hparams_summaries, tag, write_run_summary


def test_tags_name_split_model_and_key_while_metrics_jsonl_keeps_its_keys(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path, 0, 0, model="ssd")
    logger.log(2, "train", {"loss": 1.5, "loss_scale": 8.0, "diverged": False, "note": "text"})
    assert logger.tag("eval", "samples") == "eval/ssd/samples"
    logger.close()
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record == {"step": 2, "split": "train", "loss": 1.5, "loss_scale": 8.0, "diverged": False, "note": "text"}
    events = EventAccumulator(str(tmp_path)).Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/ssd/loss", "train/ssd/loss_scale"]  # numbers only
    assert tag("train", "", "loss") == "train/loss" and tag("train_stats", "ssd") == "train_stats/ssd"


def start_info(summary: dict) -> plugin_data_pb2.SessionStartInfo:
    [_, start, _] = hparams_summaries(summary, now=100.0)
    return metadata.parse_session_start_info_plugin_data(start.value[0].metadata.plugin_data.content)


def test_hparams_have_one_type_each_whatever_the_run_logged() -> None:
    info = start_info({"model": "ssd", "scale": 8, "batch_size": 4, "threads": True, "wall_s": 40.0,
                       "result_config": {"stats.enabled": 1, "trainer.lr": None}})
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    # scale is text in every run ("none", "8", "dynamic"); a bool is no thread count; None is left out
    assert hparams == {"model": "ssd", "scale": "8", "batch_size": 4.0, "stats": True}
    assert info.start_time_secs == 60.0


def test_an_out_of_memory_run_without_metrics_still_gets_its_records(tmp_path: Path) -> None:
    write_run_summary(tmp_path, {"model": "resnet50", "metric_name": "top1", "metric": None, "oom": True,
                                 "steps": 0, "memory": {}})
    events = EventAccumulator(str(tmp_path / SUMMARY_EVENTS), size_guidance={"tensors": 0}).Reload()
    assert events.Tags()["scalars"] == [f"{WHOLE_RUN}/oom"]
    assert {"_hparams_/session_end_info", "custom_scalars__config__"} <= set(events.Tags()["tensors"])
    end = metadata.parse_session_end_info_plugin_data(
        events.SummaryMetadata("_hparams_/session_end_info").plugin_data.content)
    assert end.status == api_pb2.STATUS_FAILURE
