"""`mpt-run`: the only module that knows Hydra.

Before Hydra starts any job, every job of the command line (each point of a
`-m` sweep) is composed and checked: unknown names, wrong types, missing data
and unwritable outputs fail up front with one line on stderr and exit code 2,
instead of a traceback halfway through a sweep. HYDRA_FULL_ERROR=1 shows the
traceback.
"""
from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from runner.errors import EXIT_USER_ERROR, UserError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("model", "data", "precision", "trainer", "experiment")
_FLAGS_WITH_VALUE = {"-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "--experimental-rerun"}
_NOT_A_RUN = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "--version", "--shell-completion", "-sc"}


def scale_suffix(scale: Any) -> str:
    """Run-directory suffix for a loss scale: '' for none, '-8', '-dynamic', ..."""
    return "" if str(scale) == "none" else f"-{scale}"


def linear_lr(base_lr: float, batch_size: int, reference_batch: int) -> float:
    """The linear scaling rule (Goyal et al. 2017) the ImageNet recipes use: lr = base * batch / ref."""
    return base_lr * batch_size / reference_batch


OmegaConf.register_new_resolver("mpt_scale_suffix", scale_suffix, replace=True)
OmegaConf.register_new_resolver("mpt_linear_lr", linear_lr, replace=True)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _explain_composition_error(exc: HydraException) -> str:
    """Hydra's messages span many lines; name the bad choice and the valid ones instead."""
    text = str(exc)
    for group in GROUPS:
        marker = f"Could not find '{group}/"
        if marker in text:
            bad = text.split(marker, 1)[1].split("'", 1)[0]
            return f"unknown {group} '{bad}'; choose one of: {', '.join(group_options(group))}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """All jobs of a command line: the cartesian product of comma-separated sweeps."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override, text in zip(parsed, overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(job) for job in itertools.product(*choices)]


def compose_job(overrides: list[str]) -> DictConfig:
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except MissingConfigException as exc:
        raise UserError(_explain_composition_error(exc)) from None
    except HydraException as exc:
        raise UserError(_explain_composition_error(exc)) from None
    except Exception as exc:  # OmegaConf interpolation / type errors surface here too
        raise UserError(f"bad config: {str(exc).splitlines()[0]}") from None


def preflight(argv: list[str]) -> None:
    """Compose and check every job the command line would run."""
    from runner.engine import check_run  # torch import deferred until the command is a run

    multirun = "-m" in argv or "--multirun" in argv
    overrides = [a for a, before in zip(argv, [""] + argv)
                 if not a.startswith("-") and before not in _FLAGS_WITH_VALUE and not a.startswith("hydra.")]
    try:
        jobs = expand_sweep(overrides) if multirun else [overrides]
    except HydraException as exc:
        raise UserError(f"cannot parse overrides: {str(exc).splitlines()[0]}") from None
    for job in jobs:
        check_run(compose_job(job))


def fail(exc: UserError) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise exc
    print(f"mpt-run: error: {exc}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _hydra_job(cfg: DictConfig) -> None:
    from runner.engine import train

    try:
        summary = train(cfg)
    except UserError as exc:
        fail(exc)
        return
    metric = summary["metric"]
    shown = "n/a" if metric is None else f"{metric:.2f}"
    status = f"DIVERGED ({summary['diverged_reason']})" if summary["diverged"] else "ok"
    print(f"{summary['model']} {summary['precision']} scale={summary['scale']}: {summary['metric_name']}={shown} "
          f"skipped={summary['skipped_steps']} {status} -> {summary['run_dir']}")


def main() -> None:
    argv = sys.argv[1:]
    if not _NOT_A_RUN.intersection(argv):
        try:
            preflight(argv)
        except UserError as exc:
            fail(exc)
    _hydra_job()


if __name__ == "__main__":
    main()
