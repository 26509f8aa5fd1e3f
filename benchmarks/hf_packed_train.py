"""End-to-end training of a Hugging Face Llama on packed rows of long-tailed documents, with each
attention implementation in turn (one process, one GPU), from the same initial weights and on the
same batches: tokens/s, peak memory and the loss of every step, against cutlass_flash's.

On the GPU machine, from the repository root, with cutlass_flash built in place (as for the GPU
tests: lab/device_build.sh or device_run.sh) and, for the FlashAttention-3 row, FA3 built
with its varlen path and put on PYTHONPATH by sourcing lab/device_fa3.sh:

    FLASH_ATTENTION_DISABLE_VARLEN=FALSE FLASH_ATTENTION_DISABLE_FP16=TRUE . lab/device_fa3.sh
    python3 benchmarks/hf_packed_train.py --steps 20
    python3 benchmarks/hf_packed_train.py --steps 20 --mix long32k-short64 --layers 4 --loss-chunk 8192
    python3 benchmarks/hf_packed_train.py --impls cutlass_flash,flash_attention_3 --kv-heads 4

Model: Llama, hidden 2048, 16 heads of 128, --kv-heads (16), intermediate 5632, --layers (8), vocab
32000, bf16, AdamW lr 1e-4 (fused where possible), no gradient checkpointing; initialized once
(seeded), every implementation loading that state. Data: rows of --row-tokens tokens of documents
with lengths log-uniform in [--min-len, --max-len] (seeded), the last cut at the row end; with
--mix, a mix of benchmarks/varlen_bench.py is the row. Random tokens. As in transformers'
padding-free training: input_ids (1, tokens) (--rows rows flattened into one), position_ids
restarting at 0 at each document (transformers derives cu_seqlens from them for FlashAttention
implementations, a block-diagonal mask for sdpa), labels = input_ids with each document's first
token -100. --loss-chunk N computes the same loss N tokens at a time (lm_head and cross-entropy
under checkpointing) so that the fp32 (tokens, vocab) logits never exist whole: the 160768-token
long32k-short64 mix does not fit in 80 GB without it (about 15 GB of activations per layer).
Steps are timed with torch.cuda.synchronize and time.perf_counter, the first --warmup untimed.
Writes hf-packed-<mix or loguniform>.md/.csv to --out; exit status 1 if cutlass_flash fails or
gives a non-finite loss.
"""
import argparse
import csv
import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:
    import cutlass_flash
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutlass_flash
import cutlass_flash.integrations.transformers  # noqa: F401  (registers "cutlass_flash")
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, masking_utils
from transformers import modeling_flash_attention_utils as fa_utils
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.utils import import_utils
from cutlass_flash import benchmark as bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import varlen_bench  # noqa: E402  (MIXES, mix_lengths, loguniform_lengths, _fa3_varlen_note)

REF = "cutlass_flash"
HEADS, HEAD_DIM, VOCAB = 16, 128, 32000
# FA3 under a name of its own where transformers does not see it (register_fa3_local): like
# "cutlass_flash", it contains "flash" (transformers' mark of a FlashAttention implementation).
FA3_LOCAL = "flash_attn_interface"
DEVICE = "cuda"  # a name, so that the CPU-only parts can be tried on the CPU


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="cutlass_flash,flash_attention_3,flash_attention_2,sdpa",
                   help="comma-separated attn_implementation names (cutlass_flash is the reference)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=HEADS, help="key/value heads (< 16: GQA)")
    p.add_argument("--row-tokens", type=int, default=32768)
    p.add_argument("--rows", type=int, default=1, help="rows per step (flattened into one packed row)")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--mix", choices=sorted(varlen_bench.MIXES), default=None,
                   help="a named mix of varlen_bench.py as the row, instead of log-uniform lengths")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--loss-chunk", type=int, default=0, help="tokens per chunk of the loss (0: transformers' own)")
    p.add_argument("--loss-tol", type=float, default=0.02, help="largest |loss - cutlass_flash's| on any step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args(argv)
    args.impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    if HEADS % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide {HEADS}")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be at least 0 and less than --steps")
    return args


def document_lengths(args, row):
    """Document lengths of one row: the --mix, or log-uniform (seeded by --seed and the row's
    index) until --row-tokens are filled, the last one cut."""
    if args.mix:
        return varlen_bench.mix_lengths(args.mix, varlen_bench.parse_args(["--seed", str(args.seed)]))
    return varlen_bench.loguniform_lengths(args.row_tokens, args.min_len, args.max_len,
                                           args.seed * 1_000_003 + row)


def make_batches(args):
    """Per step (input_ids, position_ids, labels), each (1, tokens) on the CPU, and the lengths."""
    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for step in range(args.steps):
        lengths = [n for r in range(args.rows) for n in document_lengths(args, step * args.rows + r)]
        ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        labels = ids.masked_fill(pos == 0, -100)  # no prediction across a document boundary
        batches.append(((ids, pos, labels), lengths))
    return batches


def make_config(args, max_len):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=5632,
                       num_hidden_layers=args.layers, num_attention_heads=HEADS, num_key_value_heads=args.kv_heads,
                       head_dim=HEAD_DIM, max_position_embeddings=max_len, use_cache=False, tie_word_embeddings=False)


