"""The benchmark's logic on CPU: arguments, the interleaved timing schedule, FLOP count and the
markdown table (the GPU timing itself is replaced by a recording stand-in); the columns of
benchmarks/features.py and the arguments and helpers of the other scripts of benchmarks/."""

import contextlib
import sys
import types

import pytest
import torch

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
    # single-call estimate; a first, settling round is discarded (here 10x slower: it must not
    # reach the result); the median over the other rounds is reported.
    calls = []
    per_call = {"a": 2.0, "b": 0.5}
    drift = iter(range(1000))

    def fake_batch(fn, context, n):
        label = fn()
        calls.append((label, n))
        if n == 1:
            return per_call[label]
        settling = sum(1 for c in calls if c[1] > 1) <= len(per_call)
        return per_call[label] * (10 if settling else 1) + (next(drift) % 3) * 0.01

    monkeypatch.setattr(benchmark, "_batch_ms", fake_batch)
    fns = {"a": (lambda: "a", contextlib.nullcontext), "b": (lambda: "b", contextlib.nullcontext)}
    times = benchmark.time_interleaved(fns, warmup=2, rounds=4, budget_ms=40.0)
    timed = [c for c in calls if c[1] > 1]
    assert [label for label, _ in timed] == ["a", "b"] * 5
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


def test_impls_of_the_package_and_bad_impl(capsys):
    args = benchmark.parse_args(["--impls", "ours,sdpa-cudnn", "--arch", "80,sm90"])
    assert [label for label, _, _ in benchmark.implementations(args)] == ["ours-sm80", "ours-sm90", "sdpa-cudnn"]
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--impls", "ours,fa4"])
    assert "--impls: expected some of ours, sdpa-flash, sdpa-cudnn, sdpa-efficient, fa3; got 'fa4'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):  # the variant columns are benchmarks/features.py's
        benchmark.parse_args(["--impls", "ours-det"])


def test_feature_variant_columns(monkeypatch):
    features = _bench_script("features")
    calls = []
    monkeypatch.setattr(benchmark.cutlass_flash, "flash_attn_func", lambda q, k, v, **kw: calls.append(kw))
    args = features.parse_args(["--impls", "ours,ours-det,ours-softcap,ours-alibi,ours-dropout", "--check"])
    assert args.check
    impls = features.implementations(args)
    assert [label for label, _, _ in impls] == ["ours", "ours-det", "ours-softcap", "ours-alibi", "ours-dropout"]
    q = torch.zeros(1, 2, 4, 8)
    for _, factory, _ in impls:
        factory(True)(q, q, q)
    slopes = calls[3].pop("alibi_slopes")
    assert torch.equal(slopes, torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]))  # 2^(-8 (h + 1) / H)
    assert calls == [{"causal": True}, {"causal": True, "deterministic": True},
                     {"causal": True, "softcap": features.SOFTCAP}, {"causal": True},
                     {"causal": True, "dropout_p": features.DROPOUT}]


@pytest.fixture
def fresh_fa3():
    benchmark._fa3_interface.cache_clear()
    yield
    benchmark._fa3_interface.cache_clear()


def test_fa3_column_skipped_without_flash_attn_interface(monkeypatch, capsys, fresh_fa3):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # import raises ImportError
    args = benchmark.parse_args([])
    assert args.impls[-1] == "fa3"
    labels = [label for label, _, _ in benchmark.implementations(args)]
    assert labels == ["ours", *benchmark.SDPA_IMPLS]
    assert "note: no FA3 column" in capsys.readouterr().out
    benchmark.implementations(args)
    assert capsys.readouterr().out == ""  # the note is printed once
    assert benchmark.fa3_info() == "not available"


