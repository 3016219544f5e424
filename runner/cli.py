"""`mpt-run`: the only module that knows Hydra.

Before Hydra starts any job, every job of the command line (each point of a `-m` sweep) is
composed the way Hydra will compose it (same search path, `--config-dir`/`--config-name`
included) and checked: unknown names, wrong types, missing data, unwritable outputs and two
jobs sharing one run directory fail up front with one line on stderr and exit code 2, instead
of a traceback halfway through a sweep. Anything else that goes wrong is a bug and keeps its
traceback. HYDRA_FULL_ERROR=1 shows the traceback of bad input too.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import hydra
from hydra import compose
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import (create_automatic_config_search_path,
                                   detect_calling_file_or_module_from_task_function, get_args_parser)
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from runner import rundir
from runner.config import PrecisionConfig, RootConfig, TrainerConfig, explain
from runner.errors import EXIT_USER_ERROR, UserError
from runner.precision import POLICIES

CONFIG_PATH = "pkg://configs"  # the YAML tree ships inside the package (configs/__init__.py)
CONFIG_NAME = "config"
GROUPS = ("model", "data", "precision", "trainer", "experiment")


def linear_lr(base_lr: float, batch_size: int, reference_batch: int) -> float:
    """The linear scaling rule (Goyal et al. 2017) the ImageNet recipes use: lr = base * batch / ref."""
    return base_lr * batch_size / reference_batch


OmegaConf.register_new_resolver("mpt_run_dir", rundir.run_dir, replace=True)
OmegaConf.register_new_resolver("mpt_abspath", os.path.abspath, replace=True)
OmegaConf.register_new_resolver("mpt_linear_lr", linear_lr, replace=True)


def register_configs() -> None:
    """The defaults, once: the dataclasses are the root schema and the trainer default, and every
    precision policy is a `precision` option, so adding a mode is adding its class."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=RootConfig)
    store.store(group="trainer", name="default", node=TrainerConfig)
    for name in POLICIES:
        store.store(group="precision", name=name, node=PrecisionConfig(name=name))


register_configs()


@dataclass(frozen=True)
class Command:
    """What the command line asks for, read with Hydra's own argument parser."""

    overrides: list[str]
    multirun: bool
    config_name: str
    config_path: str
    config_dir: str | None
    is_run: bool  # false for --help, --cfg, --info, ...: nothing to check


def parse_command(argv: list[str]) -> Command:
    args: argparse.Namespace = get_args_parser().parse_args(argv)
    informational = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    return Command(overrides=args.overrides, multirun=args.multirun, config_name=args.config_name or CONFIG_NAME,
                   config_path=args.config_path or CONFIG_PATH, config_dir=args.config_dir,
                   is_run=not informational)


DEFAULT_COMMAND = Command([], False, CONFIG_NAME, CONFIG_PATH, None, True)


@contextmanager
def hydra_for(command: Command) -> Iterator[None]:
    """Hydra initialised with the search path `hydra.main` builds for `command` (its config path,
    then a `--config-dir` prepended as Hydra does), for compose() calls."""
    if GlobalHydra.instance().is_initialized():
        raise RuntimeError("hydra_for() inside an initialised Hydra: compose with that instead")
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(_job)
    search_path = create_automatic_config_search_path(calling_file, calling_module, command.config_path)
    if command.config_dir is not None:
        config_dir = os.path.abspath(command.config_dir)
        if not os.path.isdir(config_dir):
            raise UserError(f"--config-dir {command.config_dir}: no such directory")
        search_path.prepend(provider="command-line", path=f"file://{config_dir}",
                            anchor=SearchPathQuery(provider="schema"))
    Hydra.create_main_hydra2(task_name="mpt", config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def _explain_composition_error(exc: HydraException | OmegaConfBaseException) -> str:
    """One line naming the bad key or choice and the fix, instead of Hydra's many lines."""
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return explain(cause)
    text = str(exc)
    for group in GROUPS:
        marker = f"Could not find '{group}/"
        if marker in text:
            bad = text.split(marker, 1)[1].split("'", 1)[0]
            options = GlobalHydra.instance().config_loader().get_group_options(group)
            return f"unknown {group} '{bad}'; choose one of: {', '.join(options)}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def compose_with_hydra(overrides: list[str], config_name: str = CONFIG_NAME) -> DictConfig:
    """One job's config with its `hydra` node, inside hydra_for(); bad input -> UserError."""
    try:
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UserError(_explain_composition_error(exc)) from None


def resolve_job(cfg: DictConfig, multirun: bool) -> tuple[DictConfig, str]:
    """(the config the job's task function gets, the directory Hydra gives the job).

    out_dir reads the job's overrides through `${hydra:...}`, which needs HydraConfig: it is
    resolved here, with this job's Hydra node the current one as during the job, and fixed."""
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(cfg)
    try:
        out_dir = str(cfg.out_dir)
        job_dir = os.path.join(cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir) if multirun else str(cfg.hydra.run.dir)
    except OmegaConfBaseException as exc:
        raise UserError(_explain_composition_error(exc)) from None
    finally:
        hydra_config.cfg = previous
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.out_dir = out_dir
    return cfg, job_dir


def compose_job(overrides: list[str], command: Command = DEFAULT_COMMAND) -> DictConfig:
    """The config a run with these overrides gets (tests and benchmarks train from it directly)."""
    with hydra_for(command):
        return resolve_job(compose_with_hydra(overrides, command.config_name), command.multirun)[0]


@dataclass(frozen=True)
class Jobs:
    """The jobs of a command line as Hydra's run mode or its BasicSweeper makes them."""

    hydra_overrides: list[str]   # hydra.* overrides: every job's
    task_overrides: list[list[str]]  # each job's own: what `hydra.overrides.task` holds in that job
    swept: set[str]              # keys with several values, to tell jobs apart in messages

    def describe(self, index: int) -> str:
        shown = [o for o in self.task_overrides[index] if o.split("=", 1)[0] in self.swept]
        return f"job {index + 1} ({' '.join(shown)})"


def sweep_jobs(command: Command) -> Jobs:
    """Every job of the command line, as Hydra's BasicSweeper will run them; call inside hydra_for(command)."""
    try:
        parsed = OverridesParser.create().parse_overrides(command.overrides)
    except HydraException as exc:
        raise UserError(f"cannot parse overrides: {str(exc).splitlines()[0]}") from None
    hydra_overrides = [o.input_line for o in parsed if o.is_hydra_override()]
    task = [o for o in parsed if not o.is_hydra_override()]
    if not command.multirun:
        return Jobs(hydra_overrides, [[o.input_line for o in task]], set())
    # A preset's hydra.sweeper.params (experiment=sweep_batch) sweep too: BasicSweeper puts them before
    # the command line's overrides, so a key given in both sweeps the command line's values.
    primary = compose_with_hydra(hydra_overrides + [o.input_line for o in task if not o.is_sweep_override()],
                                 command.config_name)
    params = OmegaConf.select(primary, "hydra.sweeper.params") or {}
    try:
        task = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()]
                                                        + [o.input_line for o in task])
        jobs = BasicSweeper.split_arguments(task, None)[0]
    except HydraException as exc:
        raise UserError(f"cannot sweep: {str(exc).splitlines()[0]}") from None
    return Jobs(hydra_overrides, jobs, {o.get_key_element() for o in task if o.is_sweep_override()})


