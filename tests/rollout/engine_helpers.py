"""Helpers of the rollout engine's CPU tests (test_rollout_engine*.py, test_rollout_prompts.py,
test_rollout_rope.py, test_decode_kernels.py): the token ids, a tiny float64 model of each
family, left-padded ragged prompts, and the dense reference of decode attention with the cache's
split-KV layout."""

import torch

from dualkv_compile.models import qwen3
from dualkv_compile.testing import same_dtype_numerics, tiny_model

PAD, EOS, VOCAB = 0, 1, 101


def model_of(family, seed=0, vocab=VOCAB):
    if family == "qwen3":
        torch.manual_seed(seed)
        model = qwen3(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                      intermediate_dim=64, head_dim=8, max_seq_len=128)
    else:
        model = tiny_model(family, vocab=vocab, seed=seed, max_seq_len=128)
    with torch.no_grad():  # torchtune's builders draw N(0, 1) embeddings: near-greedy samples
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return same_dtype_numerics(model.to(torch.float64).eval())


def ragged_prompts(groups=3, width=40, seed=1, vocab=VOCAB):
    """Left-padded prompts of 40, 30, 20, ... tokens: the cache holds them in 2 splits of 24
    keys (prompt_splits), the second empty for the 20-token prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab, (groups, width), generator=g)
    for i in range(1, groups):
        prompts[i, :10 * i] = PAD
    return prompts


def dense_reference(q, pk, pv, plen, rk, rv, last, scale):
    """Each row against its group's valid prompt keys and its own keys 0..last, one softmax.
    pk/pv [G, Hkv, P, D] (unsplit)."""
    rows, hq, d = q.shape
    groups, hkv = pk.shape[:2]
    n, rep = rows // groups, hq // hkv
    out = torch.empty_like(q)
    for r in range(rows):
        g = r // n
        k = torch.cat([pk[g, :, :plen[g]], rk[r, :, :last + 1]], 1).repeat_interleave(rep, 0)
        v = torch.cat([pv[g, :, :plen[g]], rv[r, :, :last + 1]], 1).repeat_interleave(rep, 0)
        w = torch.softmax((q[r, :, None] @ k.transpose(1, 2))[:, 0] * scale, -1)
        out[r] = (w[:, None] @ v)[:, 0]
    return out


def split(kv, splits):
    """[G, Hkv, P, D] -> the cache's [G, S, Hkv, P / S, D]."""
    g, h, p, d = kv.shape
    return kv.view(g, h, splits, p // splits, d).transpose(1, 2).contiguous()
