"""The DeepSpeech 2 task: architecture sizes, exact output lengths, padding invariance, CTC in
FP32, greedy decoding, CER/WER, the speech front end, bucketing, and training in every mode."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from data.deepspeech_audio import ALPHABET, SpeechDataConfig, length_buckets, log_spectrogram, \
    spec_augment
from data.deepspeech_synthetic import SyntheticSpeech, SyntheticSpeechConfig
from models.deepspeech import DeepSpeech2, DeepSpeechConfig, DeepSpeechTask, greedy_decode
from runner.cli import compose_job
from runner.engine import train
from runner.errors import UserError
from runner.precision import make_policy

TINY_MODEL = {"name": "deepspeech", "conv_channels": 4, "rnn_hidden": 16, "rnn_layers": 3, "lookahead": 3}
SMALL_DATA = {"name": "synthetic_speech", "num_train": 8, "num_eval": 4, "batch_size": 4}
BINS = SpeechDataConfig().num_bins


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models here are tiny: a second intra-op thread only spins against busy cores (4x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _task(model: dict | None = None, data: dict | None = None) -> DeepSpeechTask:
    return DeepSpeechTask(OmegaConf.create({**TINY_MODEL, **(model or {})}),
                          OmegaConf.create({**SMALL_DATA, **(data or {})}), 0)


def _batch(task: DeepSpeechTask, indices: list[int]) -> dict:
    ds = task.build_train_data()
    return task.collate([ds[i] for i in indices])


class _FP32Context:
    """The engine context's fp32 region outside the engine (the tests below call the task directly)."""

    def __init__(self) -> None:
        self.policy = make_policy("fp32", torch.device("cpu"))

    def fp32(self, *tensors):
        return self.policy.fp32(*tensors)


# --- architecture --------------------------------------------------------------------------
def test_paper_size_is_ds2_english_with_about_115m_parameters() -> None:
    cfg = compose_job(["experiment=paper_deepspeech"])
    with torch.device("meta"):
        model = DeepSpeech2(DeepSpeechConfig(**OmegaConf.to_container(cfg.model)), BINS, len(ALPHABET))
    assert 112e6 < sum(p.numel() for p in model.parameters()) < 118e6  # paper: "about 115M"
    convs = [block.conv for block in model.convs]
    assert [c.weight.shape for c in convs] == [(32, 1, 41, 11), (32, 32, 21, 11)]
    assert [c.stride for c in convs] == [(2, 2), (2, 1)]
    grus = [layer.gru for layer in model.rnns]
    assert len(grus) == 3 and all(g.bidirectional and g.hidden_size == 1824 for g in grus)
    assert grus[0].input_size == 32 * 41  # 161 bins -> 81 -> 41 after the two frequency strides
    assert model.row_conv.conv.weight.shape == (1824, 1, 21)
    assert model.fc.weight.shape == (29, 1824)
    assert model.output_lengths(torch.tensor([300, 201], device="cpu")).tolist() == [150, 101]


def test_unidirectional_option() -> None:
    model = DeepSpeech2(DeepSpeechConfig(**{**TINY_MODEL, "bidirectional": False}), BINS, len(ALPHABET))
    assert not any(layer.gru.bidirectional for layer in model.rnns)
    logits, _ = model(torch.randn(2, BINS, 40), torch.tensor([40, 31]))
    assert logits.shape == (2, 20, 29)


def test_output_lengths_are_exact() -> None:
    model = DeepSpeech2(DeepSpeechConfig(**TINY_MODEL), BINS, len(ALPHABET)).eval()
    lengths = torch.arange(1, 40)
    expected = (lengths - 1) // 2 + 1  # kernel 11, padding 5, stride 2 in time; then stride 1
    assert torch.equal(model.output_lengths(lengths), expected)
    for length in lengths.tolist():  # each alone, unpadded: the conv stack's real output size
        x = torch.randn(1, 1, BINS, length)
        for block in model.convs:
            x = block.conv(x)
        assert x.shape[-1] == int(model.output_lengths(torch.tensor([length]))[0])


# --- variable lengths ----------------------------------------------------------------------
def _pad(batch: dict, extra: int) -> dict:
    return {**batch, "input": torch.nn.functional.pad(batch["input"], (0, extra))}


def test_padding_changes_neither_the_loss_nor_the_gradients_in_training() -> None:
    torch.manual_seed(0)
    task = _task()
    model = task.build_model().train()
    batch = _batch(task, [0, 1, 2, 3])
    assert len(set(batch["input_lengths"].tolist())) > 1  # really variable lengths

    def loss_and_grads(b: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits, lengths = model(b["input"], b["input_lengths"])
        loss = task.ctc_loss(logits, lengths, b, _FP32Context())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(batch)
    padded_loss, padded_grads = loss_and_grads(_pad(batch, 17))
    torch.testing.assert_close(padded_loss, loss)
    for g, pg in zip(grads, padded_grads):
        # Padding changes the order of FP32 sums (masked batch norm, packed GRU), so elements agree
        # to rounding relative to the tensor's scale; padding that leaked into the statistics or the
        # recurrent state would move them by the order of the gradient itself.
        torch.testing.assert_close(pg, g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))


