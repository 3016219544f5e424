"""mpt-report: tables from summaries, deltas the right way round, divergence spelled out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.report import main, render


def summary(precision: str, metric: float, higher_is_better: bool = True, **extra) -> dict:
    return {"model": "m", "precision": precision, "scale": "none", "metric": metric, "metric_name": "score",
            "higher_is_better": higher_is_better, "batch_size": 8, "steps": 10, "samples_per_s": 100.0,
            "count_unit": "tokens", "memory": {"activation_bytes": 100, "peak_rss_bytes": 2**20},
            "config": {"seed": 0}, "skipped_steps": 0, "diverged": False, **extra}


def cells(table: str, precision: str) -> list[str]:
    line = next(r for r in table.splitlines() if r.startswith(f"| {precision} |"))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.parametrize("higher_is_better, mp_metric, expected", [
    (True, 75.0, "-1.00"),   # accuracy 76 -> 75: worse
    (False, 90.0, "+10.00"),  # perplexity 100 -> 90: better
])
def test_delta_is_positive_when_better(higher_is_better: bool, mp_metric: float, expected: str) -> None:
    base = 76.0 if higher_is_better else 100.0
    table = render([summary("fp32", base, higher_is_better), summary("mp", mp_metric, higher_is_better)])
    assert cells(table, "mp")[3] == expected
    assert cells(table, "mp")[4] == "100.0 tokens/s"


def test_diverged_runs_show_their_reason() -> None:
    table = render([summary("fp32", 1.0), summary("fp16", float("nan"), diverged=True,
                                                  diverged_reason="logged loss non-finite at step 7")])
    assert cells(table, "fp16")[-1] == "yes: logged loss non-finite at step 7"
    assert cells(table, "fp32")[-1] == "no"


def test_missing_path_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_reads_run_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for precision, metric in (("fp32", 70.0), ("mp", 71.0)):
        run = tmp_path / precision
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(summary(precision, metric)))
    main([str(tmp_path), "--out", str(tmp_path / "report.md")])
    assert cells(capsys.readouterr().out, "mp")[3] == "+1.00"
    assert (tmp_path / "report.md").exists()
