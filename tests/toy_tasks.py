"""Tiny Tasks in the shapes of the paper's other models, written against the public Task interface only.

- ToyGAN: two networks, two optimizers ("disc", "gen"), batch norm in both (DCGAN shape).
- ToyPackedLM: sparse embedding + LSTM + separate softmax layer over PackedSequences, length-bucketed batches of
  varying size, counted in tokens (bigLSTM shape).
- ToyStreamLM: the same network over a fixed-order token stream, recurrent state carried
  across batches (truncated BPTT) and checkpointed through Task.state_dict.
- ToyCTC: linear front end, bidirectional GRU over a PackedSequence, CTC loss (DeepSpeech shape).

Each is a few hundred to a few thousand parameters on synthetic data that a few steps can
learn, so the tests run in every precision mode in seconds. Nothing here knows about dtypes:
the step context casts (`ctx.cast`, `ctx.fp32`) and updates (`ctx.backward/step/optimize`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import Dataset

from data.common import LoaderConfig
from runner.task import Batch, EvalResult, StepContext, Task, decay_groups


def _generator(seed: int, *parts: int) -> torch.Generator:
    key = seed
    for p in parts:
        key = key * 1_000_003 + p
    return torch.Generator().manual_seed(key % (2**63))


class _ListDataset(Dataset):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


# ======================================================================================
# GAN
# ======================================================================================
SIDE = 6


def gan_pattern() -> torch.Tensor:
    """The image every real sample shows (plus noise): diagonal stripes in [-0.8, 0.8]."""
    i = torch.arange(SIDE, dtype=torch.float32)
    return 0.8 * torch.cos(math.pi * (i[:, None] + i[None, :]) / 4)


def pattern_corr(images: torch.Tensor) -> torch.Tensor:
    """Mean over samples of the Pearson correlation of each image with the pattern (FP32)."""
    x = images.detach().float().reshape(images.shape[0], -1)
    p = gan_pattern().reshape(1, -1).to(x.device)
    x = x - x.mean(1, keepdim=True)
    p = p - p.mean()
    return ((x * p).sum(1) / (x.norm(dim=1) * p.norm() + 1e-8)).mean()


@dataclass
class ToyGANModelConfig:
    name: str = "toy_gan"
    z_dim: int = 4
    hidden: int = 16
    channels: int = 4
    disc_nonfinite_at: int = 0   # make the disc loss non-finite at this iteration (1-based); 0: never
    gen_nonfinite_at: int = 0    # the same for the gen loss


@dataclass
class ToyPatternsConfig(LoaderConfig):
    name: str = "toy_patterns"
    num_train: int = 256
    noise: float = 0.1
    batch_size: int = 16


class ToyGANNet(nn.Module):
    def __init__(self, z_dim: int, hidden: int, channels: int) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(z_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                               nn.Linear(hidden, SIDE * SIDE), nn.Tanh(), nn.Unflatten(1, (1, SIDE, SIDE)))
        self.D = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.LeakyReLU(0.2),
                               nn.Flatten(), nn.Linear(channels * SIDE * SIDE, 1))


class ToyGAN(Task):
    """Non-saturating GAN on noisy copies of one 6x6 pattern; G's samples should come to show it."""

    name = "toy_gan"
    metric_name = "corr"
    optimizer_names = ("disc", "gen")
    model_schema = ToyGANModelConfig
    data_sources = {"toy_patterns": ToyPatternsConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self.iteration = 0                 # train_step calls (1-based once running); checkpointed
        self.loss_dtypes: set[torch.dtype] = set()
        self.fake_grad_max: list[torch.Tensor] = []  # max|d loss_gen * S / d fake| per iteration, as backward saw it

    def _data(self, n: int, split: int) -> _ListDataset:
        g = _generator(self.seed, split)
        images = gan_pattern() + self.data_cfg.noise * torch.randn(n, SIDE, SIDE, generator=g)
        return _ListDataset([(img[None], 0) for img in images])

    def build_train_data(self) -> Dataset:
        return self._data(self.data_cfg.num_train, 1)

    def build_eval_data(self) -> Dataset:
        return self._data(32, 2)

    def build_model(self) -> nn.Module:
        c = self.model_cfg
        return ToyGANNet(c.z_dim, c.hidden, c.channels)

    def optimizer_params(self, model: nn.Module) -> dict[str, Any]:
        return {"disc": model.D.parameters(), "gen": model.G.parameters()}

    def _bce(self, logits: torch.Tensor, target: float) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))
        self.loss_dtypes.add(loss.dtype)
        return loss

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        self.iteration += 1
        real = batch["input"]
        noise = torch.randn(real.shape[0], self.model_cfg.z_dim, device=ctx.device)  # FP32
        fake = model.G(ctx.cast(noise))
        # Discriminator: two backward calls accumulate into the "disc" gradients, then one step.
        with ctx.fp32(model.D(real)) as logits:
            loss_real = self._bce(logits, 1.0)
        ctx.backward(loss_real, "disc")
        with ctx.fp32(model.D(fake.detach())) as logits:
            loss_fake = self._bce(logits, 0.0)
        poison = math.inf if self.iteration == self.model_cfg.disc_nonfinite_at else 1.0
        ctx.backward(loss_fake * poison, "disc")
        ctx.step("disc")
        # Generator: gradients only into G's parameters (D's stay untouched).
        fake.register_hook(lambda grad: self.fake_grad_max.append(grad.detach().abs().max().float()))
        with ctx.fp32(model.D(fake)) as logits:
            g_loss = self._bce(logits, 1.0)
        poison = math.inf if self.iteration == self.model_cfg.gen_nonfinite_at else 1.0
        ctx.optimize(g_loss * poison, "gen")
        d_loss = (loss_real + loss_fake).detach()
        return {"loss": d_loss + g_loss.detach(), "d_loss": d_loss, "g_loss": g_loss.detach(),
                "gen_corr": pattern_corr(fake)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        noise = torch.randn(8, self.model_cfg.z_dim, generator=_generator(self.seed, 99)).to(ctx.device)
        samples = model.G(ctx.cast(noise)).float()
        grid = torch.cat(list(samples[:, 0]), dim=1)  # 8 samples side by side
        image = ((grid + 1) / 2).clamp(0, 1).expand(3, -1, -1)
        return EvalResult({"corr": float(pattern_corr(samples))}, images={"samples": image})

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = state["iteration"]


# ======================================================================================
# Language models: a sparse embedding, an LSTM, a separate output layer
# ======================================================================================
def lm_successor(token: int, active: int) -> int:
    """The rule most transitions follow: a fixed map of the active tokens onto themselves."""
    return (token * 5 + 3) % active


def lm_sequence(length: int, active: int, g: torch.Generator, follow: float = 0.9) -> torch.Tensor:
    """Tokens from 0..active-1: each is the successor of the previous one with prob `follow`."""
    tokens = [int(torch.randint(active, (1,), generator=g))]
    for _ in range(length - 1):
        if float(torch.rand((), generator=g)) < follow:
            tokens.append(lm_successor(tokens[-1], active))
        else:
            tokens.append(int(torch.randint(active, (1,), generator=g)))
    return torch.tensor(tokens, dtype=torch.long)


@dataclass
class ToyLMModelConfig:
    name: str = "toy_lm"
    vocab: int = 32            # V: rows of the (sparse) embedding and outputs of the softmax
    active: int = 16           # tokens the data uses (the rest of the vocabulary never occurs)
    embed: int = 16            # E
    hidden: int = 24
    sparse: bool = True        # False: a dense embedding gradient (for comparing gradient memory)


class ToyLMNet(nn.Module):
    def __init__(self, c: ToyLMModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.embed, sparse=c.sparse)
        self.lstm = nn.LSTM(c.embed, c.hidden, batch_first=True)
        self.out = nn.Linear(c.hidden, c.vocab)  # separate from the embedding (a tied one would densify its grad)

    def _lstm(self, x: Any, state: Any) -> tuple[Any, Any]:
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            # CPU autocast sends a dense (or equal-length packed) LSTM to oneDNN in FP16, which has
            # no FP16 LSTM kernel on CPUs without AVX512-FP16 ("could not create a primitive
            # descriptor"); run it in FP32 there, as CPU autocast already does for packed input.
            with torch.autocast("cpu", enabled=False):
                return self.lstm(to_float(x), None if state is None else to_float(state))
        return self.lstm(x, state)

    def forward(self, tokens: Any, state: Any = None) -> tuple[torch.Tensor, Any]:
        """tokens: a PackedSequence -> logits per packed token; or [B, T] -> logits [B, T, V]."""
        if isinstance(tokens, PackedSequence):
            x = PackedSequence(self.embed(tokens.data), tokens.batch_sizes, tokens.sorted_indices,
                               tokens.unsorted_indices)
            out, state = self._lstm(x, state)
            return self.out(out.data), state
        out, state = self._lstm(self.embed(tokens), state)
        return self.out(out), state


def to_float(x: Any) -> Any:
    if isinstance(x, PackedSequence):
        return PackedSequence(x.data.float(), x.batch_sizes, x.sorted_indices, x.unsorted_indices)
    if isinstance(x, tuple):
        return tuple(t.float() for t in x)
    return x.float()


class _ToyLMBase(Task):
    metric_name = "ppl"
    higher_is_better = False
    count_unit = "tokens"
    model_schema = ToyLMModelConfig

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self.loss_dtypes: set[torch.dtype] = set()

    def build_model(self) -> nn.Module:
        return ToyLMNet(self.model_cfg)

    def optimizer_params(self, model: nn.Module) -> dict[str, Any]:
        return {"main": decay_groups(model)}   # no weight decay on the embedding and the biases


@dataclass
class ToySentencesConfig(LoaderConfig):
    name: str = "toy_sentences"
    num_train: int = 96
    min_len: int = 3
    max_len: int = 14
    batch_size: int = 48      # token budget of one batch (sequences are added while they fit)
    pool: int = 16            # sequences sorted by length together (bucketing window)


class ToyPackedLM(_ToyLMBase):
    """Sentences of varying length, packed; batches bucketed by length under a token budget."""

    name = "toy_lm"
    host_keys = frozenset({"lengths"})
    data_sources = {"toy_sentences": ToySentencesConfig}

    def _data(self, n: int, split: int) -> _ListDataset:
        d, g = self.data_cfg, _generator(self.seed, split)
        lengths = torch.randint(d.min_len, d.max_len + 1, (n,), generator=g)
        return _ListDataset([lm_sequence(int(n_), self.model_cfg.active, g) for n_ in lengths])

    def build_train_data(self) -> Dataset:
        return self._data(self.data_cfg.num_train, 1)

    def build_eval_data(self) -> Dataset:
        return self._data(32, 2)

    def epoch_batches(self, dataset: Dataset, batch_size: int, generator: torch.Generator) -> list[list[int]]:
        """Shuffle, sort each pool of sequences by length, fill batches up to `batch_size` tokens,
        shuffle the batches: short sequences make batches of many sequences, long ones of few."""
        order = torch.randperm(len(dataset), generator=generator).tolist()
        pool = self.data_cfg.pool
        batches: list[list[int]] = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start:start + pool], key=lambda i: len(dataset[i]))
            current: list[int] = []
            tokens = 0
            for i in chunk:
                n = len(dataset[i]) - 1
                if current and tokens + n > batch_size:
                    batches.append(current)
                    current, tokens = [], 0
                current.append(i)
                tokens += n
            if current:
                batches.append(current)
        perm = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in perm]

    def collate(self, items: list[torch.Tensor]) -> Batch:
        lengths = torch.tensor([len(s) - 1 for s in items])
        inputs = pad_sequence([s[:-1] for s in items], batch_first=True)
        targets = pad_sequence([s[1:] for s in items], batch_first=True)
        return {"input": pack_padded_sequence(inputs, lengths, batch_first=True, enforce_sorted=False),
                "target": pack_padded_sequence(targets, lengths, batch_first=True, enforce_sorted=False),
                "lengths": lengths}

    def count(self, batch: Batch) -> int:
        return int(batch["lengths"].sum())   # predicted tokens; lengths stay on the host

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self.seen_tokens: list[int] = []   # tokens of every batch train_step received, in order

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        self.seen_tokens.append(int(batch["lengths"].sum()))
        logits, _ = model(batch["input"])
        with ctx.fp32(logits) as logits:
            loss = F.cross_entropy(logits, batch["target"].data)
        self.loss_dtypes.add(loss.dtype)
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        total, n = 0.0, 0
        for b in batches:
            logits, _ = model(b["input"])
            with ctx.fp32(logits) as logits:
                total += float(F.cross_entropy(logits, b["target"].data, reduction="sum"))
            n += int(b["lengths"].sum())
        return EvalResult({"ppl": math.exp(total / max(n, 1)), "loss": total / max(n, 1)})


