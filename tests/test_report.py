"""mpt-report: seeds grouped and averaged, Welch intervals and verdicts, diverged runs counted not
averaged, Markdown/CSV/JSON, the paper beside us, batch-size sweeps."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest

from runner.report import main, render
from runner.welch import t_cdf, t_quantile, welch_interval

T_975 = {2: 4.302653, 4: 2.776445, 10: 2.228139}  # Student t 0.975 quantiles from printed tables


def summary(precision: str, metric: float, higher_is_better: bool = True, seed: int = 0, scale: str = "none",
            batch: int = 8, diverged: bool = False, config: dict | None = None, **extra) -> dict:
    result_config = {"model.name": "m", "model.width": 0.25, "data.name": "synthetic_images", "data.batch_size": batch,
                     "trainer.lr": 0.1, "trainer.max_steps": 10, "trainer.epochs": None, "precision.name": precision,
                     "scale": scale, "seed": seed, "threads": 1, **(config or {})}
    return {"model": "m", "precision": precision, "scale": scale, "metric": metric, "metric_name": "score",
            "higher_is_better": higher_is_better, "batch_size": batch, "steps": 10, "samples_per_s": 100.0,
            "count_unit": "tokens", "memory": {"activation_bytes": 100, "peak_rss_bytes": 2**20},
            "device": "cpu", "device_name": "cpu (test)", "skipped_steps": 0, "diverged": diverged,
            "diverged_reason": "logged loss non-finite at step 7" if diverged else None,
            "result_config": result_config, **extra}


def seeds(precision: str, metrics: list[float], **kw) -> list[dict]:
    return [summary(precision, m, seed=i, **kw) for i, m in enumerate(metrics)]


def rows_of(text: str, precision: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {precision} |")]


def cells(table: str, precision: str) -> dict[str, str]:
    """The Markdown row of `precision` keyed by the table's column names."""
    lines = table.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(f"| {precision} |"))
    header = next(lines[i] for i in range(index, -1, -1) if lines[i].startswith("| precision |"))
    names = [c.strip() for c in header.strip().strip("|").split("|")]
    return dict(zip(names, rows_of("\n".join(lines[index:index + 1]), precision)[0]))


def json_rows(summaries: list[dict], **kw) -> dict[str, dict]:
    rows = json.loads(render(summaries, "json", **kw))["rows"]
    return {f"{r['precision']}-{r['scale']}": r for r in rows}


# --- the t quantile and Welch's interval ---------------------------------------------------------
@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_printed_tables(df: int) -> None:
    assert t_quantile(0.975, df) == pytest.approx(T_975[df], abs=2e-6)


def test_t_quantile_closed_forms_and_normal_limit() -> None:
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)  # Cauchy
    p = 0.9
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)  # df = 2
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert t_quantile(0.025, 4) == pytest.approx(-T_975[4], abs=2e-6)


@pytest.mark.parametrize("df", [0.7, 2.9411764705882355, 7.3])
def test_t_cdf_at_fractional_df_agrees_with_integrating_the_density(df: float) -> None:
    """Welch's df is fractional: check the CDF against Simpson's rule on the t density."""
    t = t_quantile(0.975, df)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = lambda x: math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))  # noqa: E731
    n = 20000
    h = t / n
    integral = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(i * h) for i in range(n + 1))
    assert 0.5 + integral == pytest.approx(0.975, abs=1e-7)
    assert t_cdf(t, df) == pytest.approx(0.975, abs=1e-12)


def test_welch_interval_by_hand() -> None:
    # a = 1, 2, 3 and b = 3, 4, 5: means 2 and 4, both variances 1; se^2 = 1/3 + 1/3 = 2/3;
    # df = (2/3)^2 / ((1/3)^2/2 + (1/3)^2/2) = 4; half width = t(0.975, 4) * sqrt(2/3) = 2.266958
    interval = welch_interval([1, 2, 3], [3, 4, 5])
    assert interval.difference == 2.0
    assert interval.df == pytest.approx(4.0)
    assert interval.low == pytest.approx(2 - 2.776445 * math.sqrt(2 / 3), abs=1e-5)
    assert interval.high == pytest.approx(2 + 2.776445 * math.sqrt(2 / 3), abs=1e-5)
    # unequal variances and sizes: a = 10, 12 (var 2), b = 0, 4, 8, 12 (var 80/3); se^2 = 1 + 20/3 = 23/3;
    # df = (23/3)^2 / (1^2/1 + (20/3)^2/3) = (529/9) / (1 + 400/27) = 529 * 3 / 427 = 3.716628
    uneven = welch_interval([10, 12], [0, 4, 8, 12])
    assert uneven.df == pytest.approx(1587 / 427)
    half = t_quantile(0.975, 1587 / 427) * math.sqrt(23 / 3)
    assert (uneven.low, uneven.high) == pytest.approx((-5 - half, -5 + half))
    assert 2.776445 < t_quantile(0.975, 1587 / 427) < 3.182446  # between the df=4 and df=3 table values


