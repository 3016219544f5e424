"""bigLSTM (Jozefowicz et al. 2016, "BIG LSTM"), the paper's language model (section 4.5).

Word embedding -> dropout -> LSTM layers with projection (torch.nn.LSTM with proj_size:
an LSTMP cell, h = W_hr (o * tanh(c))), dropout between and after them -> softmax over the
vocabulary. Training uses sampled softmax (Jean et al. 2015, as TensorFlow's
`sampled_softmax_loss` that f-lm calls): `num_samples` words drawn from a log-uniform
(Zipfian) law over the frequency-sorted vocabulary, shared by every token of the batch;
each logit is corrected by subtracting the log of the word's expected count in the draw,
and sampled words equal to a token's own target ("accidental hits") are removed from that
token's softmax. Evaluation uses the full softmax. The paper size is the default of the
schema (vocabulary 793,471 from the data, embedding 1024, 2 layers of 8192 cells projected
to 1024, 8192 samples); configs/model/biglstm.yaml shrinks the same code path for a CPU.

Precision split (paper 3.3): the network returns raw logits (computed in the model's
precision), which the precision policy casts to FP32; corrections, masking, softmax and loss
run here in FP32. Embedding and softmax tables are nn.Embedding lookups with sparse
gradients (only the rows a batch touches), which the engine carries through master weights,
unscaling and clipping; Adagrad and SGD without momentum accept them.

The LSTM state is carried from one batch to the next (truncated BPTT over the rows of
data.biglstm_stream) and reset by the engine at the start of every epoch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.biglstm_one_billion_word import OneBillionWord, OneBillionWordConfig, check_one_billion_word
from data.biglstm_stream import TokenWindows, collate_windows
from data.biglstm_synthetic_text import ClassBigramGrammar, SyntheticTextConfig, build_synthetic_text
from runner.errors import UserError
from runner.task import Batch, EvalResult, ParamSpec, StepContext, Task, decay_groups

State = tuple[Tensor, Tensor]  # (h [layers, rows, proj], c [layers, rows, hidden])


@dataclass
class BigLSTMConfig:
    name: str = "biglstm"
    emb_size: int = 1024
    hidden_size: int = 8192        # LSTM cells per layer
    proj_size: int = 1024          # each layer's output is projected to this size
    num_layers: int = 2
    num_samples: int = 8192        # sampled-softmax candidates per batch
    keep_prob: float = 0.9         # dropout keep probability (before, between and after the LSTM layers)
    sparse_grads: bool = True      # sparse embedding/softmax gradients (Adagrad, SGD without momentum)

    def __post_init__(self) -> None:
        sizes = {"emb_size": self.emb_size, "hidden_size": self.hidden_size, "proj_size": self.proj_size,
                 "num_layers": self.num_layers, "num_samples": self.num_samples}
        bad = [k for k, v in sizes.items() if v <= 0]
        if bad:
            raise UserError(f"bad config: model.{bad[0]}={sizes[bad[0]]} must be positive")
        if self.proj_size >= self.hidden_size:
            raise UserError(f"bad config: model.proj_size={self.proj_size} must be smaller than "
                            f"model.hidden_size={self.hidden_size} (torch.nn.LSTM's proj_size rule)")
        if not 0 < self.keep_prob <= 1:
            raise UserError(f"bad config: model.keep_prob={self.keep_prob} must be in (0, 1]")


class BigLSTM(nn.Module):
    """tokens [rows, T] (+ state) -> logits; full softmax, or the sampled candidates' logits."""

    def __init__(self, vocab_size: int, cfg: BigLSTMConfig) -> None:
        super().__init__()
        drop = 1.0 - cfg.keep_prob
        self.embedding = nn.Embedding(vocab_size, cfg.emb_size, sparse=cfg.sparse_grads)
        self.dropout = nn.Dropout(drop)
        self.lstm = nn.LSTM(cfg.emb_size, cfg.hidden_size, num_layers=cfg.num_layers, proj_size=cfg.proj_size,
                            batch_first=True, dropout=drop)
        self.softmax_weight = nn.Embedding(vocab_size, cfg.proj_size, sparse=cfg.sparse_grads)
        self.softmax_bias = nn.Embedding(vocab_size, 1, sparse=cfg.sparse_grads)
        # Initialisation as PyTorch's word_language_model example (tables uniform +-0.1, zero bias),
        # and forget-gate bias 1 as TensorFlow's LSTMCell that f-lm uses (gate order i, f, g, o).
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.uniform_(self.softmax_weight.weight, -0.1, 0.1)
        nn.init.zeros_(self.softmax_bias.weight)
        with torch.no_grad():
            for name, p in self.lstm.named_parameters():
                if name.startswith("bias_ih"):
                    p[cfg.hidden_size:2 * cfg.hidden_size].fill_(1.0)

    def forward(self, tokens: Tensor, state: State | None = None, targets: Tensor | None = None,
                samples: Tensor | None = None) -> tuple[Any, State]:
        """Without samples: (full logits [rows, T, V], state). With targets [rows, T] and
        samples [S]: ((target logits [rows, T], sample logits [rows, T, S]), state), uncorrected."""
        x = self.dropout(self.embedding(tokens))
        h, state = self.lstm(x, state)
        h = self.dropout(h)
        if samples is None:
            return F.linear(h, self.softmax_weight.weight, self.softmax_bias.weight.squeeze(1)), state
        # One lookup per table for targets and samples together: a sparse gradient per table and step
        # (CPU kernels cannot add two FP16 sparse gradients).
        ids = torch.cat([targets.flatten(), samples])
        weights, biases = self.softmax_weight(ids), self.softmax_bias(ids).squeeze(-1)
        n = targets.numel()
        true_logits = (h * weights[:n].view_as(h)).sum(-1) + biases[:n].view_as(targets)
        sample_logits = F.linear(h, weights[n:], biases[n:])
        return (true_logits, sample_logits), state


