"""LibriSpeech as users have it (openslr.org/12, unpacked).

Layout: <root>/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utterance>.flac, and in each
chapter folder <speaker>-<chapter>.trans.txt with one line per utterance:
`<speaker>-<chapter>-<utterance> TRANSCRIPT IN UPPER CASE`. The paper-size run trains on
train-clean-100 + train-clean-360 + train-other-500 (960 h) and evaluates on dev-clean.

FLAC is decoded by `soundfile` (its wheels bundle libsndfile with FLAC). Audio must be
16 kHz mono, as LibriSpeech is: other rates are refused rather than resampled, since no
dependency here resamples well. Building the manifest reads every file's header once (for
the durations that bucketing needs): seconds for dev-clean, a few minutes for 960 h.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import soundfile
import torch
from torch.utils.data import Dataset

from data.deepspeech_audio import SpeechDataConfig, Utterance, encode_text, utterance
from runner.errors import UserError

LAYOUT = ("expected <root>/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac with "
          "<speaker>-<chapter>.trans.txt beside them")


@dataclass
class LibriSpeechConfig(SpeechDataConfig):
    name: str = "librispeech"
    root: str = "data/LibriSpeech"
    train_splits: list[str] = field(default_factory=lambda: ["train-clean-100", "train-clean-360", "train-other-500"])
    eval_splits: list[str] = field(default_factory=lambda: ["dev-clean"])
    max_duration: float | None = None  # drop training utterances longer than this (seconds); None: keep all
    batch_size: int = 32
    num_workers: int = 4


@dataclass(frozen=True)
class Entry:
    path: Path
    text: str
    duration_s: float


def _split_dir(cfg: LibriSpeechConfig, split: str) -> Path:
    path = Path(cfg.root).expanduser().absolute() / split
    if not path.is_dir():
        raise UserError(f"no LibriSpeech data: {path} does not exist (data.root={cfg.root}, split {split!r}); "
                        f"{LAYOUT}; or use the built-in set with data=synthetic_speech")
    return path


def check_librispeech(cfg: LibriSpeechConfig) -> None:
    for split in [*cfg.train_splits, *cfg.eval_splits]:
        if not any(_split_dir(cfg, split).rglob("*.trans.txt")):
            raise UserError(f"no *.trans.txt under {_split_dir(cfg, split)}; {LAYOUT}")


def _duration(path: Path, sample_rate: int) -> float:
    """The file's duration from its header; checks that it is readable, mono and at `sample_rate`."""
    try:
        info = soundfile.info(str(path))
    except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
        raise UserError(f"cannot read audio {path}: {exc}; re-extract the LibriSpeech archive") from None
    if info.samplerate != sample_rate or info.channels != 1:
        raise UserError(f"{path} is {info.samplerate} Hz with {info.channels} channels; need {sample_rate} Hz mono "
                        f"(resample it, e.g. `sox in.flac -r {sample_rate} -c 1 out.flac`)")
    return info.frames / info.samplerate


def read_transcripts(path: Path) -> list[tuple[str, str]]:
    """(utterance id, lower-case transcript) per line of a .trans.txt file."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        utt_id, sep, text = line.strip().partition(" ")
        if not sep or not text.strip():
            raise UserError(f"{path}:{number}: expected `<speaker>-<chapter>-<utt> TRANSCRIPT`, got {line!r}")
        rows.append((utt_id, " ".join(text.lower().split())))
    return rows


def manifest(cfg: LibriSpeechConfig, splits: list[str], max_duration: float | None) -> list[Entry]:
    """Every utterance of `splits` (sorted by id), transcripts checked against the alphabet."""
    entries = []
    for split in splits:
        for trans in sorted(_split_dir(cfg, split).rglob("*.trans.txt")):
            for utt_id, text in read_transcripts(trans):
                encode_text(text, f"{trans} ({utt_id})")
                audio = trans.parent / f"{utt_id}.flac"
                if not audio.is_file():
                    raise UserError(f"{audio} is listed in {trans} but missing; re-extract the LibriSpeech archive")
                duration = _duration(audio, cfg.sample_rate)
                if max_duration is None or duration <= max_duration:
                    entries.append(Entry(audio, text, duration))
    return entries


class LibriSpeech(Dataset):
    """Items: Utterance (features of the decoded FLAC, transcript, duration)."""

    def __init__(self, cfg: LibriSpeechConfig, split: str) -> None:
        self.cfg, self.split = cfg, split
        train = split == "train"
        self.entries = manifest(cfg, cfg.train_splits if train else cfg.eval_splits,
                                cfg.max_duration if train else None)
        if not self.entries:
            raise UserError(f"no {split} utterances in data.{split}_splits under {cfg.root}"
                            f"{' within data.max_duration' if train and cfg.max_duration else ''}")
        self.durations = [e.duration_s for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> Utterance:
        entry = self.entries[index]
        try:
            samples, _ = soundfile.read(str(entry.path), dtype="float32")
        except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
            raise UserError(f"cannot decode {entry.path}: {exc}; re-extract the LibriSpeech archive") from None
        return utterance(torch.from_numpy(samples), entry.text, self.cfg, self.split == "train", str(entry.path))