# --- verdicts --------------------------------------------------------------------------------
def test_interval_and_verdict_in_the_table() -> None:
    table = render(seeds("fp32", [1, 2, 3]) + seeds("mp", [3, 4, 5]))
    mp = cells(table, "mp")
    assert mp["n"] == "3"
    assert mp["score (mean ± sd)"] == "4.00 ± 1.00"
    assert mp["Δ vs fp32 (+ better)"] == "+2.00"
    assert mp["95% CI of Δ"] == "[-0.27, +4.27]"  # the hand-computed interval above
    assert mp["verdict"] == "matches fp32 (wide CI)"  # contains 0, reaches beyond ±1% of 2
    assert cells(table, "fp32")["verdict"] == "baseline"


@pytest.mark.parametrize("higher_is_better, mp_metrics, verdict", [
    (True, [70.0, 70.5, 71.0], "worse"),      # accuracy clearly lower
    (True, [80.0, 80.5, 81.0], "better"),
    (False, [70.0, 70.5, 71.0], "better"),    # a lower perplexity is better
    (False, [80.0, 80.5, 81.0], "worse"),
    (True, [75.0, 75.1, 75.2], "matches fp32"),  # CI within ±1% of 75
])
def test_verdict_follows_the_metric_direction(higher_is_better: bool, mp_metrics: list[float], verdict: str) -> None:
    rows = json_rows(seeds("fp32", [75.0, 75.1, 75.2], higher_is_better=higher_is_better)
                     + seeds("mp", mp_metrics, higher_is_better=higher_is_better))
    assert rows["mp-none"]["verdict"] == verdict
    assert (rows["mp-none"]["delta"] > 0) == (verdict == "better") or verdict == "matches fp32"


def test_significant_but_within_margin_matches() -> None:
    """A difference the seeds detect but smaller than the margin is equivalence, not 'worse'."""
    base, mp = [75.00, 75.01, 75.02], [74.90, 74.91, 74.92]
    strict = json_rows(seeds("fp32", base) + seeds("mp", mp), margin="0")["mp-none"]
    loose = json_rows(seeds("fp32", base) + seeds("mp", mp), margin="0.5")["mp-none"]
    assert strict["verdict"] == "worse" and strict["ci_high"] < 0
    assert loose["verdict"] == "matches fp32" and loose["equivalent"] is True


def test_too_few_seeds_and_single_seed_tables() -> None:
    table = render([summary("fp32", 76.0), summary("mp", 75.0)])
    mp = cells(table, "mp")
    assert mp["score"] == "75.00"                      # no "± sd" for one seed
    assert mp["Δ vs fp32 (+ better)"] == "-1.00" and mp["95% CI of Δ"] == "–"
    assert mp["verdict"] == "too few seeds" and mp["diverged"] == "0/1"
    assert mp["throughput"] == "100.0 tokens/s"
    one_side = json_rows(seeds("fp32", [1, 2, 3]) + [summary("mp", 2.0)])
    assert one_side["mp-none"]["verdict"] == "too few seeds"


def test_diverged_runs_are_counted_never_averaged() -> None:
    mp = seeds("mp", [3.0, 5.0]) + [summary("mp", float("nan"), seed=2, diverged=True),
                                      summary("mp", 1000.0, seed=3, diverged=True)]  # finite but diverged
    rows = json_rows(seeds("fp32", [1, 2, 3]) + mp)
    assert rows["mp-none"]["metric_mean"] == 4.0 and rows["mp-none"]["n"] == 2
    assert rows["mp-none"]["diverged"] == 2 and rows["mp-none"]["runs"] == 4
    table = render(seeds("fp32", [1, 2, 3]) + mp)
    assert cells(table, "mp")["diverged"] == "2/4: logged loss non-finite at step 7 (+1 more)"
    every = json_rows(seeds("fp32", [1, 2]) + [summary("fp16", float("nan"), seed=s, diverged=True) for s in (0, 1)])
    assert every["fp16-none"]["verdict"] == "all diverged" and every["fp16-none"]["metric_mean"] is None


