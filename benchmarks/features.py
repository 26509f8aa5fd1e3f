"""cutlass_flash.benchmark's grid with variant columns: ours with a score feature or deterministic,
and FlashAttention-3 with the same, and a check of the outputs.

    python benchmarks/features.py --impls ours,ours-det,fa3,fa3-det --modes bwd
    python benchmarks/features.py --impls ours-softcap,ours-alibi,ours-dropout,sdpa-flash --modes fwd,bwd
    python benchmarks/features.py --head-dims 128 --seqlens 2048 --check

Beside cutlass_flash.benchmark's --impls: ours-det is ours with deterministic=True, ours-softcap
with softcap=SOFTCAP, ours-alibi with ALiBi slopes, ours-dropout with dropout_p=DROPOUT (our
kernel family as dispatched; CUTLASS_FLASH_FORCE_ARCH forces one); fa3-det is FlashAttention-3
with deterministic=True (the reference for the cost of ours-det), fa3-softcap FA3 with
softcap=SOFTCAP (n/a where FA3 was built without softcap: FLASH_ATTENTION_DISABLE_SOFTCAP=FALSE
bash lab/device_fa3.sh builds it). --check then compares every column's forward output with the
first column's, config by config (max abs diff). Timing, TFLOPS and reports (CSV, markdown, plot
under --out) are cutlass_flash.benchmark's.
"""
import contextlib
import os
import sys
import warnings

import torch

try:
    import cutlass_flash
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutlass_flash
from cutlass_flash import benchmark as bench

import bench_common

# ours-softcap's cap: Gemma 2's attn_logit_softcapping.
SOFTCAP = 50.0
# ours-dropout's probability: FlashAttention's and BERT/GPT-2's attention dropout.
DROPOUT = 0.1
# FlashAttention-3's deterministic backward exists up to this head dim: it rounds a head dim up
# to 64 / 96 / 128 / 192 / 256 and refuses the rounded 256 (flash_api.cpp).
FA3_DETERMINISTIC_MAX_HEAD_DIM = 192


def _ours_alibi(causal):
    def fwd(q, k, v):  # ALiBi's usual slopes, 2^(-8 (h + 1) / H)
        heads = torch.arange(q.shape[2], device=q.device, dtype=torch.float32)
        slopes = torch.pow(2.0, -8.0 * (heads + 1) / q.shape[2])
        return cutlass_flash.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
    return fwd


def _fa3(causal, deterministic=False, softcap=0.0):
    fwd = bench._fa3(causal, **({"deterministic": True} if deterministic else {}),
                     **({"softcap": softcap} if softcap else {}))
    # Read once, not in the timed calls.
    no_softcap = softcap and bench._fa3_build_flags().get("FLASHATTENTION_DISABLE_SOFTCAP")

    def checked(q, k, v):
        # FA3 refuses it (flash_api.cpp: "Deterministic backward not supported for hdim 256"),
        # and in one H100 run (2026-11-25) its refusal took the benchmark process down with it.
        if deterministic and q.shape[-1] > FA3_DETERMINISTIC_MAX_HEAD_DIM:
            raise ValueError(f"FA3 has no deterministic backward at head_dim {q.shape[-1]}")
        if no_softcap:
            raise ValueError("FA3 build has no softcap (FLASH_ATTENTION_DISABLE_SOFTCAP)")
        return fwd(q, k, v)
    return checked


# The variant columns: factory(causal) -> a forward function of (q, k, v), (B, S, H, D) layout.
VARIANTS = {
    "ours-det": lambda causal: bench._ours(causal, deterministic=True),
    "ours-softcap": lambda causal: bench._ours(causal, softcap=SOFTCAP),
    "ours-alibi": _ours_alibi,
    "ours-dropout": lambda causal: bench._ours(causal, dropout_p=DROPOUT),
    "fa3-det": lambda causal: _fa3(causal, deterministic=True),
    "fa3-softcap": lambda causal: _fa3(causal, softcap=SOFTCAP),
}


def parse_args(argv=None):
    p = bench.build_parser("python benchmarks/features.py", __doc__, (*bench.IMPLS, *VARIANTS))
    p.add_argument("--check", action="store_true",
                   help="after the grid, compare each column's forward output with the first column's")
    return p.parse_args(argv)


def implementations(args):
    """cutlass_flash.benchmark.implementations with the variant columns; the fa3 ones are left out
    where flash_attn_interface does not import."""
    out = []
    for impl in args.impls:
        if impl not in VARIANTS:
            out += bench.columns(impl, args.arch)
        elif not impl.startswith("fa3") or bench._fa3_interface() is not None:
            out.append((impl, VARIANTS[impl], contextlib.nullcontext))
    return out


def check(args, impls):
    """Prints, for each config of the grid, max |out - out of the first column| of the others."""
    for dt, hd, seqlen, causal in bench.grid(args):
        _, _, q, k, v, _ = bench.inputs(args, dt, hd, seqlen)
        outputs = {}
        for label, factory, context in impls:
            try:
                with context(), warnings.catch_warnings(), torch.no_grad():
                    warnings.simplefilter("ignore")
                    outputs[label] = factory(causal)(q, k, v).float()
            except Exception:
                pass
        if len(outputs) > 1:
            (base_label, base), *others = outputs.items()
            print(f"{dt} head_dim={hd} seqlen={seqlen} causal={int(causal)}: max|out - {base_label}|: "
                  + ", ".join(f"{lb} {(o - base).abs().max().item():.3g}" for lb, o in others), flush=True)
        del q, k, v, outputs
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if not bench.gpu_ready(args.impls):
        return 2
    env = bench.environment()
    if any(i.startswith("fa3") for i in args.impls):
        env["FA3"] = bench_common.fa3_info()
    impls = implementations(args)
    bench.run(args, impls, env)
    if args.check:
        check(args, impls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