def register_fa3_local(fa3):
    """transformers uses "flash_attention_3" only where FA3 is pip-installed (the flash-attn-3
    distribution); lab/device_fa3.sh builds it in place on PYTHONPATH. Then FA3_LOCAL runs
    transformers' same FlashAttention path with flash_attn_interface's functions (as
    cutlass_flash.integrations.transformers does for ours)."""
    previous = fa_utils._lazy_imports

    def lazy_imports(implementation, *a, **k):
        if implementation == FA3_LOCAL:
            return fa3.flash_attn_func, fa3.flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input
        return previous(implementation, *a, **k)

    fa_utils._lazy_imports = lazy_imports
    AttentionInterface.register(FA3_LOCAL, flash_attention_forward)
    masking_utils.AttentionMaskInterface.register(FA3_LOCAL, masking_utils.flash_attention_mask)


def resolve(impl):
    """(attn_implementation to build with, None), or (None, why impl is skipped)."""
    if impl == "flash_attention_3":
        try:
            import flash_attn_interface as fa3
        except Exception as e:
            return None, f"import flash_attn_interface failed ({bench._short(e)})"
        why = varlen_bench._fa3_varlen_note(fa3, HEAD_DIM)  # packed rows run its varlen function
        if why:
            return None, why
        if import_utils.is_flash_attn_3_available():
            return impl, None
        register_fa3_local(fa3)
        return FA3_LOCAL, None
    if impl == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except Exception as e:
            return None, f"import flash_attn failed ({bench._short(e)})"
        if not import_utils.is_flash_attn_2_available():
            return None, "flash_attn imports but transformers does not see it (is_flash_attn_2_available)"
    if impl == "sdpa":  # isolation of packed documents is a mask built from position_ids
        find = getattr(masking_utils, "find_packed_sequence_indices", None)
        if find is None or find(torch.tensor([[0, 1, 0, 1]])) is None:
            return None, f"transformers {transformers.__version__} builds no packed-sequence mask for sdpa"
    return impl, None


def step_loss(model, ids, pos, labels, chunk):
    if not chunk:
        return model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
    # transformers' causal-LM loss (mean over the labelled next tokens), chunk by chunk.
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
    target = torch.cat([labels[0, 1:], labels.new_full((1,), -100)])

    def part(h, t):
        return F.cross_entropy(model.lm_head(h).float(), t, ignore_index=-100, reduction="sum")

    total = sum(checkpoint(part, hidden[i:i + chunk], target[i:i + chunk], use_reentrant=False)
                for i in range(0, target.numel(), chunk))
    return total / (target != -100).sum()


