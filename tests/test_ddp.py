"""Data-parallel runs (runner/distributed.py) on CPU with gloo, against one process.

One 2-process group (torch.multiprocessing spawn with the environment torchrun sets) trains
every scenario below in turn; each rank returns its final weights, scales and skips and the
files it tried to write. The single-process references train in the test process itself.

Tolerances: a 2-rank run computes each rank's gradient over half of the global batch and sums
the halves (each weighted 1/2, exact), where one process sums all items at once: only the
order of the floating-point additions differs. fp32: a few float32 ulps per step (~1e-7
relative); over 6 SGD steps of a small, well-conditioned MLP that stays below rtol 1e-5 /
atol 1e-6. mp: the gradients are FP16 (11-bit significand) and are rounded once more when the
halves are weighted and summed, so each step's gradient may differ by ~2^-11 relative; the
FP32 master weights then differ by at most steps x lr x max|grad| x 2^-10, bounded by 2e-3
here. Across ranks nothing may differ at all: every rank applies the same reduced gradient.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import TensorDataset

import models
from data.common import LoaderConfig
from runner.cli import compose_job
from runner.errors import UserError
from runner.task import Batch, EvalResult, StepContext, Task
from tests.conftest import ENV, TINY

WORLD = 2


# --- a tiny deterministic task: no batch norm, a loss that is a mean over the batch's items -----
@dataclass
class TinyModelConfig:
    name: str = "ddp_tiny"
    hidden: int = 16
    dropout: float = 0.0  # > 0 makes each rank draw from its own RNG stream (per-rank RNG state)


@dataclass
class TinyDataConfig(LoaderConfig):
    name: str = "ddp_points"
    num_train: int = 64
    batch_size: int = 8


class TinyRegression(Task):
    name = "ddp_tiny"
    metric_name = "mse"
    higher_is_better = False
    model_schema = TinyModelConfig
    data_sources = {"ddp_points": TinyDataConfig}

    def build_model(self) -> nn.Module:
        c = self.model_cfg
        return nn.Sequential(nn.Linear(6, c.hidden), nn.Tanh(), nn.Dropout(c.dropout), nn.Linear(c.hidden, 1))

    def _points(self, n: int, key: int) -> TensorDataset:
        g = torch.Generator().manual_seed(key)
        x = torch.randn(n, 6, generator=g)
        return TensorDataset(x, (x[:, :3].sum(1, keepdim=True).sin() + 0.1 * x[:, 3:]).sum(1))

    def build_train_data(self) -> TensorDataset:
        return self._points(self.data_cfg.num_train, 1)

    def build_eval_data(self) -> TensorDataset:
        return self._points(32, 2)

    def collate(self, items: list[Any]) -> Batch:
        x, y = zip(*items)
        return {"input": torch.stack(x), "target": torch.stack(y)}

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        with ctx.fp32(model(batch["input"])) as out:
            loss = F.mse_loss(out.squeeze(1), batch["target"])
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        losses = []
        for batch in batches:
            with ctx.fp32(model(batch["input"])) as out:
                losses.append(F.mse_loss(out.squeeze(1), batch["target"]))
        return EvalResult({"mse": float(torch.stack(losses).mean())})


COMMON = ["trainer.optimizer=sgd", "trainer.lr=0.1", "trainer.momentum=0.9", "trainer.weight_decay=0",
          "trainer.schedule=constant", "trainer.warmup_steps=0", "trainer.max_steps=6", "trainer.log_every=2",
          "trainer.timing_warmup_steps=0", "threads=1", "device=cpu"]
DYNAMIC = ["precision=mp", "scale=dynamic", "scaler.init_scale=262144", "scaler.growth_interval=2"]
SCENARIOS: dict[str, list[str]] = {
    "fp32": [],
    "mp_fixed": ["precision=mp", "scale=128"],
    "mp_dynamic": DYNAMIC,                                   # overflows at first: skips must agree
    "one_rank_inf": ["precision=mp", "scale=128", "debug.nonfinite_steps=[3]", "debug.nonfinite_ranks=[1]"],
    "lognormal": ["precision=mp", "scale=lognormal"],
    "auto": ["precision=mp", "scale=auto", "scaler.auto_every=2"],
    "stats": ["precision=mp", "scale=dynamic", "stats.enabled=true", "stats.every=2"],
}
# Resume: 3 steps, then the same run extended to 6 (trainer.resume=force), against 6 at once.
RESUME = ["model.dropout=0.2", "trainer.checkpoint_every=1"]


def compose(out_dir: Path, *overrides: str) -> Any:
    """A composed config for the tiny task (model.* overrides go to the task's own section)."""
    model = {"name": "ddp_tiny", **{o.split("=")[0][len("model."):]: float(o.split("=")[1])
                                    for o in overrides if o.startswith("model.")}}
    cfg = compose_job([*COMMON, f"out_dir={out_dir}", *(o for o in overrides if not o.startswith("model."))])
    OmegaConf.set_struct(cfg, False)
    cfg.model, cfg.data = model, {"name": "ddp_points"}
    return cfg


def train_and_read(cfg: Any) -> dict[str, Any]:
    """Train; every optimizer's weights (master copies where there are), scales and skips, and
    the model's buffers (batch-norm statistics are rank 0's: it evaluates and checkpoints)."""
    from runner.engine import Trainer

    trainer = Trainer(cfg)
    summary = trainer.run()
    slots = list(trainer.slots.values())
    weights = [w for s in slots for w in (s.params.master_params or s.params.model_params)]
    return {"weights": [w.detach().clone() for w in weights], "scale": [float(s.scaler.scale) for s in slots],
            "skipped": sum(s.skipped_steps for s in slots), "summary": summary, "rng": torch.get_rng_state()}


def toy_config(task: str, out_dir: Path) -> Any:
    """A task of tests/toy_tasks.py (GAN: two optimizers; packed LM: sparse embedding gradients,
    PackedSequence, batches of varying size; stream LM: state carried per row; CTC) in mp."""
    from tests.test_toy_tasks import COMMON as TOY_COMMON, RECIPES, TOYS

    models.TASKS[task] = TOYS[task][0]
    cfg = compose_job([*TOY_COMMON, *RECIPES[task], "precision=mp", "scale=dynamic", "threads=1", "device=cpu",
                       f"out_dir={out_dir}"])
    OmegaConf.set_struct(cfg, False)
    cfg.model, cfg.data = {"name": task}, {"name": TOYS[task][1]}
    return cfg


TOY_TASKS = ("toy_gan", "toy_lm", "toy_stream_lm", "toy_ctc")


def _worker(rank: int, port: int, root: str, results: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    models.TASKS["ddp_tiny"] = TinyRegression
    writes = _record_writes()
    out: dict[str, Any] = {}
    for name, overrides in SCENARIOS.items():
        out[name] = train_and_read(compose(Path(root) / name, *overrides))
    try:  # the finished fp32 run again with another lr: refused (by rank 0, for every rank)
        train_and_read(compose(Path(root) / "fp32", *SCENARIOS["fp32"], "trainer.lr=0.05"))
        out["refused"] = ""
    except UserError as exc:
        out["refused"] = str(exc)
    for task in TOY_TASKS:
        out[task] = train_and_read(toy_config(task, Path(root) / task))
    out["resume_straight"] = train_and_read(compose(Path(root) / "straight", *RESUME))
    train_and_read(compose(Path(root) / "resumed", *RESUME, "trainer.max_steps=3"))
    out["resume_resumed"] = train_and_read(compose(Path(root) / "resumed", *RESUME, "trainer.resume=force"))
    stream = toy_config("toy_stream_lm", Path(root) / "stream_resumed")  # LSTM state carried per rank's rows
    OmegaConf.update(stream, "trainer.max_steps", 6)
    train_and_read(stream)
    OmegaConf.update(stream, "trainer.max_steps", 12)
    OmegaConf.update(stream, "trainer.resume", "force")
    out["stream_resumed"] = train_and_read(stream)
    out["writes"] = writes
    torch.save(out, f"{results}/rank{rank}.pt")


def _record_writes() -> list[str]:
    """Every file-writing entry point of the engine records what it writes (and still writes)."""
    import runner.checkpoint
    import runner.engine
    import runner.logs
    import runner.rundir

    writes: list[str] = []

    def recording(fn: Any, what: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            writes.append(f"{what} {args[0] if args else ''}")
            return fn(*args, **kwargs)
        return wrapper

    for module in (runner.checkpoint, runner.logs, runner.rundir):
        module.atomic_write = recording(module.atomic_write, "atomic_write")
    runner.engine.RunLogger = recording(runner.engine.RunLogger, "RunLogger")
    runner.engine.RunLock = recording(runner.engine.RunLock, "RunLock")
    runner.engine.write_run_config = recording(runner.engine.write_run_config, "write_run_config")
    import runner.gradstats
    runner.gradstats.JsonlLog = recording(runner.gradstats.JsonlLog, "JsonlLog")
    return writes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root, results = tmp_path_factory.mktemp("ddp"), tmp_path_factory.mktemp("ddp_results")
    mp.start_processes(_worker, args=(_free_port(), str(root), str(results)), nprocs=WORLD, start_method="spawn")
    return [torch.load(results / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """name -> the same scenario in this process (one rank, the same global batch)."""
    root = tmp_path_factory.mktemp("single")
    cache: dict[str, dict[str, Any]] = {}
    threads = torch.get_num_threads()

    def run(name: str, overrides: list[str] | None = None) -> dict[str, Any]:
        if name not in cache:
            previous = models.TASKS.get("ddp_tiny")
            models.TASKS["ddp_tiny"] = TinyRegression
            try:
                cache[name] = train_and_read(compose(root / name, *(SCENARIOS[name] if overrides is None else overrides)))
            finally:
                models.TASKS.pop("ddp_tiny") if previous is None else models.TASKS.update(ddp_tiny=previous)
                torch.set_num_threads(threads)
        return cache[name]
    return run


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float, atol: float) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def assert_ranks_identical(ranks: list[dict[str, Any]], name: str) -> None:
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r0["scale"] == r1["scale"] and r0["skipped"] == r1["skipped"]
    for x, y in zip(r0["weights"], r1["weights"], strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("name, rtol, atol", [("fp32", 1e-5, 1e-6), ("mp_fixed", 0, 2e-3), ("mp_dynamic", 0, 2e-3)])
def test_two_ranks_train_as_one_process_with_the_global_batch(ranks, single, name, rtol, atol) -> None:
    assert_ranks_identical(ranks, name)
    one = single(name)
    assert ranks[0][name]["skipped"] == one["skipped"] and ranks[0][name]["scale"] == one["scale"]
    assert_close(ranks[0][name]["weights"], one["weights"], rtol, atol)


def test_dynamic_scaler_overflowed_and_backed_off_the_same_on_both_ranks(ranks) -> None:
    r = ranks[0]["mp_dynamic"]
    assert r["skipped"] >= 1 and r["scale"][0] < 262144  # init 2^18 overflows FP16 gradients at first


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, single) -> None:
    assert_ranks_identical(ranks, "one_rank_inf")
    assert [r["one_rank_inf"]["skipped"] for r in ranks] == [1, 1]
    # one process with the injection on its (only) rank skips the same step and trains the same weights
    one = single("one_rank_inf", ["precision=mp", "scale=128", "debug.nonfinite_steps=[3]"])
    assert one["skipped"] == 1
    assert_close(ranks[0]["one_rank_inf"]["weights"], one["weights"], 0, 2e-3)


@pytest.mark.parametrize("name", ["lognormal", "auto", "stats", *TOY_TASKS])
def test_every_rank_holds_the_same_scale_and_weights(ranks, name) -> None:
    assert_ranks_identical(ranks, name)
    if name in ("lognormal", "auto"):  # the statistical scalers did move away from their initial scale
        assert ranks[0][name]["scale"] != [2.0**16]
    assert ranks[0][name]["summary"]["steps"] == ranks[0][name]["summary"]["config"]["trainer"]["max_steps"]


def test_only_rank_0_writes_files(ranks) -> None:
    assert ranks[1]["writes"] == []
    written = " ".join(ranks[0]["writes"])
    for what in ("RunLock", "RunLogger", "write_run_config", "checkpoint.pt", "summary.json", "JsonlLog"):
        assert what in written


def test_summary_records_the_world_and_the_global_batch(ranks) -> None:
    summary = ranks[0]["fp32"]["summary"]
    assert summary["world_size"] == WORLD and summary["batch_size"] == 8 and summary["oom"] is False
    assert summary["samples"] == 6 * 8  # every rank's items, counted once
    assert ranks[1]["fp32"]["summary"]["metrics"] == summary["metrics"]  # rank 0 evaluated for all


def test_resume_under_ddp_restores_every_ranks_weights_and_rng(ranks) -> None:
    for r in ranks:
        straight, resumed = r["resume_straight"], r["resume_resumed"]
        assert resumed["summary"]["steps"] == 6
        for x, y in zip(straight["weights"], resumed["weights"], strict=True):
            assert torch.equal(x, y)
        assert torch.equal(straight["rng"], resumed["rng"])  # the rank's own dropout stream went on
    assert not torch.equal(ranks[0]["resume_straight"]["rng"], ranks[1]["resume_straight"]["rng"])
    for r in ranks:  # each rank's carried LSTM state (its rows of the stream) came back from the checkpoint
        for x, y in zip(r["toy_stream_lm"]["weights"], r["stream_resumed"]["weights"], strict=True):
            assert torch.equal(x, y)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# --- the command line under torchrun ----------------------------------------------------------
def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port()),
               "-m", "runner", *TINY, "threads=1", "device=cpu", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def test_torchrun_trains_a_model_with_rank_0_reporting_and_logging(tmp_path: Path) -> None:
    result = torchrun("precision=mp", "scale=dynamic", "trainer.max_steps=2", f"out_root={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("resnet50 mp")]
    assert len(printed) == 1 and " ok -> " in printed[0]  # the result line comes from rank 0 only
    run_dir = Path(printed[0].rsplit(" -> ", 1)[1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 and summary["samples"] == 2 * 8
    log_lines = (run_dir / "mpt.log").read_text().splitlines()
    assert sum("step 2/2" in line for line in log_lines) == 1  # rank 1 wrote no log file lines
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == [".hydra", ".lock"]


def test_bad_input_on_a_rank_exits_2_with_one_line(tmp_path: Path) -> None:
    """What each torchrun worker does with bad input (checked before any process group exists):
    data.batch_size is the global batch, and 1 item cannot be shared by 2 processes."""
    env = {**ENV, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    result = subprocess.run([sys.executable, "-m", "runner", *TINY, "data.batch_size=1", f"out_root={tmp_path}"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mpt-run: error: no training batch has 2 items to give each process one; data.batch_size is the global "
        "batch: raise it or start fewer processes"]


def test_rank_0s_refusal_reaches_every_rank(ranks) -> None:
    """Rank 0 alone inspects the run directory (under its lock); its UserError is every rank's."""
    assert ranks[0]["refused"] == ranks[1]["refused"] and "differ from this command" in ranks[0]["refused"]


class _RandomItems(torch.utils.data.Dataset):
    """Each item is a draw from the worker's RNG: what random augmentation sees."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


def test_data_loader_workers_of_each_rank_draw_their_own_augmentation() -> None:
    from runner.loader import shard_batches

    def first_batch(rank: int) -> torch.Tensor:
        stream = shard_batches(_RandomItems(), lambda g: [list(range(4))], 1, torch.stack, 0, 0, lambda: None,
                               rank=rank)
        return next(stream)[0]

    assert torch.equal(first_batch(0), first_batch(0))        # reproducible
    assert not torch.equal(first_batch(0), first_batch(1))    # ranks' workers are seeded apart
