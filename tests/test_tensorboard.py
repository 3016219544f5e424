"""What TensorBoard itself reads back from a run directory: the HParams table (experiment,
sessions, final values), the Custom Scalars layout and the tag groups, through TensorBoard's own
event multiplexer, data provider and plugins (the code its server runs). One test starts a real
`tensorboard` server on 127.0.0.1; it runs only with MPT_LIVE_TENSORBOARD=1 (~25 s for both loaders)."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin
from tensorboard.plugins.hparams import api_pb2, get_experiment, list_session_groups
from tensorboard.plugins.hparams.hparams_plugin import HParamsPlugin
from tensorboard.plugins.scalar.scalars_plugin import ScalarsPlugin

from runner.logs import (COMPARED, EVAL, HPARAMS, RUN_VALUES, STATS, SUMMARY_EVENTS, TRAIN, WHOLE_RUN, RunLogger,
                         tag, tensorboard_link, write_run_summary)


def fake_summary(model: str, precision: str, seed: int, **changes: Any) -> dict[str, Any]:
    """The keys of an engine summary that the TensorBoard records read."""
    summary = {"model": model, "precision": precision, "scale": "none" if precision == "fp32" else 8,
               "batch_size": 8, "steps": 4, "threads": 1, "device": "cpu", "torch_version": "2.14.1",
               "metric_name": {"resnet50": "top1", "ssd": "mAP"}[model], "metric": 50.0 + seed,
               "count_unit": "samples", "samples_per_s": 100.0, "skipped_steps": 0, "diverged": False,
               "wall_s": 3.0, "memory": {"peak_allocated_bytes": None, "peak_rss_bytes": 2**30,
                                         "activation_bytes": 3 * 2**20},
               "result_config": {"seed": seed, "trainer.lr": 0.1, "trainer.optimizer": "sgd",
                                 "stats.enabled": False}}
    summary.update(changes)
    return summary


def fake_run(root: Path, model: str, precision: str, seed: int = 0, steps: int = 4, **changes: Any) -> Path:
    """A run directory as the engine leaves it: logged train/eval scalars, then the run summary."""
    scale = "" if precision == "fp32" else "-8"
    run_dir = root / model / f"{precision}{scale}" / f"seed{seed}"
    run_dir.mkdir(parents=True)
    summary = fake_summary(model, precision, seed, steps=steps, **changes)
    logger = RunLogger(run_dir, 0, 0, model=model)
    for step in range(1, steps + 1):
        logger.log(step, "train", {"loss": 2.0 / step, "loss_scale": 8.0, "samples_per_s": 100.0, "lr": 0.1})
    logger.log(steps, "eval", {summary["metric_name"]: summary["metric"]})
    logger.close()
    write_run_summary(run_dir, summary)
    return run_dir


class Board:
    """TensorBoard's backend over a logdir, as `tensorboard --logdir` builds it (without HTTP)."""

    def __init__(self, logdir: Path) -> None:
        mux = plugin_event_multiplexer.EventMultiplexer()
        mux.AddRunsFromDirectory(str(logdir))
        mux.Reload()
        self.ctx = context.RequestContext()
        self.provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
        plugins: dict[str, Any] = {}
        tb_context = base_plugin.TBContext(logdir=str(logdir), data_provider=self.provider,
                                           plugin_name_to_instance=plugins)
        plugins["scalars"] = ScalarsPlugin(tb_context)
        self.hparams = HParamsPlugin(tb_context)
        self.custom = CustomScalarsPlugin(tb_context)

    def experiment(self) -> api_pb2.Experiment:
        return get_experiment.Handler(self.ctx, self.hparams._context, "", api_pb2.GetExperimentRequest()).run()

    def session_groups(self) -> list[api_pb2.SessionGroup]:
        """What the HParams table lists (every status the dashboard can show)."""
        request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=[
            api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING])
        return list(list_session_groups.Handler(self.ctx, self.hparams._context, "", request).run().session_groups)

    def sessions(self) -> dict[str, api_pb2.Session]:
        return {s.name: s for g in self.session_groups() for s in g.sessions}

    def session_hparams(self) -> dict[str, dict[str, Any]]:
        """Per session group (one per run): its hyper-parameters and metric values, by name."""
        out = {}
        for g in self.session_groups():
            values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in g.hparams.items()}
            values.update({m.name.tag: m.value for m in g.metric_values})
            out[g.name] = values
        return out

    def scalar_tags(self) -> dict[str, set[str]]:
        return {run: set(tags) for run, tags in self.provider.list_scalars(
            self.ctx, experiment_id="", plugin_name="scalars").items()}

    def points(self, run: str, tag_: str) -> list[tuple[int, float]]:
        data = self.provider.read_scalars(self.ctx, experiment_id="", plugin_name="scalars", downsample=100,
                                          run_tag_filter=None)[run][tag_]
        return [(d.step, d.value) for d in data]


