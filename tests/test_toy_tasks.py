"""The engine serves the paper's other model shapes through the public Task interface only.

Three tiny tasks (tests/toy_tasks.py) stand in for DCGAN (two networks, two optimizers),
bigLSTM (sparse embedding, packed sequences, carried recurrent state, token counts) and
DeepSpeech (bidirectional GRU over packed sequences, CTC). Each trains in every precision
mode (with a loss scale where the mode takes one) and in mp with every loss scaler, and
must learn: every test asserts a loss ratio or a learned metric, not only that it ran.

Runs use one intra-op thread: these models are hundreds of tiny kernels per step, which
OpenMP turns into thread hand-offs that are 5-30x slower on a shared 2-core machine.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

import models
from runner.cli import compose_job
from runner.engine import Trainer
from runner.errors import UserError
from runner.loader import epoch_batches
from runner.task import decay_groups
from tests.conftest import skip_if_cpu_lacks_kernel
from tests.toy_tasks import (ToyCTC, ToyGAN, ToyLMModelConfig, ToyLMNet, ToyPackedLM, ToyStreamLM, gan_pattern,
                              pattern_corr)

MODES = ["fp32", "tf32", "fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"]
SCALERS = ["none", "8", "dynamic", "lognormal", "auto"]
# Every mode with the scaler it takes (FP32 modes take none), then mp with every other scaler.
COMBOS = ([(m, "none" if m in ("fp32", "tf32") else "dynamic") for m in MODES]
          + [("mp", s) for s in SCALERS if s != "dynamic"])
COMBO_IDS = [f"{m}-{s}" for m, s in COMBOS]

TOYS: dict[str, tuple[type, str]] = {
    "toy_gan": (ToyGAN, "toy_patterns"),
    "toy_lm": (ToyPackedLM, "toy_sentences"),
    "toy_stream_lm": (ToyStreamLM, "toy_stream"),
    "toy_ctc": (ToyCTC, "toy_speech"),
}
COMMON = ["trainer.schedule=constant", "trainer.warmup_steps=0", "trainer.log_every=1",
          "trainer.timing_warmup_steps=0", "trainer.eval_batches=1", "scaler.auto_every=4"]
GAN_LR = {"disc": 0.01, "gen": 0.03}
GAN_BETAS = {"disc": [0.5, 0.99], "gen": [0.5, 0.999]}
# Adam/Adagrad eps 1e-8 rounds to 0 in FP16 (precision=fp16 keeps optimizer state in FP16,
# and a zero denominator turns never-updated elements into NaN): eps must be FP16-representable.
RECIPES = {
    "toy_gan": ["trainer.max_steps=10", "trainer.optimizer=adam", "trainer.eps=1e-4", "trainer.weight_decay=0",
                *(f"+trainer.optimizers.{n}.lr={lr}" for n, lr in GAN_LR.items()),
                *(f"+trainer.optimizers.{n}.betas=[{b[0]},{b[1]}]" for n, b in GAN_BETAS.items())],
    "toy_lm": ["trainer.max_steps=12", "trainer.optimizer=adagrad", "trainer.lr=0.1", "trainer.eps=1e-3",
               "trainer.weight_decay=1e-4"],
    "toy_stream_lm": ["trainer.max_steps=12", "trainer.optimizer=sgd", "trainer.momentum=0", "trainer.lr=5.0",
                      "trainer.weight_decay=1e-4"],
    "toy_ctc": ["trainer.max_steps=12", "trainer.optimizer=adam", "trainer.lr=0.05", "trainer.eps=1e-4",
                "trainer.weight_decay=0"],
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """toy(task, run, *overrides, model={...}, data={...}) -> a composed config writing to tmp_path/run."""
    for name, (cls, _) in TOYS.items():
        monkeypatch.setitem(models.TASKS, name, cls)

    def make(task: str, run: str, *overrides: str, model: dict | None = None, data: dict | None = None) -> Any:
        cfg = compose_job([*COMMON, *RECIPES[task], f"out_dir={tmp_path / run}", *overrides])
        OmegaConf.set_struct(cfg, False)
        cfg.model = {"name": task, **(model or {})}
        cfg.data = {"name": TOYS[task][1], **(data or {})}
        return cfg
    return make


def records(run_dir: Path, split: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def run(cfg: Any) -> tuple[Trainer, dict, list[dict]]:
    trainer = Trainer(cfg)
    summary = trainer.run()
    return trainer, summary, records(trainer.run_dir)


def loss_ratio(recs: list[dict], key: str = "loss") -> float:
    """Mean of the last three logged losses over the first one."""
    losses = [r[key] for r in recs]
    return sum(losses[-3:]) / 3 / losses[0]


def checkpoint(trainer: Trainer) -> dict:
    return torch.load(trainer.run_dir / "checkpoint.pt", weights_only=True)


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists of tensors and numbers are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def extend(toy, task: str, run_name: str, *overrides: str, **sections: Any) -> tuple[Trainer, dict, list[dict]]:
    """Run again on a finished run's out_dir with a larger max_steps. Where the engine refuses to
    lengthen a finished run by default, it names the switch that does; use that one."""
    try:
        return run(toy(task, run_name, *overrides, **sections))
    except UserError as exc:
        if "trainer.resume=force" not in str(exc):
            raise
        return run(toy(task, run_name, *overrides, "trainer.resume=force", **sections))


def assert_resume_is_bit_identical(toy, task: str, *overrides: str, **sections: Any) -> tuple[dict, dict]:
    """8 steps in one go == 4 steps, then the same command with max_steps=8 on the same out_dir."""
    whole, _, whole_recs = run(toy(task, "whole", *overrides, "trainer.max_steps=8", **sections))
    run(toy(task, "split", *overrides, "trainer.max_steps=4", **sections))
    split, summary, split_recs = extend(toy, task, "split", *overrides, "trainer.max_steps=8", **sections)
    assert summary["steps"] == 8
    a, b = checkpoint(whole), checkpoint(split)
    for key in ("model", "slots", "task", "step", "samples"):
        assert_same_tensors(a[key], b[key], key)
    # Every logged number that is not a timing: losses, learning rates, loss scales, skips.
    kept = ("step", "loss", "d_loss", "g_loss", "gen_corr", "lr", "skipped", "overflow")
    logged = lambda recs: [{k: v for k, v in r.items() if k.startswith(kept)} for r in recs]  # noqa: E731
    assert logged(whole_recs) == logged(split_recs) and len(whole_recs) == 8
    return a, b


# ======================================================================================
# GAN: two optimizers, each with its own config, scaler and skips
# ======================================================================================
@pytest.mark.parametrize("precision,scale", COMBOS, ids=COMBO_IDS)
def test_gan_trains_with_two_optimizers(toy, precision: str, scale: str) -> None:
    trainer, summary, recs = run(toy("toy_gan", "run", f"precision={precision}", f"scale={scale}"))
    assert not summary["diverged"] and summary["steps"] == 10
    assert trainer.task.loss_dtypes == {torch.float32}  # BCE on FP32 logits in every mode
    # G's samples come to show the pattern the real images show (correlation 0 at the start).
    corr = [r["gen_corr"] for r in recs]
    assert corr[0] < 0.2 and sum(corr[-2:]) / 2 > 0.4, corr
    assert summary["metric"] > 0.3
    # Each optimizer runs with its own settings, logged under its own name.
    for r in recs:
        assert (r["lr_disc"], r["lr_gen"]) == (GAN_LR["disc"], GAN_LR["gen"])
    for name, slot in trainer.slots.items():
        group = slot.optimizer.param_groups[0]
        assert (group["lr"], list(group["betas"])) == (GAN_LR[name], GAN_BETAS[name])
        assert summary["optimizers"][name]["lr_last"] == GAN_LR[name]
    assert {id(p) for p in trainer.slots["disc"].params.model_params} == {id(p) for p in trainer.model.D.parameters()}
    assert {id(p) for p in trainer.slots["gen"].params.model_params} == {id(p) for p in trainer.model.G.parameters()}


def test_gan_nonfinite_disc_loss_skips_only_the_disc_step(toy) -> None:
    """Iteration 3's disc loss is inf: the disc step is skipped, the gen step of that iteration is not."""
    common = ("precision=mp", "scale=dynamic", "scaler.init_scale=1024")
    poisoned, summary, recs = run(toy("toy_gan", "poison3", *common, "trainer.max_steps=3",
                                      model={"disc_nonfinite_at": 3}))
    before, _, _ = run(toy("toy_gan", "poison2", *common, "trainer.max_steps=2", model={"disc_nonfinite_at": 3}))
    last = recs[-1]
    assert (last["skipped_steps_disc"], last["skipped_steps_gen"], last["overflow"]) == (1, 0, 1)
    assert summary["optimizers"]["disc"]["skipped_steps"] == 1 and summary["optimizers"]["gen"]["skipped_steps"] == 0
    # Only the disc scaler backed off.
    assert (recs[-2]["loss_scale_disc"], last["loss_scale_disc"]) == (1024, 512)
    assert (recs[-2]["loss_scale_gen"], last["loss_scale_gen"]) == (1024, 1024)
    assert not summary["diverged"]
    # D (weights and FP32 master) is exactly as after step 2; G moved on at step 3.
    for p, q in zip(poisoned.model.D.parameters(), before.model.D.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(poisoned.slots["disc"].params.master_params, before.slots["disc"].params.master_params):
        assert torch.equal(p, q)
    moved = [not torch.equal(p, q) for p, q in zip(poisoned.model.G.parameters(), before.model.G.parameters())]
    assert all(moved), moved


def test_gan_checkpoint_holds_both_optimizers_and_resume_is_bit_identical(toy) -> None:
    a, _ = assert_resume_is_bit_identical(toy, "toy_gan", "precision=mp", "scale=dynamic", "scaler.growth_interval=3")
    assert set(a["slots"]) == {"disc", "gen"}
    for name, slot in a["slots"].items():
        assert slot["optimizer"]["state"], name                       # Adam moments of that optimizer
        assert slot["optimizer"]["param_groups"][0]["lr"] == GAN_LR[name]
        assert slot["scaler"]["scale"].item() != 65536.0 and "growth_tracker" in slot["scaler"]  # it moved
        assert len(slot["master"]) == len(slot["optimizer"]["param_groups"][0]["params"])
    assert a["task"] == {"iteration": 8}
    assert any(k.endswith("running_mean") for k in a["model"])  # batch-norm statistics travel too


# ======================================================================================
# Packed LM: sparse embedding, bucketed batches of varying size, counted in tokens
# ======================================================================================
@pytest.mark.parametrize("precision,scale", COMBOS, ids=COMBO_IDS)
def test_packed_lm_trains(toy, precision: str, scale: str) -> None:
    with skip_if_cpu_lacks_kernel():  # LSTM under CPU autocast: see conftest
        trainer, summary, recs = run(toy("toy_lm", "run", f"precision={precision}", f"scale={scale}"))
    assert not summary["diverged"] and summary["steps"] == 12
    assert loss_ratio(recs) < 0.5, [r["loss"] for r in recs]   # 3.47 (ln 32) -> below half
    assert trainer.task.loss_dtypes == {torch.float32}
    assert summary["count_unit"] == "tokens"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "mp", "pseudo_fp16", "bf16"])