def test_an_utterance_gives_the_same_outputs_alone_and_in_a_padded_batch() -> None:
    torch.manual_seed(0)
    task = _task()
    model = task.build_model().eval()  # running statistics: the batch's others do not matter
    ds = task.build_train_data()
    items = [ds[i] for i in range(4)]
    shortest = min(range(4), key=lambda i: items[i].features.shape[1])
    batch = task.collate(items)
    alone = task.collate([items[shortest]])
    with torch.no_grad():
        logits, lengths = model(batch["input"], batch["input_lengths"])
        alone_logits, alone_lengths = model(alone["input"], alone["input_lengths"])
    n = int(alone_lengths[0])
    assert int(lengths[shortest]) == n and logits.shape[1] > n
    torch.testing.assert_close(logits[shortest, :n], alone_logits[0], rtol=1e-4, atol=1e-5)


# --- CTC, decoding, error rates ------------------------------------------------------------
def test_ctc_runs_in_fp32_on_fp16_logits_and_zeroes_infeasible_utterances() -> None:
    task = _task()
    batch = {"targets": torch.tensor([3, 4, 5, 3, 4, 5, 6]), "target_lengths": torch.tensor([3, 4])}
    logits = torch.randn(2, 5, 29, dtype=torch.float16, requires_grad=True)
    lengths = torch.tensor([5, 3])  # the second utterance has 3 frames for 4 labels: CTC loss +inf
    loss = task.ctc_loss(logits, lengths, batch, _FP32Context())
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[1].abs().sum() == 0 and logits.grad[0].abs().sum() > 0


def test_greedy_decoding_merges_repeats_and_drops_blanks() -> None:
    a, b, space = ALPHABET.index("a"), ALPHABET.index("b"), ALPHABET.index(" ")
    path = [0, a, a, 0, a, space, space, b, b, 0]
    logits = torch.nn.functional.one_hot(torch.tensor([path, [space, b] + [0] * 8]), 29).float()
    assert greedy_decode(logits, torch.tensor([10, 1])) == ["aa b", ""]
    assert greedy_decode(logits, torch.tensor([8, 2])) == ["aa b", "b"]