def test_hparams_table_lists_every_run_once_with_its_settings_and_final_values(tmp_path: Path) -> None:
    fake_run(tmp_path, "resnet50", "fp32", seed=0)
    fake_run(tmp_path, "resnet50", "mp", seed=1)
    fake_run(tmp_path, "ssd", "mp", seed=0)
    board = Board(tmp_path)

    experiment = board.experiment()
    assert sorted(h.name for h in experiment.hparam_infos) == sorted(name for name, _, _ in HPARAMS)
    # the dashboard shows the first five columns until the user picks others: the compared ones
    assert {h.name for h in experiment.hparam_infos[:5]} == set(COMPARED)
    assert [m.name.tag for m in experiment.metric_infos] == [tag(WHOLE_RUN, "", name) for name, _, _ in RUN_VALUES]
    rows = board.session_hparams()
    assert sorted(rows) == ["resnet50/fp32/seed0", "resnet50/mp-8/seed1", "ssd/mp-8/seed0"]
    row = rows["resnet50/mp-8/seed1"]
    assert (row["model"], row["precision"], row["scale"], row["seed"], row["lr"]) == ("resnet50", "mp", "8", 1.0, 0.1)
    assert row["stats"] is False and row["metric_name"] == "top1" and row["threads"] == 1.0
    assert row[f"{WHOLE_RUN}/metric"] == 51.0 and row[f"{WHOLE_RUN}/peak_rss_mib"] == 1024.0
    assert row[f"{WHOLE_RUN}/activation_mib"] == 3.0 and row[f"{WHOLE_RUN}/diverged"] == 0.0
    assert f"{WHOLE_RUN}/peak_allocated_mib" not in row  # CPU: no CUDA peak, no made-up value
    assert rows["ssd/mp-8/seed0"]["metric_name"] == "mAP"
    assert {s.status for s in board.sessions().values()} == {api_pb2.STATUS_SUCCESS}
    # the final values sit at the run's last step, in the run itself (one run per session)
    assert board.points("resnet50/mp-8/seed1", f"{WHOLE_RUN}/metric") == [(4, 51.0)]


def test_diverged_run_is_a_failed_session_without_non_finite_values(tmp_path: Path) -> None:
    fake_run(tmp_path, "ssd", "fp16", metric=float("nan"), samples_per_s=float("inf"), diverged=True,
             skipped_steps=3)
    board = Board(tmp_path)
    [(name, session)] = board.sessions().items()
    assert session.status == api_pb2.STATUS_FAILURE
    row = board.session_hparams()[name]
    assert row[f"{WHOLE_RUN}/diverged"] == 1.0 and row[f"{WHOLE_RUN}/skipped_steps"] == 3.0
    # inf/NaN would break the table's sorting and filters: left out (summary.json has them)
    assert f"{WHOLE_RUN}/metric" not in row and f"{WHOLE_RUN}/samples_per_s" not in row
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_a_resumed_and_extended_run_shows_its_last_summary_once(tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path, "resnet50", "mp", seed=0, steps=4)
    # trainer.resume=force extends it to 8 steps: the logger reopens at step 4 (purging later
    # events) and the end of the run writes the summary records again
    logger = RunLogger(run_dir, 4, (run_dir / "metrics.jsonl").stat().st_size, model="resnet50")
    for step in range(5, 9):
        logger.log(step, "train", {"loss": 2.0 / step, "loss_scale": 8.0, "samples_per_s": 100.0})
    logger.close()
    write_run_summary(run_dir, fake_summary("resnet50", "mp", 0, steps=8, metric=77.0))
    assert sorted(p.name for p in run_dir.iterdir() if "tfevents" in p.name)[-1] == SUMMARY_EVENTS
    assert not list(run_dir.glob("*.tmp"))
    board = Board(tmp_path)
    rows = board.session_hparams()
    assert list(rows) == ["resnet50/mp-8/seed0"]
    assert rows["resnet50/mp-8/seed0"]["steps"] == 8.0 and rows["resnet50/mp-8/seed0"][f"{WHOLE_RUN}/metric"] == 77.0
    assert board.points("resnet50/mp-8/seed0", f"{WHOLE_RUN}/metric") == [(8, 77.0)]  # the old (4, 50) is gone
    assert [s for s, _ in board.points("resnet50/mp-8/seed0", tag(TRAIN, "resnet50", "loss"))] == list(range(1, 9))


