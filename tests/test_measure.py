"""runner.measure.SavedActivations: bytes autograd keeps for backward, derived by hand."""
from __future__ import annotations

import torch

from runner.measure import SavedActivations

ROWS, WIDTH = 64, 256
BYTES = ROWS * WIDTH * 4  # one FP32 [64, 256] activation


def two_layer_pass(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    # x @ w1 saves x (for w1's grad); relu saves its output h; h @ w2 saves h (the same storage)
    (torch.relu(x @ w1) @ w2).sum().backward()


def test_one_backward_counts_each_saved_storage_once():
    w1, w2 = (torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in range(2))
    recorder = SavedActivations([w1, w2])
    with recorder.recording():
        two_layer_pass(torch.randn(ROWS, WIDTH), w1, w2)
    assert recorder.peak == 2 * BYTES          # x and h; the weights are not activations
    assert recorder.current == 0               # both freed with the graph (x was a temporary)


def test_several_backward_passes_report_the_peak_not_the_sum():
    """A GAN's D and G passes: the second reuses the first's freed memory (often at the same
    addresses); what was alive at once is one pass's worth, and nothing is lost or double-counted."""
    w1, w2 = (torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in range(2))
    recorder = SavedActivations([w1, w2])
    with recorder.recording():
        for _ in range(3):
            two_layer_pass(torch.randn(ROWS, WIDTH), w1, w2)
    assert recorder.peak == 2 * BYTES and recorder.current == 0


def test_graphs_alive_together_add_up():
    w1, w2 = (torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in range(2))
    recorder = SavedActivations([w1, w2])
    with recorder.recording():
        x = torch.randn(ROWS, WIDTH)
        first = torch.relu(x @ w1) @ w2      # graph 1 alive...
        second = torch.relu(x @ w1) @ w2     # ...while graph 2 is built: x shared, two relu outputs
        (first.sum() + second.sum()).backward()
    assert recorder.peak == 3 * BYTES
