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


def test_batch_sweep_plot_is_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Summaries written here (GPU-like, one batch out of memory) -> one PNG with a panel per quantity."""
    for precision, fits in (("fp32", 32), ("mp", 64)):
        for batch in (16, 32, 64):
            s = {"model": "m", "precision": precision, "scale": "none", "device": "cuda", "device_name": "GPU X",
                 "batch_size": batch, "count_unit": "samples", "metric": None, "diverged": False,
                 "result_config": {"model.name": "m", "data.batch_size": batch, "precision.name": precision,
                                   "scale": "none", "seed": 0}}
            if batch > fits:
                s.update(oom=True, samples_per_s=None, memory={})
            else:
                s.update(samples_per_s=10.0 * batch, memory={"activation_bytes": batch * 2**20,
                                                             "peak_allocated_bytes": batch * 2**21})
            run = tmp_path / "sweep" / precision / str(batch)
            run.mkdir(parents=True)
            (run / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "sweep.png"
    main(["--batch-sweep", str(tmp_path / "sweep"), "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    image = imread(out)
    assert image.shape[1] > 2.5 * image.shape[0]  # three panels side by side (throughput, activations, peak)


def test_batch_sweep_without_a_sweep_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(
        {"model": "m", "precision": "fp32", "scale": "none", "batch_size": 8, "metric": 1.0}))
    with pytest.raises(SystemExit) as exc:
        main(["--batch-sweep", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "experiment=sweep_batch" in err
