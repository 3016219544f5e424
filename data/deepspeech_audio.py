"""The speech front end shared by every DeepSpeech data source: alphabet, spectrogram, batching.

Features are computed on the fly in the data loader (never stored): a log-power spectrogram
from `torch.stft` with DS2's 20 ms window and 10 ms hop at 16 kHz (a Hamming window, as
deepspeech.pytorch's LibriSpeech recipe), normalised per utterance to zero mean and unit
variance, and optionally masked SpecAugment-style (Park et al. 2019; off by default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from data.common import LoaderConfig, require
from runner.errors import UserError

# CTC blank first (index 0: the only index cuDNN's CTC kernel accepts), then DS2 English's
# output alphabet: apostrophe, a-z and space (29 symbols with the blank).
BLANK = "_"
ALPHABET = BLANK + "'abcdefghijklmnopqrstuvwxyz "
CHAR_INDEX = {c: i for i, c in enumerate(ALPHABET)}
LOG_FLOOR = 1e-10  # power floor before the log: digital silence gives log(1e-10), not -inf


@dataclass
class SpeechDataConfig(LoaderConfig):
    """What every speech source shares: the front end and length bucketing."""

    sample_rate: int = 16000
    window_ms: float = 20.0
    hop_ms: float = 10.0
    max_batch_seconds: float | None = None  # cap on padded audio per batch (longest x count); None: batch_size only
    spec_augment: bool = False              # training only: frequency and time masks
    freq_mask_bins: int = 15                # SpecAugment F: each frequency mask covers up to this many bins
    time_mask_frames: int = 35              # SpecAugment T: each time mask covers up to this many frames
    num_masks: int = 2                      # masks of each kind per utterance

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.sample_rate > 0, "sample_rate", self.sample_rate, "positive", "Hz; DS2 and LibriSpeech: 16000")
        require(self.window_ms > 0, "window_ms", self.window_ms, "positive", "STFT window; DS2: 20")
        require(0 < self.hop_ms <= self.window_ms, "hop_ms", self.hop_ms, f"in (0, window_ms={self.window_ms}]",
                "STFT hop; DS2: 10")
        require(self.max_batch_seconds is None or self.max_batch_seconds > 0, "max_batch_seconds",
                self.max_batch_seconds, "positive or null", "padded audio seconds per batch")
        for key in ("freq_mask_bins", "time_mask_frames", "num_masks"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "0 or more", "SpecAugment mask sizes and count")

    @property
    def n_fft(self) -> int:
        return round(self.sample_rate * self.window_ms / 1000)

    @property
    def hop_length(self) -> int:
        return round(self.sample_rate * self.hop_ms / 1000)

    @property
    def num_bins(self) -> int:
        """Frequency bins of the spectrogram: 161 for DS2's 20 ms window at 16 kHz."""
        return self.n_fft // 2 + 1


def encode_text(text: str, where: str) -> Tensor:
    """A transcript as alphabet indices (int64); `where` names its source in the error."""
    try:
        return torch.tensor([CHAR_INDEX[c] for c in text], dtype=torch.int64)
    except KeyError as exc:
        raise UserError(f"{where}: character {exc.args[0]!r} is not in the alphabet "
                        f"{ALPHABET[1:]!r}; normalise the transcript") from None


def log_spectrogram(wave: Tensor, cfg: SpeechDataConfig) -> Tensor:
    """(samples,) FP32 waveform -> (bins, frames) log-power spectrogram, normalised per utterance."""
    window = torch.hamming_window(cfg.n_fft)
    spec = torch.stft(wave, n_fft=cfg.n_fft, hop_length=cfg.hop_length, window=window, center=True,
                      return_complex=True)
    features = spec.abs().square().clamp_min(LOG_FLOOR).log()
    return (features - features.mean()) / (features.std() + 1e-5)


def spec_augment(features: Tensor, cfg: SpeechDataConfig) -> Tensor:
    """SpecAugment's frequency and time masks (set to 0, the normalised mean). Draws from the global
    RNG, which the loader seeds per worker and the checkpoint restores in the main process."""
    features = features.clone()
    bins, frames = features.shape
    for size, limit, axis in ((cfg.freq_mask_bins, bins, 0), (cfg.time_mask_frames, frames, 1)):
        for _ in range(cfg.num_masks):
            width = int(torch.randint(0, min(size, limit) + 1, ()))
            start = int(torch.randint(0, limit - width + 1, ()))
            features.narrow(axis, start, width).zero_()
    return features


@dataclass
class Utterance:
    """One dataset item: features, the transcript and its indices, and the audio duration."""

    features: Tensor      # (bins, frames) FP32
    text: str
    target: Tensor        # (len(text),) int64 alphabet indices
    duration_s: float


def utterance(wave: Tensor, text: str, cfg: SpeechDataConfig, augment: bool, where: str) -> Utterance:
    """One item from its waveform: the front end (SpecAugment only if `augment` and configured)."""
    features = log_spectrogram(wave, cfg)
    if augment and cfg.spec_augment:
        features = spec_augment(features, cfg)
    return Utterance(features, text, encode_text(text, where), wave.numel() / cfg.sample_rate)


def collate_utterances(items: Sequence[Utterance]) -> dict[str, Any]:
    """Zero-padded features (N, bins, T); lengths, transcripts and durations for the host."""
    lengths = torch.tensor([u.features.shape[1] for u in items], dtype=torch.int64)
    features = torch.zeros(len(items), items[0].features.shape[0], int(lengths.max()))
    for i, u in enumerate(items):
        features[i, :, :u.features.shape[1]] = u.features
    return {
        "input": features,
        "input_lengths": lengths,
        "targets": torch.cat([u.target for u in items]),  # concatenated, as F.ctc_loss takes them
        "target_lengths": torch.tensor([len(u.target) for u in items], dtype=torch.int64),
        "transcripts": [u.text for u in items],
        "durations": torch.tensor([u.duration_s for u in items], dtype=torch.float64),
    }


def length_buckets(durations: Sequence[float], batch_size: int, max_batch_seconds: float | None,
                   generator: torch.Generator) -> list[list[int]]:
    """Batches of utterances of similar length (little padding), in a random order.

    Utterances are sorted by duration (ties in random order) and cut into batches of at most
    `batch_size` whose padded audio (count x longest) stays within `max_batch_seconds`, so
    batches of long utterances hold fewer of them. The batch order is shuffled.
    """
    order = torch.randperm(len(durations), generator=generator).tolist()
    order.sort(key=lambda i: durations[i])  # stable: equal durations keep their random order
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = durations[i]  # sorted, so the newest is the longest
        if current and (len(current) == batch_size
                        or (max_batch_seconds is not None and (len(current) + 1) * longest > max_batch_seconds)):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return [batches[j] for j in torch.randperm(len(batches), generator=generator).tolist()]
