"""Every logged value goes to two places: metrics.jsonl (keys as logged) and TensorBoard.

TensorBoard tags are `<split>/<model>/<key>` (train/resnet50/loss, train/resnet50/loss_scale,
train/resnet50/samples_per_s, eval/resnet50/top1, ...): identical for every precision, so the
precisions of one model overlay on one chart, and different for every model, so ResNet's and
SSD's losses never share an axis. TensorBoard groups cards by the tag's first component and
sorts the groups by name, opening the first two: `eval` and `train` (the headline charts), then
`train_stats` (gradient statistics, runner/gradstats.py) and `whole_run` (the final values).

At the end of a run `write_run_summary` adds what TensorBoard compares runs with: the run's
hyper-parameters and final values for the HParams table and a Custom Scalars layout with one
category per model (loss, headline metric, loss scale, throughput; every precision on each).
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata as hparams_metadata, plugin_data_pb2
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import custom_scalars, scalar

from runner.errors import UserError
from runner.rundir import atomic_write

# Tag groups, in the order TensorBoard shows them (by name): headline groups first.
EVAL, TRAIN, STATS, WHOLE_RUN = "eval", "train", "train_stats", "whole_run"
# What the README's link and the Custom Scalars layout show for each model.
HEADLINE_TRAIN_KEYS = ("loss", "loss_scale", "samples_per_s")
# A file of its own, replaced whole at each end of the run: a resumed or extended run's
# HParams entry is its last summary (TensorBoard keeps the first metadata of a tag it reads,
# so a second record in the run's event stream would not replace the first). Its name sorts
# after the SummaryWriter's time-stamped files, so it is read last, after any purge.
SUMMARY_EVENTS = "events.out.tfevents.mpt-summary"


def tag(group: str, model: str, key: str = "") -> str:
    """The TensorBoard tag `<group>/<model>/<key>`; an empty model or key is left out."""
    return "/".join(part for part in (group, model, key) if part)


def json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: write them as strings so a diverged run's log stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class JsonlLog:
    """An append-only JSON-lines file that a resumed run continues where its checkpoint left it.

    `offset()` is the byte length of what has been written (and synced); the checkpoint stores
    it, and `JsonlLog(path, offset)` cuts the file back to it with `os.truncate` before
    appending: records of steps after the checkpoint (which the resumed run logs again) and a
    damaged tail from a crash disappear without the file ever being read or rewritten."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        """Open at `offset` bytes: 0 starts a new log, a checkpoint's offset continues one."""
        if offset:
            size = path.stat().st_size if path.exists() else None
            if size is None or size < offset:
                found = "is missing" if size is None else f"has {size} bytes"
                raise UserError(f"{path} {found} but the checkpoint recorded {offset}; it was changed outside "
                                f"mpt: restore it, or start the run again in another out_dir")
        self.path = path
        self._file = open(path, "ab")
        os.truncate(path, offset)  # after open: a missing file has been created by then
        self._offset = offset

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(json_safe(record)) + "\n").encode("utf-8")
        self._file.write(data)
        self._file.flush()  # a killed process loses no record that was logged
        self._offset += len(data)

    def offset(self) -> int:
        """Bytes written so far, synced to disk: a checkpoint storing it never points past the file's end."""
        os.fsync(self._file.fileno())
        return self._offset

    def close(self) -> None:
        self._file.close()


class RunLogger:
    """metrics.jsonl and TensorBoard, opened where the run's checkpoint left them: `start_step`
    (TensorBoard drops later events of a crashed segment with purge_step) and `start_offset`
    (metrics.jsonl is cut back to it; the checkpoint stores `jsonl.offset()`). A new run passes 0 and 0.
    `model` (the task's name) goes into every tag; see the module docstring."""

    def __init__(self, run_dir: Path, start_step: int, start_offset: int, model: str = "") -> None:
        self.run_dir = run_dir
        self.model = model
        self.jsonl = JsonlLog(run_dir / "metrics.jsonl", start_offset)
        self.tb = SummaryWriter(log_dir=str(run_dir), purge_step=start_step + 1 if start_step else 0)

    def tag(self, split: str, key: str) -> str:
        """The tag of a value logged under `split` (also for images: eval/<model>/<name>)."""
        return tag(split, self.model, key)

    def log(self, step: int, split: str, values: dict[str, Any]) -> None:
        self.jsonl.write({"step": step, "split": split, **values})
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(self.tag(split, key), value, step)

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()


