"""`mpt-report <dir>...`: FP32-vs-reduced-precision verdicts over seeds, from summary.json files.

Runs are grouped by model and every setting that changes the result (batch size, lr, model size,
data, ... from the summary's result_config) except the seed; one table per model and setting, one
row per precision and loss scale. A row averages its seeds: mean ± standard deviation of the metric
and n, the difference to the fp32 row of the same table with a 95% Welch t interval, and a verdict.
Diverged runs are counted, never averaged. `--paper` puts the paper's numbers beside ours;
`--by batch_size` shows speed and memory against batch size instead (batch-size sweeps).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from runner import rundir
from runner.errors import EXIT_USER_ERROR, UserError
from runner.welch import mean, sample_sd, welch_interval

PRECISION_ORDER = ["fp32", "tf32", "mp", "amp", "fp16", "pseudo_fp16", "bf16", "bf16_amp"]
BASELINE = "fp32"
FORMATS = ("md", "csv", "json")
DEFAULT_MARGIN = "1%"
CONFIDENCE = 0.95
# Keys that vary between seeds of one configuration without changing what it should give: the
# seed itself, and settings that change only rounding order or what is observed (thread count,
# deterministic kernels, gradient statistics). Runs that differ only here are averaged together.
REPLICATE_KEYS = ("seed", "threads", "trainer.deterministic")
REPLICATE_PREFIXES = ("stats.",)
ROW_KEYS = ("scale", "precision.name")  # name a row inside a table (with precision.* / scaler.*)
ADAPTIVE_SCALES = ("dynamic", "lognormal", "auto")  # scales whose scaler.* knobs change the result
SHOWN_IN_HEADING = ("model.name", "data.batch_size", "trainer.max_steps", "trainer.epochs")
VERDICT_RULE = ("verdict: the 95% Welch t interval of the difference to fp32 (+ = better) contains 0 or lies "
                "within ±{margin} → matches fp32; else worse / better by its sign; fewer than 2 finished "
                "seeds on either side → too few seeds; every run diverged → all diverged. Diverged runs are "
                "counted (diverged k/n), never averaged; throughput, memory and skipped steps are means. "
                "(wide CI): the interval also reaches beyond ±{margin}, so a difference that large is not ruled "
                "out; more seeds narrow it. n counts seeds: reruns of one seed with another thread count, "
                "deterministic kernels or machine are averaged into that seed's value, and their pooled "
                "standard deviation is the run-to-run column (summation order alone, apart from the seed "
                "spread).")


# --- reading --------------------------------------------------------------------------------
def find_summaries(paths: list[Path]) -> list[dict[str, Any]]:
    summaries = []
    for path in paths:
        files = [path] if path.is_file() else sorted(path.rglob("summary.json"))
        for f in files:
            try:
                summary = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                raise UserError(f"cannot read {f} ({exc}); remove it or rerun that run") from None
            summary.setdefault("run_dir", str(f.parent))
            summaries.append(summary)
    return summaries


def result_config(s: dict[str, Any]) -> dict[str, Any]:
    """The run's result config (every summary since run identity has one); older or hand-written
    summaries: derived from their resolved config, or from the few fields every summary has."""
    if "result_config" in s:
        return s["result_config"]
    if "config" in s and "model" in s["config"]:
        return rundir.result_config(OmegaConf.create(s["config"]))
    return {"model.name": s["model"], "precision.name": s["precision"], "scale": s.get("scale", "none"),
            "data.batch_size": s.get("batch_size"), "seed": s.get("config", {}).get("seed", 0)}


def _replicate(key: str) -> bool:
    return key in REPLICATE_KEYS or key.startswith(REPLICATE_PREFIXES)


def _row_key(key: str, scale: Any) -> bool:
    return (key in ROW_KEYS or key.startswith("precision.")
            or (key.startswith("scaler.") and str(scale) in ADAPTIVE_SCALES))


def _setting_key(key: str) -> bool:
    return not (_replicate(key) or key in ROW_KEYS or key.startswith(("precision.", "scaler.")))


def device_class(s: dict[str, Any]) -> str:
    """Which runs' speed and memory may be averaged: every CPU run of a machine is 'cpu' (threads are
    a replicate setting), each GPU model its own."""
    return "cpu" if s.get("device", "cpu") == "cpu" else str(s.get("device_name") or s.get("device"))


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def peak_memory(s: dict[str, Any]) -> int | None:
    """GPU: the allocator's peak; CPU: the process's peak RSS (includes the framework itself)."""
    mem = s.get("memory") or {}
    return mem.get("peak_allocated_bytes") or mem.get("peak_rss_bytes")


def _means(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> float | None:
    values = [v for v in map(get, runs) if _finite(v)]
    return mean(values) if values else None


# --- grouping --------------------------------------------------------------------------------
@dataclass
class Group:
    """The runs of one model, setting, precision and scale: one row."""

    model: str
    setting: tuple[tuple[str, str], ...]
    row: tuple[tuple[str, str], ...]
    precision: str
    scale: Any
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first(self) -> dict[str, Any]:
        return self.runs[0]

    @property
    def finished(self) -> list[dict[str, Any]]:
        """Runs whose metric is averaged: not diverged, not out of memory, a finite metric."""
        return [r for r in self.runs if not r.get("diverged") and not r.get("oom") and _finite(r.get("metric"))]

    @property
    def by_seed(self) -> dict[Any, list[float]]:
        """Each seed's finished metrics: more than one when it was rerun with another thread count,
        deterministic kernels or on another machine (run-to-run replicates, not new seeds)."""
        out: dict[Any, list[float]] = {}
        for r in sorted(self.finished, key=lambda r: _number(result_config(r).get("seed"))):
            out.setdefault(_hashable(result_config(r).get("seed")), []).append(float(r["metric"]))
        return out  # in seed order, so that values line up with the sorted seeds

    @property
    def values(self) -> list[float]:
        """One value per seed (its replicates' mean): seed statistics count seeds, not reruns."""
        return [mean(v) for v in self.by_seed.values()]

    @property
    def run_to_run(self) -> tuple[float | None, int]:
        """The pooled standard deviation between runs of one seed, and how many seeds have reruns:
        the spread from summation order (threads, machines) alone, kept apart from the seed spread."""
        replicated = [v for v in self.by_seed.values() if len(v) > 1]
        dof = sum(len(v) - 1 for v in replicated)
        if not dof:
            return None, 0
        squares = sum((x - mean(v)) ** 2 for v in replicated for x in v)
        return math.sqrt(squares / dof), len(replicated)

    @property
    def diverged(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if r.get("diverged")]

    @property
    def oom(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if r.get("oom")]

    @property
    def measured(self) -> list[dict[str, Any]]:
        """Runs whose speed and memory count: every run that did not run out of memory."""
        return [r for r in self.runs if not r.get("oom")]


def precision_rank(precision: str) -> int:
    return PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)


