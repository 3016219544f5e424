"""`mpt-report <dir>...`: FP32-vs-reduced-precision tables from summary.json files.

One Markdown table per model. Each row is one run; deltas and ratios are
against the fp32 run of the same model, seed and batch size (the paper's
baseline), when there is one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from runner.errors import EXIT_USER_ERROR

PRECISION_ORDER = ["fp32", "tf32", "mp", "amp", "fp16", "pseudo_fp16", "bf16", "bf16_amp"]
COLUMNS = ["precision", "scale", "metric", "Δ vs fp32 (+ better)", "throughput", "speed-up", "peak mem",
           "act. mem vs fp32", "skipped", "diverged"]


def find_summaries(paths: list[Path]) -> list[dict[str, Any]]:
    summaries = []
    for path in paths:
        files = [path] if path.is_file() else sorted(path.rglob("summary.json"))
        for f in files:
            summary = json.loads(f.read_text())
            summary.setdefault("run_dir", str(f.parent))
            summaries.append(summary)
    return summaries


def _mib(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:.0f} MiB"


def _num(x: Any, fmt: str) -> str:
    return "–" if not isinstance(x, (int, float)) else format(x, fmt)


def peak_memory(s: dict[str, Any]) -> int | None:
    """GPU: the allocator's peak; CPU: the process's peak RSS (includes the framework itself)."""
    mem = s.get("memory", {})
    return mem.get("peak_allocated_bytes") or mem.get("peak_rss_bytes")


def baseline_for(s: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    seed = s.get("config", {}).get("seed")
    candidates = [r for r in runs if r["precision"] == "fp32" and r.get("batch_size") == s.get("batch_size")]
    same_seed = [r for r in candidates if r.get("config", {}).get("seed") == seed]
    return (same_seed or candidates or [None])[0]


def improvement(s: dict[str, Any], base: dict[str, Any]) -> float:
    """How much better than the baseline: positive is better, whichever way the metric points."""
    sign = 1.0 if s.get("higher_is_better", True) else -1.0
    return sign * (s["metric"] - base["metric"])


def outcome(s: dict[str, Any]) -> str:
    return f"yes: {s.get('diverged_reason') or 'no reason recorded'}" if s.get("diverged") else "no"


def row(s: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    metric, delta, speedup, act_ratio = s.get("metric"), "–", "–", "–"
    if base is not None and base is not s:
        if isinstance(metric, (int, float)) and isinstance(base.get("metric"), (int, float)):
            delta = f"{improvement(s, base):+.2f}"
        if s.get("samples_per_s") and base.get("samples_per_s"):
            speedup = f"{s['samples_per_s'] / base['samples_per_s']:.2f}x"
        act, base_act = s["memory"].get("activation_bytes"), base["memory"].get("activation_bytes")
        if act and base_act:
            act_ratio = f"{act / base_act:.2f}"
    throughput = f"{_num(s.get('samples_per_s'), '.1f')} {s.get('count_unit', 'samples')}/s"
    return [s["precision"], str(s.get("scale")), f"{_num(metric, '.2f')} {s.get('metric_name', '')}".strip(),
            delta, throughput, speedup, _mib(peak_memory(s)), act_ratio,
            str(s.get("skipped_steps", "–")), outcome(s)]


def render(summaries: list[dict[str, Any]]) -> str:
    out = []
    for model in sorted({s["model"] for s in summaries}):
        runs = [s for s in summaries if s["model"] == model]
        runs.sort(key=lambda s: (PRECISION_ORDER.index(s["precision"]) if s["precision"] in PRECISION_ORDER else 99,
                                 str(s.get("scale")), s.get("config", {}).get("seed", 0)))
        first = runs[0]
        out.append(f"### {model} ({first.get('device_name', first.get('device'))}, batch {first.get('batch_size')}, "
                   f"{first.get('steps')} steps)\n")
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "---|" * len(COLUMNS))
        for s in runs:
            out.append("| " + " | ".join(row(s, baseline_for(s, runs))) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mpt-report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("outputs")],
                        help="run directories, summary.json files, or folders to search (default: outputs)")
    parser.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    missing = [p for p in args.paths if not p.exists()]
    if missing:
        print(f"mpt-report: error: {missing[0]} does not exist; pass a run directory or the outputs folder",
              file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    summaries = find_summaries(args.paths)
    if not summaries:
        print(f"mpt-report: error: no summary.json under {', '.join(map(str, args.paths))}; run mpt-run first",
              file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    text = render(summaries)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
