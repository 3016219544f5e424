"""`mpt-figures` (runner/figures.py): PNGs from a tiny run's statistics, one-line errors on bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from runner.cli import compose_job
from runner.engine import train
from runner.figures import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny mp run, dynamic scaling from 256 with one forced overflow (step 3), sampled at steps 1 and 3."""
    out = tmp_path_factory.mktemp("figures")
    cfg = compose_job(["model.width=0.125", "model.depth=[1,1,1,1]", "data.image_size=16", "data.num_train=256",
                       "data.num_eval=64", "data.batch_size=8", "trainer.max_steps=3", "trainer.log_every=1",
                       "trainer.eval_batches=1", f"out_root={out}", "stats.enabled=true", "stats.every=2",
                       "precision=mp", "scale=dynamic", "scaler.init_scale=256", "debug.nonfinite_steps=[3]"])
    return Path(train(cfg)["run_dir"])


def test_figures_are_valid_pngs(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(run_dir), "--out", str(tmp_path / "figs")])
    printed = capsys.readouterr().out.split()
    names = {"grad_hist.png", "lost_updates.png", "loss_scale.png"}
    assert {Path(p).name for p in printed} == names
    for name in names:
        path = tmp_path / "figs" / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_overflow_step_is_recorded_as_nonfinite(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records}
    assert by_step[3]["weight_grad"]["hist"]["nonfinite"] > 0  # debug.nonfinite_steps=[3]
    assert "lost_updates" not in by_step[3]                      # the skipped step applies no update
    assert by_step[1]["weight_grad"]["hist"]["nonfinite"] == 0


def test_default_out_dir_is_inside_the_run(run_dir: Path) -> None:
    main([str(run_dir)])
    assert (run_dir / "figures" / "grad_hist.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("make", ["missing", "no_stats"])
def test_bad_input_is_one_line_naming_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str) -> None:
    target = tmp_path / "nope" if make == "missing" else tmp_path
    if make == "no_stats":
        (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as exc:
        main([str(target)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpt-figures: error:") and "stats.enabled=true" in err
