"""A built-in text corpus with a known answer: a class-bigram grammar with Zipfian words.

The vocabulary is split into `num_classes` word classes of equal size. The next word's
class depends on the current word's class: each class has `successors` likely next classes
(random, with random Dirichlet(1) weights), and with probability `smoothing` any class is
equally likely (so the chain is ergodic). Inside its class a word is drawn from a Zipf
law over ranks, p(rank r) ~ 1 / (r + 1)^zipf_exponent. The whole corpus is a Markov chain
over words, so its true per-word entropy rate is computable:

    H = sum_c pi(c) H(T[c, :]) + H(Zipf)    (pi: the stationary class distribution)

exp(H) is the perplexity floor no model can beat; the unigram baseline (a model that
knows every word's frequency but no context) has perplexity exp(H(pi) + H(Zipf)).
Word ids are sorted by frequency (id 0 the most frequent), as in a real vocabulary file,
so the log-uniform sampler of sampled softmax sees the order it assumes.

Deterministic by `data.seed` (the grammar and the text; independent of the run's seed, so
different training seeds learn the same corpus).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from data.biglstm_stream import TextStreamConfig, TokenWindows
from runner.errors import UserError

CHAINS = 256  # independent chains generated side by side, then concatenated into one stream


@dataclass
class SyntheticTextConfig(TextStreamConfig):
    name: str = "synthetic_text"
    vocab_size: int = 10000
    num_classes: int = 50          # must divide vocab_size
    successors: int = 3            # likely next classes per class
    smoothing: float = 0.05        # probability that the next class is uniform over all classes
    zipf_exponent: float = 1.1     # word frequencies inside a class
    num_train_tokens: int = 1_000_000
    num_eval_tokens: int = 50_000
    seed: int = 0                  # the corpus seed (grammar and text)
    batch_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_classes < 2 or self.vocab_size % self.num_classes:
            raise UserError(f"bad config: data.num_classes={self.num_classes} must be >= 2 and divide "
                            f"data.vocab_size={self.vocab_size}")
        if not 1 <= self.successors <= self.num_classes:
            raise UserError(f"bad config: data.successors={self.successors} must be in 1..data.num_classes")
        if not 0 < self.smoothing <= 1 or self.zipf_exponent <= 0:
            raise UserError(f"bad config: data.smoothing={self.smoothing} must be in (0, 1] and "
                            f"data.zipf_exponent={self.zipf_exponent} positive")
        if min(self.num_train_tokens, self.num_eval_tokens) < 2:
            raise UserError("bad config: data.num_train_tokens and data.num_eval_tokens must be at least 2")


def _entropy(p: Tensor) -> Tensor:
    """Shannon entropy in nats along the last dimension (0 log 0 = 0)."""
    return -torch.special.xlogy(p, p).sum(-1)


class ClassBigramGrammar:
    """The word model: class transitions, in-class Zipf law, frequency-sorted word ids."""

    def __init__(self, cfg: SyntheticTextConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        c, per_class = cfg.num_classes, cfg.vocab_size // cfg.num_classes
        likely = torch.zeros(c, c, dtype=torch.float64)
        for row in range(c):
            nxt = torch.randperm(c, generator=g)[:cfg.successors]
            weights = -torch.rand(cfg.successors, generator=g, dtype=torch.float64).log()  # Dirichlet(1)
            likely[row, nxt] = weights / weights.sum()
        self.transitions = (1 - cfg.smoothing) * likely + cfg.smoothing / c
        # The chain mixes at rate (1 - smoothing): any row of a high power is the stationary law.
        self.class_probs = torch.linalg.matrix_power(self.transitions, 4096)[0]
        ranks = torch.arange(per_class, dtype=torch.float64)
        zipf = (ranks + 1) ** -cfg.zipf_exponent
        self.in_class = zipf / zipf.sum()
        # word (class k, rank r) before sorting -> its id in the frequency-sorted vocabulary
        unsorted = torch.randperm(cfg.vocab_size, generator=g).view(c, per_class)
        freq = torch.empty(cfg.vocab_size, dtype=torch.float64)
        freq[unsorted] = self.class_probs[:, None] * self.in_class[None, :]
        new_id = torch.empty(cfg.vocab_size, dtype=torch.long)
        new_id[freq.argsort(descending=True, stable=True)] = torch.arange(cfg.vocab_size)
        self.members = new_id[unsorted]  # [class, rank] -> word id
        self.unigram = freq.sort(descending=True, stable=True).values

    def entropy_rate(self) -> float:
        """True per-word entropy of the text, nats: the floor of any model's loss."""
        return float((self.class_probs * _entropy(self.transitions)).sum() + _entropy(self.in_class))

    def unigram_entropy(self) -> float:
        """Per-word entropy of the word frequencies alone (no context), nats."""
        return float(_entropy(self.unigram))

    def sample(self, num_tokens: int, g: torch.Generator) -> Tensor:
        """num_tokens words: CHAINS chains from the stationary law, concatenated (int32)."""
        steps = math.ceil(num_tokens / CHAINS)
        classes = torch.empty(CHAINS, steps, dtype=torch.long)
        classes[:, 0] = torch.multinomial(self.class_probs, CHAINS, replacement=True, generator=g)
        # Inverse-CDF draws (one searchsorted per step) instead of a multinomial call per step: ~20x faster.
        cdf = self.transitions.cumsum(-1)
        cdf[:, -1] = 1.0  # no draw may fall past the last class through rounding
        uniform = torch.rand(steps, CHAINS, 1, generator=g, dtype=torch.float64)
        for t in range(1, steps):
            classes[:, t] = torch.searchsorted(cdf[classes[:, t - 1]], uniform[t]).squeeze(1)
        ranks = torch.multinomial(self.in_class, CHAINS * steps, replacement=True, generator=g).view(CHAINS, steps)
        return self.members[classes, ranks].flatten()[:num_tokens].to(torch.int32)


def build_synthetic_text(cfg: SyntheticTextConfig, split: str, rows: int) -> TokenWindows:
    """One segment: the split's text, generated from (data.seed, split)."""
    grammar = ClassBigramGrammar(cfg)
    n = cfg.num_train_tokens if split == "train" else cfg.num_eval_tokens
    text = grammar.sample(n, torch.Generator().manual_seed(cfg.seed * 2 + (split != "train") + 1))
    return TokenWindows([n], lambda _segment: text, rows, cfg.unroll)
