"""The LibriSpeech reader on a real-audio fixture (tests/fixtures/deepspeech: espeak-ng speech as
16 kHz FLAC in LibriSpeech's layout), and its one-line errors for missing or malformed data."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from data.deepspeech_librispeech import LibriSpeech, LibriSpeechConfig, check_librispeech, read_transcripts
from runner.errors import UserError

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeech" / "LibriSpeech"
TRAIN = ["train-clean-100"]
EVAL = ["dev-clean"]


def _cfg(root: Path = FIXTURE, **overrides) -> LibriSpeechConfig:
    return LibriSpeechConfig(root=str(root), train_splits=TRAIN, eval_splits=EVAL, num_workers=0, **overrides)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A writable copy of the fixture, to damage."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "LibriSpeech"))


def test_transcripts_manifest() -> None:
    rows = read_transcripts(FIXTURE / "train-clean-100" / "19" / "198" / "19-198.trans.txt")
    assert rows == [("19-198-0000", "the cat sat on the mat"), ("19-198-0001", "yes it is"),
                    ("19-198-0002", "don't stop now")]


def test_reads_the_fixture_splits_with_durations_and_features() -> None:
    check_librispeech(_cfg())
    train, dev = LibriSpeech(_cfg(), "train"), LibriSpeech(_cfg(), "eval")
    assert len(train) == 3 and len(dev) == 2
    assert [e.path.name for e in dev.entries] == ["84-121123-0000.flac", "84-121123-0001.flac"]
    item = dev[0]
    samples, rate = soundfile.read(str(dev.entries[0].path), dtype="float32")
    assert rate == 16000 and item.duration_s == pytest.approx(len(samples) / 16000)
    assert item.features.shape == (161, len(samples) // 160 + 1)
    assert item.text == "go left" and item.target.tolist() == [8, 16, 28, 13, 6, 7, 21]
    assert torch.isfinite(item.features).all()


def test_max_duration_drops_long_training_utterances() -> None:
    full = LibriSpeech(_cfg(), "train")
    limit = sorted(full.durations)[1]
    assert len(LibriSpeech(_cfg(max_duration=limit), "train")) == 2


def test_missing_root_or_split_is_one_clear_line(tmp_path: Path) -> None:
    for cfg in (_cfg(tmp_path / "nowhere"), LibriSpeechConfig(root=str(FIXTURE), train_splits=["train-other-500"])):
        with pytest.raises(UserError, match="does not exist.*data=synthetic_speech") as err:
            check_librispeech(cfg)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("damage, match", [
    ("missing_flac", "listed in .* but missing"),
    ("malformed_line", r"19-198.trans.txt:2: expected"),
    ("bad_character", "not in the alphabet"),
    ("wrong_rate", "8000 Hz .* need 16000 Hz mono"),
    ("not_audio", "cannot read audio"),
])
def test_damaged_data_is_a_user_error(tree: Path, damage: str, match: str) -> None:
    chapter = tree / "train-clean-100" / "19" / "198"
    trans = chapter / "19-198.trans.txt"
    if damage == "missing_flac":
        (chapter / "19-198-0001.flac").unlink()
    elif damage == "malformed_line":
        trans.write_text(trans.read_text().replace("19-198-0001 YES IT IS", "19-198-0001"))
    elif damage == "bad_character":
        trans.write_text(trans.read_text().replace("YES IT IS", "YES IT IS 42"))
    elif damage == "wrong_rate":
        soundfile.write(str(chapter / "19-198-0001.flac"), np.zeros(8000, dtype=np.float32), 8000)
    else:
        (chapter / "19-198-0001.flac").write_bytes(b"not a flac file")
    with pytest.raises(UserError, match=match) as err:
        LibriSpeech(_cfg(tree), "train")
    assert "\n" not in str(err.value)
