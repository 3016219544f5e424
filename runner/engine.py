"""The training loop shared by every model and precision mode.

train(cfg) takes a composed config (no Hydra runtime needed, so tests call it
directly) and returns the run summary. One iteration, whatever the precision:

    host batch -> count = task.count(batch) -> to device (except task.host_keys) -> policy.cast_inputs
    ctx.begin(step)                                     # step: 1-based, the number the logs show
    with policy.autocast(): task.train_step(model, batch, ctx)
        ctx.backward(loss, name) / ctx.step(name)       # runner/step.py: per-optimizer master
                                                        # weights, unscale, skip, clip, publish
    ctx.finish_iteration(...)                           # every stepped optimizer's scaler, on device

Gradient statistics (runner/gradstats.py) bracket an iteration with stats.begin(step) /
stats.end(step, S); between sampled steps every one of those calls returns at once.
stats.end also hands scale=auto its max|grad|.

Under torchrun the same loop runs in every process (runner/distributed.py): each trains on its
share of every global batch, the step context all-reduces gradients and overflow flags, and
rank 0 alone holds the lock and writes files (logs, stats, checkpoints, summary) and evaluates
while the others wait. A CUDA out-of-memory error ends a single-process run as `oom: true`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset
from torchvision.utils import save_image

from models import TASKS
from runner import checkpoint, distributed
from runner.config import RootConfig, validate
from runner.errors import UserError
from runner.gradstats import GradStats
from runner.interrupt import GracefulInterrupt
from runner.loader import check_plan, epoch_batches, eval_batches, shard_batches, shareable
from runner.logs import RunLogger, write_json_atomic, write_run_summary
from runner.measure import SavedActivations, StepTimer, memory_report
from runner.optim import build_optimizer, build_scheduler
from runner.precision import PrecisionPolicy, make_policy
from runner.rundir import RunLock, config_differences, result_config, write_run_config
from runner.scaling import AutoScaler, make_scaler, parse_scale
from runner.step import OptimizerSlot, TrainStep
from runner.task import Batch, Task
from runner.trees import to_device

log = logging.getLogger("mpt")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name} but no CUDA device is available; use device=cpu or device=auto")
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} logical cores, {torch.get_num_threads()} threads)"


def machine_name() -> str:
    """The host and its CPU model: reruns of one seed on two machines tell run-to-run spread apart."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:  # not Linux
        pass
    return f"{platform.node()} ({cpu})"


def seed_everything(seed: int, deterministic: bool, threads: int | None) -> None:
    """Everything that decides a run's numbers on this machine: RNGs, algorithms, CPU threads."""
    if threads is not None:
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


def prepare_run_dir(out_dir: str) -> Path:
    run_dir = Path(out_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test.{os.getpid()}"  # per process: two runs may start at once
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to out_dir {run_dir} ({exc.strerror or exc}); "
                        f"pass out_root=<a writable directory> or out_dir=<path>") from None
    return run_dir


def check_precision_scale(root: RootConfig, policy: PrecisionPolicy) -> None:
    kind, _ = parse_scale(root.scale)
    if policy.low_dtype is None and kind != "none":
        raise UserError(f"precision={policy.name} computes in FP32 and takes no loss scale; drop scale={root.scale} "
                        f"or choose a reduced-precision mode such as precision=mp")


# What trainer.resume=force may change when a run continues: how long it trains.
EXTENDABLE = ("trainer.epochs", "trainer.max_steps")


@dataclass
class PreviousRun:
    """What a run directory already holds for this configuration."""

    summary: dict[str, Any] | None = None  # a finished (or diverged) run: reported, never retrained
    state: dict[str, Any] | None = None    # the checkpoint of an unfinished run: resumed
    forced: list[str] = field(default_factory=list)  # keys trainer.resume=force allowed to differ


def _refuse(run_dir: Path, what: str, differing: list[str], resume: str) -> UserError:
    keys = ", ".join(differing[:6]) + (f" and {len(differing) - 6} more" if len(differing) > 6 else "")
    hint = ("trainer.resume=force continues it with the new length" if set(differing) <= set(EXTENDABLE)
            and resume != "force" else "choose another out_dir, or rerun with the values that run used")
    return UserError(f"{run_dir} holds {what} whose {keys} differ from this command; {hint}")