def scale_rank(scale: Any) -> tuple[int, float, str]:
    """none first, then fixed scales ascending, then the adaptive ones by name."""
    if str(scale) == "none":
        return (0, 0.0, "")
    try:
        return (1, float(scale), "")
    except (TypeError, ValueError):
        return (2, 0.0, str(scale))


def group_runs(summaries: Iterable[dict[str, Any]],
               setting_of: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]) -> list[Group]:
    groups: dict[tuple[Any, ...], Group] = {}
    for s in summaries:
        config = result_config(s)
        setting = tuple(sorted((k, _hashable(v)) for k, v in setting_of(s, config).items()))
        row = tuple(sorted((k, _hashable(v)) for k, v in config.items() if _row_key(k, s.get("scale"))))
        key = (s["model"], setting, s["precision"], str(s.get("scale")), row)
        groups.setdefault(key, Group(s["model"], setting, row, s["precision"], s.get("scale"))).runs.append(s)
    return sorted(groups.values(), key=lambda g: (g.model, g.setting, precision_rank(g.precision),
                                                  scale_rank(g.scale), g.row))


def seed_setting(s: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for runs to be seeds of one configuration (besides precision and scale)."""
    return {**{k: v for k, v in config.items() if _setting_key(k)}, "device": device_class(s),
            "world_size": s.get("world_size", 1)}  # 1 GPU and 4 GPUs are different speeds, not seeds


@dataclass
class Table:
    model: str
    setting: dict[str, Any]
    groups: list[Group]

    @property
    def baseline(self) -> Group | None:
        return next((g for g in self.groups if g.precision == BASELINE), None)


def tables_of(groups: list[Group]) -> list[Table]:
    tables: dict[tuple[str, Any], Table] = {}
    for g in groups:
        setting = {k: json.loads(v) for k, v in g.setting}
        tables.setdefault((g.model, g.setting), Table(g.model, setting, [])).groups.append(g)
    return sorted(tables.values(), key=lambda t: (t.model, _number(t.setting.get("data.batch_size")),
                                                  _number(t.setting.get("trainer.max_steps")), _hashable(t.setting)))


def _number(x: Any) -> float:
    return float(x) if _finite(x) else math.inf


def distinguishing_keys(tables: list[Table]) -> dict[str, list[str]]:
    """Per model, the setting keys whose values differ between its tables: a heading shows them."""
    out: dict[str, list[str]] = {}
    for model in {t.model for t in tables}:
        settings = [t.setting for t in tables if t.model == model]
        keys = set().union(*settings)
        out[model] = sorted(k for k in keys if k not in SHOWN_IN_HEADING and k != "device"
                            and len({_hashable(s.get(k)) for s in settings}) > 1)
    return out


def row_label_keys(table: Table) -> list[str]:
    """Row keys beyond precision and scale that differ inside a table (e.g. two scaler.init_scale)."""
    shown: set[str] = set()
    for g in table.groups:
        same = [dict(h.row) for h in table.groups if (h.precision, str(h.scale)) == (g.precision, str(g.scale))]
        shown |= {k for k in dict(g.row) if k not in ROW_KEYS and len({r.get(k) for r in same}) > 1}
    return sorted(shown)


# --- the verdict -----------------------------------------------------------------------------
def parse_margin(text: str) -> tuple[float, bool]:
    """'1%' -> (0.01, relative to the fp32 mean); '0.5' -> (0.5, absolute, in the metric's unit)."""
    relative = text.endswith("%")
    try:
        value = float(text[:-1] if relative else text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise UserError(f"--margin {text}: give a non-negative number (metric units) or a percentage "
                        f"of the fp32 mean such as 1%")
    return (value / 100.0 if relative else value), relative


@dataclass(frozen=True)
class Comparison:
    delta: float | None      # mean difference to fp32, positive = better whatever the metric's direction
    low: float | None        # 95% Welch interval of delta
    high: float | None
    df: float | None
    margin: float | None     # the equivalence margin in metric units
    verdict: str

    @property
    def equivalent(self) -> bool | None:
        """The interval lies within ±margin: a difference larger than the margin is ruled out."""
        if self.low is None or self.margin is None:
            return None
        return -self.margin <= self.low and self.high <= self.margin  # type: ignore[operator]


def compare(group: Group, base: Group | None, margin: tuple[float, bool]) -> Comparison:
    if group is base:
        return Comparison(None, None, None, None, None, "baseline")
    if base is None:
        return Comparison(None, None, None, None, None, f"no {BASELINE} run")
    sign = 1.0 if group.first.get("higher_is_better", True) else -1.0
    ours, theirs = group.values, base.values
    delta = sign * (mean(ours) - mean(theirs)) if ours and theirs else None
    m = margin[0] * abs(mean(theirs)) if margin[1] and theirs else (None if margin[1] else margin[0])
    if group.runs and len(group.diverged) == len(group.runs):
        return Comparison(None, None, None, None, m, "all diverged")
    if len(ours) < 2 or len(theirs) < 2:
        return Comparison(delta, None, None, None, m, "too few seeds")
    interval = welch_interval(theirs, ours, CONFIDENCE)
    low, high = sorted((sign * interval.low, sign * interval.high))
    if low <= 0.0 <= high or (m is not None and -m <= low and high <= m):
        verdict = "matches fp32"
    else:
        verdict = "better" if low > 0 else "worse"
    return Comparison(delta, low, high, interval.df, m, verdict)


# --- the paper beside us --------------------------------------------------------------------
def paper_results() -> dict[str, Any]:
    """runner/paper_results.yaml: the paper's published numbers and settings (package data)."""
    return yaml.safe_load(resources.files("runner").joinpath("paper_results.yaml").read_text(encoding="utf-8"))


def paper_preset(name: str) -> dict[str, Any]:
    """A paper_* experiment file as written (its model/data/trainer deltas): the paper's size."""
    text = resources.files("configs").joinpath("experiment", f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text) or {}


def _length(config: dict[str, Any]) -> tuple[str, Any]:
    epochs = config.get("trainer.epochs")
    return ("epochs", epochs) if epochs is not None else ("steps", config.get("trainer.max_steps"))


def comparability(entry: dict[str, Any], config: dict[str, Any]) -> tuple[bool, list[str]]:
    """(comparable in value, reasons it is not): built-in data, a model smaller than the paper
    preset's, shorter training, another batch size."""
    preset = paper_preset(entry["preset"])
    reasons = [entry["never_comparable"]] if entry.get("never_comparable") else []
    data = str(config.get("data.name", ""))
    if data.startswith("synthetic_"):
        reasons.append(f"built-in synthetic data ({data}; paper: {entry['dataset']})")
    size = [f"model.{k}={_fmt_value(config.get(f'model.{k}'))} (paper {_fmt_value(v)})"
            for k, v in (preset.get("model") or {}).items() if config.get(f"model.{k}") != v]
    if size:
        reasons.append("reduced model: " + ", ".join(size))
    trainer = preset.get("trainer") or {}
    paper_len = ("epochs", trainer["epochs"]) if trainer.get("epochs") else ("steps", trainer.get("max_steps"))
    ours_len = _length(config)
    if paper_len[1] is not None and (ours_len[0] != paper_len[0] or (ours_len[1] or 0) < paper_len[1]):
        reasons.append(f"trained {ours_len[1]} {ours_len[0]} (paper preset: {paper_len[1]} {paper_len[0]})")
    paper_batch = (preset.get("data") or {}).get("batch_size")
    if paper_batch is not None and config.get("data.batch_size") != paper_batch:
        reasons.append(f"batch {config.get('data.batch_size')} (paper {paper_batch})")
    return not reasons, reasons


def _fmt_value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, list) else str(v)


def paper_entry_for(group: Group, entry: dict[str, Any]) -> dict[str, Any] | None:
    """The paper's result to put beside a row: its FP32 for fp32/tf32, else its reduced-precision
    result at the same loss scale (none, or the same fixed number)."""
    reduced = group.precision not in (BASELINE, "tf32")
    for result in entry["results"]:
        if (result["mode"] != BASELINE) == reduced and (not reduced or str(result["scale"]) == str(group.scale)):
            return result
    return None


def paper_text(result: dict[str, Any] | None) -> str:
    if result is None:
        return "–"
    value = result.get("value")
    shown = f"{value:g}" if value is not None else result["outcome"]
    if result["mode"] == BASELINE:
        return f"{shown} (FP32)"
    scale = "no scaling" if str(result["scale"]) == "none" else f"scale {result['scale']}"
    return f"{shown} ({result['label']}, {scale})"


def paper_line(entry: dict[str, Any]) -> str:
    parts = "; ".join(f"{'FP32' if r['mode'] == BASELINE else r['label']}"
                      f"{'' if r['mode'] == BASELINE else ' ' + ('no scaling' if str(r['scale']) == 'none' else 'scale ' + str(r['scale']))}"
                      f": {r['value'] if r.get('value') is not None else r['outcome']}" for r in entry["results"])
    return (f"Paper ({entry['source']}; {entry['network']}, {entry['dataset']}, {entry['metric']}): {parts}; "
            f"loss scale {entry['loss_scale']}.")


# --- rows ------------------------------------------------------------------------------------
def seed_rows(table: Table, margin: tuple[float, bool], paper: dict[str, Any] | None) -> list[dict[str, Any]]:
    base = table.baseline
    base_speed = _means(base.measured, lambda r: r.get("samples_per_s")) if base else None
    base_act = _means(base.measured, lambda r: (r.get("memory") or {}).get("activation_bytes")) if base else None
    extra_keys = row_label_keys(table)
    rows = []
    for g in table.groups:
        c = compare(g, base, margin)
        values = g.values
        run_to_run_sd, replicated_seeds = g.run_to_run
        speed = _means(g.measured, lambda r: r.get("samples_per_s"))
        act = _means(g.measured, lambda r: (r.get("memory") or {}).get("activation_bytes"))
        row: dict[str, Any] = {
            "model": g.model, "precision": g.precision, "scale": g.scale,
            "row_settings": {k: json.loads(v) for k, v in g.row if k in extra_keys},
            "metric_name": g.first.get("metric_name"), "higher_is_better": g.first.get("higher_is_better", True),
            "runs": len(g.runs), "n": len(values),
            "seeds": sorted(json.loads(seed) for seed in g.by_seed),
            "metric_mean": mean(values) if values else None, "metric_sd": sample_sd(values),
            "metric_values": values, "run_to_run_sd": run_to_run_sd, "replicated_seeds": replicated_seeds,
            "machines": sorted({str(r["machine"]) for r in g.runs if r.get("machine")}),
            "delta": c.delta, "ci_low": c.low, "ci_high": c.high, "df": c.df, "margin": c.margin,
            "verdict": c.verdict, "equivalent": c.equivalent,
            "diverged": len(g.diverged), "diverged_reasons": [r.get("diverged_reason") for r in g.diverged],
            "oom": len(g.oom),
            "samples_per_s": speed, "count_unit": g.first.get("count_unit", "samples"),
            "speedup": speed / base_speed if g is not base and speed and base_speed else None,
            "peak_bytes": _means(g.measured, peak_memory),
            "activation_bytes": act,
            "activation_vs_fp32": act / base_act if g is not base and act and base_act else None,
            "skipped_steps": _means(g.runs, lambda r: r.get("skipped_steps")),
            "threads": sorted({t for r in g.runs if (t := r.get("threads", result_config(r).get("threads")))}),
        }
        if paper is not None:
            row.update(paper_fields(g, paper))
        rows.append(row)
    return rows


def paper_fields(group: Group, paper: dict[str, Any]) -> dict[str, Any]:
    entry = paper["models"].get(group.model)
    if entry is None:
        return {"paper": None}
    result = paper_entry_for(group, entry)
    comparable, reasons = comparability(entry, result_config(group.first))
    return {"paper": paper_text(result), "paper_value": (result or {}).get("value"),
            "paper_loss_scale": entry["loss_scale"], "paper_source": entry["source"],
            "comparable_in_value": comparable, "not_comparable_because": reasons}


def heading(table: Table, shown_keys: list[str]) -> str:
    first = table.groups[0].first
    config = result_config(first)
    names = {r.get("device_name") for g in table.groups for r in g.runs}
    device = names.pop() if len(names) == 1 else table.setting.get("device")
    unit, length = _length(config)
    parts = [f"{device}", f"batch {config.get('data.batch_size', first.get('batch_size'))}",
             f"{length if length is not None else first.get('steps')} {unit}"]
    parts += [f"{k}={_fmt_value(table.setting.get(k))}" for k in shown_keys]
    return f"{table.model} ({', '.join(parts)})"


# --- formatting ------------------------------------------------------------------------------
def _num(x: Any, fmt: str) -> str:
    return "–" if not _finite(x) else format(x, fmt)


def _speed(x: float | None, unit: str) -> str:
    return "–" if not _finite(x) else f"{x:.1f} {unit}/s"


def _mib(n: float | None) -> str:
    if n is None:
        return "–"
    return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.2f} MiB"


def _count(x: float | None) -> str:
    return "–" if x is None else (f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}")


def metric_cell(row: dict[str, Any]) -> str:
    if row["metric_mean"] is None:
        return "–"
    sd = "" if row["metric_sd"] is None else f" ± {row['metric_sd']:.2f}"
    return f"{row['metric_mean']:.2f}{sd}"


def scale_cell(row: dict[str, Any]) -> str:
    extra = ", ".join(f"{k}={_fmt_value(v)}" for k, v in row["row_settings"].items())
    return f"{row['scale']} ({extra})" if extra else str(row["scale"])


def diverged_cell(row: dict[str, Any]) -> str:
    text = f"{row['diverged']}/{row['runs']}"
    reasons = [r or "no reason recorded" for r in row["diverged_reasons"]]
    if reasons:
        text += f": {reasons[0]}" + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "")
    if row["oom"]:
        text += f", out of memory {row['oom']}/{row['runs']}"
    return text


