"""The test grids' own helpers (tests/cases.py), on the CPU."""
import cases
from cases import Case


def test_missing_kernels_asks_the_dispatch(fake_backend):
    """A case with arch 0 (the dispatch picks the family) needs the kernel in some family this
    GPU runs; looking for an (0, ...) kernel skipped every such GPU test. The answer is the
    dispatch's own (cutlass_flash.plan), not a copy of its rules."""
    fake_backend.set_built([(80, "fwd", 64, "bf16"), (80, "bwd", 64, "bf16"), (90, "fwd", 128, "bf16")])

    def missing(head_dim, dtype, arch):
        return [d for d, _ in cases.missing_kernels(Case(1, 1, 1, 1, 1, head_dim, dtype, False, arch), "cpu")]

    assert missing(64, "bf16", 0) == []
    assert missing(128, "bf16", 0) == ["bwd"]
    assert missing(64, "fp16", 0) == ["fwd", "bwd"]
    assert missing(64, "bf16", 90) == ["fwd", "bwd"]  # a forced family needs its own kernels
    assert missing(64, "bf16", 80) == []
    fake_backend.set_capability((8, 0))
    assert missing(128, "bf16", 0) == ["fwd", "bwd"]