def test_fa3_column_and_ratio_with_a_stand_in(monkeypatch, fresh_fa3):
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        calls.append(causal)
        return q + 1, None  # older FA3 returned (out, softmax_lse)

    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_func=flash_attn_func, __file__="/x/y.py"))
    monkeypatch.setitem(sys.modules, "flash_attn_config", types.SimpleNamespace(CONFIG={
        "build_flags": {"FLASHATTENTION_DISABLE_HDIM96": True, "FLASHATTENTION_DISABLE_HDIM192": True}}))
    args = benchmark.parse_args(["--impls", "ours,sdpa-flash,fa3", "--modes", "fwd",
                                 "--head-dims", "128", "--seqlens", "2048", "--causal", "false"])
    impls = benchmark.implementations(args)
    assert [label for label, _, _ in impls] == ["ours", "sdpa-flash", "fa3"]
    fwd = dict((label, f) for label, f, _ in impls)["fa3"](True)
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    assert torch.equal(fwd(q, q, q), q + 1) and calls == [True]
    with pytest.raises(ValueError, match="head_dim 96"):
        fwd(*(torch.zeros(1, 4, 2, 96, dtype=torch.bfloat16),) * 3)
    assert "head dims 64,128,256" in benchmark.fa3_info()
    assert _bench_script("bench_common").fa3_info() == benchmark.fa3_info()  # no SOURCE.txt under /x
    rows = [dict(dtype="bf16", head_dim=128, seqlen=2048, batch=8, nheads=16, causal=0, mode="fwd",
                 impl=impl, ms=1.0, tflops=tf, status="")
            for impl, tf in (("ours", 600.0), ("sdpa-flash", 300.0), ("fa3", 500.0))]
    md = benchmark.markdown(rows, ["ours", "sdpa-flash", "fa3"], {"gpu": "test"}, args)
    assert "| ours / FA2 | ours / FA3 |" in md
    assert "| 128 | 2048 | 8 x 16 | no | 600.0 | 300.0 | 500.0 | 2.00x | 1.20x |" in md