def verdict_cell(row: dict[str, Any]) -> str:
    """'matches fp32 (wide CI)' when no difference was detected but one beyond the margin is not ruled out."""
    return row["verdict"] + (" (wide CI)" if row["verdict"] == "matches fp32" and row["equivalent"] is False else "")


def run_to_run_cell(row: dict[str, Any]) -> str:
    if row["run_to_run_sd"] is None:
        return "–"
    return f"{row['run_to_run_sd']:.2f} ({row['replicated_seeds']} seed{'s' if row['replicated_seeds'] > 1 else ''})"


def ci_cell(row: dict[str, Any]) -> str:
    return "–" if row["ci_low"] is None else f"[{row['ci_low']:+.2f}, {row['ci_high']:+.2f}]"


def seed_markdown(table: Table, rows: list[dict[str, Any]], title: str, paper_note: list[str]) -> list[str]:
    metric = rows[0]["metric_name"] or "metric"
    several = any(r["n"] >= 2 for r in rows)
    columns = ["precision", "scale", "n", f"{metric} (mean ± sd)" if several else metric, "Δ vs fp32 (+ better)",
               "95% CI of Δ", "verdict", "diverged", "throughput", "speed-up", "peak mem", "act. mem vs fp32",
               "skipped"]
    with_reruns = any(r["replicated_seeds"] for r in rows)
    if with_reruns:
        columns.insert(4, "run-to-run sd (reruns of a seed)")
    with_paper = any("paper" in r for r in rows)
    if with_paper:
        columns.append("paper")
    out = [f"### {title}", "", *paper_note, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r["precision"], scale_cell(r), str(r["n"]), metric_cell(r), _num(r["delta"], "+.2f"), ci_cell(r),
                 verdict_cell(r), diverged_cell(r), _speed(r['samples_per_s'], r['count_unit']),
                 _num(r["speedup"], ".2f") + ("x" if r["speedup"] else ""), _mib(r["peak_bytes"]),
                 _num(r["activation_vs_fp32"], ".2f"), _count(r["skipped_steps"])]
        if with_reruns:
            cells.insert(4, run_to_run_cell(r))
        if with_paper:
            cells.append(r.get("paper") or "–")
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def paper_note_lines(table: Table, paper: dict[str, Any] | None) -> list[str]:
    if paper is None:
        return []
    entry = paper["models"].get(table.model)
    if entry is None:
        return [f"Paper: no published result for {table.model}.", ""]
    comparable, reasons = comparability(entry, result_config(table.groups[0].first))
    verdict = ("Our runs are at the paper's size, on real data: comparable in value." if comparable else
               "Comparable in direction only, not in value: " + "; ".join(reasons) + ".")
    return [paper_line(entry), "", verdict, ""]


