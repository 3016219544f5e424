"""The One Billion Word benchmark (Chelba et al. 2013) as users have it on disk:

    <root>/training-monolingual.tokenized.shuffled/news.en-000NN-of-00100     (training shards)
    <root>/heldout-monolingual.tokenized.shuffled/news.en.heldout-000NN-of-00050
    <root>/1b_word_vocab.txt     one "word count" per line (f-lm's public vocabulary file)

One tokenized sentence per line. A sentence becomes `<S> w1 ... wn </S>` (the benchmark's
boundary tokens; f-lm's vocabulary has no `</S>` and ends sentences with `<S>` again, which
is used when `</S>` is missing); words not in the vocabulary become `<UNK>`. Word ids follow
the counts, most frequent first, as the log-uniform sampler of sampled softmax assumes.

Each shard is one segment of data.biglstm_stream: only the shard being read is in memory
(the corpus is 4 GB). Building the dataset counts every shard's tokens once (a streaming
pass that keeps nothing), so an epoch plan and a resume point are known without loading.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from data.biglstm_stream import TextStreamConfig, TokenWindows
from runner.errors import UserError

LAYOUT = ("<root>/training-monolingual.tokenized.shuffled/news.en-000NN-of-00100, "
          "<root>/heldout-monolingual.tokenized.shuffled/news.en.heldout-000NN-of-00050 and "
          "<root>/<vocab> with 'word count' lines (or use data=synthetic_text)")


@dataclass
class OneBillionWordConfig(TextStreamConfig):
    name: str = "one_billion_word"
    root: str = "data/1-billion-word-language-modeling-benchmark-r13output"
    vocab: str = "1b_word_vocab.txt"   # relative to root (or absolute)
    train_files: str = "training-monolingual.tokenized.shuffled/news.en-*-of-00100"
    eval_files: str = "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050"  # the test set
    batch_size: int = 128
    num_workers: int = 0


class Vocabulary:
    """Word -> id, ids sorted by count (most frequent first)."""

    def __init__(self, path: Path) -> None:
        counts: list[tuple[int, str]] = []
        try:
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    fields = line.split()
                    if len(fields) != 2 or not fields[1].isdigit():
                        raise UserError(f"malformed vocabulary {path} line {number}: expected 'word count', "
                                        f"got {line.strip()[:60]!r}")
                    counts.append((-int(fields[1]), fields[0]))
        except OSError as exc:
            raise UserError(f"cannot read vocabulary {path} ({exc.strerror or exc}); expected {LAYOUT}") from None
        except UnicodeDecodeError:
            raise UserError(f"vocabulary {path} is not UTF-8 text; expected {LAYOUT}") from None
        counts.sort()  # stable on ties: by count, then by word, so ids do not depend on file order
        self.ids = {word: i for i, (_, word) in enumerate(counts)}
        missing = [w for w in ("<S>", "<UNK>") if w not in self.ids]
        if missing:
            raise UserError(f"vocabulary {path} lacks {', '.join(missing)}; the 1B Word vocabulary has <S> and <UNK>")
        self.start, self.unk = self.ids["<S>"], self.ids["<UNK>"]
        self.end = self.ids.get("</S>", self.start)

    def __len__(self) -> int:
        return len(self.ids)

    def encode(self, line: str) -> list[int]:
        get, unk = self.ids.get, self.unk
        return [self.start, *(get(w, unk) for w in line.split()), self.end]


def _resolve(cfg: OneBillionWordConfig, relative: str) -> Path:
    return Path(cfg.root) / relative  # an absolute `relative` wins, as pathlib joins it


def _shards(cfg: OneBillionWordConfig, split: str) -> list[str]:
    pattern = cfg.train_files if split == "train" else cfg.eval_files
    key = "data.train_files" if split == "train" else "data.eval_files"
    files = sorted(glob.glob(str(_resolve(cfg, pattern))))
    if not files:
        raise UserError(f"no 1B Word {split} shards match {_resolve(cfg, pattern)} ({key}); expected {LAYOUT}")
    return files


def _shard_lines(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read 1B Word shard {path} ({exc}); expected UTF-8 text, "
                        f"one tokenized sentence per line") from None


def check_one_billion_word(cfg: OneBillionWordConfig) -> None:
    """Fail early (one line) when the layout is not there; the vocabulary is parsed in full."""
    if not os.path.isdir(cfg.root):
        raise UserError(f"data.root={cfg.root} is not a directory; expected {LAYOUT}")
    for split in ("train", "eval"):
        _shards(cfg, split)
    Vocabulary(_resolve(cfg, cfg.vocab))


class OneBillionWord:
    """The benchmark's vocabulary and shards; `windows(split, rows)` batches a split."""

    def __init__(self, cfg: OneBillionWordConfig) -> None:
        self.cfg = cfg

    @cached_property
    def vocab(self) -> Vocabulary:
        return Vocabulary(_resolve(self.cfg, self.cfg.vocab))

    def count_tokens(self, path: str) -> int:
        """Tokens the shard encodes to (words + 2 boundary tokens per sentence), read line by line."""
        return sum(len(line.split()) + 2 for line in _shard_lines(path))

    def load(self, path: str) -> Tensor:
        """One shard as int32 word ids, sentences in file order (the corpus is shuffled already)."""
        encode = self.vocab.encode
        return torch.tensor([i for line in _shard_lines(path) for i in encode(line)], dtype=torch.int32)

    def windows(self, split: str, rows: int) -> TokenWindows:
        files = _shards(self.cfg, split)
        return TokenWindows([self.count_tokens(f) for f in files], lambda i: self.load(files[i]), rows, self.cfg.unroll)
