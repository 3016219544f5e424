"""A built-in, learnable speech-like set (no download, deterministic by seed).

Each utterance is a few words from a small lexicon, rendered as a 16 kHz waveform: every
letter is a distinct chord of two tones (one from a low, one from a high frequency group,
as telephone DTMF digits), held for a random duration, with random loudness and slight
pitch jitter, separated by short silences; a space is a longer silence; white noise is
added at a random signal-to-noise ratio. The waveform goes through the same front end as
real audio (data/deepspeech_audio.py), so the model sees a spectrogram whose time-frequency
patterns determine the transcript. Item i of a split comes from a generator seeded with
(seed, split, i): the same on every run and worker.
"""
from __future__ import annotations

import math
from typing import Union
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.data import Dataset

from data.common import item_generator, require
from data.deepspeech_audio import ALPHABET, SpeechDataConfig, Utterance, utterance

LETTERS = ALPHABET[1:-1]  # apostrophe and a-z: the characters that sound
# 6 low x 5 high tones = 30 chords for the 27 letters; tones 100+ Hz apart (the bins are 50 Hz wide).
LOW_HZ = (300.0, 420.0, 560.0, 720.0, 900.0, 1100.0)
HIGH_HZ = (1500.0, 1800.0, 2150.0, 2550.0, 3000.0)
DEFAULT_LEXICON = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "zero", "one", "two",
                   "three", "four", "five", "six", "seven", "eight", "nine", "cat", "dog", "bird", "tree",
                   "house", "happy", "wow", "don't", "learn", "follow"]


@dataclass
class SyntheticSpeechConfig(SpeechDataConfig):
    name: str = "synthetic_speech"
    num_train: int = 2048
    num_eval: int = 128
    lexicon: list[str] = field(default_factory=lambda: list(DEFAULT_LEXICON))
    min_words: int = 1
    max_words: int = 3
    letter_ms: list[float] = field(default_factory=lambda: [40.0, 90.0])  # duration range of one letter
    gap_ms: list[float] = field(default_factory=lambda: [10.0, 30.0])     # silence between letters
    space_ms: list[float] = field(default_factory=lambda: [80.0, 160.0])  # silence between words
    snr_db: list[float] = field(default_factory=lambda: [10.0, 30.0])     # white-noise SNR range
    batch_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.lexicon) and all(w and not set(w) - set(LETTERS) for w in self.lexicon), "lexicon",
                list(self.lexicon), f"non-empty words of the letters {LETTERS!r}", "the words transcripts are drawn from")
        require(1 <= self.min_words <= self.max_words, "min_words", self.min_words,
                f"between 1 and data.max_words={self.max_words}", "words per utterance")
        for key in ("letter_ms", "gap_ms", "space_ms", "snr_db"):
            low_high = list(getattr(self, key))
            positive = key != "snr_db"
            require(len(low_high) == 2 and low_high[0] <= low_high[1] and (not positive or low_high[0] > 0), key,
                    low_high, f"[low, high] with low <= high{', both positive' if positive else ''}",
                    "a range the generator draws from uniformly")
        for key in ("num_train", "num_eval"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "1 or more", "generated utterances in that split")


def _uniform(g: torch.Generator, low_high: list[float]) -> float:
    return low_high[0] + (low_high[1] - low_high[0]) * float(torch.rand((), generator=g))


# One piece of an utterance: a silence (its length in samples) or a letter (char, length, pitch
# jitter, loudness). All random choices are drawn into pieces first, so that an utterance's length
# is known without synthesising it (length bucketing needs every duration up front).
Piece = Union[int, tuple[str, int, Tensor, float]]


def _silence(low_high: list[float], g: torch.Generator, cfg: SyntheticSpeechConfig) -> int:
    return round(_uniform(g, low_high) * cfg.sample_rate / 1000)


def _letter(char: str, g: torch.Generator, cfg: SyntheticSpeechConfig) -> Piece:
    """One letter's choices: random length, +-2% pitch and loudness."""
    n = round(_uniform(g, cfg.letter_ms) * cfg.sample_rate / 1000)
    jitter = 1 + 0.02 * (2 * torch.rand(2, generator=g) - 1)
    return char, n, jitter, _uniform(g, [0.2, 0.5])


def pieces(text: str, g: torch.Generator, cfg: SyntheticSpeechConfig) -> list[Piece]:
    """The random choices of `text` (lower-case words separated by single spaces), drawn in order."""
    out: list[Piece] = [_silence(cfg.gap_ms, g, cfg)]
    for char in text:
        if char == " ":
            out.append(_silence(cfg.space_ms, g, cfg))
        else:
            out += [_letter(char, g, cfg), _silence(cfg.gap_ms, g, cfg)]
    return out


def num_samples(plan: list[Piece]) -> int:
    return sum(p if isinstance(p, int) else p[1] for p in plan)


def _tone(piece: tuple[str, int, Tensor, float], cfg: SyntheticSpeechConfig) -> Tensor:
    """A letter: its two-tone chord, faded in and out."""
    char, n, jitter, loudness = piece
    index = LETTERS.index(char)
    t = torch.arange(n) / cfg.sample_rate
    low, high = LOW_HZ[index % len(LOW_HZ)] * jitter[0], HIGH_HZ[index // len(LOW_HZ)] * jitter[1]
    chord = torch.sin(2 * math.pi * low * t) + torch.sin(2 * math.pi * high * t)
    return loudness * chord * torch.hann_window(n, periodic=False)


def render(plan: list[Piece], g: torch.Generator, cfg: SyntheticSpeechConfig) -> Tensor:
    """The waveform of an utterance's pieces, with noise (drawn from `g` after the pieces)."""
    wave = torch.cat([torch.zeros(p) if isinstance(p, int) else _tone(p, cfg) for p in plan])
    noise_power = wave.square().mean() / 10 ** (_uniform(g, cfg.snr_db) / 10)
    return wave + noise_power.sqrt() * torch.randn(wave.shape, generator=g)


class SyntheticSpeech(Dataset):
    """Items: Utterance (features from the shared front end, transcript, duration)."""

    def __init__(self, cfg: SyntheticSpeechConfig, split: str, seed: int) -> None:
        self.cfg, self.split, self.seed = cfg, split, seed
        self.length = cfg.num_train if split == "train" else cfg.num_eval
        # Durations for length bucketing, known without synthesising: the random choices only.
        self.durations = [num_samples(self._plan(i)[1]) / cfg.sample_rate for i in range(self.length)]

    def __len__(self) -> int:
        return self.length

    def _plan(self, index: int) -> tuple[str, list[Piece], torch.Generator]:
        g = item_generator(self.seed, self.split, index)
        cfg = self.cfg
        count = int(torch.randint(cfg.min_words, cfg.max_words + 1, (), generator=g))
        words = [cfg.lexicon[int(i)] for i in torch.randint(len(cfg.lexicon), (count,), generator=g)]
        text = " ".join(words)
        return text, pieces(text, g, cfg), g

    def __getitem__(self, index: int) -> Utterance:
        if not 0 <= index < self.length:
            raise IndexError(index)
        text, plan, g = self._plan(index)
        return utterance(render(plan, g, self.cfg), text, self.cfg, self.split == "train", "data.lexicon")
