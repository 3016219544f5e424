"""DeepSpeech 2 (Amodei et al. 2016), English layout, as the paper's speech experiment (4.3).

spectrogram (N, 161, T) -> 2 x [2-D conv, batch norm, clipped ReLU] (DS2's 41x11 then 21x11
kernels over frequency x time, strides (2, 2) then (2, 1)) -> 3 GRU layers (bidirectional,
the two directions summed as in DS2; `bidirectional: false` for the streaming variant) with
sequence-wise batch norm before every GRU but the first -> row convolution (lookahead over
`lookahead` future frames) -> clipped ReLU -> fully connected to the 29 characters -> CTC.

Variable lengths: padding changes neither the loss nor any utterance's state. Every batch
norm takes its statistics over the valid frames only and writes zeros into the padding, so
each convolution and the row convolution read zeros past an utterance's end exactly as for
that utterance alone (zero padding), and the GRUs run on PackedSequences, so no padding
frame enters a recurrent state. `output_lengths` gives the exact frame counts after the
strided convolutions.

Precision (paper 3.3): the model returns raw logits, which the policy casts to FP32; the
log-softmax, CTC loss and decoding run in FP32 here. CTC: `F.ctc_loss`, blank index 0 (the
only one cuDNN accepts), `zero_infinity=True` so that an utterance too short for its
transcript (fewer output frames than labels plus repeats: its CTC loss is +inf) adds zero
loss and zero gradient instead of an overflow that a loss scaler would count as its own.
On CUDA this runs the native CTC kernel: cuDNN's needs int32 targets on the host and every
input length equal to T, and bucketed variable-length batches are neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import jiwer
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from data.deepspeech_audio import ALPHABET, SpeechDataConfig, collate_utterances, length_buckets
from data.deepspeech_librispeech import LibriSpeech, LibriSpeechConfig, check_librispeech
from data.deepspeech_synthetic import SyntheticSpeech, SyntheticSpeechConfig
from runner.errors import UserError
from runner.task import Batch, EvalResult, StepContext, Task

CLIP = 20.0  # DS2's clipped ReLU: min(max(x, 0), 20)


@dataclass
class DeepSpeechConfig:
    name: str = "deepspeech"
    conv_channels: int = 32       # both 2-D convolutions (DS2: 32)
    rnn_hidden: int = 1824        # GRU units per direction (1824: 114.6M parameters, the paper's ~115M)
    rnn_layers: int = 3
    bidirectional: bool = True
    lookahead: int = 20           # row convolution's future context in frames (after the strided conv)

    def __post_init__(self) -> None:
        for key in ("conv_channels", "rnn_hidden", "rnn_layers"):
            if getattr(self, key) < 1:
                raise UserError(f"bad config: model.{key}={getattr(self, key)} must be 1 or more "
                                f"(DS2 paper size: conv_channels=32, rnn_hidden=1824, rnn_layers=3)")
        if self.lookahead < 0:
            raise UserError(f"bad config: model.lookahead={self.lookahead} must be 0 or more "
                            f"(future frames the row convolution sees; DS2: 20)")


def length_mask(lengths: Tensor, frames: int) -> Tensor:
    """(N, frames) bool: True on the valid frames of each utterance."""
    return torch.arange(frames, device=lengths.device) < lengths[:, None]


class MaskedBatchNorm(nn.BatchNorm1d):
    """Batch norm over the valid frames only; padding frames come out as zeros.

    Input: channels last (N, T, ..., C) and a (N, T) mask. A BatchNorm subclass, so the
    precision policy keeps it in FP32 under MP and weight decay skips it.
    """

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        valid = x[mask]  # (frames, ..., C)
        out = torch.zeros_like(x)
        out[mask] = super().forward(valid.reshape(-1, x.shape[-1])).view(valid.shape).to(x.dtype)
        return out


class ConvBlock(nn.Module):
    """2-D convolution over (frequency, time), masked batch norm, clipped ReLU."""

    def __init__(self, in_ch: int, out_ch: int, kernel: tuple[int, int], stride: tuple[int, int]) -> None:
        super().__init__()
        padding = (kernel[0] // 2, kernel[1] // 2)
        self.conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=False)  # BN adds the bias
        self.norm = MaskedBatchNorm(out_ch)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """Frames after this convolution along time (PyTorch's Conv2d output-size formula)."""
        c = self.conv
        return (lengths + 2 * c.padding[1] - c.dilation[1] * (c.kernel_size[1] - 1) - 1) // c.stride[1] + 1

    def output_bins(self, bins: int) -> int:
        c = self.conv
        return (bins + 2 * c.padding[0] - c.dilation[0] * (c.kernel_size[0] - 1) - 1) // c.stride[0] + 1

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        x = self.conv(x)  # (N, C, F, T)
        lengths = self.output_lengths(lengths)
        normed = self.norm(x.permute(0, 3, 2, 1), length_mask(lengths.to(x.device), x.shape[-1]))  # (N, T, F, C)
        return F.hardtanh(normed.permute(0, 3, 2, 1), 0.0, CLIP), lengths


class RecurrentLayer(nn.Module):
    """[sequence-wise masked batch norm] -> GRU over a PackedSequence -> directions summed."""

    def __init__(self, in_size: int, hidden: int, bidirectional: bool, norm: bool) -> None:
        super().__init__()
        self.norm = MaskedBatchNorm(in_size) if norm else None
        self.gru = nn.GRU(in_size, hidden, batch_first=True, bidirectional=bidirectional)

    def forward(self, x: Tensor, lengths: Tensor, mask: Tensor) -> Tensor:
        if self.norm is not None:
            x = self.norm(x, mask)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=x.shape[1])
        if self.gru.bidirectional:
            out = out.view(*out.shape[:2], 2, -1).sum(dim=2)
        return out