def test_groups_split_on_result_changing_settings_not_on_threads() -> None:
    runs = (seeds("fp32", [1, 2]) + seeds("mp", [1, 2])
            + [summary("mp", 50.0, seed=5, config={"trainer.lr": 0.01})]     # another lr: its own table
            + [summary("mp", 1.5, seed=7, config={"threads": 2}, batch=8)])  # threads: same group
    data = json.loads(render(runs, "json"))["rows"]
    assert sorted(r["table"] for r in data if r["precision"] == "mp")[0] != \
           sorted(r["table"] for r in data if r["precision"] == "mp")[-1]
    main_mp = next(r for r in data if r["precision"] == "mp" and r["setting"]["trainer.lr"] == 0.1)
    assert main_mp["n"] == 3 and main_mp["threads"] == [1, 2]
    other = next(r for r in data if r["precision"] == "mp" and r["setting"]["trainer.lr"] == 0.01)
    assert other["metric_mean"] == 50.0 and other["verdict"] == "no fp32 run"
    assert "trainer.lr=0.01" in render(runs)  # the heading names what tells the tables apart
    batches = json.loads(render(seeds("fp32", [1, 2]) + seeds("fp32", [5, 6], batch=16), "json"))["rows"]
    assert sorted(r["metric_mean"] for r in batches) == [1.5, 5.5]


def test_reruns_of_a_seed_are_one_seed_and_their_spread_is_run_to_run() -> None:
    """Seed 0 trained with 1 and 2 threads (and seed 1 on another machine) is two seeds, not four runs
    of four seeds: the seed statistics use each seed's mean, the reruns give the run-to-run sd."""
    mp = [summary("mp", 10.0, seed=0), summary("mp", 12.0, seed=0, config={"threads": 2}),
          summary("mp", 20.0, seed=1, machine="a (cpu)"), summary("mp", 23.0, seed=1, machine="b (cpu)")]
    rows = json_rows(seeds("fp32", [15.0, 17.0]) + mp[::-1])  # any order in: seed order out
    row = rows["mp-none"]
    assert row["n"] == 2 and row["runs"] == 4 and row["seeds"] == [0, 1]
    assert row["metric_values"] == [11.0, 21.5] and row["metric_mean"] == 16.25
    # pooled within-seed sd: ((10-11)^2 + (12-11)^2 + (20-21.5)^2 + (23-21.5)^2) / (1 + 1) = 3.25
    assert row["run_to_run_sd"] == pytest.approx(math.sqrt(3.25)) and row["replicated_seeds"] == 2
    assert row["machines"] == ["a (cpu)", "b (cpu)"]
    assert rows["fp32-none"]["run_to_run_sd"] is None and rows["fp32-none"]["replicated_seeds"] == 0
    table = render(seeds("fp32", [15.0, 17.0]) + mp)
    assert cells(table, "mp")["run-to-run sd (reruns of a seed)"] == "1.80 (2 seeds)"
    assert cells(table, "fp32")["run-to-run sd (reruns of a seed)"] == "–"
    assert "run-to-run" not in render(seeds("fp32", [15.0, 17.0]) + seeds("mp", [1.0, 2.0])).split("verdict:")[0]


def test_runs_on_different_numbers_of_processes_are_not_seeds_of_one_row() -> None:
    runs = seeds("fp32", [1, 2]) + [summary("fp32", 9.0, seed=s, world_size=4) for s in (0, 1)]
    rows = json.loads(render(runs, "json"))["rows"]
    assert sorted((r["setting"]["world_size"], r["metric_mean"]) for r in rows) == [(1, 1.5), (4, 9.0)]


def test_scales_are_separate_rows() -> None:
    rows = json_rows(seeds("fp32", [1, 2]) + seeds("mp", [1, 2]) + seeds("mp", [3, 4], scale="8"))
    assert rows["mp-none"]["metric_mean"] == 1.5 and rows["mp-8"]["metric_mean"] == 3.5


# --- formats ---------------------------------------------------------------------------------
def test_csv_and_json_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for s in seeds("fp32", [1, 2, 3]) + seeds("mp", [3, 4, 5]) + [summary("fp16", float("nan"), diverged=True)]:
        run = tmp_path / "runs" / f"{s['precision']}{s['result_config']['seed']}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(s))
    main([str(tmp_path / "runs"), "--format", "csv", "--out", str(tmp_path / "r.csv")])
    records = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["precision"] for r in records] == ["fp32", "mp", "fp16"]
    mp = records[1]
    assert float(mp["ci_low"]) == pytest.approx(2 - 2.776445 * math.sqrt(2 / 3), abs=1e-5)
    assert mp["verdict"] == "matches fp32" and mp["n"] == "3"
    assert (tmp_path / "r.csv").read_text().splitlines()[0].startswith("table,")
    main([str(tmp_path / "runs"), "--format", "json"])
    data = json.loads(capsys.readouterr().out)  # strict JSON: the diverged NaN metric became null
    fp16 = next(r for r in data["rows"] if r["precision"] == "fp16")
    assert fp16["metric_mean"] is None and fp16["diverged"] == 1 and "rule" in data


