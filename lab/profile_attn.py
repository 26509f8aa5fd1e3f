"""Forward or backward calls of ours (and of FlashAttention-3 where `flash_attn_interface` imports,
or with a fifth argument `fa2`, of SDPA's FlashAttention-2 instead) on the benchmark grid's shape,
for Nsight Compute:

    ncu --kernel-name regex:"bwd_kernel|flash_bwd|FlashAttnBwd" --launch-skip 1 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python lab/profile_attn.py bwd 256 8192 0
    ncu --kernel-name regex:"fwd_kernel|FlashAttnFwd" --launch-skip 1 --launch-count 2 \\
        --section SpeedOfLight python lab/profile_attn.py fwd 128 8192 1

Arguments: fwd or bwd, head dim (or D:DV, V's head dim of its own: 192:128), seqlen (batch *
seqlen = 16k tokens, nheads * head_dim = 2048), causal (0/1). Each implementation runs its
forward (or backward) twice (the first call builds caches), ours first, so `--launch-skip 1
--launch-count 2` with a regex matching both implementations' main kernels profiles ours, then
FA3's first call.
"""
import sys

import torch

import cutlass_flash


def main():
    mode = sys.argv[1]
    if mode not in ("fwd", "bwd"):
        raise SystemExit(f"mode must be fwd or bwd, got {mode!r}")
    head_dim, _, head_dim_v = sys.argv[2].partition(":")
    head_dim, seqlen, causal = int(head_dim), int(sys.argv[3]), bool(int(sys.argv[4]))
    head_dim_v = int(head_dim_v or head_dim)
    batch, nheads = max(1, 16384 // seqlen), 2048 // head_dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "bwd")
               for d in (head_dim, head_dim, head_dim_v))
    dout = torch.randn(batch, seqlen, nheads, head_dim_v, device="cuda", dtype=torch.bfloat16)
    impls = [("ours", lambda: cutlass_flash.flash_attn_func(q, k, v, causal=causal))]
    if sys.argv[5:] == ["fa2"]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def fa2():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        impls.append(("fa2", fa2))
    else:
        try:
            import flash_attn_interface

            impls.append(("fa3", lambda: flash_attn_interface.flash_attn_func(q, k, v, causal=causal)))
        except ImportError as e:
            print(f"no FA3: {e}")
    for name, fn in impls:
        if mode == "fwd":
            for _ in range(2):
                fn()
        else:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            for _ in range(2):
                torch.autograd.grad(out, (q, k, v), dout if out.shape == dout.shape else dout.transpose(1, 2),
                                    retain_graph=True)
        torch.cuda.synchronize()
        print(f"{name}: done", flush=True)


if __name__ == "__main__":
    main()
