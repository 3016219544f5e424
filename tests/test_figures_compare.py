"""`mpt-figures --compare`: two runs' last sample grids side by side, one-line error without grids."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread
from torchvision.utils import save_image

from runner.errors import EXIT_USER_ERROR
from runner.figures import last_samples, main


def _run(root: Path, precision: str, steps: list[int]) -> Path:
    run_dir = root / precision
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"precision": precision}))
    for step in steps:
        save_image(torch.rand(3, 20, 20), run_dir / f"samples_step{step}.png")
    return run_dir


def test_compare_writes_one_png_of_the_last_grids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fp32, mp = _run(tmp_path, "fp32", [50, 300, 100]), _run(tmp_path, "mp", [300])
    assert last_samples(fp32).name == "samples_step300.png"  # numeric, not lexical, order
    out = tmp_path / "side_by_side.png"
    main(["--compare", str(fp32), str(mp), "--out", str(out)])
    assert capsys.readouterr().out.split() == [str(out)]
    assert imread(out).shape[1] > imread(out).shape[0]  # two grids next to each other


def test_compare_without_samples_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fp32, empty = _run(tmp_path, "fp32", [10]), _run(tmp_path, "mp", [])
    with pytest.raises(SystemExit) as exit_info:
        main(["--compare", str(fp32), str(empty), "--out", str(tmp_path / "x.png")])
    assert exit_info.value.code == EXIT_USER_ERROR
    assert "has no samples_step<N>.png" in capsys.readouterr().err
