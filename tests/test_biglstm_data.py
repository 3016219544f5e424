"""The 1B Word reader on a tiny tree generated here: layout, vocabulary, streaming, errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.biglstm_one_billion_word import OneBillionWord, OneBillionWordConfig, Vocabulary, check_one_billion_word
from runner.errors import UserError

TRAIN = "training-monolingual.tokenized.shuffled"
HELDOUT = "heldout-monolingual.tokenized.shuffled"
VOCAB = "<S> 40\n</S> 40\n<UNK> 3\nthe 30\ncat 9\nsat 8\n. 20\ndog 7\n"


def _tree(root: Path) -> Path:
    (root / TRAIN).mkdir(parents=True)
    (root / HELDOUT).mkdir(parents=True)
    (root / "1b_word_vocab.txt").write_text(VOCAB)
    (root / TRAIN / "news.en-00001-of-00100").write_text("the cat sat .\nthe dog sat .\n" * 5)
    (root / TRAIN / "news.en-00002-of-00100").write_text("the zebra sat .\n" * 8)
    (root / HELDOUT / "news.en.heldout-00000-of-00050").write_text("the cat sat .\n" * 4)
    return root


def _cfg(root: Path, **kw) -> OneBillionWordConfig:
    return OneBillionWordConfig(root=str(root), batch_size=2, unroll=3, **kw)


def test_vocabulary_sorts_by_count_and_encodes_sentences(tmp_path: Path) -> None:
    vocab = Vocabulary(_tree(tmp_path) / "1b_word_vocab.txt")
    assert len(vocab) == 8
    assert [vocab.ids[w] for w in ("</S>", "<S>", "the", ".", "cat")] == [0, 1, 2, 3, 4]  # by count, ties by word
    assert vocab.encode("the zebra sat") == [vocab.start, 2, vocab.unk, vocab.ids["sat"], vocab.end]


def test_f_lm_vocabulary_without_end_token_ends_with_start(tmp_path: Path) -> None:
    path = tmp_path / "v.txt"
    path.write_text("<S> 5\n<UNK> 1\na 3\n")
    vocab = Vocabulary(path)
    assert vocab.encode("a") == [vocab.start, vocab.ids["a"], vocab.start]


def test_shards_stream_as_windows_one_shard_at_a_time(tmp_path: Path) -> None:
    corpus = OneBillionWord(_cfg(_tree(tmp_path)))
    data = corpus.windows("train", rows=2)
    shard1 = corpus.load(str(tmp_path / TRAIN / "news.en-00001-of-00100"))
    assert len(shard1) == 10 * 6 and corpus.count_tokens(str(tmp_path / TRAIN / "news.en-00001-of-00100")) == 60
    assert data.chunks == [(60 - 1) // 6, (8 * 6 - 1) // 6]
    loads = []
    data.load = lambda i, load=data.load: loads.append(i) or load(i)
    plan = data.plan([1, 0])  # shard 2 first, then shard 1
    batches = [torch.stack([data[i] for i in b]) for b in plan]
    assert loads == [1, 0]  # each shard read once, when its first batch is
    # row 0 of shard 1 is its first L tokens, continued window by window
    first_of_shard1 = batches[data.chunks[1]]
    assert first_of_shard1[0].tolist() == shard1[:4].tolist()
    assert batches[data.chunks[1] + 1][0, 0] == first_of_shard1[0, -1]


def test_resume_skips_to_a_batch_without_reading_earlier_shards(tmp_path: Path) -> None:
    data = OneBillionWord(_cfg(_tree(tmp_path))).windows("train", rows=2)
    loads = []
    data.load = lambda i, load=data.load: loads.append(i) or load(i)
    plan = data.plan([0, 1])
    last = [data[i] for i in plan[-1]]
    assert loads == [1] and len(last) == 2


@pytest.mark.parametrize("breakage, match", [
    (lambda root: (root / "1b_word_vocab.txt").unlink(), "cannot read vocabulary"),
    (lambda root: (root / "1b_word_vocab.txt").write_text("the\n"), "malformed vocabulary .* line 1"),
    (lambda root: (root / "1b_word_vocab.txt").write_text("the 3\n"), "lacks <S>, <UNK>"),
    (lambda root: [p.unlink() for p in (root / TRAIN).iterdir()], "no 1B Word train shards"),
    (lambda root: (root / HELDOUT / "news.en.heldout-00000-of-00050").unlink(), "no 1B Word eval shards"),
])
def test_missing_or_malformed_files_are_one_line_user_errors(tmp_path: Path, breakage, match: str) -> None:
    root = _tree(tmp_path)
    breakage(root)
    with pytest.raises(UserError, match=match) as err:
        check_one_billion_word(_cfg(root))
    assert "\n" not in str(err.value)


def test_missing_root_and_unreadable_shard(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data.root=.* is not a directory"):
        check_one_billion_word(_cfg(tmp_path / "nowhere"))
    root = _tree(tmp_path)
    (root / TRAIN / "news.en-00002-of-00100").write_bytes(b"\xff\xfe bad")
    with pytest.raises(UserError, match="cannot read 1B Word shard .*00002"):
        OneBillionWord(_cfg(root)).windows("train", rows=2)
