"""`mpt-figures <run dir> [--out DIR]`: the paper's diagnostic figures from a run's statistics.

Reads <run dir>/stats.jsonl (written with stats.enabled=true) and metrics.jsonl,
writes PNGs to --out (default <run dir>/figures) and prints their paths:

  grad_hist.png     log2|g| histograms of weight and activation gradients summed
                    over the sampled steps, at scale 1, with the FP16 regions
                    shaded (underflow to zero / subnormal / normal / overflow), and
                    the same histogram shifted by the final loss scale S (paper
                    Figures 2b and 3).
  lost_updates.png  histogram of log2(|w| / |dw|) with the 2^11 = 2048 threshold
                    of paper 3.1 marked, and the lost fraction per sampled step.
  loss_scale.png    the loss scale per logged step; logging windows that skipped
                    steps (non-finite gradients) are marked.

`mpt-figures --compare <run A> <run B> [--out FILE]`: the last `samples_step<N>.png`
grids of two runs side by side (e.g. fp32 and mp of the same seed: paper Figure 6),
titled with each run's precision; default FILE: compare_samples.png.

`mpt-figures --batch-sweep <dir> [--out FILE]`: throughput, activation memory and (GPU) peak
memory against batch size, one line per precision, batches that ran out of memory marked, from
the summaries under <dir> (`mpt-run -m experiment=sweep_batch`; the numbers of
`mpt-report --by batch_size`); default FILE: batch_sweep.png.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import imread

from runner.errors import EXIT_USER_ERROR, UserError
from runner.gradstats import (FP16_NORMAL_FROM, FP16_OVERFLOW_FROM, FP16_ZERO_BELOW, fp16_regions,
                              scale_shift)

KIND_TITLES = {"weight_grad": "weight gradients (paper Fig. 2b)", "act_grad": "activation gradients (paper Fig. 3)"}
REGION_STYLE = [  # (label, from exponent, to exponent, colour); None = open end
    ("becomes 0 in FP16", None, FP16_ZERO_BELOW, "#d62728"),
    ("FP16 subnormal", FP16_ZERO_BELOW, FP16_NORMAL_FROM, "#ff7f0e"),
    ("FP16 normal", FP16_NORMAL_FROM, FP16_OVERFLOW_FROM, "#2ca02c"),
    ("FP16 overflow", FP16_OVERFLOW_FROM, None, "#9467bd"),
]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_stats(run_dir: Path) -> list[dict[str, Any]]:
    """The run's sampled-step records, or UserError naming the fix."""
    if not run_dir.is_dir():
        raise UserError(f"no run directory {run_dir}; pass the out_dir of a run trained with stats.enabled=true, "
                        f"e.g. outputs/resnet50/mp-8/seed0")
    path = run_dir / "stats.jsonl"
    records = read_jsonl(path) if path.exists() else []
    if not records:
        raise UserError(f"{run_dir} has no gradient statistics ({path.name} missing or empty); "
                        f"train it with stats.enabled=true (and stats.every=N below trainer.max_steps)")
    return records


def exponent_counts(hist: dict[str, Any], lo: int, shift: int) -> Counter[int]:
    """Exponent bin -> count of a recorded histogram, every value multiplied by 2^shift."""
    return Counter({lo + i + shift: c for i, c in enumerate(hist["counts"]) if c})


def _shade_regions(ax: Axes, xmin: float, xmax: float) -> None:
    for label, start, stop, colour in REGION_STYLE:
        ax.axvspan(xmin if start is None else start, xmax if stop is None else stop,
                   color=colour, alpha=0.12, label=label, lw=0)


def _bars(ax: Axes, counts: Counter[int], total: int, **style: Any) -> None:
    xs = sorted(counts)
    ax.bar(xs, [100.0 * counts[x] / total for x in xs], width=1.0, align="edge", **style)


