"""The benchmark's logic on CPU: arguments, the interleaved timing schedule, FLOP count and the
markdown table (the GPU timing itself is replaced by a recording stand-in)."""

import contextlib

import pytest

from cutlass_flash import benchmark


def test_dtype_list_and_errors():
    assert benchmark.parse_args(["--dtype", "bf16,fp16"]).dtype == ["bf16", "fp16"]
    assert benchmark.parse_args([]).dtype == ["bf16"]
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--dtype", "fp32"])


def test_flops_follow_flashattention():
    # forward 4 * B * H * Sq * Sk * D, halved when causal; backward 2.5x, fwd+bwd 3.5x
    assert benchmark.attention_flops(2, 3, 5, 7, 64, False, "fwd") == 4 * 2 * 3 * 5 * 7 * 64
    assert benchmark.attention_flops(2, 3, 5, 7, 64, True, "bwd") == 4 * 2 * 3 * 5 * 7 * 64 / 2 * 2.5
    assert benchmark.attention_flops(1, 1, 8, 8, 8, False, "fwdbwd") == 4 * 8 * 8 * 8 * 3.5


def test_interleaved_rounds(monkeypatch):
    # Every round times each implementation once, in column order; batches are sized from the
    # single-call estimate; the median over rounds is reported.
    calls = []
    per_call = {"a": 2.0, "b": 0.5}
    drift = iter(range(1000))

    def fake_batch(fn, context, n):
        label = fn()
        calls.append((label, n))
        return per_call[label] + (next(drift) % 3) * 0.01 if n > 1 else per_call[label]

    monkeypatch.setattr(benchmark, "_batch_ms", fake_batch)
    fns = {"a": (lambda: "a", contextlib.nullcontext), "b": (lambda: "b", contextlib.nullcontext)}
    times = benchmark.time_interleaved(fns, warmup=2, rounds=4, budget_ms=40.0)
    timed = [c for c in calls if c[1] > 1]
    assert [label for label, _ in timed] == ["a", "b"] * 4
    assert {label: n for label, n in timed} == {"a": 5, "b": 20}  # 40 ms / 4 rounds / per call
    assert times["a"] == pytest.approx(2.0, abs=0.021) and times["b"] == pytest.approx(0.5, abs=0.021)


def test_markdown_has_one_section_per_dtype_and_mode():
    args = benchmark.parse_args(["--dtype", "bf16,fp16", "--modes", "fwd", "--head-dims", "128",
                                 "--seqlens", "2048", "--causal", "false"])
    rows = []
    for dt, ours, flash, cudnn in (("bf16", 600.0, 300.0, 500.0), ("fp16", 550.0, 275.0, 600.0)):
        for impl, tf in (("ours", ours), ("sdpa-flash", flash), ("sdpa-cudnn", cudnn)):
            rows.append(dict(dtype=dt, head_dim=128, seqlen=2048, batch=8, nheads=16, causal=0,
                             mode="fwd", impl=impl, ms=1.0, tflops=tf, status=""))
    md = benchmark.markdown(rows, ["ours", "sdpa-flash", "sdpa-cudnn"], {"gpu": "test"}, args)
    bf16 = md[md.index("## bf16 fwd"):md.index("## fp16 fwd")]
    fp16 = md[md.index("## fp16 fwd"):]
    assert "| 128 | 2048 | 8 x 16 | no | 600.0 | 300.0 | 500.0 | 2.00x | 1.20x |" in bf16
    assert "| 128 | 2048 | 8 x 16 | no | 550.0 | 275.0 | 600.0 | 2.00x | 0.92x |" in fp16