def inspect_run_dir(run_dir: Path, current: dict[str, Any], resume: str) -> PreviousRun:
    """Decide what an existing run directory means for a run of config `current`.

    A finished run is reported as it is; an unfinished one resumes when its configuration
    is the same (or, with trainer.resume=force, differs only in its length). A finished run
    that is extended keeps its summary as summary.step<N>.json. Anything else is refused.
    """
    summary_path, ckpt_path = run_dir / "summary.json", run_dir / checkpoint.CHECKPOINT_NAME
    if summary_path.exists() and not read_summary(summary_path).get("oom"):  # an OOM run is tried again
        summary = read_summary(summary_path)
        differing = config_differences(summary.get("result_config", {}), current)
        if not differing:
            return PreviousRun(summary=summary)
        if not (resume == "force" and set(differing) <= set(EXTENDABLE) and ckpt_path.exists()):
            raise _refuse(run_dir, "a finished run", differing, resume)
    if not ckpt_path.exists():
        return PreviousRun()
    if resume == "never":
        raise UserError(f"{ckpt_path} already exists and trainer.resume=never; choose another out_dir "
                        f"(or trainer.resume=auto to continue that run)")
    state = checkpoint.load(ckpt_path)
    differing = config_differences(state.get("result_config", {}), current)
    if differing and not (resume == "force" and set(differing) <= set(EXTENDABLE)):
        raise _refuse(run_dir, "an unfinished run", differing, resume)
    return PreviousRun(state=state, forced=differing)


def archive_summary(run_dir: Path) -> None:
    """Keep a finished run's summary under its step count before the run is extended."""
    path = run_dir / "summary.json"
    if path.exists():
        steps = read_summary(path).get("steps")
        path.replace(run_dir / f"summary.step{steps}.json")


def read_summary(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); it was left untouched: move it aside to rerun "
                        f"that run") from None


@dataclass
class RunPlan:
    """A checked run: everything that can be wrong with the input has been found."""

    root: RootConfig
    device: torch.device
    policy: PrecisionPolicy
    task: Task
    run_dir: Path
    train_set: Dataset
    eval_set: Dataset
    per_epoch: int  # batches in epoch 0 (what epochs=N and schedule_unit=epochs count)


def check_optimizer_names(root: RootConfig, task: Task) -> None:
    unknown = sorted(set(root.trainer.optimizers) - set(task.optimizer_names))
    if unknown:
        raise UserError(f"bad config: trainer.optimizers.{unknown[0]}: model {task.name} has no optimizer "
                        f"{unknown[0]!r}; its optimizers are: {', '.join(task.optimizer_names)}")


def check_run(cfg: DictConfig, inspect_existing: bool = True) -> RunPlan:
    """Validate a composed config, its data and what its run directory holds; raises UserError
    with a one-line fix on bad input.

    Seeds the global RNG and builds the datasets (cheap: they read lazily), so that the
    pre-flight of every sweep job finds a training set smaller than one batch too, and an
    unreadable or mismatching checkpoint before any job trains.
    """
    root = validate(cfg)
    name = None if root.model is None else root.model.get("name")
    if name not in TASKS:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(TASKS)}")
    device = resolve_device(root.device)
    policy = make_policy(root.precision.name, device)
    check_precision_scale(root, policy)
    task = TASKS[name](cfg.model, cfg.data, root.seed)
    check_optimizer_names(root, task)
    task.check_data()
    run_dir = prepare_run_dir(root.out_dir)
    if inspect_existing:
        inspect_run_dir(run_dir, result_config(cfg), root.trainer.resume)
    seed_everything(root.seed, root.trainer.deterministic, root.threads)
    train_set, eval_set = task.build_train_data(), task.build_eval_data()
    batch_size, world_size = task.data_cfg.batch_size, distributed.env_world_size()
    plan = shareable(lambda g: task.epoch_batches(train_set, batch_size, g), world_size)
    first_epoch = epoch_batches(plan, root.seed, 0)
    check_plan(first_epoch, train_set, batch_size, world_size)
    return RunPlan(root, device, policy, task, run_dir, train_set, eval_set, len(first_epoch))