def preflight(command: Command) -> None:
    """Compose and check every job the command line would run; refuse two jobs that share a directory
    before anything is created."""
    from runner.engine import check_run, prepare_run_dir  # models, torchvision, tensorboard: only for a run

    resolved: list[tuple[DictConfig, str]] = []
    owners: dict[str, int] = {}
    with hydra_for(command):
        jobs = sweep_jobs(command)  # composes the primary config (a preset's sweeper params): needs Hydra
        for index, job in enumerate(jobs.task_overrides):
            cfg, job_dir = resolve_job(compose_with_hydra(jobs.hydra_overrides + job, command.config_name),
                                       command.multirun)
            run_dir = os.path.abspath(cfg.out_dir)
            if run_dir in owners:
                raise UserError(f"{jobs.describe(owners[run_dir])} and {jobs.describe(index)} would both write "
                                f"{cfg.out_dir}; sweep a key that changes the result, or give each job its own out_dir")
            owners[run_dir] = index
            resolved.append((cfg, job_dir))
    for cfg, job_dir in resolved:
        if os.path.abspath(job_dir) != os.path.abspath(cfg.out_dir):
            prepare_run_dir(job_dir)  # hydra.run.dir / hydra.sweep.* overridden: Hydra's log goes there
        check_run(cfg)


def user_message(exc: UserError) -> str:
    """The message itself, also when a DataLoader worker re-raised it wrapped in its traceback."""
    text = str(exc)
    marker = f"{UserError.__module__}.{UserError.__qualname__}: "
    if "Original Traceback" in text and marker in text:
        return text.rsplit(marker, 1)[1].strip()
    return text


def fail(exc: UserError) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise exc
    print(f"mpt-run: error: {user_message(exc)}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def _job(cfg: DictConfig) -> None:
    from runner.engine import train

    _quiet_other_ranks()
    try:
        summary = train(cfg, list(HydraConfig.get().overrides.task))
    except UserError as exc:
        fail(exc)
        return
    if not is_main_process():
        return
    metric = summary["metric"]
    shown = "n/a" if metric is None else f"{metric:.2f}"
    status = (f"DIVERGED ({summary['diverged_reason']})" if summary["diverged"] else
              f"OUT OF MEMORY (data.batch_size={summary['batch_size']})" if summary.get("oom") else "ok")
    print(f"{summary['model']} {summary['precision']} scale={summary['scale']}: {summary['metric_name']}={shown} "
          f"skipped={summary['skipped_steps']} {status} -> {summary['run_dir']}")


def is_main_process() -> bool:
    """False in ranks 1.. of a torchrun job or of a multi-GPU SLURM job of the submitit launcher
    (configs/hydra/launcher/slurm_gpus.yaml): they neither print the result nor write a log file."""
    slurm = os.environ.get("SLURM_PROCID") if "SUBMITIT_EXECUTOR" in os.environ else None
    return os.environ.get("RANK", slurm or "0") == "0"


def _quiet_other_ranks() -> None:
    """In a submitit job Hydra has configured logging already (torchrun ranks get job_logging=none
    in main()): only rank 0 keeps the file handler of <out_dir>/mpt.log."""
    if is_main_process():
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


_hydra_main = hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")(_job)


def main() -> None:
    try:
        command = parse_command(sys.argv[1:])
        if command.is_run:
            try:
                preflight(command)
            except UserError as exc:
                fail(exc)
            if not is_main_process():  # rank 0 writes <out_dir>/mpt.log; the others log warnings to stderr
                sys.argv.append("hydra/job_logging=none")
        _hydra_main()
    except KeyboardInterrupt:
        # Ctrl-C before the run installed its own handler (composing, importing): nothing to save.
        sys.exit(130)