def test_missing_path_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bad_margin_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(summary("fp32", 1.0)))
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--margin", "-3%"])
    assert exit_info.value.code == 2
    assert "--margin" in capsys.readouterr().err


def test_reads_run_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for precision, metric in (("fp32", 70.0), ("mp", 71.0)):
        run = tmp_path / precision
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(summary(precision, metric)))
    main([str(tmp_path), "--out", str(tmp_path / "report.md")])
    assert cells(capsys.readouterr().out, "mp")["Δ vs fp32 (+ better)"] == "+1.00"
    assert "| mp |" in (tmp_path / "report.md").read_text()


# --- the paper beside us ---------------------------------------------------------------------
def resnet(precision: str, metric: float, scale: str = "none", **config) -> dict:
    s = summary(precision, metric, scale=scale, config={"model.name": "resnet50", "model.depth": [1, 1, 1, 1],
                                                        "data.batch_size": 32, **config})
    return {**s, "model": "resnet50", "metric_name": "top1"}


def test_paper_columns_and_reduced_size_said_plainly() -> None:
    table = render([resnet("fp32", 95.5), resnet("mp", 93.2), resnet("amp", 92.0, scale="dynamic")], paper=True)
    assert "FP32: 75.92; MP no scaling: 76.04; loss scale none." in table
    assert "Comparable in direction only" in table
    assert "built-in synthetic data (synthetic_images" in table
    assert "model.width=0.25 (paper 1.0)" in table and "model.depth=[1, 1, 1, 1] (paper [3, 4, 6, 3])" in table
    assert "trained 10 steps (paper preset: 90 epochs)" in table
    assert cells(table, "fp32")["paper"] == "75.92 (FP32)"
    assert cells(table, "mp")["paper"] == "76.04 (MP, no scaling)"
    assert cells(table, "amp")["paper"] == "–"  # the paper has no dynamic-scaling result


def test_paper_size_on_real_data_is_comparable_in_value() -> None:
    full = {"model.width": 1.0, "model.depth": [3, 4, 6, 3], "data.name": "imagefolder", "data.batch_size": 256,
            "trainer.epochs": 90}
    rows = json_rows([resnet("fp32", 75.8, **full), resnet("mp", 75.9, **full)], paper=True)
    assert rows["mp-none"]["comparable_in_value"] is True and rows["mp-none"]["not_comparable_because"] == []
    assert "comparable in value" in render([resnet("fp32", 75.8, **full)], paper=True)


def test_deepspeech_is_never_comparable_in_value() -> None:
    """Even at the paper's size on LibriSpeech: the paper's speech data was internal."""
    full = {"model.name": "deepspeech", "model.conv_channels": 32, "model.rnn_hidden": 1824, "model.rnn_layers": 3,
            "model.bidirectional": True, "model.lookahead": 20, "data.name": "librispeech", "data.batch_size": 32,
            "trainer.epochs": 20}
    run = {**summary("fp32", 2.5, higher_is_better=False, config=full), "model": "deepspeech"}
    row = json_rows([run], paper=True)["fp32-none"]
    assert row["comparable_in_value"] is False
    assert row["not_comparable_because"] == ["the paper's data (internal 6000 h) is not public; "
                                             "paper_deepspeech trains on LibriSpeech 960 h"]


def test_paper_ssd_rows_match_by_loss_scale() -> None:
    def ssd(precision: str, metric: float, scale: str = "none") -> dict:
        s = summary(precision, metric, scale=scale, config={"model.name": "ssd", "model.variant": "tiny",
                                                            "data.name": "synthetic_detection"})
        return {**s, "model": "ssd", "metric_name": "mAP"}
    rows = json_rows([ssd("fp32", 25.7), ssd("pseudo_fp16", 24.1, "8"), ssd("pseudo_fp16", 23.1)], paper=True)
    assert rows["pseudo_fp16-8"]["paper"] == "77.1 (MP, scale 8)" and rows["pseudo_fp16-8"]["paper_loss_scale"] == 8
    assert rows["pseudo_fp16-none"]["paper"] == "diverges (MP, no scaling)"
    assert "model.variant=tiny (paper ssd300)" in " ".join(rows["fp32-none"]["not_comparable_because"])