def report_seeds(summaries: list[dict[str, Any]], margin_text: str, with_paper: bool) -> dict[str, Any]:
    margin = parse_margin(margin_text)
    paper = paper_results() if with_paper else None
    tables = tables_of(group_runs(summaries, seed_setting))
    shown = distinguishing_keys(tables)
    out = []
    for t in tables:
        out.append({"model": t.model, "title": heading(t, shown[t.model]), "setting": t.setting, "table": t,
                    "rows": seed_rows(t, margin, paper), "paper_note": paper_note_lines(t, paper)})
    return {"tables": out, "rule": VERDICT_RULE.format(margin=margin_text if margin[1] else f"{margin[0]:g}")}


def seed_markdown_all(report: dict[str, Any]) -> str:
    lines: list[str] = []
    for t in report["tables"]:
        lines += seed_markdown(t["table"], t["rows"], t["title"], t["paper_note"])
    return "\n".join(lines + [report["rule"], ""])


# --- batch-size sweeps -----------------------------------------------------------------------
SPEED_NEUTRAL_PREFIXES = ("trainer.", "seed", "debug.")  # do not change per-step cost or memory
SPEED_KEYS = ("trainer.optimizer", "threads", "stats.enabled")  # ...except these


def sweep_setting(s: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for runs to lie on one batch-size curve: the network, the data's shape,
    the optimizer (its state is memory), threads and statistics (speed); not the lr, schedule,
    length or seed, which change neither speed nor memory, and not the batch size itself."""
    keep = {k: v for k, v in config.items()
            if k != "data.batch_size" and not _row_key(k, s.get("scale"))
            and (k in SPEED_KEYS or not (k.startswith(SPEED_NEUTRAL_PREFIXES) or _replicate(k)))}
    return {**keep, "device": device_class(s), "world_size": s.get("world_size", 1)}


def batch_rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model, curve, precision, scale and batch size: means over its runs."""
    rows = []
    for g in group_runs(summaries, lambda s, c: {**sweep_setting(s, c), "data.batch_size": c.get("data.batch_size",
                                                                                                 s.get("batch_size"))}):
        setting = {k: json.loads(v) for k, v in g.setting}
        gpu = setting["device"] != "cpu"
        rows.append({
            "model": g.model, "curve": {k: v for k, v in setting.items() if k != "data.batch_size"},
            "precision": g.precision, "scale": g.scale, "batch_size": setting["data.batch_size"],
            "runs": len(g.runs), "fit": not g.oom, "oom": len(g.oom), "device": setting["device"],
            "samples_per_s": _means(g.measured, lambda r: r.get("samples_per_s")),
            "count_unit": g.first.get("count_unit", "samples"),
            # CPU peak RSS is the process's: cumulative over the jobs of one `mpt-run -m`, so not shown
            "peak_bytes": _means(g.measured, lambda r: (r.get("memory") or {}).get("peak_allocated_bytes"))
            if gpu else None,
            "activation_bytes": _means(g.measured, lambda r: (r.get("memory") or {}).get("activation_bytes")),
        })
    rows.sort(key=lambda r: (r["model"], _hashable(r["curve"]), precision_rank(r["precision"]),
                             scale_rank(r["scale"]), r["batch_size"] or 0))
    return rows


def largest_fit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, curve, precision and scale: the largest batch that ran without running out of
    memory, and whether a larger one was tried (else the limit is only a lower bound)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key = (r["model"], _hashable(r["curve"]), r["precision"], str(r["scale"]))
        entry = out.setdefault(key, {"model": r["model"], "curve": r["curve"], "precision": r["precision"],
                                     "scale": r["scale"], "largest_fit": None, "smallest_oom": None})
        if r["fit"]:
            entry["largest_fit"] = max(entry["largest_fit"] or 0, r["batch_size"])
        else:
            entry["smallest_oom"] = min(entry["smallest_oom"] or r["batch_size"], r["batch_size"])
    for entry in out.values():
        entry["bound"] = "exact" if entry["smallest_oom"] and (entry["largest_fit"] or 0) < entry["smallest_oom"] \
            else "at least (no larger batch ran out of memory)"
    return list(out.values())


def fit_text(entry: dict[str, Any], base: dict[str, Any] | None) -> str:
    scale = "" if str(entry["scale"]) == "none" else f" (scale {entry['scale']})"
    if entry["largest_fit"] is None:
        return f"{entry['precision']}{scale}: none fit (smallest tried ran out of memory)"
    limit = ("" if entry["bound"] == "exact" else "≥ ") + str(entry["largest_fit"])
    ratio = ""  # a ratio of two limits means something only when both were found
    if base is not None and base is not entry and base["largest_fit"] and entry["bound"] == base["bound"] == "exact":
        ratio = f", {entry['largest_fit'] / base['largest_fit']:.2f}x fp32's"
    return f"{entry['precision']}{scale}: {limit}{ratio}"


def batch_markdown(rows: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    fits = largest_fit(rows)
    for curve_key in dict.fromkeys((r["model"], _hashable(r["curve"])) for r in rows):
        curve_rows = [r for r in rows if (r["model"], _hashable(r["curve"])) == curve_key]
        first = curve_rows[0]
        base_act = {r["batch_size"]: r["activation_bytes"] for r in curve_rows if r["precision"] == BASELINE}
        lines += [f"### {first['model']} batch-size sweep ({first['device']})", "",
                  "| precision | scale | batch | runs | throughput | peak mem | act. mem | act. mem vs fp32 | fit |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in curve_rows:
            ratio = (r["activation_bytes"] / base_act[r["batch_size"]]
                     if r["activation_bytes"] and base_act.get(r["batch_size"]) else None)
            lines.append(f"| {r['precision']} | {r['scale']} | {r['batch_size']} | {r['runs']} | "
                         f"{_speed(r['samples_per_s'], r['count_unit'])} | {_mib(r['peak_bytes'])} | "
                         f"{_mib(r['activation_bytes'])} | {_num(ratio, '.2f')} | "
                         f"{'yes' if r['fit'] else 'out of memory'} |")
        curve_fits = [f for f in fits if (f["model"], _hashable(f["curve"])) == curve_key]
        base = next((f for f in curve_fits if f["precision"] == BASELINE), None)
        lines += ["", "Largest batch that fit: " + "; ".join(fit_text(f, base) for f in curve_fits) + ".", ""]
    if any(r["device"] == "cpu" for r in rows):
        lines += ["CPU runs: no out-of-memory limit and no allocator peak (peak RSS is the process's, cumulative "
                  "over the jobs of one `mpt-run -m`); activation bytes are exact on any device.", ""]
    return "\n".join(lines)


# --- output ----------------------------------------------------------------------------------
def _csv_value(v: Any) -> Any:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return "" if v is None else v


def to_csv(records: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(k for r in records for k in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: _csv_value(r.get(k)) for k in columns})
    return buffer.getvalue()


def _json_safe(v: Any) -> Any:
    """Strict JSON: non-finite numbers (a diverged metric) become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def render_seeds(summaries: list[dict[str, Any]], fmt: str = "md", margin: str = DEFAULT_MARGIN,
                 paper: bool = False) -> str:
    report = report_seeds(summaries, margin, paper)
    if fmt == "md":
        return seed_markdown_all(report)
    records = [{"table": t["title"], **r, "setting": t["setting"]} for t in report["tables"] for r in t["rows"]]
    if fmt == "csv":
        return to_csv(records)
    notes = {t["title"]: t["paper_note"] for t in report["tables"] if t["paper_note"]}
    return json.dumps(_json_safe({"rule": report["rule"], "rows": records, **({"paper_notes": notes} if notes else {})}),
                      indent=1, allow_nan=False)


def render_batches(summaries: list[dict[str, Any]], fmt: str = "md") -> str:
    rows = batch_rows(summaries)
    if fmt == "md":
        return batch_markdown(rows)
    fits = {(f["model"], _hashable(f["curve"]), f["precision"], str(f["scale"])): f for f in largest_fit(rows)}
    records = [{**r, "largest_fit": fits[(r["model"], _hashable(r["curve"]), r["precision"], str(r["scale"]))]
                ["largest_fit"]} for r in rows]
    if fmt == "csv":
        return to_csv(records)
    return json.dumps(_json_safe({"rows": rows, "largest_fit": list(fits.values())}), indent=1, allow_nan=False)


def render(summaries: list[dict[str, Any]], fmt: str = "md", margin: str = DEFAULT_MARGIN, paper: bool = False,
           by: str | None = None) -> str:
    if by == "batch_size":
        if paper:
            raise UserError("--paper compares metrics over seeds; drop it with --by batch_size")
        return render_batches(summaries, fmt)
    return render_seeds(summaries, fmt, margin, paper)


def load(paths: list[Path]) -> list[dict[str, Any]]:
    """Every summary under the paths, or UserError naming the fix."""
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise UserError(f"{missing[0]} does not exist; pass a run directory or the outputs folder")
    summaries = find_summaries(paths)
    if not summaries:
        raise UserError(f"no summary.json under {', '.join(map(str, paths))}; run mpt-run first")
    return summaries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mpt-report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("outputs")],
                        help="run directories, summary.json files, or folders to search (default: outputs)")
    parser.add_argument("--format", choices=FORMATS, default="md", help="md (default), csv or json")
    parser.add_argument("--out", type=Path, help="also write the output to this file")
    parser.add_argument("--paper", action="store_true",
                        help="put the paper's FP32/MP numbers and loss scale beside ours, and say whether our "
                             "runs are comparable in value (paper size, real data) or in direction only")
    parser.add_argument("--margin", default=DEFAULT_MARGIN,
                        help="equivalence margin of the verdict: a percentage of the fp32 mean (default 1%%) or "
                             "an absolute number in the metric's unit")
    parser.add_argument("--by", choices=["batch_size"],
                        help="batch_size: throughput and memory against batch size per precision, and the "
                             "largest batch that fit (batch-size sweeps)")
    args = parser.parse_args(argv)
    try:
        text = render(load(args.paths), args.format, args.margin, args.paper, args.by)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except UserError as exc:
        print(f"mpt-report: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except OSError as exc:
        print(f"mpt-report: error: cannot write {args.out} ({exc.strerror or exc}); pass --out <a writable file>",
              file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    try:
        print(text)
    except BrokenPipeError:  # `mpt-report | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet


if __name__ == "__main__":
    main()