@dataclass
class ToyStreamConfig(LoaderConfig):
    name: str = "toy_stream"
    stream_len: int = 400     # tokens per parallel stream
    bptt: int = 8             # tokens per batch row (truncated back-propagation length)
    batch_size: int = 4       # parallel streams


class _StreamChunks(Dataset):
    """Item k * B + b: chunk k (bptt + 1 tokens) of stream b."""

    def __init__(self, streams: torch.Tensor, bptt: int) -> None:
        self.streams, self.bptt = streams, bptt
        self.chunks = (streams.shape[1] - 1) // bptt

    def __len__(self) -> int:
        return self.chunks * self.streams.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        k, b = divmod(index, self.streams.shape[0])
        return self.streams[b, k * self.bptt:(k + 1) * self.bptt + 1]


class ToyStreamLM(_ToyLMBase):
    """One token stream cut into B parallel rows; the LSTM state runs on from batch to batch."""

    name = "toy_stream_lm"
    data_sources = {"toy_stream": ToyStreamConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self.hidden_state: tuple[torch.Tensor, torch.Tensor] | None = None
        self.resets = 0

    def _data(self, split: int) -> _StreamChunks:
        d, g = self.data_cfg, _generator(self.seed, split)
        streams = torch.stack([lm_sequence(d.stream_len, self.model_cfg.active, g) for _ in range(d.batch_size)])
        return _StreamChunks(streams, d.bptt)

    def build_train_data(self) -> Dataset:
        return self._data(1)

    def build_eval_data(self) -> Dataset:
        return self._data(2)

    def epoch_batches(self, dataset: Dataset, batch_size: int, generator: torch.Generator) -> list[list[int]]:
        """Fixed order (the state of row b must continue stream b): batch k = chunk k of every stream."""
        return [[k * batch_size + b for b in range(batch_size)] for k in range(len(dataset) // batch_size)]

    def collate(self, items: list[torch.Tensor]) -> Batch:
        rows = torch.stack(items)
        return {"input": rows[:, :-1], "target": rows[:, 1:]}

    def count(self, batch: Batch) -> int:
        return int(batch["target"].numel())

    def reset_state(self) -> None:
        self.hidden_state = None
        self.resets += 1

    def state_dict(self) -> dict[str, Any]:
        if self.hidden_state is None:
            return {}
        h, c = self.hidden_state
        return {"h": h.cpu(), "c": c.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hidden_state = (state["h"], state["c"]) if state else None

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        state = None
        if self.hidden_state is not None:
            state = ctx.cast(tuple(t.to(ctx.device) for t in self.hidden_state))
        logits, (h, c) = model(batch["input"], state)
        self.hidden_state = (h.detach(), c.detach())  # carried on, cut from the graph (truncated BPTT)
        with ctx.fp32(logits) as logits:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["target"].reshape(-1))
        self.loss_dtypes.add(loss.dtype)
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        total, n, state = 0.0, 0, None  # its own state: the training state is left alone
        for b in batches:
            logits, state = model(b["input"], None if state is None else ctx.cast(state))
            with ctx.fp32(logits) as logits:
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["target"].reshape(-1),
                                               reduction="sum"))
            n += b["target"].numel()
        return EvalResult({"ppl": math.exp(total / max(n, 1)), "loss": total / max(n, 1)})


# ======================================================================================
# GRU + CTC (DeepSpeech shape)
# ======================================================================================
@dataclass
class ToyCTCModelConfig:
    name: str = "toy_ctc"
    labels: int = 4            # characters 1..labels; 0 is the CTC blank
    features: int = 8          # frequency bins per frame
    hidden: int = 16


@dataclass
class ToySpeechConfig(LoaderConfig):
    name: str = "toy_speech"
    num_train: int = 128
    min_labels: int = 2
    max_labels: int = 5
    noise: float = 0.3
    batch_size: int = 8


def render_utterance(labels: torch.Tensor, features: int, noise: float, g: torch.Generator) -> torch.Tensor:
    """Each label l: 2-3 frames of a bump at frequency bin 2l-1; 0-1 frames of silence between labels."""
    bins = torch.arange(features, dtype=torch.float32)
    frames = []
    for label in labels.tolist():
        if float(torch.rand((), generator=g)) < 0.5:
            frames.append(torch.zeros(features))
        bump = torch.exp(-0.5 * (bins - (2 * label - 1)) ** 2)
        frames += [bump] * int(torch.randint(2, 4, (1,), generator=g))
    x = torch.stack(frames)
    return x + noise * torch.randn(x.shape, generator=g)


class ToyCTCNet(nn.Module):
    def __init__(self, c: ToyCTCModelConfig) -> None:
        super().__init__()
        self.front = nn.Sequential(nn.Linear(c.features, c.hidden), nn.ReLU())
        self.gru = nn.GRU(c.hidden, c.hidden, batch_first=True, bidirectional=True)
        self.classify = nn.Linear(2 * c.hidden, c.labels + 1)

    def forward(self, x: PackedSequence) -> torch.Tensor:
        """Packed features -> logits [T, B, labels + 1] (time first, as ctc_loss wants)."""
        h = PackedSequence(self.front(x.data), x.batch_sizes, x.sorted_indices, x.unsorted_indices)
        out, _ = self.gru(h)
        logits = PackedSequence(self.classify(out.data), out.batch_sizes, out.sorted_indices, out.unsorted_indices)
        return pad_packed_sequence(logits)[0]


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Best path: argmax per frame, merge repeats, drop blanks."""
    best = log_probs.argmax(-1).t().cpu()  # [B, T]
    out = []
    for row, n in zip(best, lengths.tolist()):
        merged = torch.unique_consecutive(row[:n])
        out.append([int(t) for t in merged if t != 0])
    return out


def edit_distance(a: list[int], b: list[int]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


class ToyCTC(Task):
    name = "toy_ctc"
    metric_name = "cer"
    higher_is_better = False
    count_unit = "frames"
    host_keys = frozenset({"input_lengths", "target_lengths"})
    model_schema = ToyCTCModelConfig
    data_sources = {"toy_speech": ToySpeechConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self.loss_dtypes: set[torch.dtype] = set()

    def _data(self, n: int, split: int) -> _ListDataset:
        d, c, g = self.data_cfg, self.model_cfg, _generator(self.seed, split)
        items = []
        for _ in range(n):
            count = int(torch.randint(d.min_labels, d.max_labels + 1, (1,), generator=g))
            labels = torch.randint(1, c.labels + 1, (count,), generator=g)
            items.append((render_utterance(labels, c.features, d.noise, g), labels))
        return _ListDataset(items)

    def build_train_data(self) -> Dataset:
        return self._data(self.data_cfg.num_train, 1)

    def build_eval_data(self) -> Dataset:
        return self._data(32, 2)

    def build_model(self) -> nn.Module:
        return ToyCTCNet(self.model_cfg)

    def collate(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
        feats, labels = zip(*items)
        input_lengths = torch.tensor([len(f) for f in feats])
        padded = pad_sequence(list(feats), batch_first=True)
        return {"input": pack_padded_sequence(padded, input_lengths, batch_first=True, enforce_sorted=False),
                "target": torch.cat(labels), "input_lengths": input_lengths,
                "target_lengths": torch.tensor([len(t) for t in labels])}

    def count(self, batch: Batch) -> int:
        return int(batch["input_lengths"].sum())

    def _loss(self, logits: torch.Tensor, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        with ctx.fp32(logits) as logits:   # CTC has no FP16 kernel: log-probs and loss in FP32
            log_probs = logits.log_softmax(-1)
            loss = F.ctc_loss(log_probs, batch["target"], batch["input_lengths"], batch["target_lengths"])
        return loss, log_probs

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        loss, _ = self._loss(model(batch["input"]), batch, ctx)
        self.loss_dtypes.add(loss.dtype)
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        edits = total = 0
        loss_sum, n = 0.0, 0
        for b in batches:
            loss, log_probs = self._loss(model(b["input"]), b, ctx)
            loss_sum += float(loss)
            n += 1
            targets = b["target"].cpu().split(b["target_lengths"].tolist())
            for hyp, ref in zip(greedy_decode(log_probs, b["input_lengths"]), targets):
                edits += edit_distance(hyp, ref.tolist())
                total += len(ref)
        return EvalResult({"cer": edits / max(total, 1), "loss": loss_sum / max(n, 1)})