def _plot_gradients(ax: Axes, kind: str, records: list[dict[str, Any]]) -> None:
    """Summed scale-1 histogram, regions shaded, and its shift by the final loss scale."""
    lo = records[0]["grad_bins"][0]
    at_1: Counter[int] = Counter()
    zero = nonfinite = 0
    for r in records:
        s = r[kind]
        at_1.update(exponent_counts(s["hist"], lo, -scale_shift(s["recorded_at_scale"])))
        zero, nonfinite = zero + s["hist"]["zero"], nonfinite + s["hist"]["nonfinite"]
    total = sum(at_1.values()) + zero + nonfinite
    loss_scale = records[-1]["loss_scale"]
    shift = scale_shift(loss_scale)
    at_s = Counter({e + shift: c for e, c in at_1.items()})
    xs = list(at_1) + list(at_s) or [0]
    xmin, xmax = min(min(xs), FP16_ZERO_BELOW - 5) - 2, max(max(xs) + 1, FP16_OVERFLOW_FROM + 1) + 1
    _shade_regions(ax, xmin, xmax)
    _bars(ax, at_1, total, color="#1f77b4", label="scale 1")
    if shift:
        _bars(ax, at_s, total, fill=False, edgecolor="black", lw=0.8, label=f"x {loss_scale:g} (+{shift} in log2)")
    ax.bar([xmin], [100.0 * zero / total], width=1.0, align="edge", color="grey", label="exactly 0")
    first = min(at_1, default=0)
    merged = {"counts": [at_1.get(e, 0) for e in range(first, max(at_1, default=0) + 1)],
              "zero": zero, "nonfinite": nonfinite}
    frac_1, frac_s = fp16_regions(merged, 0, first), fp16_regions(merged, shift, first)
    ax.set_title(f"{KIND_TITLES[kind]}, {len(records)} sampled steps\n"
                 f"0 in FP16: {100 * frac_1['underflow']:.3g}% at scale 1, {100 * frac_s['underflow']:.3g}% at "
                 f"S={loss_scale:g}; overflow: {100 * frac_1['overflow']:.3g}% / {100 * frac_s['overflow']:.3g}%",
                 fontsize=9)
    ax.set_xlim(xmin, xmax)
    ax.set_yscale("log")
    ax.set_xlabel("log2 |gradient| (bin e holds [2^e, 2^(e+1)); leftmost bar: exact zeros)")
    ax.set_ylabel("% of all values")
    ax.legend(fontsize=7, loc="upper right")


def gradient_figure(records: list[dict[str, Any]], path: Path) -> Path | None:
    kinds = [k for k in KIND_TITLES if any(k in r for r in records)]
    if not kinds:
        return None
    fig = Figure(figsize=(10, 4 * len(kinds)), layout="constrained")
    for ax, kind in zip(fig.subplots(len(kinds), 1, squeeze=False)[:, 0], kinds):
        _plot_gradients(ax, kind, [r for r in records if kind in r])
    return _save(fig, path)


