"""The test grids' own helpers (tests/cases.py), on the CPU."""
import cases
from cases import Case


def test_auto_family_cases_run_where_a_family_has_the_kernels(monkeypatch):
    """A case with arch 0 (the dispatch picks the family) needs the kernel in some family this
    GPU runs; looking for an (0, ...) kernel skipped every such GPU test."""
    built = [(80, "fwd", 64, "bf16"), (80, "bwd", 64, "bf16"), (90, "fwd", 128, "bf16")]
    monkeypatch.setattr(cases, "built_kernels", lambda: built)
    monkeypatch.setattr(cases, "kernel_archs", lambda: (80, 90))
    assert cases.missing_kernels(Case(1, 1, 1, 1, 1, 64, "bf16", False, 0)) == []
    assert cases.missing_kernels(Case(1, 1, 1, 1, 1, 128, "bf16", False, 0)) == [(90, "bwd", 128, "bf16")]
    assert cases.missing_kernels(Case(1, 1, 1, 1, 1, 64, "fp16", False, 0)) == [
        (90, "fwd", 64, "fp16"), (90, "bwd", 64, "fp16")]
    # A forced family still needs its own kernels.
    assert cases.missing_kernels(Case(1, 1, 1, 1, 1, 64, "bf16", False, 90)) == [
        (90, "fwd", 64, "bf16"), (90, "bwd", 64, "bf16")]
