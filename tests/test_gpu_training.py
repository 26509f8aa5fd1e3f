"""A short bf16 training loop of a small GQA decoder with our op matches the same loop with
PyTorch SDPA (benchmarks/train_check.py): loss curves within the drift between SDPA's own
backends."""
import os
import sys

import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def test_training_loss_matches_sdpa():
    import train_check
    from cases import Case
    from gpu_check import skip_if_not_built

    block = train_check.Decoder().blocks[0]
    skip_if_not_built(Case(4, 512, 512, block.heads, block.kv_heads, block.head_dim, "bf16", True, 0))

    ours = train_check.train(train_check.ours)
    ref = train_check.train(train_check.sdpa)
    # The loop must learn (it memorises one batch): otherwise agreement says nothing.
    assert ref[-1] < 0.5 * ref[0], ref
    # bf16 weights and activations drift apart step by step whichever attention runs, most where
    # the loss is small (steps 20-30). The bound is the drift of PyTorch's own math backend from
    # its default one over the same loop (the accuracy rule's 2x, plus a floor): on an H100 ours
    # deviated by at most 0.0115 and the math backend by 0.0103, where a fixed 5% of the loss
    # (0.0096 at step 24) failed both. A wrong gradient (a sign, a missing scale, a wrong head)
    # changes the curve by far more.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        other = train_check.train(train_check.sdpa)
    drift = max(abs(a - b) for a, b in zip(other, ref))
    assert drift < 0.05 * ref[0], (other, ref)  # the bound stays tight
    deviation = max(abs(a - b) for a, b in zip(ours, ref))
    assert deviation <= 2 * drift + 1e-3, (deviation, drift, ours, ref, other)