def lost_updates_figure(records: list[dict[str, Any]], path: Path) -> Path | None:
    lost = [(r["step"], r["lost_updates"]) for r in records if "lost_updates" in r]
    if not lost:
        return None
    first = lost[0][1]
    lo, threshold = first["ratio_bins"][0], first["threshold_log2"]
    ratios: Counter[int] = Counter()
    for _, entry in lost:
        ratios.update(exponent_counts(entry["ratio_hist"], lo, 0))
    updated, lost_total = sum(e["updated"] for _, e in lost), sum(e["lost"] for _, e in lost)
    fig = Figure(figsize=(10, 7), layout="constrained")
    hist_ax, frac_ax = fig.subplots(2, 1, height_ratios=[2, 1])
    xs = list(ratios) or [threshold]
    xmax = max(max(xs) + 2, threshold + 3)
    hist_ax.axvspan(threshold - 1, threshold, color="#ff7f0e", alpha=0.15, lw=0, label="may be lost (rounding)")
    hist_ax.axvspan(threshold, xmax, color="#d62728", alpha=0.15, lw=0, label=f"lost: |w|/|dw| > 2^{threshold}")
    _bars(hist_ax, ratios, max(1, sum(ratios.values())), color="#1f77b4", label="non-zero updates")
    hist_ax.axvline(threshold, color="#d62728", lw=1.5)
    hist_ax.text(threshold + 0.3, 0.97, f"2^{threshold} = {2 ** threshold}", color="#d62728", va="top",
                 transform=hist_ax.get_xaxis_transform(), bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    how = "lost by the FP16 weights" if first["how"] == "applied" else f"that adding in {first['format']} would lose"
    hist_ax.set_title(f"weight updates {how}: {100 * lost_total / max(1, updated):.3g}% of "
                      f"{updated} non-zero updates over {len(lost)} sampled steps (paper 3.1)", fontsize=9)
    hist_ax.set_xlim(min(min(xs) - 1, threshold - 12), xmax)
    hist_ax.set_ylim(top=hist_ax.get_ylim()[1] * 1.15)  # room for the threshold label
    hist_ax.set_xlabel("log2(|w| / |dw|)")
    hist_ax.set_ylabel("% of non-zero updates")
    hist_ax.legend(fontsize=7, loc="upper left")
    frac_ax.plot([s for s, _ in lost], [100 * e["lost_frac"] for _, e in lost], marker="o")
    frac_ax.set_xlabel("step")
    frac_ax.set_ylabel("% of updates lost")
    frac_ax.set_ylim(bottom=0)
    return _save(fig, path)


def loss_scale_figure(run_dir: Path, path: Path) -> Path | None:
    metrics = run_dir / "metrics.jsonl"
    train = [r for r in read_jsonl(metrics) if r.get("split") == "train"] if metrics.exists() else []
    if not train:
        return None
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    ax.step([r["step"] for r in train], [r["loss_scale"] for r in train], where="post", label="loss scale")
    skipped = [r for r in train if r.get("overflow")]
    if skipped:
        ax.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], marker="x", color="#d62728",
                   zorder=3, label="window with skipped steps (count)")
        for r in skipped:
            ax.annotate(str(r["overflow"]), (r["step"], r["loss_scale"]), textcoords="offset points",
                        xytext=(3, 3), fontsize=7, color="#d62728")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale S")
    ax.set_title(f"loss scale; {train[-1].get('skipped_steps', 0)} skipped steps in total", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def render(run_dir: Path, out_dir: Path) -> list[Path]:
    """Write every figure the run's data supports; returns their paths."""
    records = load_stats(run_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out_dir} ({exc.strerror or exc}); pass --out <a writable directory>") from None
    written = [gradient_figure(records, out_dir / "grad_hist.png"),
               lost_updates_figure(records, out_dir / "lost_updates.png"),
               loss_scale_figure(run_dir, out_dir / "loss_scale.png")]
    return [p for p in written if p is not None]


def last_samples(run_dir: Path) -> Path:
    """The sample grid of a run's latest evaluation, or UserError naming the fix."""
    found = {int(m.group(1)): p for p in run_dir.glob("samples_step*.png")
             if (m := re.fullmatch(r"samples_step(\d+)\.png", p.name))}
    if not found:
        raise UserError(f"{run_dir} has no samples_step<N>.png; pass the out_dir of a finished GAN run "
                        f"(e.g. outputs/dcgan/fp32/seed0)")
    return found[max(found)]


def compare_samples(run_dirs: list[Path], out: Path) -> Path:
    """The runs' latest sample grids side by side, titled with precision and step."""
    fig = Figure(figsize=(5 * len(run_dirs), 5.4))
    for i, run_dir in enumerate(run_dirs):
        path = last_samples(run_dir)
        summary = run_dir / "summary.json"
        precision = json.loads(summary.read_text())["precision"] if summary.exists() else run_dir.name
        ax = fig.add_subplot(1, len(run_dirs), i + 1)
        ax.imshow(imread(path))
        ax.set_title(f"{precision} ({path.stem.removeprefix('samples_')})")
        ax.axis("off")
    fig.tight_layout()
    return _save(fig, out)


def _batch_panel(ax: Axes, rows: list[dict[str, Any]], key: str, scale: float, ylabel: str) -> None:
    """One quantity against batch size, a line per precision; out-of-memory batches as red crosses
    on the x axis (they have no value)."""
    for label, line in _by_precision(rows).items():
        done = [r for r in line if r[key] is not None]
        drawn = ax.plot([r["batch_size"] for r in done], [r[key] / scale for r in done], marker="o", label=label)
        oom = [r["batch_size"] for r in line if not r["fit"]]
        if oom:
            ax.scatter(oom, [0] * len(oom), marker="x", s=60, color=drawn[0].get_color(), zorder=3, clip_on=False,
                       label=f"{label}: out of memory")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def _by_precision(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    lines: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = r["precision"] + ("" if str(r["scale"]) == "none" else f" (scale {r['scale']})")
        lines.setdefault(label, []).append(r)
    return lines


def batch_sweep_figure(sweep_dir: Path, out: Path) -> Path:
    """Throughput and memory against batch size per precision, one row of panels per model/curve."""
    from runner.report import batch_rows, fit_text, largest_fit, load  # the report's grouping, not a copy

    rows = [r for r in batch_rows(load([sweep_dir])) if r["batch_size"] is not None]
    curves: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        curves.setdefault(json.dumps([r["model"], r["curve"]], sort_keys=True), []).append(r)
    if len(rows) < 2 or all(len({r["batch_size"] for r in c}) < 2 for c in curves.values()):
        raise UserError(f"{sweep_dir} holds no batch-size sweep (fewer than two batch sizes of one model); "
                        f"run mpt-run -m experiment=sweep_batch model=<name> first")
    panels = [("samples_per_s", 1.0, "throughput ({unit}/s)"), ("activation_bytes", 2**20, "activation memory (MiB)")]
    if any(r["peak_bytes"] is not None for r in rows):
        panels.append(("peak_bytes", 2**30, "peak allocated (GiB)"))
    fig = Figure(figsize=(5 * len(panels), 4 * len(curves)), layout="constrained")
    axes = fig.subplots(len(curves), len(panels), squeeze=False)
    fits = largest_fit(rows)
    for ax_row, curve in zip(axes, curves.values()):
        first = curve[0]
        for ax, (key, scale, ylabel) in zip(ax_row, panels):
            _batch_panel(ax, curve, key, scale, ylabel.format(unit=first["count_unit"]))
        mine = [f for f in fits if f["model"] == first["model"] and f["curve"] == first["curve"]]
        base = next((f for f in mine if f["precision"] == "fp32"), None)
        ax_row[0].set_title(f"{first['model']} on {first['device']}; largest batch that fit: "
                            + "; ".join(fit_text(f, base) for f in mine), fontsize=9, loc="left")
    return _save(fig, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mpt-figures", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", help="a run's out_dir, trained with stats.enabled=true")
    parser.add_argument("--compare", type=Path, nargs=2, metavar="RUN_DIR",
                        help="put the last sample grids of two runs side by side (e.g. fp32 and mp)")
    parser.add_argument("--batch-sweep", type=Path, metavar="DIR",
                        help="throughput and memory against batch size per precision from the runs under DIR "
                             "(mpt-run -m experiment=sweep_batch)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the PNGs (default: <run_dir>/figures; with --compare / --batch-sweep: "
                             "a PNG file, default compare_samples.png / batch_sweep.png)")
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.run_dir, args.compare, args.batch_sweep)) != 1:
        parser.error("give one of: a run directory, --compare <run A> <run B>, --batch-sweep <dir>")
    try:
        if args.batch_sweep:
            paths = [batch_sweep_figure(args.batch_sweep, args.out or Path("batch_sweep.png"))]
        elif args.compare:
            paths = [compare_samples(args.compare, args.out or Path("compare_samples.png"))]
        else:
            paths = render(args.run_dir, args.out or args.run_dir / "figures")
    except UserError as exc:
        print(f"mpt-figures: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