def test_sparse_embedding_gradient_reaches_the_optimizer_sparse(toy, monkeypatch, precision: str) -> None:
    seen: list[tuple[bool, torch.dtype, torch.dtype, float]] = []
    original = torch.optim.Adagrad.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.shape == (32, 16) and p.grad is not None:  # the embedding (V=32, E=16)
                    seen.append((p.grad.is_sparse, p.grad.dtype, p.dtype, group["weight_decay"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adagrad, "step", step)
    scale = "none" if precision == "fp32" else "8"
    trainer, summary, recs = run(toy("toy_lm", "run", f"precision={precision}", f"scale={scale}",
                                     "trainer.max_steps=3"))
    # The optimizer updates FP32 masters in mp/pseudo_fp16/bf16, the FP16 weights themselves in fp16.
    dtype = torch.float16 if precision == "fp16" else torch.float32
    assert seen == [(True, dtype, dtype, 0.0)] * 3
    assert trainer.model.embed.weight.dtype == {"fp16": torch.float16, "mp": torch.float16,
                                                "bf16": torch.bfloat16}.get(precision, torch.float32)
    # decay_groups: the embedding (sparse: Adagrad refuses weight decay on it) is in the group without.
    groups = trainer.slots["main"].optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    assert any(p.shape == (32, 16) for p in groups[1]["params"])
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_packed_lm_counts_tokens_of_variable_batches(toy) -> None:
    trainer, summary, _ = run(toy("toy_lm", "run", "precision=mp", "scale=dynamic", "trainer.max_steps=20"))
    # Replay the task's plan for (seed, epoch): the batches the run must have trained on.
    plan, steps, epoch = [], 20, 0
    while len(plan) < steps:
        plan += epoch_batches(trainer.epoch_plan, 0, epoch)
        epoch += 1
    plan = plan[:steps]
    tokens = [sum(len(trainer.train_set[i]) - 1 for i in batch) for batch in plan]
    assert trainer.task.seen_tokens == tokens
    assert summary["samples"] == sum(tokens) and summary["count_unit"] == "tokens"
    # Batches really vary: in sequences and in tokens.
    assert len({len(b) for b in plan}) >= 3 and len(set(tokens)) >= 3
    largest = max(tokens)
    assert summary["memory"]["measured_on"] == {"step": tokens.index(largest) + 1, "count": largest}
    assert tokens.index(largest) > 0  # the first batch is not the largest: the measurement moved


@pytest.mark.parametrize("precision", ["fp32", "mp"])
def test_sparse_embedding_gradient_bytes_stay_below_a_dense_one(toy, precision: str) -> None:
    """V=2048, E=32: a dense embedding gradient alone would be V*E*4 = 262144 bytes."""
    vocab, embed = 2048, 32
    model = {"vocab": vocab, "embed": embed, "hidden": 8, "active": 16}
    scale = "none" if precision == "fp32" else "dynamic"
    sparse = run(toy("toy_lm", "sparse", f"precision={precision}", f"scale={scale}", "trainer.max_steps=2",
                     model=model))[1]["memory"]
    dense = run(toy("toy_lm", "dense", f"precision={precision}", f"scale={scale}", "trainer.max_steps=2",
                    model={**model, "sparse": False}))[1]["memory"]
    print(f"{precision}: grad_bytes sparse={sparse['grad_bytes']} dense={dense['grad_bytes']} "
          f"V*E*4={vocab * embed * 4}")
    assert sparse["grad_bytes"] < vocab * embed * 4 < dense["grad_bytes"]
    # The saving is the embedding's: dense - sparse is the dense embedding gradient minus the rows used.
    per_element = 4 if precision == "fp32" else 2 + 4   # mp: FP16 model gradient + FP32 master gradient
    assert dense["grad_bytes"] - sparse["grad_bytes"] > 0.9 * vocab * embed * per_element


@pytest.mark.parametrize("precision", ["mp", "pseudo_fp16"])
def test_gradient_stats_and_auto_scale_with_packed_sequences(toy, precision: str) -> None:
    trainer, summary, recs = run(toy("toy_lm", "run", f"precision={precision}", "scale=auto", "scaler.auto_every=2",
                                     "stats.enabled=true", "stats.every=4", "stats.per_layer=true"))
    assert not summary["diverged"] and loss_ratio(recs) < 0.5
    stats = [json.loads(line) for line in (trainer.run_dir / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [1, 5, 9]
    for s in stats:
        assert {"embed", "lstm", "out"} <= set(s["act_grad"]["layers"])   # hooks on every leaf, LSTM included
        assert {"embed.weight", "lstm.weight_ih_l0", "out.weight"} <= set(s["weight_grad"]["layers"])
        assert s["lost_updates"]["updated"] > 0
        # auto (sampled at steps 1, 3, 5, ...) chose the paper's S from this step's max|grad| over
        # weight and activation gradients: the largest 2^k with 2^k * max < 65504 * auto_margin.
        grad_max = max(s["weight_grad"]["max_abs"], s["act_grad"]["max_abs"])
        assert recs[s["step"] - 1]["loss_scale"] == 2 ** math.floor(math.log2(65504 * 0.125 / grad_max))
    assert len({r["loss_scale"] for r in recs}) > 1 and summary["skipped_steps"] == 0


# ======================================================================================
# Stream LM: truncated BPTT with the recurrent state carried (and checkpointed) by the task
# ======================================================================================
@pytest.mark.parametrize("precision,scale", COMBOS, ids=COMBO_IDS)
def test_stream_lm_trains(toy, precision: str, scale: str) -> None:
    with skip_if_cpu_lacks_kernel():  # LSTM under CPU autocast: see conftest
        trainer, summary, recs = run(toy("toy_stream_lm", "run", f"precision={precision}", f"scale={scale}"))
    assert not summary["diverged"] and summary["steps"] == 12
    assert loss_ratio(recs) < 0.5, [r["loss"] for r in recs]
    assert trainer.task.loss_dtypes == {torch.float32}
    assert summary["samples"] == 12 * 4 * 8 and summary["count_unit"] == "tokens"
    h, c = trainer.task.hidden_state
    assert h.shape == c.shape == (1, 4, 24)


STREAM = {"stream_len": 41}  # 5 batches of 4 x 8 tokens per epoch: 8 steps cross an epoch boundary


def test_stream_lm_carried_state_is_checkpointed_and_resume_is_bit_identical(toy) -> None:
    a, _ = assert_resume_is_bit_identical(toy, "toy_stream_lm", "precision=mp", "scale=dynamic", data=STREAM)
    assert a["task"]["h"].shape == (1, 4, 24) and a["task"]["h"].abs().sum() > 0


def test_stream_lm_state_is_reset_each_epoch_and_matters(toy, monkeypatch) -> None:
    """Control for the resume test: a task that drops its state on resume does not reproduce the run."""
    whole, _, _ = run(toy("toy_stream_lm", "whole", "trainer.max_steps=8", data=STREAM))
    assert whole.task.resets == 2   # epoch 0 and epoch 1 (from step 6)
    run(toy("toy_stream_lm", "split", "trainer.max_steps=4", data=STREAM))
    monkeypatch.setattr(ToyStreamLM, "load_state_dict", lambda self, state: None)
    forgetful, _, _ = extend(toy, "toy_stream_lm", "split", "trainer.max_steps=8", data=STREAM)
    assert forgetful.task.resets == 1  # resumed mid-epoch 0: only epoch 1 started from its beginning
    assert not all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), forgetful.model.parameters()))


# ======================================================================================
# GRU + CTC
# ======================================================================================
@pytest.mark.parametrize("precision,scale", COMBOS, ids=COMBO_IDS)
def test_ctc_trains(toy, precision: str, scale: str) -> None:
    trainer, summary, recs = run(toy("toy_ctc", "run", f"precision={precision}", f"scale={scale}"))
    assert not summary["diverged"] and summary["steps"] == 12
    assert loss_ratio(recs) < 0.65, [r["loss"] for r in recs]
    assert trainer.task.loss_dtypes == {torch.float32}


@pytest.mark.parametrize("precision", ["fp32", "mp"])
def test_ctc_greedy_decoded_error_goes_down(toy, precision: str) -> None:
    scale = "none" if precision == "fp32" else "dynamic"
    trainer, summary, _ = run(toy("toy_ctc", "run", f"precision={precision}", f"scale={scale}",
                                  "trainer.max_steps=24", "trainer.eval_every=3", "trainer.eval_batches=4"))
    cer = [r["cer"] for r in records(trainer.run_dir, "eval")]
    assert len(cer) == 8 and cer[0] > 0.6 and cer[-1] < 0.3, cer
    assert summary["metric"] == cer[-1]


# ======================================================================================
# Engine gaps found while writing these tests (fixed; kept as regression tests)
# ======================================================================================
def test_decay_groups_exempt_recurrent_biases() -> None:
    net = ToyLMNet(ToyLMModelConfig())
    no_decay = {id(p) for p in decay_groups(net)[1]["params"]}
    assert [n for n, p in net.named_parameters() if id(p) in no_decay] == [
        "embed.weight", "lstm.bias_ih_l0", "lstm.bias_hh_l0", "out.bias"]


def test_activation_stats_of_the_generator_use_the_generator_scale(toy) -> None:
    """The gen step of iteration 1 overflows: from then on gen's scale is 512, disc's 1024. G's layers only
    get gradients from the gen backward, so their histograms were recorded at 512."""
    trainer, _, recs = run(toy("toy_gan", "run", "precision=mp", "scale=dynamic", "scaler.init_scale=1024",
                               "trainer.max_steps=2", "stats.enabled=true", "stats.every=1", "stats.per_layer=true",
                               model={"gen_nonfinite_at": 1}))
    assert (recs[0]["loss_scale_disc"], recs[0]["loss_scale_gen"]) == (1024, 512)
    step2 = [json.loads(line) for line in (trainer.run_dir / "stats.jsonl").read_text().splitlines()][1]
    act = step2["act_grad"]
    counts = act["layers"]["G.5"]["counts"]                # G's output, the tensor `fake`
    top_recorded = max(i for i, c in enumerate(counts) if c) + step2["grad_bins"][0]
    reported_scale_1 = top_recorded - round(math.log2(act["recorded_at_scale"]))
    true_scale_1 = math.floor(math.log2(trainer.task.fake_grad_max[1].item() / 512))
    assert reported_scale_1 == true_scale_1


def test_gan_pattern_is_what_correlation_measures() -> None:
    """The GAN's learning signal itself: the pattern correlates 1 with itself, about 0 with noise."""
    p = gan_pattern()[None, None]
    assert pattern_corr(p).item() == pytest.approx(1.0, abs=1e-6)
    noise = torch.randn(64, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    assert abs(pattern_corr(noise).item()) < 0.1


def test_overrides_of_an_optimizer_the_task_lacks_are_refused(toy) -> None:
    with pytest.raises(UserError, match="has no optimizer 'critic'; its optimizers are: disc, gen"):
        Trainer(toy("toy_gan", "run", "+trainer.optimizers.critic.lr=0.1"))
