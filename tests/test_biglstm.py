"""The bigLSTM task: LSTMP cell, sampled softmax, the paper size, training through the engine."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from data.biglstm_synthetic_text import ClassBigramGrammar, SyntheticTextConfig
from models.biglstm import BigLSTM, BigLSTMConfig, BigLSTMTask, LogUniformSampler, sampled_softmax_loss
from runner.cli import compose_job
from runner.engine import train
from runner.errors import UserError
from tests.conftest import skip_if_cpu_lacks_kernel

TINY_MODEL = {"name": "biglstm", "emb_size": 16, "hidden_size": 32, "proj_size": 16, "num_layers": 2,
              "num_samples": 64}
TINY_DATA = {"name": "synthetic_text", "vocab_size": 100, "num_classes": 4, "successors": 1, "num_train_tokens": 4000,
             "num_eval_tokens": 400, "batch_size": 8, "unroll": 10}
# The same tiny size through Hydra (every key of the tiny dicts as an override).
TINY_OVERRIDES = ["model=biglstm", *(f"model.{k}={v}" for k, v in TINY_MODEL.items() if k != "name"),
                  *(f"data.{k}={v}" for k, v in TINY_DATA.items() if k != "name"),
                  "trainer.optimizer=adagrad", "trainer.lr=0.2", "trainer.initial_accumulator_value=1.0",
                  "trainer.weight_decay=0", "trainer.grad_clip=null", "trainer.schedule=constant",
                  "trainer.warmup_steps=0", "trainer.timing_warmup_steps=1",
                  "threads=1"]  # tiny ops: more threads only spin-wait (and fight other test processes)


def _task(model: dict | None = None, data: dict | None = None) -> BigLSTMTask:
    return BigLSTMTask(OmegaConf.create({**TINY_MODEL, **(model or {})}), OmegaConf.create({**TINY_DATA, **(data or {})}), 0)


def test_lstm_with_projection_is_the_lstmp_cell() -> None:
    # Hand-written LSTMP (Sak et al. 2014): gates from x and the projected h, c' = f c + i g, h' = W_hr (o tanh c').
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 7, num_layers=1, proj_size=3, batch_first=True)
    x, h0, c0 = torch.randn(2, 4, 5), torch.randn(1, 2, 3), torch.randn(1, 2, 7)
    out, (hn, cn) = lstm(x, (h0, c0))
    h, c = h0[0], c0[0]
    for t in range(x.shape[1]):
        gates = x[:, t] @ lstm.weight_ih_l0.T + lstm.bias_ih_l0 + h @ lstm.weight_hh_l0.T + lstm.bias_hh_l0
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = (torch.sigmoid(o) * torch.tanh(c)) @ lstm.weight_hr_l0.T
        torch.testing.assert_close(out[:, t], h)
    torch.testing.assert_close(hn[0], h)
    torch.testing.assert_close(cn[0], c)


def test_paper_size_on_meta_device() -> None:
    cfg = BigLSTMConfig()  # the schema's defaults are the paper's model
    with torch.device("meta"):
        model = BigLSTM(793_471, cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["embedding.weight"] == (793_471, 1024)
    assert shapes["softmax_weight.weight"] == (793_471, 1024)
    for layer in range(2):
        assert shapes[f"lstm.weight_ih_l{layer}"] == (4 * 8192, 1024)
        assert shapes[f"lstm.weight_hh_l{layer}"] == (4 * 8192, 1024)
        assert shapes[f"lstm.weight_hr_l{layer}"] == (1024, 8192)
    lstm_params = 2 * (2 * 4 * 8192 * 1024 + 2 * 4 * 8192 + 1024 * 8192)
    tables = 2 * 793_471 * 1024 + 793_471
    assert sum(p.numel() for p in model.parameters()) == lstm_params + tables  # 1.98 G parameters
    assert cfg.num_samples == 8192 and cfg.keep_prob == 0.9


def test_expected_counts_match_monte_carlo() -> None:
    torch.manual_seed(0)
    sampler = LogUniformSampler(50, 20)
    draws = torch.stack([sampler.sample(torch.device("cpu")) for _ in range(4000)])
    counts = torch.bincount(draws.flatten(), minlength=50).float() / 4000
    expected = sampler.log_expected_count(torch.arange(50)).exp()
    torch.testing.assert_close(expected.sum(), torch.tensor(20.0))
    # Poisson-like noise: the standard error of a mean count is sqrt(E / 4000) <= 0.04 here
    assert (counts - expected).abs().max() < 5 * (expected / 4000).sqrt().max()


def test_all_words_sampled_once_is_the_full_softmax() -> None:
    torch.manual_seed(0)
    vocab, tokens = 30, 12
    logits = torch.randn(tokens, vocab)
    targets = torch.randint(vocab, (tokens,))
    samples = torch.arange(vocab)
    zero = torch.zeros(())  # every word drawn exactly once: expected count 1, no correction
    sampled = sampled_softmax_loss(logits.gather(1, targets[:, None]).squeeze(1), logits, targets, samples,
                                   zero.expand(tokens), zero.expand(vocab))
    torch.testing.assert_close(sampled, F.cross_entropy(logits, targets))


def test_accidental_hits_are_removed_and_logits_corrected() -> None:
    true_logits, targets = torch.tensor([2.0]), torch.tensor([3])
    samples = torch.tensor([3, 5])          # sample 0 is the target itself
    sample_logits = torch.tensor([[2.0, 1.0]])
    log_q = torch.tensor([0.5, -1.0])
    loss = sampled_softmax_loss(true_logits, sample_logits, targets, samples, torch.tensor([0.5]), log_q)
    kept = torch.tensor([2.0 - 0.5, 1.0 + 1.0])  # the target (corrected) and sample 5 (corrected); the hit is gone
    torch.testing.assert_close(loss, -(kept[0] - kept.logsumexp(0)))


def test_gradients_reach_only_sampled_and_target_rows() -> None:
    torch.manual_seed(0)
    task = _task()
    model = task.build_model()
    vocab = TINY_DATA["vocab_size"]
    tokens, targets = torch.randint(vocab, (2, 5)), torch.randint(vocab, (2, 5))
    samples = torch.tensor([0, 1, 2, 7, 9])
    (true_logits, sample_logits), _ = model(tokens, None, targets, samples)
    sampler = LogUniformSampler(vocab, 5)
    loss = sampled_softmax_loss(true_logits, sample_logits, targets, samples,
                                sampler.log_expected_count(targets), sampler.log_expected_count(samples))
    loss.backward()
    for table, rows in ((model.softmax_weight, {*samples.tolist(), *targets.flatten().tolist()}),
                        (model.softmax_bias, {*samples.tolist(), *targets.flatten().tolist()}),
                        (model.embedding, set(tokens.flatten().tolist()))):
        grad = table.weight.grad
        assert grad.is_sparse
        assert set(grad.coalesce().indices()[0].tolist()) == rows


def test_synthetic_corpus_entropy_and_determinism() -> None:
    cfg = SyntheticTextConfig(vocab_size=400, num_classes=8)
    grammar = ClassBigramGrammar(cfg)
    assert 0 < grammar.entropy_rate() < grammar.unigram_entropy() <= math.log(400)
    text = grammar.sample(200_000, torch.Generator().manual_seed(1))
    assert torch.equal(text[:100], ClassBigramGrammar(cfg).sample(200_000, torch.Generator().manual_seed(1))[:100])
    # ids are sorted by frequency (id 0 the most likely word), and the text follows the frequencies
    assert torch.all(grammar.unigram[:-1] >= grammar.unigram[1:])
    counts = torch.bincount(text.long(), minlength=400).double() / len(text)
    assert (counts - grammar.unigram).abs().max() < 0.005
    # the text's mean log-loss under the true word model converges to the stated entropy rate
    word_class = torch.empty(400, dtype=torch.long)
    word_rank = torch.empty(400, dtype=torch.long)
    word_class[grammar.members.flatten()] = torch.arange(8).repeat_interleave(50)
    word_rank[grammar.members.flatten()] = torch.arange(50).repeat(8)
    prev, nxt = text[:-1].long(), text[1:].long()
    log_p = grammar.transitions[word_class[prev], word_class[nxt]].log() + grammar.in_class[word_rank[nxt]].log()
    assert abs(float(-log_p.mean()) - grammar.entropy_rate()) < 0.02


def test_batches_continue_each_row() -> None:
    task = _task()
    data = task.build_train_data()
    plan = task.epoch_batches(data, 8, torch.Generator().manual_seed(0))
    assert len(plan) == (4000 - 1) // (8 * 10)
    first, second = (task.collate([data[i] for i in batch]) for batch in plan[:2])
    assert first["input"].shape == (8, 10)
    torch.testing.assert_close(first["input"][:, 1:], first["target"][:, :-1])
    torch.testing.assert_close(second["input"][:, 0], first["target"][:, -1])  # row r goes on where it stopped


@pytest.mark.parametrize("model, data, match", [
    ({"proj_size": 64}, {}, "model.proj_size"),
    ({"keep_prob": 0.0}, {}, "model.keep_prob"),
    ({"num_samples": 0}, {}, "model.num_samples"),
    ({}, {"num_classes": 7}, "data.num_classes"),
    ({}, {"unroll": 0}, "data.unroll"),
])
def test_bad_config_is_a_user_error(model: dict, data: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        _task(model, data)


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"])
def test_trains_through_the_engine_in_every_precision(tmp_path: Path, precision: str) -> None:
    scale = "none" if precision in ("fp32", "tf32", "bf16", "bf16_amp") else "128"
    cfg = compose_job([*TINY_OVERRIDES, f"precision={precision}", f"scale={scale}", "trainer.max_steps=24",
                       "trainer.log_every=4", "data.eval_batch_size=4", f"out_root={tmp_path}"])
    with skip_if_cpu_lacks_kernel():  # LSTM under CPU autocast: see conftest
        summary = train(cfg)
    losses = _losses(Path(summary["run_dir"]))
    assert summary["skipped_steps"] == 0 and not summary["diverged"]
    assert sum(losses[-2:]) / 2 < 0.85 * losses[0], losses  # the sampled loss falls by 15% or more in 24 steps
    assert summary["metric_name"] == "ppl" and summary["higher_is_better"] is False
    assert summary["metric"] < 0.5 * TINY_DATA["vocab_size"]  # far better than uniform guessing
    assert summary["metrics"]["floor_ppl"] < summary["metrics"]["unigram_ppl"]
    assert summary["count_unit"] == "tokens" and summary["samples"] == 24 * 8 * 10


def test_loss_scale_leaves_the_first_update_unchanged(tmp_path: Path) -> None:
    # bf16 has FP32's exponent range, so S = 128 scales every gradient exactly: mpt unscales before
    # clipping (active here) and Adagrad (its initial accumulator unscaled), so the update must be identical.
    weights = []
    for scale in ("none", "128"):
        cfg = compose_job([*TINY_OVERRIDES, "precision=bf16", f"scale={scale}", "trainer.max_steps=1",
                           "trainer.grad_clip=0.01", f"out_root={tmp_path}"])
        summary = train(cfg)
        weights.append(torch.load(Path(summary["run_dir"]) / "checkpoint.pt", weights_only=True)["model"])
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


def test_resume_restores_the_carried_state(tmp_path: Path) -> None:
    # 6 steps in one go vs 3 + 3 with a checkpoint in between: same weights, same LSTM state.
    common = [*TINY_OVERRIDES, "precision=fp32", "trainer.max_steps=6", "model.keep_prob=1.0"]
    whole = train(compose_job([*common, f"out_root={tmp_path / 'whole'}"]))
    train(compose_job([*common, "trainer.max_steps=3", f"out_root={tmp_path / 'split'}"]))
    split = train(compose_job([*common, f"out_root={tmp_path / 'split'}"]))
    a = torch.load(Path(whole["run_dir"]) / "checkpoint.pt", weights_only=True)
    b = torch.load(Path(split["run_dir"]) / "checkpoint.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    torch.testing.assert_close(a["task"], b["task"])
    torch.testing.assert_close(a["model"], b["model"])