class Trainer:
    """Holds one run's state; `run()` trains, evaluates, checkpoints and summarises."""

    def __init__(self, cfg: DictConfig) -> None:
        plan = check_run(cfg, inspect_existing=False)  # run() inspects the run directory under its lock
        self.cfg, self.root, self.t = cfg, plan.root, plan.root.trainer
        self.task, self.run_dir = plan.task, plan.run_dir
        root = self.root
        self.world = distributed.init(plan.device)  # World() outside torchrun
        self.device = distributed.local_device(plan.device, self.world)
        self.policy = plan.policy if self.device == plan.device else make_policy(root.precision.name, self.device)

        self.policy.configure_backends()
        if self.device.type == "cuda":  # jobs of one sweep share a process: each reports its own peak
            torch.cuda.reset_peak_memory_stats(self.device)
        self.train_set, self.eval_set = plan.train_set, plan.eval_set
        data = self.task.data_cfg
        self.batch_size = data.batch_size
        self.eval_batch_size = data.eval_batch_size or data.batch_size
        self.num_workers = data.num_workers
        per_epoch = plan.per_epoch
        self.total_steps = self.t.epochs * per_epoch if self.t.epochs else self.t.max_steps

        self.model = self.policy.prepare_model(self.task.build_model().to(self.device))
        self.world.broadcast_model(self.model)  # before master copies are made from it
        self.slots = self.build_slots(per_epoch)
        # Gradient statistics; scale=auto reads its max|grad| from them every auto_every steps.
        # Rank 0 writes them (gradients are all-reduced, so its weight gradients are everyone's).
        auto_every = root.scaler.auto_every if any(isinstance(s.scaler, AutoScaler) for s in self.slots.values()) else 0
        stats_cfg = root.stats if self.world.is_main else dataclasses.replace(root.stats, enabled=False)
        self.stats = GradStats(stats_cfg, self.model, self.run_dir, self.policy.low_dtype, scaler_every=auto_every)
        injected = root.debug.nonfinite_ranks
        self.ctx = TrainStep(self.policy, self.slots, self.stats,
                             root.debug.nonfinite_steps if not injected or self.world.rank in injected else [],
                             self.world)
        if self.world.rank:  # same initial weights, then each rank its own dropout / augmentation stream
            torch.manual_seed(root.seed + 1_000_003 * self.world.rank)
            random.seed(root.seed + 1_000_003 * self.world.rank)

        self.step = 0      # optimizer iterations done; the iteration in progress is number step + 1
        self.samples = 0   # sum of task.count(batch) over all ranks: samples, tokens, ... (task.count_unit)
        self.activation_bytes: int | None = None
        self.measured_on: dict[str, int] | None = None  # the batch activations were measured on
        self.timer = StepTimer(self.device, self.t.timing_warmup_steps)
        self._window_overflows = 0
        self._log_sums: dict[str, torch.Tensor] = {}
        self._log_count = 0
        self.diverged_reason: str | None = None
        self.oom = False   # a CUDA out-of-memory error ended the run (batch-size sweeps)
        self.logger: RunLogger | None = None  # rank 0's metrics.jsonl and TensorBoard
        self.result_config = result_config(cfg)
        self.forced: list[str] = []  # keys a trainer.resume=force resume allowed to change
        self._previous_state: dict[str, Any] | None = None  # rank 0: the checkpoint inspect_run_dir read
        self._ranks: list[dict[str, Any]] | None = None  # rank 0, saving: every rank's own state
        self.log_offsets = {"metrics": 0, "stats": 0}
        self._last_checkpoint = 0.0
        self._wall_start = time.perf_counter()
        self._wall_before = 0.0  # wall time of earlier segments of a resumed run

    def epoch_plan(self, generator: torch.Generator) -> list[list[int]]:
        plan = shareable(lambda g: self.task.epoch_batches(self.train_set, self.batch_size, g), self.world.size)
        return plan(generator)

    def build_slots(self, per_epoch: int) -> dict[str, OptimizerSlot]:
        specs = self.task.optimizer_params(self.model)
        if set(specs) != set(self.task.optimizer_names):
            raise RuntimeError(f"{type(self.task).__name__}.optimizer_params() returned {sorted(specs)}, "
                               f"but its optimizer_names are {list(self.task.optimizer_names)}")
        format_max = torch.finfo(self.policy.low_dtype or torch.float32).max
        slots = {}
        for name, spec in specs.items():
            cfg = self.t.for_optimizer(name)
            bound = self.policy.bind(spec)
            optimizer = build_optimizer(cfg, bound.optimizer_groups)
            slots[name] = OptimizerSlot(
                name, cfg, bound, optimizer, build_scheduler(cfg, optimizer, self.total_steps, per_epoch),
                make_scaler(self.root.scale, self.root.scaler, format_max, self.device))
        return slots

    # --- checkpoint -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "result_config": self.result_config,
            "step": self.step, "samples": self.samples,
            "model": self.model.state_dict(),
            "slots": {n: slot.state_dict() for n, slot in self.slots.items()},
            "task": self.task.state_dict(),
            "rng": checkpoint.rng_state(),
            # data-parallel: each rank's RNG and task state (carried per-row state is the rank's own)
            "ranks": self._ranks,
            "diverged_reason": self.diverged_reason,
            # where the logs end at this step: a resume cuts them back to it
            "log_offsets": {"metrics": self.logger.jsonl.offset(), "stats": self.stats.offset()},
            # the open logging window, so the first record after a resume averages the same steps
            "window": {"sums": {k: v.detach().cpu() for k, v in self._log_sums.items()},
                       "count": self._log_count, "overflows": self._window_overflows},
            # so a resumed run's summary covers the whole run, not only its last part
            "measurements": {"activation_bytes": self.activation_bytes, "measured_on": self.measured_on,
                             "timer": self.timer.state_dict(), "wall_s": self.wall_s()},
        }

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        try:
            self.step, self.samples = state["step"], state["samples"]
            self.model.load_state_dict(state["model"])
            for name, slot in self.slots.items():
                slot.load_state_dict(state["slots"][name])
            ranks = state.get("ranks") or [{"rng": state["rng"], "task": state["task"]}]
            if len(ranks) != self.world.size:  # each rank resumes its own rows and random streams
                raise UserError(f"checkpoint {path} was written by {len(ranks)} process(es); resume it with as many "
                                f"(torchrun --nproc_per_node={len(ranks)}, or without torchrun for 1)")
            own = ranks[self.world.rank]
            self.task.load_state_dict(own["task"])
            checkpoint.set_rng_state(own["rng"])
            self.diverged_reason = state["diverged_reason"]
            self.log_offsets = state["log_offsets"]
            window = state["window"]
            measured = state["measurements"]
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"checkpoint {path} does not fit this run ({reason}); it was left untouched: "
                            f"move it aside or choose another out_dir") from None
        self._log_sums = {k: v.to(self.device) for k, v in window["sums"].items()}
        self._log_count, self._window_overflows = window["count"], window["overflows"]
        self.activation_bytes, self.measured_on = measured["activation_bytes"], measured["measured_on"]
        self.timer.load_state_dict(measured["timer"])
        self._wall_before = measured["wall_s"]

    def save_checkpoint(self) -> None:
        """Rank 0 writes it, with every rank's RNG and task state (all ranks call this at the same step)."""
        ranks = None
        if self.world.active:
            ranks = self.world.gather({"rng": checkpoint.rng_state(),
                                       "task": to_device(self.task.state_dict(), torch.device("cpu"))})
        if self.world.is_main:
            self._ranks = ranks
            checkpoint.save(self.run_dir / checkpoint.CHECKPOINT_NAME, self.state_dict())
        self._last_checkpoint = time.monotonic()

    def checkpoint_due(self, minutes_passed: bool) -> bool:
        every = self.t.checkpoint_every
        return bool((every and self.step % every == 0) or minutes_passed)

    def minutes_passed(self) -> bool:
        minutes = self.t.checkpoint_minutes
        return bool(minutes and time.monotonic() - self._last_checkpoint >= 60 * minutes)

    def wall_s(self) -> float:
        return self._wall_before + time.perf_counter() - self._wall_start

    # --- one iteration ---------------------------------------------------------------
    def train_iteration(self, batch: Batch, measure_memory: bool) -> tuple[dict[str, torch.Tensor], bool]:
        """Runs iteration number step + 1; returns the task's logs and whether any optimizer skipped."""
        number = self.step + 1
        self.ctx.begin(number)
        self.ctx.measure_grad_bytes = measure_memory
        self.stats.begin(number)
        recorder = SavedActivations(self.model.parameters()) if measure_memory else None
        with (recorder.recording() if recorder else contextlib.nullcontext()), self.policy.autocast():
            logs = self.task.train_step(self.model, batch, self.ctx)
        if recorder:
            self.activation_bytes = recorder.peak
        first = next(iter(self.slots.values()))
        stats_max = self.stats.end(number, first.scaler.scale)  # auto's max|grad| on its steps, else None
        return logs, self.ctx.finish_iteration(stats_max)

    # --- the loop -------------------------------------------------------------------
    def to_device(self, batch: Batch) -> Batch:
        host = {k: v for k, v in batch.items() if k in self.task.host_keys}
        moved = to_device({k: v for k, v in batch.items() if k not in self.task.host_keys}, self.device)
        return self.policy.cast_inputs({**moved, **host})

    def evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates the whole evaluation set while the others wait; every rank gets its metrics.

        Not sharded: each task computes its metric its own way (top-1 counts, mAP over all
        detections, perplexity, CER/WER), and one process over the whole set gives the numbers
        a single-process run gives, with no per-task reduction code."""
        metrics = self._evaluate(self.logger) if self.world.is_main else {}
        return self.world.broadcast(metrics)

    def _evaluate(self, logger: RunLogger) -> dict[str, float]:
        """Evaluate, log the metrics and any pictures (TensorBoard eval/<model>/<name>, <name>_step<N>.png)."""
        self.model.eval()
        batches = (self.to_device(b) for b in eval_batches(self.eval_set, self.eval_batch_size, self.num_workers,
                                                           self.task.collate, self.t.eval_batches))
        with torch.no_grad(), self.policy.autocast():
            result = self.task.evaluate(self.model, batches, self.ctx)
        self.model.train()
        logger.log(self.step, "eval", result.metrics)
        for name, image in result.images.items():
            image = image.detach().float().clamp(0, 1).cpu()
            logger.tb.add_image(logger.tag("eval", name), image, self.step)
            save_image(image, self.run_dir / f"{name}_step{self.step}.png")
        return result.metrics

    def log_train(self) -> None:
        """Log the window's means (over steps and ranks); every rank calls it at the same steps."""
        keys = sorted(self._log_sums)
        means = self.world.mean(torch.stack([self._log_sums[k] for k in keys])).tolist() if keys else []
        values = {k: v / self._log_count for k, v in zip(keys, means)}
        slots = list(self.slots.values())
        values.update({
            "lr": slots[0].lr,
            "samples_per_s": self.timer.recent_samples_per_s(self.t.log_every),
            "loss_scale": float(slots[0].scaler.scale),
            "overflow": self._window_overflows,
            "skipped_steps": sum(s.skipped_steps for s in slots),
        })
        if len(slots) > 1:  # every optimizer's own lr, scale and skips
            for s in slots:
                values.update({f"lr_{s.name}": s.lr, f"loss_scale_{s.name}": float(s.scaler.scale),
                               f"skipped_steps_{s.name}": s.skipped_steps})
        if self.logger is not None:
            self.logger.log(self.step, "train", values)
        log.info("step %d/%d loss %.4f lr %.4g scale %g skipped %d", self.step, self.total_steps,
                 values.get("loss", float("nan")), values["lr"], values["loss_scale"], values["skipped_steps"])
        self._log_sums, self._log_count, self._window_overflows = {}, 0, 0
        bad = sorted(k for k in logs_checked(values) if not math.isfinite(values[k]))
        if bad and self.diverged_reason is None:
            self.diverged_reason = f"logged {', '.join(bad)} non-finite at step {self.step}"
            log.warning("diverged: %s", self.diverged_reason)

    def check_skips(self) -> None:
        limit = self.t.abort_after_skips
        for s in self.slots.values():
            if limit and s.consecutive_skips >= limit and self.diverged_reason is None:
                self.diverged_reason = (f"{s.consecutive_skips} consecutive skipped steps of optimizer {s.name} "
                                        f"(non-finite gradients up to step {self.step}, loss scale "
                                        f"{float(s.scaler.scale):g})")
                log.warning("diverged: %s", self.diverged_reason)

    def run(self, overrides: list[str] | None = None) -> dict[str, Any]:
        """Train (or resume) under the run directory's lock; a finished run returns its summary.

        SIGTERM / Ctrl-C finish the step in progress, write a checkpoint and exit (130 / 143).
        Under torchrun rank 0 holds the lock and decides what the directory means; the other
        ranks follow its decision and read the same checkpoint."""
        with contextlib.ExitStack() as lock, GracefulInterrupt() as interrupt:
            kind, value = self.world.broadcast(self._inspect(lock, overrides))
            if kind == "error":
                raise UserError(value)
            if kind == "finished":
                log.info("run already ended; summary at %s", self.run_dir / "summary.json")
                return value
            if kind == "resume":
                path = self.run_dir / checkpoint.CHECKPOINT_NAME
                # rank 0 read it already; the others read it from the (shared) run directory
                state = self._previous_state if self.world.is_main else checkpoint.load(path)
                self._previous_state = None
                self.load_state_dict(state, path)
                self.forced = value
                log.info("resumed at step %d%s", self.step,
                         f" (trainer.resume=force: {', '.join(value)} changed)" if value else "")
            return self.train_and_summarise(interrupt)

    def _inspect(self, lock: contextlib.ExitStack, overrides: list[str] | None) -> tuple[str, Any]:
        """Rank 0 takes the lock and says what the run directory means: ('finished', summary) |
        ('resume', forced keys) | ('fresh', None) | ('error', message) (under torchrun, so that
        every rank exits with it); other ranks return None and receive rank 0's answer."""
        if not self.world.is_main:
            return None  # type: ignore[return-value]
        try:
            lock.enter_context(RunLock(self.run_dir))
            previous = inspect_run_dir(self.run_dir, self.result_config, self.t.resume)
            if previous.summary is not None:
                return "finished", previous.summary
            if previous.state is not None:
                archive_summary(self.run_dir)  # only there when a finished run is extended (force)
                self._previous_state = previous.state
                return "resume", previous.forced
            write_run_config(self.run_dir, self.cfg, overrides or [])
            return "fresh", None
        except UserError as exc:
            if not self.world.active:
                raise
            return "error", str(exc)

    def train_and_summarise(self, interrupt: GracefulInterrupt) -> dict[str, Any]:
        if self.world.is_main:
            self.logger = RunLogger(self.run_dir, self.step, self.log_offsets["metrics"], model=self.task.name)
            self.stats.open(self.logger.tb, self.log_offsets["stats"], model=self.task.name)
        self.model.train()
        metrics: dict[str, float] = {}
        try:
            self.train_loop(interrupt)
            metrics = self.evaluate()
        except torch.OutOfMemoryError:
            if self.world.active:
                raise  # the other ranks wait in a collective: end the whole job (torchrun stops them)
            self.oom = True
        finally:
            self.stats.close()
            if self.logger is not None:
                self.logger.close()
        if self.oom:
            self.release_memory()
            log.warning("out of memory at step %d with data.batch_size=%d", self.step + 1, self.batch_size)
        summary = self.summary(metrics, self.diverged_reason, self.wall_s())
        if self.world.is_main:
            write_run_summary(self.run_dir, summary)  # TensorBoard HParams + Custom Scalars; before summary.json
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary

    def train_loop(self, interrupt: GracefulInterrupt) -> None:
        stream = shard_batches(self.train_set, self.epoch_plan, self.num_workers, self.task.collate,
                               self.root.seed, self.step, self.task.reset_state, self.world.shard, self.world.rank)
        largest = -1 if self.measured_on is None else self.measured_on["count"]
        self._last_checkpoint = time.monotonic()
        while self.step < self.total_steps and self.diverged_reason is None:
            host_batch, share = next(stream)
            count = self.task.count(host_batch)
            batch = self.to_device(host_batch)
            # Activation memory is measured on the largest batch so far (for fixed-size
            # batches: once, on the first), so a short first batch cannot under-report.
            measure = count > largest
            self.ctx.grad_weight = share
            self.timer.start()
            logs, skipped = self.train_iteration(batch, measure_memory=measure)
            # One host-side exchange per iteration (none for one process): a signal or a due
            # time-based checkpoint on any rank stops or checkpoints all of them at this step,
            # and the global batch's count makes throughput and `samples` global.
            stop, minutes_passed, global_count = self.world.sum(
                interrupt.requested is not None, self.minutes_passed(), count)
            global_count = int(global_count) if isinstance(count, int) else global_count
            self.timer.stop(global_count)
            if measure:
                largest = count
                self.measured_on = {"step": self.step + 1, "count": count}
            self._window_overflows += int(skipped)
            for k, v in logs.items():
                self._log_sums[k] = self._log_sums.get(k, 0) + v.detach().float()
            self._log_count += 1
            self.step += 1
            self.samples += global_count
            if self.step % self.t.log_every == 0 or self.step == self.total_steps:
                self.log_train()
            if self.t.eval_every and self.step % self.t.eval_every == 0 and self.step < self.total_steps:
                self.evaluate()
            self.check_skips()
            if stop:
                interrupt.follow()  # a rank that got no signal itself stops as the one that did
                self.save_checkpoint()
                interrupt.stop(self.step)
            if self.checkpoint_due(bool(minutes_passed)):
                self.save_checkpoint()
        if self._log_count:
            self.log_train()
        self.save_checkpoint()

    def release_memory(self) -> None:
        """After an out-of-memory error: drop gradients and optimizer state and return cached
        blocks, so the next job of a sweep in this process starts from an empty GPU."""
        self.model.zero_grad(set_to_none=True)
        for slot in self.slots.values():
            slot.optimizer.zero_grad(set_to_none=True)
            slot.optimizer.state.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def summary(self, metrics: dict[str, float], diverged_reason: str | None, wall_s: float) -> dict[str, Any]:
        headline = metrics.get(self.task.metric_name)
        if diverged_reason is None and headline is not None and not math.isfinite(headline):
            diverged_reason = f"final {self.task.metric_name} is {headline}"
        slots = list(self.slots.values())
        masters = [m for s in slots for m in (s.params.master_params or [])]
        grad_bytes = [s.grad_bytes for s in slots if s.grad_bytes is not None]
        return {
            "model": self.task.name,
            "precision": self.policy.name,
            "scale": self.root.scale,
            "scale_final": float(slots[0].scaler.scale),
            "device": self.device.type,
            "device_name": device_name(self.device),
            "machine": machine_name(),
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),  # CPU intra-op threads: they change reduction order
            "precision_details": self.policy.describe(),
            "steps": self.step,
            "samples": self.samples,
            "count_unit": self.task.count_unit,
            "batch_size": self.batch_size,  # the global batch (data.batch_size), split over world_size ranks
            "world_size": self.world.size,
            "oom": self.oom,
            "metric_name": self.task.metric_name,
            "metric": headline,
            "higher_is_better": self.task.higher_is_better,
            "metrics": metrics,
            **self.timer.summary(),
            "memory": {**memory_report(self.device, self.model, masters, [s.optimizer for s in slots],
                                       self.activation_bytes, sum(grad_bytes) if grad_bytes else None),
                       "measured_on": self.measured_on},
            "optimizers": {s.name: {"optimizer": s.cfg.optimizer, "lr_last": s.lr,
                                    "scale_final": float(s.scaler.scale), "skipped_steps": s.skipped_steps}
                           for s in slots},
            "skipped_steps": sum(s.skipped_steps for s in slots),
            "diverged": diverged_reason is not None,
            "diverged_reason": diverged_reason,
            "wall_s": wall_s,
            "run_dir": str(self.run_dir),
            "resume_forced": self.forced,
            "result_config": self.result_config,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }


def logs_checked(values: dict[str, Any]) -> list[str]:
    """The logged keys whose non-finite value means the run diverged: the task's losses."""
    return [k for k, v in values.items() if "loss" in k and k != "loss_scale" and not k.startswith("loss_scale_")
            and isinstance(v, float)]


def train(cfg: DictConfig, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train one run described by a composed config; returns (and writes) its summary.

    `overrides`: the command line's, recorded in <run_dir>/.hydra/overrides.yaml on a fresh start."""
    return Trainer(cfg).run(overrides)
