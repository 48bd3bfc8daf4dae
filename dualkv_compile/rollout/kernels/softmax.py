"""The online softmax both decode kernels run over their blocks of keys (prompt.py over a
group's prompt, response.py over a row's response): one block folded into the running
(max m, sum l, accumulator acc) of a tile of queries, and the tile's normalised output."""

from __future__ import annotations

from . import triton

__all__ = ["fold_keys", "normalise"]

if triton is not None:
    import triton.language as tl

    @triton.jit
    def fold_keys(q, k, v_ptrs, valid, scale, m_i, l_i, acc, IEEE: tl.constexpr):
        """q [M, D] against a block of keys k [BLOCK_N, D] (`valid` [BLOCK_N] marks the real
        ones; the first is always real, so the new max is finite) and their values, loaded
        from v_ptrs after the scores: -> the updated (m_i, l_i, acc)."""
        if IEEE:  # float32 inputs: full-precision dots, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv

    @triton.jit
    def normalise(m_i, l_i, acc):
        """-> (output acc / l, log-sum-exp); a query that met no key gets output 0 and
        log-sum-exp -inf (weight 0 wherever it is merged)."""
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        return out, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