def write_json_atomic(path: Path, obj: Any) -> None:
    """A JSON file that a crash never leaves half-written."""
    text = (json.dumps(json_safe(obj), indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(text))


# --- comparing runs: HParams and Custom Scalars ----------------------------------------------
_STRING, _NUMBER, _BOOL = api_pb2.DATA_TYPE_STRING, api_pb2.DATA_TYPE_FLOAT64, api_pb2.DATA_TYPE_BOOL
Getter = Callable[[dict[str, Any]], Any]


def _key(name: str) -> Getter:
    return lambda s: s.get(name)


def _config(name: str) -> Getter:
    return lambda s: (s.get("result_config") or {}).get(name)


def _flag(s: dict[str, Any], name: str) -> float | None:
    return None if s.get(name) is None else float(bool(s[name]))


def _mib(name: str) -> Getter:
    def get(s: dict[str, Any]) -> float | None:
        value = (s.get("memory") or {}).get(name)
        return None if value is None else value / 2**20
    return get


# One fixed list for every run: TensorBoard takes the HParams table's columns from the
# experiment record of one (arbitrary) run, so every run writes the same one.
HPARAMS: tuple[tuple[str, int, Getter], ...] = (
    ("model", _STRING, _key("model")),
    ("precision", _STRING, _key("precision")),
    ("scale", _STRING, _key("scale")),
    ("batch_size", _NUMBER, _key("batch_size")),
    ("seed", _NUMBER, _config("seed")),
    ("lr", _NUMBER, _config("trainer.lr")),
    ("optimizer", _STRING, _config("trainer.optimizer")),
    ("steps", _NUMBER, _key("steps")),
    ("threads", _NUMBER, _key("threads")),
    ("world_size", _NUMBER, _key("world_size")),
    ("device", _STRING, _key("device")),
    ("stats", _BOOL, _config("stats.enabled")),
    ("metric_name", _STRING, _key("metric_name")),
    ("torch", _STRING, _key("torch_version")),
)
# Marked `differs`: TensorBoard lists those columns first (then by name), and the HParams
# dashboard shows the first five until the user picks others.
COMPARED = ("model", "precision", "scale", "batch_size", "seed")
# Final values, written as scalars `whole_run/<name>` at the run's last step; the HParams table's metrics.
RUN_VALUES: tuple[tuple[str, str, Getter], ...] = (
    ("metric", "headline metric (metric_name)", _key("metric")),
    ("samples_per_s", "samples/s (count_unit/s)", _key("samples_per_s")),
    ("peak_allocated_mib", "peak allocated MiB (CUDA)", _mib("peak_allocated_bytes")),
    ("peak_rss_mib", "peak RSS MiB (process)", _mib("peak_rss_bytes")),
    ("activation_mib", "activation MiB (measured)", _mib("activation_bytes")),
    ("skipped_steps", "skipped steps", _key("skipped_steps")),
    ("diverged", "diverged (1 = yes)", lambda s: _flag(s, "diverged")),
    ("oom", "out of memory (1 = yes)", lambda s: _flag(s, "oom")),
)


def _hparam_value(kind: int, value: Any) -> Any:
    """`value` as the hyper-parameter's fixed type, or None (left out) when it has none."""
    if value is None:
        return None
    if kind == _BOOL:
        return bool(value)
    if kind == _NUMBER:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return str(value)


def _finite(value: Any) -> float | None:
    """A number the HParams table can sort and filter; None for missing or inf/NaN (a diverged run)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _hparams_summary(tag_: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    # The plugin reads its record from the metadata; the value is TensorBoard's own empty tensor.
    return Summary(value=[Summary.Value(tag=tag_, metadata=hparams_metadata.create_summary_metadata(data),
                                        tensor=hparams_metadata.NULL_TENSOR)])


def hparams_summaries(summary: dict[str, Any], now: float) -> list[Summary]:
    """The experiment, session-start and session-end records of a run's summary.json contents."""
    experiment = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=name, type=kind, differs=name in COMPARED) for name, kind, _ in HPARAMS],
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag(WHOLE_RUN, "", name)), display_name=shown)
                      for name, shown, _ in RUN_VALUES])
    start = plugin_data_pb2.SessionStartInfo(start_time_secs=now - float(summary.get("wall_s") or 0.0))
    for name, kind, get in HPARAMS:
        value = _hparam_value(kind, get(summary))
        if value is None:
            continue
        field = start.hparams[name]
        if kind == _BOOL:
            field.bool_value = value
        elif kind == _NUMBER:
            field.number_value = value
        else:
            field.string_value = value
    status = api_pb2.STATUS_FAILURE if summary.get("diverged") or summary.get("oom") else api_pb2.STATUS_SUCCESS
    end = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=now)
    return [_hparams_summary(hparams_metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
            _hparams_summary(hparams_metadata.SESSION_START_INFO_TAG,
                             plugin_data_pb2.HParamsPluginData(session_start_info=start)),
            _hparams_summary(hparams_metadata.SESSION_END_INFO_TAG,
                             plugin_data_pb2.HParamsPluginData(session_end_info=end))]


def scalars_layout(model: str, metric_name: str, count_unit: str = "samples") -> dict[str, Any]:
    """One Custom Scalars category per model: its runs of every precision overlaid on each chart.

    The charts' regexes name the model, so a logdir with several models' runs shows each
    category with its own model's runs only. Runs write identical categories, which the plugin
    merges (same title) and de-duplicates (same chart)."""
    m = re.escape(model)
    return {model: {
        "loss": ["Multiline", [f"^{tag(TRAIN, m, 'loss')}$"]],
        metric_name: ["Multiline", [f"^{tag(EVAL, m, re.escape(metric_name))}$"]],
        "loss scale": ["Multiline", [f"^{tag(TRAIN, m, 'loss_scale')}$"]],
        f"{count_unit}/s": ["Multiline", [f"^{tag(TRAIN, m, 'samples_per_s')}$"]],
    }}


def write_run_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write the run's TensorBoard comparison records (HParams, `whole_run/*`, Custom Scalars
    layout) from its summary.json contents into SUMMARY_EVENTS, replacing an earlier one.

    Call it once a run ends (also a diverged one), before summary.json is written: a crash in
    between leaves no summary.json, so the rerun writes both again."""
    now = time.time()
    step = int(summary.get("steps") or 0)
    records = [Event(wall_time=now, file_version="brain.Event:2")]
    records += [Event(wall_time=now, step=0, summary=s) for s in hparams_summaries(summary, now)]
    if summary.get("model") and summary.get("metric_name"):
        layout = scalars_layout(summary["model"], summary["metric_name"], summary.get("count_unit") or "samples")
        records.append(Event(wall_time=now, step=0, summary=custom_scalars(layout)))
    for name, _, get in RUN_VALUES:
        value = _finite(get(summary))
        if value is not None:
            records.append(Event(wall_time=now, step=step, summary=scalar(tag(WHOLE_RUN, "", name), value)))
    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    for event in records:
        writer.write(event.SerializeToString())
    path = run_dir / SUMMARY_EVENTS
    atomic_write(path, lambda f: f.write(buffer.getvalue()))
    return path


def headline_tag_filter(metric_names: Iterable[str]) -> str:
    """The time-series tag filter of the headline charts: each model's metric, loss, loss scale, throughput."""
    metrics = "|".join(sorted(re.escape(n) for n in metric_names))
    return f"^({EVAL}/[^/]+/({metrics})|{TRAIN}/[^/]+/({'|'.join(HEADLINE_TRAIN_KEYS)}))$"


def precision_colour_regex(precisions: Iterable[str]) -> str:
    """Run-name regex whose capture group is the precision directory (`mp-8`, `fp32`, ...):
    TensorBoard gives runs with the same captured text the same colour, whichever model and
    seed, and whether the logdir is out_root or one model's directory."""
    names = "|".join(sorted((re.escape(p) for p in precisions), key=len, reverse=True))
    return f"(?:^|/)((?:{names})(?:-[^/]+)?)/"


def tensorboard_link(metric_names: Iterable[str], precisions: Iterable[str],
                     base: str = "http://localhost:6006/") -> str:
    """The time-series dashboard with smoothing 0, the headline tags only and runs coloured by precision."""
    query = urlencode({"smoothing": "0", "tagFilter": headline_tag_filter(metric_names),
                       "runColorGroup": f"regex:{precision_colour_regex(precisions)}"})
    return f"{base}?{query}#timeseries"