def test_custom_scalars_layout_has_one_category_per_model_showing_only_its_runs(tmp_path: Path) -> None:
    for precision in ("fp32", "mp"):
        fake_run(tmp_path, "resnet50", precision)
        fake_run(tmp_path, "ssd", precision)
    board = Board(tmp_path)
    layout = json.loads(board.custom.layout_impl(board.ctx, ""))  # the body the /layout route sends
    categories = {c["title"]: c["chart"] for c in layout["category"]}
    assert sorted(categories) == ["resnet50", "ssd"]
    # four runs wrote their model's category: merged by title, identical charts kept once
    assert [c["title"] for c in categories["ssd"]] == ["loss", "mAP", "loss scale", "samples/s"]
    for model, charts in categories.items():
        for chart in charts:
            [regex] = chart["multiline"]["tag"]
            for run in board.scalar_tags():
                found = board.custom.scalars_impl(board.ctx, run, regex, "")
                assert found["regex_valid"]
                # every precision of this model has exactly this chart's series; other models none
                assert len(found["tag_to_events"]) == (1 if run.startswith(model + "/") else 0), (chart, run)


def test_headline_groups_come_first_and_tags_match_across_precisions(tmp_path: Path) -> None:
    runs = [fake_run(tmp_path, "resnet50", p) for p in ("fp32", "mp")]
    stats_logger = RunLogger(runs[1], 0, 0, model="resnet50")  # a tag of each later group, as logged
    stats_logger.tb.add_scalar(tag(STATS, "resnet50", "act_grad/scale_1/underflow"), 0.1, 1)
    stats_logger.close()
    tags = Board(tmp_path).scalar_tags()
    assert tags["resnet50/fp32/seed0"] <= tags["resnet50/mp-8/seed0"]
    # the time-series dashboard groups cards by the tag's first component, sorts the groups by
    # name and opens the first two: they must be the headline groups
    groups = sorted({t.split("/", 1)[0] for t in set().union(*tags.values())})
    assert groups == [EVAL, TRAIN, STATS, WHOLE_RUN]
    assert "train_stats/resnet50/loss_scale" not in tags["resnet50/mp-8/seed0"]


def test_readme_link_filters_headline_tags_and_colours_runs_by_precision(tmp_path: Path) -> None:
    for precision in ("fp32", "mp"):
        fake_run(tmp_path, "resnet50", precision)
    link = tensorboard_link(["top1", "mAP"], ["fp32", "mp", "fp16", "pseudo_fp16", "bf16", "bf16_amp", "amp"])
    parts = urlsplit(link)
    query = {k: v for k, [v] in parse_qs(parts.query).items()}
    assert parts.fragment == "timeseries" and query["smoothing"] == "0"
    tag_filter = re.compile(query["tagFilter"])
    tags = set().union(*Board(tmp_path).scalar_tags().values())
    shown = {t for t in tags if tag_filter.search(t)}
    assert shown == {tag(EVAL, "resnet50", "top1"), *(tag(TRAIN, "resnet50", k) for k in
                                                      ("loss", "loss_scale", "samples_per_s"))}
    assert query["runColorGroup"].startswith("regex:")
    colour = re.compile(query["runColorGroup"].removeprefix("regex:"))
    captured = {run: colour.search(run).group(1) for run in
                ("resnet50/fp32/seed0", "ssd/fp32/seed3", "ssd/fp16-8/data.batch_size=4/seed0",
                 "pseudo_fp16-dynamic/seed1", "resnet50/bf16_amp/seed0")}
    assert captured == {"resnet50/fp32/seed0": "fp32", "ssd/fp32/seed3": "fp32",
                        "ssd/fp16-8/data.batch_size=4/seed0": "fp16-8",
                        "pseudo_fp16-dynamic/seed1": "pseudo_fp16-dynamic", "resnet50/bf16_amp/seed0": "bf16_amp"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("MPT_LIVE_TENSORBOARD") != "1", reason="starts a tensorboard server; "
                    "set MPT_LIVE_TENSORBOARD=1")
@pytest.mark.parametrize("load_fast", ["false", "true"])
def test_live_tensorboard_server_lists_hparams_and_custom_scalars(tmp_path: Path, load_fast: str) -> None:
    for precision in ("fp32", "mp"):
        fake_run(tmp_path / "logs", "resnet50", precision)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "logs"),
                               "--host", "127.0.0.1", "--port", str(port), "--load_fast", load_fast,
                               "--reload_interval", "1"],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "tb.log", "wb"))
    base = f"http://127.0.0.1:{port}"

    def get(path: str) -> Any:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return json.loads(response.read())
    try:
        listing: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                listing = get("/data/plugins_listing")
                runs = get("/data/runs")
                if listing["hparams"]["enabled"] and listing["custom_scalars"]["enabled"] and len(runs) == 2:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert listing["hparams"]["enabled"] and listing["custom_scalars"]["enabled"], listing
        layout = get("/data/plugin/custom_scalars/layout")
        assert [c["title"] for c in layout["category"]] == ["resnet50"]
        request = json.dumps({"startIndex": 0, "sliceSize": 10, "allowedStatuses": [
            "STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]})
        groups = get("/data/plugin/hparams/session_groups?request=" + urllib.request.quote(request))
        assert sorted(g["name"] for g in groups["sessionGroups"]) == ["resnet50/fp32/seed0", "resnet50/mp-8/seed0"]
    finally:
        server.terminate()
        server.wait(timeout=30)