class LogUniformSampler:
    """Draws with replacement from Q(k) = log((k + 2) / (k + 1)) / log(V + 1), k = 0 .. V-1.

    Zipf-like over a frequency-sorted vocabulary (TensorFlow's log_uniform_candidate_sampler's law).
    """

    def __init__(self, vocab_size: int, num_samples: int) -> None:
        k = torch.arange(vocab_size, dtype=torch.float64)
        self.probs = (torch.log1p(1.0 / (k + 1)) / math.log(vocab_size + 1)).float()
        self.num_samples = num_samples

    def sample(self, device: torch.device) -> Tensor:
        if self.probs.device != device:
            self.probs = self.probs.to(device)
        return torch.multinomial(self.probs, self.num_samples, replacement=True)

    def log_expected_count(self, ids: Tensor) -> Tensor:
        """log E[times id is drawn] = log(S Q(id)), FP32."""
        return math.log(self.num_samples) + self.probs.to(ids.device)[ids].log()


def sampled_softmax_loss(true_logits: Tensor, sample_logits: Tensor, targets: Tensor, samples: Tensor,
                         log_count_true: Tensor, log_count_samples: Tensor) -> Tensor:
    """Mean sampled-softmax cross-entropy in FP32 (call inside ctx.fp32).

    true_logits/targets/log_count_true [...], sample_logits [..., S], samples/log_count_samples [S].
    """
    corrected = torch.cat([(true_logits - log_count_true).unsqueeze(-1), sample_logits - log_count_samples], dim=-1)
    hits = torch.cat([torch.zeros_like(targets, dtype=torch.bool).unsqueeze(-1),
                      samples == targets.unsqueeze(-1)], dim=-1)  # accidental hits: a sample is the target
    corrected = corrected.masked_fill(hits, float("-inf"))
    flat = corrected.flatten(0, -2)
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


