"""A short bf16 training loop of a small decoder, once with cutlass_flash's attention and once
with PyTorch SDPA, from the same initial weights and batches: the two loss curves must agree
within bf16 noise. Used by tests/test_gpu_training.py; run alone it prints both curves:

    python benchmarks/train_check.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import cutlass_flash


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attention):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        q = q.view(B, S, self.heads, self.head_dim)
        k = k.view(B, S, self.kv_heads, self.head_dim)
        v = v.view(B, S, self.kv_heads, self.head_dim)
        x = x + self.proj(attention(q, k, v).reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab=512, dim=256, layers=2, heads=4, kv_heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, attention):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, attention)
        return self.head(x)


def ours(q, k, v):
    return cutlass_flash.flash_attn_func(q, k, v, causal=True)


def sdpa(q, k, v):
    g = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def train(attention, steps=30, seed=0, batch=4, seqlen=512, vocab=512):
    torch.manual_seed(seed)
    model = Decoder(vocab=vocab).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    # One fixed batch: the model memorises it, so the loss falls steeply within 30 steps and a
    # wrong gradient shows as a different curve.
    tokens = torch.randint(0, vocab, (batch, seqlen + 1), device="cuda", generator=g)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1], attention)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    a, b = train(ours), train(sdpa)
    for i, (x, y) in enumerate(zip(a, b)):
        print(f"{i:3d} ours {x:.4f} sdpa {y:.4f} diff {x - y:+.4f}")