class RowConvolution(nn.Module):
    """DS2's lookahead: out[t] = sum_{j=0..tau} w_j * h[t + j] per channel, zeros past the end."""

    def __init__(self, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv = nn.Conv1d(channels, channels, lookahead + 1, groups=channels, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (N, T, C), zero past each utterance's end
        return self.conv(F.pad(x.transpose(1, 2), (0, self.lookahead))).transpose(1, 2)


class DeepSpeech2(nn.Module):
    """(features (N, bins, T), lengths (N,) on the host) -> (logits (N, T', 29), lengths T')."""

    def __init__(self, cfg: DeepSpeechConfig, num_bins: int, num_chars: int) -> None:
        super().__init__()
        ch = cfg.conv_channels
        self.convs = nn.ModuleList([ConvBlock(1, ch, (41, 11), (2, 2)), ConvBlock(ch, ch, (21, 11), (2, 1))])
        bins = num_bins
        for block in self.convs:
            bins = block.output_bins(bins)
        sizes = [ch * bins] + [cfg.rnn_hidden] * (cfg.rnn_layers - 1)
        self.rnns = nn.ModuleList([RecurrentLayer(size, cfg.rnn_hidden, cfg.bidirectional, norm=i > 0)
                                   for i, size in enumerate(sizes)])
        self.row_conv = RowConvolution(cfg.rnn_hidden, cfg.lookahead)
        self.fc = nn.Linear(cfg.rnn_hidden, num_chars)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        for block in self.convs:
            lengths = block.output_lengths(lengths)
        return lengths

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        x = features.unsqueeze(1)  # (N, 1, bins, T)
        for block in self.convs:
            x, lengths = block(x, lengths)
        x = x.flatten(1, 2).transpose(1, 2)  # (N, T', C * bins)
        mask = length_mask(lengths.to(x.device), x.shape[1])
        for rnn in self.rnns:
            x = rnn(x, lengths, mask)
        x = F.hardtanh(self.row_conv(x), 0.0, CLIP)
        return self.fc(x), lengths


def greedy_decode(logits: Tensor, lengths: Tensor) -> list[str]:
    """Best path: argmax per frame, repeats merged, blanks dropped, spaces normalised."""
    best = logits.argmax(dim=-1).cpu()  # (N, T)
    texts = []
    for path, length in zip(best, lengths.tolist()):
        symbols = torch.unique_consecutive(path[:length]).tolist()
        texts.append(" ".join("".join(ALPHABET[s] for s in symbols if s != 0).split()))
    return texts


class DeepSpeechTask(Task):
    name = "deepspeech"
    metric_name = "cer"
    higher_is_better = False
    count_unit = "audio_s"
    # Lengths stay on the host: pack_padded_sequence and F.ctc_loss read them there (no device sync).
    host_keys = frozenset({"input_lengths", "target_lengths", "transcripts", "durations"})
    model_schema = DeepSpeechConfig
    data_sources = {"synthetic_speech": SyntheticSpeechConfig, "librispeech": LibriSpeechConfig}

    def check_data(self) -> None:
        if isinstance(self.data_cfg, LibriSpeechConfig):
            check_librispeech(self.data_cfg)

    def _dataset(self, split: str) -> torch.utils.data.Dataset:
        if isinstance(self.data_cfg, LibriSpeechConfig):
            return LibriSpeech(self.data_cfg, split)
        return SyntheticSpeech(self.data_cfg, split, self.seed)

    def build_train_data(self) -> torch.utils.data.Dataset:
        return self._dataset("train")

    def build_eval_data(self) -> torch.utils.data.Dataset:
        return self._dataset("eval")

    def build_model(self) -> nn.Module:
        data: SpeechDataConfig = self.data_cfg
        return DeepSpeech2(self.model_cfg, data.num_bins, len(ALPHABET))

    def collate(self, items: list[Any]) -> Batch:
        return collate_utterances(items)

    def epoch_batches(self, dataset: Any, batch_size: int, generator: torch.Generator) -> list[list[int]]:
        return length_buckets(dataset.durations, batch_size, self.data_cfg.max_batch_seconds, generator)

    def count(self, batch: Batch) -> float:
        """Seconds of audio in the batch (padding excluded)."""
        return float(batch["durations"].sum())

    def ctc_loss(self, logits: Tensor, lengths: Tensor, batch: Batch, ctx: StepContext) -> Tensor:
        """Mean over utterances of each one's summed CTC loss (deepspeech.pytorch's normalisation), FP32."""
        with ctx.fp32(logits) as logits:
            log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)  # (T', N, 29) as ctc_loss takes it
            loss = F.ctc_loss(log_probs, batch["targets"], lengths, batch["target_lengths"], blank=0,
                              reduction="sum", zero_infinity=True)
            return loss / logits.shape[0]

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, Tensor]:
        logits, lengths = model(batch["input"], batch["input_lengths"])
        loss = self.ctc_loss(logits, lengths, batch, ctx)
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        references: list[str] = []
        hypotheses: list[str] = []
        loss_sum, count = 0.0, 0
        for batch in batches:
            logits, lengths = model(batch["input"], batch["input_lengths"])
            n = logits.shape[0]
            loss_sum += float(self.ctc_loss(logits, lengths, batch, ctx)) * n
            count += n
            hypotheses += greedy_decode(logits, lengths)
            references += batch["transcripts"]
        return EvalResult({"cer": 100.0 * jiwer.cer(references, hypotheses),
                           "wer": 100.0 * jiwer.wer(references, hypotheses),
                           "loss": loss_sum / max(count, 1)})
