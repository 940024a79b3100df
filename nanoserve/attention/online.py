"""Online softmax: attention over keys taken a block at a time, never holding a whole row of scores.

softmax(s) @ V needs the row's max (for a safe exp) and its sum (to normalise) before any value
is weighted, which seems to need every score first. It does not: keep three running numbers per
(query, head), the max m of the scores seen so far, the sum l of e^(s - m) over them, and the
unnormalised output acc = sum of e^(s - m) * v. A new block of keys brings its own (m', l', acc');
the two merge exactly by rescaling to the larger max (`merge`), and acc / l at the end is the
softmax attention. Kernels that read K/V in pieces (Day 23's paged kernel, Day 24's split-K) are
built on this one identity.

    >>> q, k, v = torch.randn(1, 2, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    >>> torch.allclose(online_attention(q, k, v, block=3), full_attention(q, k, v), atol=1e-6)
    True

Shapes: T queries, S keys, H query heads, K kv heads (H a multiple of K), D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SoftmaxState:
    """What a reader of keys carries for each (query, head): the running max m, the running sum
    l = sum e^(s - m), and the unnormalised output acc = sum e^(s - m) v. `keys`: keys seen so far."""

    m: Tensor  # (T, H)
    l: Tensor  # (T, H)  # noqa: E741 (the name FlashAttention gives it)
    acc: Tensor  # (T, H, D)
    keys: int = 0

    def output(self) -> Tensor:
        """The attention output so far: acc / l, (T, H, D)."""
        return self.acc / self.l[..., None]


def scores_of(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """Scaled scores of every query head over keys k, grouped-query. q (T, H, D), k (S, K, D) -> (T, H, S)."""
    T, H, D = q.shape
    rep = H // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # (S, H, D): each query head's kv head
    return torch.einsum("thd,shd->ths", q, k) * (D**-0.5 if scale is None else scale)


def causal_mask(T: int, S: int, start: int | None = None) -> Tensor:
    """(T, S) bool: query t sits at position start + t (default S - T) and sees keys 0 .. start + t."""
    start = S - T if start is None else start
    return torch.arange(S)[None, :] <= start + torch.arange(T)[:, None]


def block_state(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float | None = None) -> SoftmaxState:
    """One block of keys on its own: its scores' max, sum and unnormalised output. visible (T, S) bool;
    a (query, head) that sees none of the block gets m = -inf, l = 0, acc = 0."""
    rep = q.shape[1] // k.shape[1]
    s = scores_of(q, k, scale).masked_fill(~visible[:, None, :], float("-inf"))  # (T, H, S)
    m = s.amax(-1)  # (T, H)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])  # masked keys: e^-inf = 0
    acc = torch.einsum("ths,shd->thd", p, v.repeat_interleave(rep, dim=1))
    return SoftmaxState(m, p.sum(-1), acc, k.shape[0])


def merge(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Two states over disjoint keys -> the state over both: rescale each to the larger max and add.
    Exact in real arithmetic; in floats, one rescale per merge."""
    m = torch.maximum(a.m, b.m)
    safe = torch.where(torch.isinf(m), 0.0, m)  # neither saw a key: keep zeros, not nan
    ca, cb = torch.exp(a.m - safe), torch.exp(b.m - safe)  # (T, H): each side's rescale
    return SoftmaxState(m, a.l * ca + b.l * cb, a.acc * ca[..., None] + b.acc * cb[..., None], a.keys + b.keys)


def online_states(q: Tensor, k: Tensor, v: Tensor, block: int, start: int | None = None,
                  scale: float | None = None) -> list[SoftmaxState]:
    """The running state after each block of `block` keys, in order: what a kernel reading keys a block
    at a time holds. The last one's `output()` is the attention. q (T, H, D), k/v (S, K, D), causal
    with the queries at positions start .. start + T - 1 (default: the last T of the S keys)."""
    if block < 1:
        raise ValueError(f"block={block}: a block holds at least one key")
    T, S = q.shape[0], k.shape[0]
    visible = causal_mask(T, S, start)
    H, D = q.shape[1], q.shape[2]
    state = SoftmaxState(q.new_full((T, H), float("-inf")), q.new_zeros(T, H), q.new_zeros(T, H, D))
    states = []
    for b0 in range(0, S, block):
        b1 = min(S, b0 + block)
        state = merge(state, block_state(q, k[b0:b1], v[b0:b1], visible[:, b0:b1], scale))
        states.append(state)
    return states


def online_attention(q: Tensor, k: Tensor, v: Tensor, block: int, start: int | None = None,
                     scale: float | None = None) -> Tensor:
    """Causal grouped-query attention computed a block of keys at a time. q (T, H, D), k/v (S, K, D)
    -> (T, H, D)."""
    return online_states(q, k, v, block, start, scale)[-1].output()


def full_attention(q: Tensor, k: Tensor, v: Tensor, start: int | None = None, scale: float | None = None) -> Tensor:
    """The textbook form, every score at once: softmax(q k^T * scale, masked) v. Same shapes as
    `online_attention`; the reference it is checked against."""
    T, S = q.shape[0], k.shape[0]
    s = scores_of(q, k, scale).masked_fill(~causal_mask(T, S, start)[:, None, :], float("-inf"))
    rep = q.shape[1] // k.shape[1]
    return torch.einsum("ths,shd->thd", torch.softmax(s, -1), v.repeat_interleave(rep, dim=1))