def _stand_in_fa3_columns(monkeypatch, flash_attn_func, build_flags, column, mode):
    """The fa3 column and `column` of a benchmarks/features.py run against a stand-in FA3 (`flash_attn_func`,
    built with `build_flags`), by label."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_func=flash_attn_func, __file__="/x/y.py"))
    monkeypatch.setitem(sys.modules, "flash_attn_config", types.SimpleNamespace(CONFIG={"build_flags": build_flags}))
    features = _bench_script("features")
    args = features.parse_args(["--impls", f"fa3,{column}", "--modes", mode, "--head-dims", "64"])
    impls = dict((label, f) for label, f, _ in features.implementations(args))
    assert list(impls) == ["fa3", column]
    return impls


def test_fa3_det_column_passes_deterministic(monkeypatch, fresh_fa3):
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, deterministic=False):
        calls.append((causal, deterministic))
        return q * 2

    impls = _stand_in_fa3_columns(monkeypatch, flash_attn_func, {}, "fa3-det", "bwd")
    q = torch.ones(1, 4, 2, 64, dtype=torch.bfloat16)
    for label in ("fa3", "fa3-det"):
        assert torch.equal(impls[label](False)(q, q, q), q * 2)
    assert calls == [(False, False), (False, True)]
    # FA3 has no deterministic backward at head dim 256: n/a with the reason, FA3 never called.
    q256 = torch.ones(1, 4, 2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no deterministic backward at head_dim 256"):
        impls["fa3-det"](False)(q256, q256, q256)
    assert torch.equal(impls["fa3"](False)(q256, q256, q256), q256 * 2)
    assert calls == [(False, False), (False, True), (False, False)]


def test_fa3_softcap_column_passes_softcap(monkeypatch, fresh_fa3):
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, softcap=0.0):
        calls.append((causal, softcap))
        return q * 3

    flags = {}
    impls = _stand_in_fa3_columns(monkeypatch, flash_attn_func, flags, "fa3-softcap", "fwd")
    q = torch.ones(1, 4, 2, 64, dtype=torch.bfloat16)
    for label in ("fa3", "fa3-softcap"):
        assert torch.equal(impls[label](True)(q, q, q), q * 3)
    assert calls == [(True, 0.0), (True, _bench_script("features").SOFTCAP)]
    # A build without softcap (device_fa3.sh's default): n/a with the reason, FA3 never called.
    flags["FLASHATTENTION_DISABLE_SOFTCAP"] = True
    with pytest.raises(ValueError, match="no softcap"):
        impls["fa3-softcap"](False)(q, q, q)
    assert len(calls) == 2


def _bench_script(name):
    """benchmarks/NAME.py as a module (benchmarks/ on the path while it loads, as when run)."""
    import importlib.util
    import os

    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def test_fa3_info_with_source_commits(monkeypatch, tmp_path, fresh_fa3):
    (tmp_path / "hopper").mkdir()
    (tmp_path / "SOURCE.txt").write_text("flash-attention 0123456789abcdef0123\ncutlass fedcba9876543210\n")
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(__file__=str(tmp_path / "hopper" / "flash_attn_interface.py")))
    monkeypatch.setitem(sys.modules, "flash_attn_config", types.SimpleNamespace(CONFIG={"build_flags": {}}))
    assert _bench_script("bench_common").fa3_info() == \
        benchmark.fa3_info() + "; flash-attention 0123456789ab; cutlass fedcba987654"


def test_overhead_arguments():
    overhead = _bench_script("overhead")
    args = overhead.parse_args([])
    assert (args.dtype, args.arch, args.calls) == ("bf16", [0], 2000)
    assert overhead.parse_args(["--arch", "80,90", "--dtype", "fp16"]).arch == [80, 90]
    with pytest.raises(SystemExit):
        overhead.parse_args(["--dtype", "fp32"])


def test_window_bench_arguments():
    window_bench = _bench_script("window_bench")
    args = window_bench.parse_args([])
    assert (args.tokens, args.window, args.head_dims) == (65536, 4096, [64, 128, 256])
    assert window_bench.parse_args(["--tokens", "8192", "--window", "1024"]).window == 1024
    with pytest.raises(SystemExit):
        window_bench.parse_args(["--tokens", "5000", "--window", "4096"])


def test_varlen_bench_documents():
    """The packed batch: lengths within the bounds (the last one cut to fit), summing to the
    tokens asked for, the same for the same seed; FLOPs counted per document."""
    varlen_bench = _bench_script("varlen_bench")
    lengths = varlen_bench.document_lengths(16384, 64, 4096, seed=0)
    assert sum(lengths) == 16384
    assert all(1 <= n <= 4096 for n in lengths) and all(n >= 64 for n in lengths[:-1])
    assert lengths == varlen_bench.document_lengths(16384, 64, 4096, seed=0)
    assert lengths != varlen_bench.document_lengths(16384, 64, 4096, seed=1)
    work = varlen_bench._flops([100, 300], 8, 64, False, "fwd")
    assert work == benchmark.attention_flops(1, 8, 100, 100, 64, False, "fwd") + \
        benchmark.attention_flops(1, 8, 300, 300, 64, False, "fwd")



def test_fwd_and_fwdbwd_and_report(tmp_path, capsys):
    """The scripts' shared helpers: the forward runs without grad, forward + backward runs the
    backward for dout (tuple outputs too); the report is printed and written."""
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(g.clone())
            return g * 2

    q = torch.randn(3, 4, requires_grad=True)
    dout = torch.full((3, 4), 3.0)
    fwd, fwdbwd = _bench_script("bench_common").fwd_and_fwdbwd(lambda x: (Double.apply(x), None), (q,), dout)
    out, _ = fwd()
    assert not out.requires_grad and seen == []
    fwdbwd()
    assert len(seen) == 1 and torch.equal(seen[0], dout)
    benchmark.write_report("| a |\n", str(tmp_path / "r"), "t.md")
    assert (tmp_path / "r" / "t.md").read_text() == "| a |\n"
    assert "| a |" in capsys.readouterr().out


def test_interleaved_settling_round_is_discarded(monkeypatch):
    # With one timed round the result is that round's time alone, not a median with the first,
    # settling round (which reads 10x here).
    timed = []

    def fake_batch(fn, context, n):
        if n == 1:
            return 1.0
        timed.append(n)
        return 10.0 if len(timed) == 1 else 1.0

    monkeypatch.setattr(benchmark, "_batch_ms", fake_batch)
    times = benchmark.time_interleaved({"a": (lambda: None, contextlib.nullcontext)}, warmup=1, rounds=1,
                                       budget_ms=5.0)
    assert len(timed) == 2
    assert times["a"] == 1.0