def test_paper_qualitative_models_and_unknown_models() -> None:
    def lm(precision: str, scale: str) -> dict:
        return {**summary(precision, 150.0, higher_is_better=False, scale=scale,
                          config={"model.name": "biglstm", "data.name": "synthetic_text"}), "model": "biglstm"}
    rows = json_rows([lm("fp32", "none"), lm("mp", "128")], paper=True)
    assert rows["mp-128"]["paper"] == "curve matches FP32 (MP, scale 128)"
    assert "no published result for m" in render([summary("fp32", 1.0)], paper=True)


# --- batch-size sweeps -----------------------------------------------------------------------
def sweep_run(precision: str, batch: int, oom: bool = False, device: str = "cuda") -> dict:
    s = summary(precision, None if oom else 10.0, batch=batch, config={"trainer.lr": 0.1 * batch / 256},
                device=device, device_name="GPU X" if device == "cuda" else "cpu (test)")
    s["memory"] = {} if oom else {"activation_bytes": batch * (2 if precision == "fp32" else 1) * 2**20,
                                  "peak_allocated_bytes": batch * (3 if precision == "fp32" else 2) * 2**20}
    s["samples_per_s"] = None if oom else batch * (1.0 if precision == "fp32" else 2.0)
    return {**s, "oom": True} if oom else s


def sweep() -> list[dict]:
    return ([sweep_run("fp32", b) for b in (8, 16, 32)] + [sweep_run("fp32", 64, oom=True)]
            + [sweep_run("mp", b) for b in (8, 16, 32, 64)] + [sweep_run("mp", 128, oom=True)])


def test_by_batch_size_table_and_largest_batch() -> None:
    table = render(sweep(), by="batch_size")
    assert "Largest batch that fit: fp32: 32; mp: 64, 2.00x fp32's." in table
    rows = rows_of(table, "mp")
    assert [r[2] for r in rows] == ["8", "16", "32", "64", "128"]  # one curve, lr scaled with batch ignored
    assert rows[2][4:] == ["64.0 tokens/s", "64 MiB", "32 MiB", "0.50", "yes"]
    assert rows[3][7] == "–"  # fp32 ran out of memory at 64: nothing to compare with
    assert rows[4][-1] == "out of memory" and rows[4][4] == "–"


def test_by_batch_size_without_oom_is_a_lower_bound_and_cpu_hides_peak() -> None:
    runs = [sweep_run("fp32", b, device="cpu") for b in (8, 16)]
    table = render(runs, by="batch_size")
    assert "Largest batch that fit: fp32: ≥ 16." in table
    assert rows_of(table, "fp32")[0][5] == "–"  # CPU: no allocator peak
    data = json.loads(render(sweep(), "json", by="batch_size"))
    fit = {f["precision"]: f for f in data["largest_fit"]}
    assert fit["fp32"]["largest_fit"] == 32 and fit["fp32"]["smallest_oom"] == 64 and fit["fp32"]["bound"] == "exact"
    records = list(csv.DictReader(io.StringIO(render(sweep(), "csv", by="batch_size"))))
    assert {r["largest_fit"] for r in records if r["precision"] == "mp"} == {"64"}
    assert [r["fit"] for r in records if r["precision"] == "fp32"] == ["True", "True", "True", "False"]


def test_sweep_batch_preset_gives_each_batch_its_own_run_dir() -> None:
    """The preset's hydra.sweeper.params, expanded as Hydra's BasicSweeper expands them (params first,
    the command line's overrides after and winning), compose to jobs with distinct run directories."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from runner.cli import DEFAULT_COMMAND, compose_with_hydra, hydra_for, resolve_job

    with hydra_for(DEFAULT_COMMAND):
        primary = compose_with_hydra(["experiment=sweep_batch", "model=ssd"])
        params = OmegaConf.to_container(primary.hydra.sweeper.params)
        assert set(params) == {"data.batch_size", "precision"}
        for command_line, expected in ((["experiment=sweep_batch", "model=ssd"], 10),
                                       (["experiment=sweep_batch", "model=ssd", "data.batch_size=4,8"], 4)):
            lines = [f"{k}={v}" for k, v in params.items()] + command_line
            jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)[0]
            dirs = {resolve_job(compose_with_hydra(job), True)[0].out_dir for job in jobs}
            assert len(jobs) == len(dirs) == expected
        cfg = resolve_job(compose_with_hydra(jobs[-1]), True)[0]
    assert cfg.data.batch_size == 8 and cfg.precision.name == "mp" and cfg.trainer.max_steps == 30
    assert "data.batch_size=8" in cfg.out_dir