class _Emits(nn.Module):
    """A stand-in model whose greedy decoding is exactly the given texts."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__()
        frames = max(2 * len(t) for t in texts)
        path = torch.zeros(len(texts), frames, dtype=torch.int64)  # blanks between letters keep doubles apart
        for i, text in enumerate(texts):
            path[i, 1:2 * len(text):2] = torch.tensor([ALPHABET.index(c) for c in text])
        self.logits = torch.nn.functional.one_hot(path, 29).float() * 10
        self.lengths = torch.full((len(texts),), frames)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits, self.lengths


def test_cer_and_wer_match_hand_computed_cases() -> None:
    task = _task()
    references = ["cat dog", "yes", "go left"]
    hypotheses = ["cat dig", "yes", "go"]
    # CER: 1 substitution (o->i) + 5 deletions (" left") over 7 + 3 + 7 = 17 characters.
    # WER: 1 substitution (dog->dig) + 1 deletion (left) over 2 + 1 + 2 = 5 words.
    targets = [torch.tensor([ALPHABET.index(c) for c in r]) for r in references]
    batch = {"input": torch.zeros(3, BINS, 4), "input_lengths": torch.tensor([4, 4, 4]),
             "targets": torch.cat(targets), "target_lengths": torch.tensor([len(t) for t in targets]),
             "transcripts": references}
    result = task.evaluate(_Emits(hypotheses), [batch], _FP32Context())
    assert result.metrics["cer"] == pytest.approx(100 * 6 / 17)
    assert result.metrics["wer"] == pytest.approx(100 * 2 / 5)
    perfect = task.evaluate(_Emits(references), [batch], _FP32Context())
    assert perfect.metrics["cer"] == 0 and perfect.metrics["wer"] == 0


# --- front end, synthetic data, batching -----------------------------------------------------
def test_spectrogram_is_ds2_sized_and_normalised_per_utterance() -> None:
    cfg = SpeechDataConfig()
    wave = torch.randn(16000) * 0.1
    features = log_spectrogram(wave, cfg)
    assert features.shape == (161, 101)  # 20 ms window -> 161 bins; 10 ms hop, centred frames
    assert abs(float(features.mean())) < 1e-4 and abs(float(features.std()) - 1) < 1e-3
    assert torch.equal(log_spectrogram(wave * 3, cfg).round(decimals=3), features.round(decimals=3))


def test_spec_augment_masks_only_when_enabled() -> None:
    ds = SyntheticSpeech(SyntheticSpeechConfig(num_train=2, num_eval=2), "train", 0)
    assert not (ds[0].features == 0).all(dim=0).any()  # off by default: no masked frames
    torch.manual_seed(0)
    cfg = SyntheticSpeechConfig(spec_augment=True, time_mask_frames=10, freq_mask_bins=10)
    masked = spec_augment(torch.randn(161, 100) + 5, cfg)
    assert (masked == 0).all(dim=0).any() and (masked == 0).all(dim=1).any()


def test_synthetic_speech_is_deterministic_and_transcribes_the_lexicon() -> None:
    cfg = SyntheticSpeechConfig(num_train=8, num_eval=8)
    first, again = SyntheticSpeech(cfg, "train", 0)[3], SyntheticSpeech(cfg, "train", 0)[3]
    assert torch.equal(first.features, again.features) and first.text == again.text
    assert not torch.equal(first.features, SyntheticSpeech(cfg, "train", 1)[3].features)
    assert not torch.equal(first.features, SyntheticSpeech(cfg, "eval", 0)[3].features)
    ds = SyntheticSpeech(cfg, "train", 0)
    for i in range(8):
        item = ds[i]
        assert all(word in cfg.lexicon for word in item.text.split(" "))
        assert "".join(ALPHABET[j] for j in item.target) == item.text
        assert item.duration_s == pytest.approx(ds.durations[i])


def test_length_buckets_cover_the_set_and_respect_both_limits() -> None:
    durations = [float(d) for d in torch.rand(50, generator=torch.Generator().manual_seed(0)) * 10 + 1]
    batches = length_buckets(durations, 8, 30.0, torch.Generator().manual_seed(1))
    assert sorted(i for b in batches for i in b) == list(range(50))
    assert all(len(b) <= 8 and len(b) * max(durations[i] for i in b) <= 30.0 for b in batches)
    assert len({len(b) for b in batches}) > 1  # variable batch sizes: fewer long utterances
    assert batches == length_buckets(durations, 8, 30.0, torch.Generator().manual_seed(1))


def test_collate_and_count_in_audio_seconds() -> None:
    task = _task()
    ds = task.build_train_data()
    batch = _batch(task, [0, 1])
    assert batch["input"].shape == (2, BINS, int(batch["input_lengths"].max()))
    assert task.count(batch) == pytest.approx(ds.durations[0] + ds.durations[1])
    assert {"input_lengths", "target_lengths"} <= task.host_keys
    assert int(batch["target_lengths"].sum()) == batch["targets"].numel()


@pytest.mark.parametrize("model, data, match", [
    ({"rnn_hidden": 0}, {}, "model.rnn_hidden"),
    ({"lookahead": -1}, {}, "model.lookahead"),
    ({}, {"lexicon": ["ok!"]}, "data.lexicon"),
    ({}, {"min_words": 3, "max_words": 2}, "data.min_words"),
    ({}, {"letter_ms": [50.0, 10.0]}, "data.letter_ms"),
    ({}, {"hop_ms": 30.0}, "data.hop_ms"),
    ({}, {"name": "synthetic_images"}, "cannot use data=synthetic_images"),
])
def test_bad_config_is_a_user_error(model: dict, data: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        _task(model, data)


# --- through the engine --------------------------------------------------------------------
# One batch of four one-word utterances, seen 8 times: the curve measures learning, not batch noise.
ENGINE_TINY = ["experiment=quick_deepspeech", "model.conv_channels=4", "model.rnn_hidden=32", "model.lookahead=3",
               "data.num_train=4", "data.num_eval=4", "data.batch_size=4", "data.max_words=1",
               "trainer.max_steps=8", "trainer.log_every=1", "trainer.warmup_steps=0", "trainer.lr=0.01",
               "trainer.timing_warmup_steps=1"]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "mp", "amp", "pseudo_fp16", "bf16", "bf16_amp"])
def test_trains_through_the_engine_in_every_precision(tmp_path: Path, precision: str) -> None:
    scale = "none" if precision in ("fp32", "tf32") else "1"
    summary = train(compose_job([*ENGINE_TINY, f"precision={precision}", f"scale={scale}", f"out_root={tmp_path}"]))
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    curve = [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]
    # CTC's first steps learn to emit blanks: the summed per-utterance loss falls steeply
    # (fp32: 50.9 -> 13.7, measured).
    assert len(curve) == 8 and curve[-1] < curve[0] / 2.5, curve
    assert not summary["diverged"] and summary["count_unit"] == "audio_s"
    assert 0 <= summary["metrics"]["cer"] and "wer" in summary["metrics"]
