"""The training loop shared by every model and precision mode.

train(cfg) takes a composed config (no Hydra runtime needed, so tests call it
directly) and returns the run summary. One step, whatever the precision:

    batch -> policy.cast_inputs -> with policy.autocast(): task.train_step(model, batch, step_fn)
    step_fn(loss, name):  scaler.scale_loss(loss).backward()
                          grads = params[name].grads_for_update()      # to FP32 master if any
                          found_inf = scaler.unscale_(grads)           # no host sync
                          if not found_inf.item():                     # the one sync per optimizer step
                              clip; optimizer.step(); scheduler.step(); params[name].publish()
    scaler.update(found_inf, grad_max)                                 # once per iteration, on device

Gradient statistics (runner/gradstats.py) bracket an iteration with stats.begin(step) /
stats.end(step, S) and look at the unscaled grads and the optimizer step; between sampled
steps every one of those calls returns at once. stats.end also hands scale=auto its max|grad|.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from models import TASKS
from runner import checkpoint
from runner.config import RootConfig, validate
from runner.errors import UserError
from runner.gradstats import GradStats
from runner.loader import batches_per_epoch, eval_batches, train_batches
from runner.logs import RunLogger, write_json_atomic
from runner.measure import SavedActivations, StepTimer, memory_report
from runner.optim import build_optimizer, build_scheduler
from runner.precision import BoundParams, PrecisionPolicy, make_policy, map_tensors
from runner.scaling import AutoScaler, LossScaler, grad_abs_max, make_scaler, parse_scale
from runner.task import Batch, Task

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


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


def prepare_run_dir(out_dir: str) -> Path:
    run_dir = Path(out_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
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


@dataclass
class RunPlan:
    """A checked run: everything that can be wrong with the input has been found."""

    root: RootConfig
    device: torch.device
    policy: PrecisionPolicy
    task: Task
    run_dir: Path


def check_run(cfg: DictConfig) -> RunPlan:
    """Validate a composed config; raises UserError with a one-line fix on bad input."""
    root = validate(cfg)
    name = None if root.model is None else root.model.get("name")
    if name not in TASKS:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(TASKS)}")
    device = resolve_device(root.device)
    policy = make_policy(root.precision.name, device)
    check_precision_scale(root, policy)
    task = TASKS[name](cfg.model, cfg.data, root.seed)
    task.check_data()
    return RunPlan(root, device, policy, task, prepare_run_dir(root.out_dir))


class Trainer:
    """Holds one run's state; `run()` trains, evaluates, checkpoints and summarises."""

    def __init__(self, cfg: DictConfig) -> None:
        plan = check_run(cfg)
        self.cfg, self.root, self.t = cfg, plan.root, plan.root.trainer
        self.device, self.policy, self.task, self.run_dir = plan.device, plan.policy, plan.task, plan.run_dir
        root = self.root

        seed_everything(root.seed, self.t.deterministic)
        self.policy.configure_backends()
        self.train_set = self.task.build_train_data()
        self.eval_set = self.task.build_eval_data()
        data = self.task.data_cfg
        self.batch_size = data.batch_size
        self.eval_batch_size = data.eval_batch_size or data.batch_size
        self.num_workers = data.num_workers
        per_epoch = batches_per_epoch(self.train_set, self.batch_size)
        self.total_steps = self.t.epochs * per_epoch if self.t.epochs else self.t.max_steps

        self.model = self.policy.prepare_model(self.task.build_model().to(self.device))
        self.params: dict[str, BoundParams] = {
            name: self.policy.bind(ps) for name, ps in self.task.optimizer_params(self.model).items()}
        self.optimizers = {name: build_optimizer(self.t, b.optimizer_params) for name, b in self.params.items()}
        self.schedulers = {name: build_scheduler(self.t, opt, self.total_steps, per_epoch)
                           for name, opt in self.optimizers.items()}
        format_max = torch.finfo(self.policy.low_dtype or torch.float32).max
        self.scaler: LossScaler = make_scaler(root.scale, root.scaler, format_max, self.device)
        # Gradient statistics; scale=auto reads its max|grad| from them every auto_every steps.
        self.stats = GradStats(root.stats, self.model, self.run_dir, self.policy.low_dtype,
                               scaler_every=self.scaler.stats_every if isinstance(self.scaler, AutoScaler) else 0)

        self.step = 0
        self.samples = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.activation_bytes: int | None = None
        self.timer = StepTimer(self.device, self.t.timing_warmup_steps)
        # per-iteration scaler inputs, filled by step_fn
        self._iter_found: torch.Tensor | None = None
        self._iter_grad_max: torch.Tensor | None = None
        self._window_overflows = 0
        self._log_sums: dict[str, torch.Tensor] = {}
        self._log_count = 0
        self.diverged_reason: str | None = None
        self._wall_start = time.perf_counter()
        self._wall_before = 0.0  # wall time of earlier segments of a resumed run

    # --- identity / checkpoint -------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return {"model": self.task.name, "precision": self.policy.name, "scale": str(self.root.scale)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "identity": self.identity(),
            "step": self.step, "samples": self.samples,
            "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
            "model": self.model.state_dict(),
            "master": {n: [m.detach() for m in b.master_params] for n, b in self.params.items()
                       if b.master_params is not None},
            "optimizers": {n: o.state_dict() for n, o in self.optimizers.items()},
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
            "scaler": self.scaler.state_dict(),
            "rng": checkpoint.rng_state(),
            "diverged_reason": self.diverged_reason,
            # so a resumed run's summary covers the whole run, not only its last part
            "measurements": {"activation_bytes": self.activation_bytes, "timer": self.timer.state_dict(),
                             "wall_s": self.wall_s()},
        }

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        if state.get("identity") != self.identity():
            raise UserError(f"checkpoint {path} belongs to {state.get('identity')}, not {self.identity()}; "
                            f"use another out_dir or trainer.resume=never")
        self.step, self.samples = state["step"], state["samples"]
        self.skipped_steps, self.consecutive_skips = state["skipped_steps"], state["consecutive_skips"]
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for name, masters in state["master"].items():
                torch._foreach_copy_(self.params[name].master_params, [m.to(self.device) for m in masters])
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][name])
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state["schedulers"][name])
        self.scaler.load_state_dict(state["scaler"])
        checkpoint.set_rng_state(state["rng"])
        self.diverged_reason = state["diverged_reason"]
        measured = state["measurements"]
        self.activation_bytes = measured["activation_bytes"]
        self.timer.load_state_dict(measured["timer"])
        self._wall_before = measured["wall_s"]

    def save_checkpoint(self) -> None:
        checkpoint.save(self.run_dir / checkpoint.CHECKPOINT_NAME, self.state_dict())

    def wall_s(self) -> float:
        return self._wall_before + time.perf_counter() - self._wall_start

    def maybe_resume(self) -> bool:
        """Load an existing checkpoint. Returns True if that run had already ended (finished or diverged)."""
        path = self.run_dir / checkpoint.CHECKPOINT_NAME
        if not path.exists():
            return False
        if self.t.resume == "never":
            raise UserError(f"{path} already exists and trainer.resume=never; choose another out_dir "
                            f"(or trainer.resume=auto to continue that run)")
        self.load_state_dict(checkpoint.load(path), path)
        log.info("resumed from %s at step %d", path, self.step)
        return self.step >= self.total_steps or self.diverged_reason is not None

    # --- one optimizer step ----------------------------------------------------------------
    def step_fn(self, loss: torch.Tensor, name: str) -> None:
        bound, opt = self.params[name], self.optimizers[name]
        with torch.autocast(self.device.type, enabled=False):  # backward and update never autocast
            self.model.zero_grad(set_to_none=True)
            self.scaler.scale_loss(loss).backward()
            grads = bound.grads_for_update()
            if self.step in self.root.debug.nonfinite_steps and grads:
                grads[0].fill_(float("inf"))  # test hook: an overflow exactly here
            found_inf = self.scaler.unscale_(grads)
            self.stats.weight_grads(bound)
            if self.scaler.needs_grad_max:
                grad_max = grad_abs_max(grads)
                self._iter_grad_max = grad_max if self._iter_grad_max is None else torch.maximum(self._iter_grad_max, grad_max)
            self._iter_found = found_inf if self._iter_found is None else torch.maximum(self._iter_found, found_inf)
            if found_inf.item():  # the one host sync per optimizer step: skip needs the host
                self.skipped_steps += 1
                return
            if self.t.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(bound.optimizer_params, self.t.grad_clip, foreach=True)
            with self.stats.measure_update(bound, opt):
                opt.step()
            self.schedulers[name].step()
            bound.publish()

    def train_iteration(self, batch: Batch, record_activations: bool) -> dict[str, torch.Tensor]:
        self._iter_found, self._iter_grad_max = None, None
        self.stats.begin(self.step)
        recorder = SavedActivations(self.model.parameters()) if record_activations else None
        with (recorder.recording() if recorder else contextlib.nullcontext()), self.policy.autocast():
            logs = self.task.train_step(self.model, batch, self.step_fn)
        if recorder:
            self.activation_bytes = recorder.total
        found = self._iter_found if self._iter_found is not None else torch.zeros((), device=self.device)
        stats_max = self.stats.end(self.step, self.scaler.scale)  # auto's max|grad| on its steps, else None
        self.scaler.update(found, self._iter_grad_max if stats_max is None else stats_max, self.step)
        return logs

    # --- the loop -------------------------------------------------------------------
    def to_device(self, batch: Batch) -> Batch:
        moved = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
        return self.policy.cast_inputs(moved)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        batches = (self.to_device(b) for b in eval_batches(self.eval_set, self.eval_batch_size, self.num_workers,
                                                           self.task.collate, self.t.eval_batches))
        with torch.no_grad(), self.policy.autocast():
            result = self.task.evaluate(self.model, batches)
        self.model.train()
        return result.metrics

    def log_train(self, logger: RunLogger) -> None:
        values = {k: float(v) / self._log_count for k, v in self._log_sums.items()}
        values.update({
            "lr": self.optimizers[next(iter(self.optimizers))].param_groups[0]["lr"],
            "samples_per_s": self.timer.recent_samples_per_s(self.t.log_every),
            "loss_scale": float(self.scaler.scale),
            "overflow": self._window_overflows,
            "skipped_steps": self.skipped_steps,
        })
        logger.log(self.step, "train", values)
        log.info("step %d/%d loss %.4f lr %.4g scale %g skipped %d", self.step, self.total_steps,
                 values.get("loss", float("nan")), values["lr"], values["loss_scale"], self.skipped_steps)
        self._log_sums, self._log_count, self._window_overflows = {}, 0, 0

    def run(self) -> dict[str, Any]:
        summary_path = self.run_dir / "summary.json"
        if self.maybe_resume() and summary_path.exists():
            log.info("run already ended; summary at %s", summary_path)
            return json.loads(summary_path.read_text())
        logger = RunLogger(self.run_dir, self.step)
        self.stats.open(logger.tb)
        self.model.train()
        stream = train_batches(self.train_set, self.batch_size, self.num_workers, self.task.collate,
                               self.root.seed, self.step)
        try:
            while self.step < self.total_steps and self.diverged_reason is None:
                batch = self.to_device(next(stream))
                self.timer.start()
                skipped_before = self.skipped_steps
                logs = self.train_iteration(batch, record_activations=self.activation_bytes is None)
                self.timer.stop(self.batch_size)
                skipped_now = self.skipped_steps > skipped_before
                self._window_overflows += int(skipped_now)
                self.consecutive_skips = self.consecutive_skips + 1 if skipped_now else 0
                for k, v in logs.items():
                    self._log_sums[k] = self._log_sums.get(k, 0) + v.detach().float()
                self._log_count += 1
                self.step += 1
                self.samples += self.batch_size
                if self.step % self.t.log_every == 0 or self.step == self.total_steps:
                    self.log_train(logger)
                if self.t.eval_every and self.step % self.t.eval_every == 0 and self.step < self.total_steps:
                    logger.log(self.step, "eval", self.evaluate())
                if self.t.checkpoint_every and self.step % self.t.checkpoint_every == 0:
                    self.save_checkpoint()
                if self.t.abort_after_skips and self.consecutive_skips >= self.t.abort_after_skips:
                    self.diverged_reason = (f"{self.consecutive_skips} consecutive steps with non-finite gradients "
                                            f"(up to step {self.step}, loss scale {float(self.scaler.scale):g})")
                    log.warning("diverged: %s", self.diverged_reason)
            if self._log_count:
                self.log_train(logger)
            self.save_checkpoint()
            metrics = self.evaluate()
            logger.log(self.step, "eval", metrics)
        finally:
            self.stats.close()
            logger.close()
        summary = self.summary(metrics, self.diverged_reason, self.wall_s())
        write_json_atomic(summary_path, summary)
        return summary

    def summary(self, metrics: dict[str, float], diverged_reason: str | None, wall_s: float) -> dict[str, Any]:
        headline = metrics.get(self.task.metric_name)
        if diverged_reason is None and headline is not None and not math.isfinite(headline):
            diverged_reason = f"final {self.task.metric_name} is {headline}"
        masters = [m for b in self.params.values() for m in (b.master_params or [])]
        return {
            "model": self.task.name,
            "precision": self.policy.name,
            "scale": self.root.scale,
            "scale_final": float(self.scaler.scale),
            "device": self.device.type,
            "device_name": device_name(self.device),
            "torch_version": torch.__version__,
            "precision_details": self.policy.describe(),
            "steps": self.step,
            "samples": self.samples,
            "batch_size": self.batch_size,
            "metric_name": self.task.metric_name,
            "metric": headline,
            "higher_is_better": self.task.higher_is_better,
            "metrics": metrics,
            **self.timer.summary(),
            "memory": memory_report(self.device, self.model, masters, self.optimizers.values(),
                                    self.activation_bytes),
            "skipped_steps": self.skipped_steps,
            "diverged": diverged_reason is not None,
            "diverged_reason": diverged_reason,
            "wall_s": wall_s,
            "run_dir": str(self.run_dir),
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train one run described by a composed config; returns (and writes) its summary."""
    return Trainer(cfg).run()