def train(impl, attn, args, config, state, batches):
    """Trains a fresh model from state on every batch; returns losses, step seconds, peak GiB."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    model.load_state_dict(state)
    model.train()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, seconds = [], []
    for step, ((ids, pos, labels), lengths) in enumerate(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step_loss(model, ids, pos, labels, args.loss_chunk)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        print(f"{impl:18s} step {step:3d}: {len(lengths):5d} docs, loss {losses[-1]:.4f}, "
              f"{seconds[-1] * 1e3:8.1f} ms{' (warm-up)' if step < args.warmup else ''}", flush=True)
    return dict(losses=losses, seconds=seconds, peak=torch.cuda.max_memory_allocated() / 2**30)


def max_diff(a, b):
    """Largest |a - b| over the steps (inf if any is not finite)."""
    return max(abs(x - y) if math.isfinite(x - y) else math.inf for x, y in zip(a, b))


def report(args, env, results, notes, tokens):
    ref = results.get(REF)
    lines = ["| impl | tokens/s | / cutlass_flash | peak GiB | first loss | last loss | max abs loss diff |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results.values():
        r["tps"] = statistics.median(tokens / s for s in r["seconds"][args.warmup:])
    for impl, r in results.items():
        ratio = f"{r['tps'] / ref['tps']:.3f}" if ref else "-"
        diff = f"{max_diff(r['losses'], ref['losses']):.4f}" if ref else "-"
        lines.append(f"| {impl} | {r['tps']:,.0f} | {ratio} | {r['peak']:.1f} | {r['losses'][0]:.4f} | "
                     f"{r['losses'][-1]:.4f} | {diff} |")
    table = "\n".join(lines) + "\n"
    agree = [f"{impl}: losses {'agree' if d <= args.loss_tol else 'DIFFER'} with {REF}'s (max |diff| {d:.4f}, "
             f"tolerance {args.loss_tol} on every step)"
             for impl, d in ((i, max_diff(r["losses"], ref["losses"])) for i, r in results.items() if ref and i != REF)]
    name = args.mix or "loguniform"
    head = [f"# Hugging Face Llama, packed training: {name}", ""] + [f"- {k}: {v}" for k, v in env.items()]
    head += [f"- model: Llama, {args.layers} layers, hidden {HEADS * HEAD_DIM}, {HEADS} heads x {HEAD_DIM}, "
             f"{args.kv_heads} kv heads, intermediate 5632, vocab {VOCAB}, bf16, AdamW lr {args.lr:g}",
             f"- data: {tokens} tokens per step ({args.rows} row(s) of "
             + (f"mix {name}: {varlen_bench.MIXES[name]}" if args.mix else
                f"{args.row_tokens}, documents log-uniform in [{args.min_len}, {args.max_len}]")
             + f"), seed {args.seed}, position_ids restart per document; loss "
             + (f"in chunks of {args.loss_chunk}" if args.loss_chunk else "transformers' own"),
             f"- tokens/s: median of {args.steps - args.warmup} timed steps after {args.warmup} warm-up; "
             "peak: torch.cuda.max_memory_allocated per implementation", ""]
    head += [f"- {impl}: {note}" for impl, note in notes.items()]
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"hf-packed-{name}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(head) + "\n\n" + table + "".join(f"\n- {x}" for x in agree) + "\n")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "timed"] + [f"{i}_{c}" for i in results for c in ("loss", "ms")])
        for s in range(args.steps):
            w.writerow([s, int(s >= args.warmup)] + [f"{r[c][s] * m:.6g}" for r in results.values()
                                                     for c, m in (("losses", 1), ("seconds", 1e3))])
    print(f"\nwrote {stem}.md and {stem}.csv\n\n{table}\n" + "\n".join(agree))


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_packed_train needs a CUDA GPU", file=sys.stderr)
        return 2
    env = bench.environment()
    env["transformers"] = transformers.__version__
    env["FA3"] = bench_common.fa3_info()
    for k, v in env.items():
        print(f"{k:22s} {v}", flush=True)
    batches = make_batches(args)
    tokens = batches[0][0][0].numel()
    longest = max(max(lengths) for _, lengths in batches)
    print(f"{args.steps} steps of {tokens} tokens, {statistics.mean(len(b[1]) for b in batches):.1f} documents "
          f"per step on average, longest {longest}", flush=True)
    batches = [(tuple(t.to(DEVICE) for t in b), lengths) for b, lengths in batches]
    config = lambda: make_config(args, max(longest, args.max_len))  # noqa: E731  (from_config edits it)
    torch.manual_seed(args.seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config(), dtype=torch.bfloat16)
    state = {k: v.cpu() for k, v in model.state_dict().items()}  # every implementation starts here
    del model
    results, notes = {}, {}
    for impl in args.impls:
        attn, why = resolve(impl)
        if attn is None:
            print(f"note: skipping {impl}: {why}", flush=True)
            notes[impl] = f"skipped: {why}"
            continue
        try:
            results[impl] = train(impl, attn, args, config(), state, batches)
        except Exception as e:  # OOM, a build without some kernel, a refusal
            notes[impl] = f"failed: {bench._short(e)}"
            print(f"note: {impl} {notes[impl]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    report(args, env, results, notes, tokens)
    ref = results.get(REF)
    if ref is None or not all(math.isfinite(x) for x in ref["losses"]):
        print(f"FAIL: {REF} " + ("did not run" if ref is None else "gave a non-finite loss"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