class BigLSTMTask(Task):
    name = "biglstm"
    metric_name = "ppl"
    higher_is_better = False
    count_unit = "tokens"
    model_schema = BigLSTMConfig
    data_sources = {"synthetic_text": SyntheticTextConfig, "one_billion_word": OneBillionWordConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self._corpus = OneBillionWord(self.data_cfg) if isinstance(self.data_cfg, OneBillionWordConfig) else None
        self._state: State | None = None  # carried between consecutive training batches, FP32
        self._sampler: LogUniformSampler | None = None

    # --- data ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.data_cfg.vocab_size if self._corpus is None else len(self._corpus.vocab)

    def check_data(self) -> None:
        if self._corpus is not None:
            check_one_billion_word(self.data_cfg)

    def _windows(self, split: str, rows: int) -> TokenWindows:
        if self._corpus is None:
            return build_synthetic_text(self.data_cfg, split, rows)
        return self._corpus.windows(split, rows)

    def build_train_data(self) -> TokenWindows:
        return self._windows("train", self.data_cfg.batch_size)

    def build_eval_data(self) -> TokenWindows:
        # Rows = the evaluation batch size, so the engine's sequential eval batches continue each row.
        return self._windows("eval", self.data_cfg.eval_batch_size or self.data_cfg.batch_size)

    def collate(self, items: list[Tensor]) -> Batch:
        return collate_windows(items)

    def epoch_batches(self, dataset: TokenWindows, batch_size: int, generator: torch.Generator) -> list[range]:
        """Segments (1B Word shards) in a fresh random order per epoch, each read front to back."""
        return dataset.plan(torch.randperm(len(dataset.chunks), generator=generator).tolist())

    def count(self, batch: Batch) -> int:
        return batch["target"].numel()

    # --- model --------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return BigLSTM(self.vocab_size, self.model_cfg)

    def optimizer_params(self, model: nn.Module) -> dict[str, ParamSpec]:
        # Tables (embedding, softmax) without weight decay: sparse gradients do not take it.
        return {"main": decay_groups(model)}

    def _sampler_for(self) -> LogUniformSampler:
        if self._sampler is None:
            self._sampler = LogUniformSampler(self.vocab_size, self.model_cfg.num_samples)
        return self._sampler

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, Tensor]:
        tokens, targets = batch["input"], batch["target"]
        sampler = self._sampler_for()
        samples = sampler.sample(tokens.device)  # shared by every token of the batch
        state = None if self._state is None else ctx.cast(tuple(s.to(tokens.device) for s in self._state))
        (true_logits, sample_logits), state = model(tokens, state, targets, samples)
        self._state = tuple(s.detach().float() for s in state)
        with ctx.fp32(true_logits, sample_logits) as (true_logits, sample_logits):
            loss = sampled_softmax_loss(true_logits, sample_logits, targets, samples,
                                        sampler.log_expected_count(targets), sampler.log_expected_count(samples))
        # f-lm back-propagates the loss summed over the unrolled steps (mean over rows): same here,
        # so its recipe (lr, clip, Adagrad's initial accumulator) sees gradients of the same size.
        ctx.optimize(loss * tokens.shape[1])
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        """Per-word perplexity with the full softmax, the state carried across the eval batches."""
        state: State | None = None
        loss_sum = torch.zeros((), dtype=torch.float64)
        tokens = 0
        for batch in batches:
            logits, state = model(batch["input"], None if state is None else ctx.cast(state))
            with ctx.fp32(logits) as logits:
                loss_sum += F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), reduction="sum").cpu()
            tokens += batch["target"].numel()
        loss = float(loss_sum) / max(tokens, 1)
        metrics = {"ppl": math.exp(loss), "loss": loss}
        if self._corpus is None:  # the synthetic corpus knows the answer
            grammar = ClassBigramGrammar(self.data_cfg)
            metrics["floor_ppl"] = math.exp(grammar.entropy_rate())
            metrics["unigram_ppl"] = math.exp(grammar.unigram_entropy())
        return EvalResult(metrics)

    # --- truncated BPTT state -------------------------------------------------------------
    def reset_state(self) -> None:
        self._state = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self._state is None else {"h": self._state[0].cpu(), "c": self._state[1].cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = (state["h"], state["c"]) if state else None
