"""Many sequences through one forward: padded prefill and the batched decode step (Days 27-28).

A decode step of one sequence streams every weight from memory to make one token. Batching
is the difference between using the hardware and paying for it: B rows share that one read
of the weights, and the extra rows ride along in arithmetic that would otherwise sit idle
(Day 29 measures how far that holds on this machine).

Two ideas make B prompts of different lengths one forward:

- padding (Day 27): prompts are right-padded into a (B, T) rectangle. Positions count each
  row from 0, logits are read at each row's own last token, and attention looks only at a
  row's real tokens, so padding changes nothing a real token computes.
- block tables (Day 28): every row has its own BlockTable in one shared PagedKVCache. A decode
  step writes each row's new k/v into that row's next slot and lets each row attend over its
  own history only.

Batch invariance. A row's tokens must not depend on what else is in the batch, and fp32
results are only reproducible when the same kernel computes them. Two rules here:
- matmuls: `model.linear` multiplies two or more rows with oneDNN, whose rows are bit-identical
  whatever the number of rows in the call. torch's own F.linear (MKL, the fallback where oneDNN
  is missing or gradients are on) is row-stable only when the rows of the call (M) are a
  multiple of 4; a partial group of 1-3 rows takes other kernels. So forwards of two or more
  rows run a multiple of ROW_MULTIPLE rows (dummy rows are added, cheap when weights dominate),
  and the prefill pads its length to one: both kernels then agree. A batch of one is the
  exception: a single row takes the model's one-row road (`model.linear`'s embedding_bag, fast
  where the step is bound by reading weights and the most accurate road), so a solo run agrees
  with its row in a batch to fp32 rounding (the same tokens, except at a genuine near-tie).
- attention: each row attends in a computation that sees only its own keys. The prefill calls
  the fused kernel once per row on exactly its real tokens; the decode step's masked softmax is
  written out (a scores matmul, then a weighted sum of value rows), where masked keys add exact zeros.

>>> greedy_generate_batch(model, [tok.encode("Hi"), tok.encode("The capital of France is")],
...                       max_new_tokens=[2, 4])                        # doctest: +SKIP
[[28, 2683], [7042, 30, 378, 2451]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .generate import check_prompt
from .kernels import fused_layer, paged_decode_attention, unavailable_reason
from .kernels import load as load_kernels
from .model import Llama, linear
from .paged import BlockTable, PagedKVCache, check_block_size
from .sampling import argmax_rows

ROW_MULTIPLE = 4
"""Rows per forward of a batch (and the prefill length) are rounded up to this: one GEMM kernel for every row."""

KEY_MULTIPLE = 16
"""Keys per row a decode step gathers are rounded up to this (the fp32 lanes of an AVX-512 register, a multiple of
AVX2's and NEON's). The softmax and the value sums vectorise over keys; past a whole number of vectors, masked keys
only add exact zeros, but a ragged tail is summed another way, and a row's rounding would follow the longest row."""


def round_up(n: int, multiple: int = ROW_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def forward_rows(batch_size: int) -> int:
    """Rows a forward of `batch_size` sequences runs: itself alone, else a multiple of ROW_MULTIPLE."""
    return 1 if batch_size == 1 else round_up(batch_size)


def check_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, max_new_tokens: int = 1) -> None:
    """Refuse a batch any row of which no engine path could serve; the message names the row.
    Every row needs room for `max_new_tokens` after its prompt (a static batch runs each row as long as its
    slowest)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"need a list of prompts (each a list of token ids), got text {prompts[:20]!r}")
    if len(prompts) == 0:
        raise ValueError("empty batch: need at least one prompt")
    for i, p in enumerate(prompts):
        try:
            ids = p if isinstance(p, (str, bytes)) else list(p)
        except TypeError:
            raise ValueError(f"prompt {i}: expected a sequence of token ids, got {p!r}") from None
        try:
            check_prompt(ids, cfg.max_position_embeddings, cfg.vocab_size, max_new_tokens)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None


@dataclass(frozen=True)
class PaddedBatch:
    """Prompts as one right-padded rectangle."""

    ids: Tensor  # (B, T) token ids, pad_id after each row's end
    positions: Tensor  # (B, T) 0, 1, ... in every row (padding keeps counting; its outputs are never read)
    key_mask: Tensor  # (B, T) True on real tokens
    lengths: list[int]  # real tokens per row

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def last_index(self) -> Tensor:
        """(B,) where each row's next-token logits are read: its last real token."""
        return torch.tensor(self.lengths) - 1


def pad_batch(prompts: Sequence[Sequence[int]], pad_id: int = 0, multiple: int = ROW_MULTIPLE) -> PaddedBatch:
    """Right-pad prompts into (B, T), T the longest prompt rounded up to `multiple`.

    >>> b = pad_batch([[5, 6, 7], [8]], multiple=2)
    >>> b.ids.tolist(), b.key_mask.int().tolist(), b.last_index.tolist()
    ([[5, 6, 7, 0], [8, 0, 0, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]], [2, 0])
    """
    lengths = [len(p) for p in prompts]
    if not lengths:
        raise ValueError("empty batch: need at least one prompt")
    if min(lengths) == 0:
        raise ValueError(f"every prompt needs at least one token, got lengths {lengths}")
    B, T = len(prompts), round_up(max(lengths), multiple)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    key_mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return PaddedBatch(ids, torch.arange(T).expand(B, T), key_mask, lengths)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int]) -> Tensor:
    """Causal attention of each row over its own first lengths[i] tokens; padding gets zeros.

    One call per row on exactly its real tokens is the call a solo prefill of that prompt makes,
    so the result is bit-identical whatever the batch (one masked (B, T, T) call is not: the fused
    kernel's rounding depends on the other rows). A row of length 0 is all zeros, never NaN.
    q (R, T, H, D), k/v (R, T, K, D) -> (R, T, H*D)."""
    R, T, H, D = q.shape
    out = q.new_zeros(R, T, H, D)
    for i, n in enumerate(lengths):
        if n:
            out[i, :n] = F.scaled_dot_product_attention(
                q[i, :n].transpose(0, 1), k[i, :n].transpose(0, 1), v[i, :n].transpose(0, 1),
                is_causal=True, enable_gqa=True).transpose(0, 1)  # (n, H, D)
    return out.view(R, T, H * D)


def decode_attention(q: Tensor, k: Tensor, values: Tensor, value_bags: tuple[Tensor, Tensor],
                     key_bias: Tensor) -> Tensor:
    """One new query per row over that row's keys (grouped-query): scores as one batched matmul
    that also adds the mask, a softmax, then each query head's weighted sum of its value rows. A
    row's result depends on nothing but its own keys: a key past the row's context gets bias -inf,
    so probability exactly 0, and adds exact zeros (the pool holds finite numbers: zeros until
    written). Each row needs at least one key in context.

    Keys come gathered head-major, (R, K, L, D), as `BatchedPagedAttention` reads them, so the
    matmul reads them in place. Values are not gathered at all: the weighted sum of rows is what
    F.embedding_bag computes (Day 13's decode attention does the same), straight from the layer's
    pool seen as (rows, D), `value_bags` (from `value_bags`) saying which rows each head sums.
    q (R, 1, H, D), k (R, K, L, D), key_bias (R * K, 1, L) from `key_bias` -> (R, 1, H*D)."""
    R, _, H, D = q.shape
    K, L = k.shape[1], k.shape[2]
    qg = q.reshape(R * K, H // K, D)  # the query heads that share each kv head
    # bias + scale * q @ k.T in one call: the 0/-inf bias adds exactly what a masked_fill would, and
    # the scale rounds as a separate multiply does; two kernels fewer per layer
    scores = torch.baddbmm(key_bias, qg, k.view(R * K, L, D).transpose(1, 2), alpha=D**-0.5)  # (R*K, rep, L)
    rows, offsets = value_bags
    out = F.embedding_bag(rows, values, offsets, mode="sum",
                          per_sample_weights=torch.softmax(scores, dim=-1).view(-1))  # (R * H, D)
    return out.view(R, 1, H * D)


def key_bias(key_mask: Tensor, n_kv_heads: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """`decode_attention`'s mask as an additive bias: 0 on keys in context, -inf past it, one
    (1, L) row per (row, kv head), broadcast over that head's query heads. key_mask (R, L)."""
    bias = torch.zeros(key_mask.shape, dtype=dtype).masked_fill_(~key_mask, float("-inf"))
    return bias[:, None, None, :].expand(-1, n_kv_heads, -1, -1).reshape(-1, 1, key_mask.shape[1])


def value_bags(key_rows: Tensor, batch_rows: int, n_kv_heads: int, rep: int) -> tuple[Tensor, Tensor]:
    """embedding_bag indices for `decode_attention`: one bag per (row, query head), holding the
    pool rows of that row's keys under the head's kv head, in key order. key_rows (R * K * L,)."""
    rows = key_rows.view(batch_rows, n_kv_heads, 1, -1)
    L = rows.shape[-1]
    rows = rows.expand(-1, -1, rep, -1).reshape(-1)  # (R * K * rep * L,)
    return rows, torch.arange(0, rows.numel(), L)


def logits_at(model: Llama, h: Tensor, index: Tensor) -> Tensor:
    """Next-token logits (B, V) from hidden states h (B, T, C), at position index[b] of row b.

    The LM head runs on forward_rows(B) rows (zero rows added), the batch's kernel for every row
    and the kernel a one-prompt prefill uses too, so prefill logits are bit-identical in any batch."""
    B = h.shape[0]
    rows = h[torch.arange(B), index]  # (B, C)
    rows = F.pad(rows, (0, 0, 0, round_up(B) - B))  # (R, C)
    return linear(rows, model.lm_head).float()[:B]


@torch.inference_mode()
def padded_prefill(model: Llama, prompts: PaddedBatch | Sequence[Sequence[int]]) -> Tensor:
    """Logits (B, V) at each prompt's last real token, every prompt in one forward that keeps no cache."""
    if not isinstance(prompts, PaddedBatch):
        check_prompts(prompts, model.cfg)
    batch = prompts if isinstance(prompts, PaddedBatch) else pad_batch(prompts)
    kv = lambda layer, q, k, v: prefill_attention(q, k, v, batch.lengths)
    return logits_at(model, model.hidden_states(batch.ids, batch.positions, kv), batch.last_index)


@dataclass(frozen=True)
class BatchStep:
    """What one batched forward needs to find its K/V. Built by BatchedPagedKVCache, passed explicitly."""

    positions: Tensor  # (R, T) position of each new token
    slot_mapping: Tensor  # (R, T) pool slot each new token's k/v goes to; -1: padding, not written
    block_tables: Tensor  # (R, W) each row's physical blocks, padded with block 0 (masked, never used)
    context_lens: Tensor  # (R,) keys each row attends over, new ones included
    key_mask: Tensor  # prefill: (R, T) real new tokens; decode: (R, L) keys in context, L >= W * block_size
    write_rows: Tensor  # (n,) flat (row * T + t) indices of the new tokens that are written
    write_slots: Tensor  # (n,) their slots
    is_prefill: bool  # the new tokens are each row's whole history
    key_rows: Tensor | None = None  # decode: (R * K * L,) rows of a layer's pool seen as
    # (blocks * block_size * K, D), in (row, kv head, key) order: the gather that lands head-major


class BatchedPagedAttention:
    """The KVBackend of one batched forward: write the new k/v into their slots, then attend.

    The prefill starts from empty tables, so the new tokens are each row's whole history. A
    decode step gathers each row's blocks into an (R, K, L) rectangle of keys (L: W * block_size
    rounded up to KEY_MULTIPLE), one row of D numbers at a time in the head-major order the scores'
    matmul reads, masks those past the row's context, and sums the value rows straight from the
    pool: the reference read, whose cost follows the longest row (Day 34's kernel removes it).
    With `compiled`, a decode step attends with `kernels.paged_decode_attention` instead, which
    reads each row's keys and values where they lie in the pool (Day 29)."""

    def __init__(self, cache: PagedKVCache, step: BatchStep, compiled: bool = False):
        self.cache, self.step, self.compiled = cache, step, compiled
        self._value_bags: tuple[Tensor, Tensor] | None = None  # the same for every layer of the step ...
        self._key_bias: Tensor | None = None  # ... made on the first layer's call

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        R, T, H, D = q.shape  # k, v: (R, T, K, D)
        s, K = self.step, k.shape[2]
        if s.is_prefill:  # write the real tokens, not the padding; attend within each row
            kf, vf = k.reshape(R * T, K, D), v.reshape(R * T, K, D)
            if s.write_rows.numel() != R * T:
                kf, vf = kf.index_select(0, s.write_rows), vf.index_select(0, s.write_rows)
            self.cache.write(layer, s.write_slots, kf, vf)
            return prefill_attention(q, k, v, s.context_lens.tolist())
        n = s.write_slots.numel()  # a decode step's real rows come first: the rest are dummies
        self.cache.write(layer, s.write_slots, k[:n, 0], v[:n, 0])
        if self.compiled:
            out = paged_decode_attention(q.reshape(R, H, D), self.cache.k[layer], self.cache.v[layer],
                                         s.block_tables, s.context_lens, D**-0.5)
            return out.view(R, 1, H * D)
        kc = self.cache.k[layer].view(-1, D).index_select(0, s.key_rows).view(R, K, -1, D)
        if self._value_bags is None:
            self._value_bags = value_bags(s.key_rows, R, K, H // K)
            self._key_bias = key_bias(s.key_mask, K, q.dtype)
        return decode_attention(q, kc, self.cache.v[layer].view(-1, D), self._value_bags, self._key_bias)


class BatchedPagedKVCache:
    """B rows in one PagedKVCache, each with its own BlockTable, for the life of a static batch.

    Row i keeps index i, and its blocks, until `free()`, finished or not: a static batch has no
    way to hand a row's place to another request. That is the limit Week 8's scheduler removes."""

    def __init__(self, cache: PagedKVCache, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.cache = cache
        self.tables: list[BlockTable] = [cache.new_table() for _ in range(batch_size)]

    @classmethod
    def for_batch(cls, cfg: ModelConfig, prompt_lens: Sequence[int], max_new_tokens: int,
                  block_size: int = 16, dtype: torch.dtype = torch.float32) -> BatchedPagedKVCache:
        """A pool just large enough for every row's prompt plus `max_new_tokens` (no prefix caching)."""
        check_block_size(block_size)
        blocks = sum(math.ceil((n + max_new_tokens) / block_size) for n in prompt_lens)
        cache = PagedKVCache(cfg, max(blocks, 1), block_size, dtype=dtype, prefix_caching=False)
        return cls(cache, len(prompt_lens))

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def context_lens(self) -> list[int]:
        return [t.num_tokens for t in self.tables]

    def backend(self, step: BatchStep, compiled: bool = False) -> BatchedPagedAttention:
        return BatchedPagedAttention(self.cache, step, compiled)

    def prefill_step(self, batch: PaddedBatch) -> BatchStep:
        """Give every prompt token a slot (allocating blocks) and describe the padded prefill."""
        if batch.batch_size != self.batch_size:
            raise ValueError(f"batch has {batch.batch_size} prompts, the cache {self.batch_size} rows")
        if any(t.num_tokens for t in self.tables):
            raise ValueError("prefill_step needs empty rows: a static batch is prefilled once")
        B, T = batch.ids.shape
        slots = torch.full((B, T), -1, dtype=torch.long)
        for i, (table, n) in enumerate(zip(self.tables, batch.lengths)):
            slots[i, :n] = self.cache.append(table, batch.ids[i, :n].tolist())
        flat = slots.reshape(-1)
        write_rows = (flat >= 0).nonzero().squeeze(1)
        return BatchStep(batch.positions, slots, self._block_tables(B), torch.tensor(batch.lengths),
                         batch.key_mask, write_rows, flat[write_rows], is_prefill=True)

    def decode_step(self, tokens: Sequence[int]) -> BatchStep:
        """Append one token per row and describe the step over forward_rows(B) rows. Dummy rows sit
        at position 0, write nothing and attend over row 0's first key: finite, and never read."""
        B = self.batch_size
        if len(tokens) != B:
            raise ValueError(f"decode_step needs one token per row ({B}), got {len(tokens)}")
        if any(t.num_tokens == 0 for t in self.tables):
            raise ValueError("decode_step before prefill_step: every row needs its prompt first")
        R = forward_rows(B)
        slots = [int(self.cache.append(t, [tok])[0]) for t, tok in zip(self.tables, tokens)]
        context_lens = torch.tensor(self.context_lens + [1] * (R - B))
        block_tables = self._block_tables(R)
        bs = self.block_size
        L = round_up(block_tables.shape[1] * bs, KEY_MULTIPLE)  # past the blocks: block 0 again, masked
        pos = torch.arange(L)
        key_mask = pos[None, :] < context_lens[:, None]  # (R, L)
        slot_mapping = torch.tensor(slots + [-1] * (R - B))[:, None]  # (R, 1)
        K = self.cache.k.shape[-2]
        tables = F.pad(block_tables, (0, -(-L // bs) - block_tables.shape[1]))  # (R, ceil(L / bs)) blocks
        key_slots = tables[:, pos // bs] * bs + pos % bs  # (R, L) each key's pool slot
        key_rows = (key_slots[:, None, :] * K + torch.arange(K)[None, :, None]).reshape(-1)  # (R, K, L) flattened
        return BatchStep(positions=(context_lens - 1)[:, None], slot_mapping=slot_mapping,
                         block_tables=block_tables, context_lens=context_lens, key_mask=key_mask,
                         write_rows=torch.arange(B), write_slots=torch.tensor(slots), is_prefill=False,
                         key_rows=key_rows)

    def _block_tables(self, R: int) -> Tensor:
        """(R, W) physical blocks per row; dummy rows borrow row 0's table."""
        W = max(len(t.blocks) for t in self.tables)
        rows = [t.blocks + [0] * (W - len(t.blocks)) for t in self.tables]
        return torch.tensor(rows + [rows[0]] * (R - len(rows)), dtype=torch.long)

    def free(self) -> None:
        """Give every row's blocks back to the pool."""
        for t in self.tables:
            self.cache.free(t)


def use_kernels(model: Llama, want: bool | None = None) -> bool:
    """Whether decode steps of `model` run the compiled kernels: `want` None means where they can."""
    if want is False:
        return False
    if model.dtype != torch.float32:
        if want:
            raise ValueError(f"the compiled kernels are fp32 only; this model is {model.dtype}")
        return False
    if load_kernels() is None:
        if want:
            raise RuntimeError(f"the compiled kernels are unavailable: {unavailable_reason()}")
        return False
    return True


class StaticBatch:
    """One static batch: fixed when it starts, run until its slowest row is done (Day 28).

    `prefill()` and `step()` are the two calls greedy_generate_batch makes, and the two the
    Day-29 runner times. Row i collects the prefill's token and then one per step for its next
    `stop_steps[i]` steps; after that it keeps its slot, its blocks and its place in every
    forward, and collects nothing. Rows stop on a step budget, not on EOS: output length is
    what Day 29 varies.

    `kernels`: decode steps with the compiled glue and attention (`kernels.py`): None uses them
    where they are built (an fp32 model on a machine with a compiler), True insists, False runs
    torch's ops. Either way a row's tokens do not depend on the rows beside it.
    """

    def __init__(self, model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                 block_size: int = 16, kernels: bool | None = None):
        if not isinstance(stop_steps, Sequence) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stop_steps):
            raise ValueError(f"stop_steps must be a list of ints >= 0 (decode steps per row), got {stop_steps!r}")
        check_prompts(prompts, model.cfg, max(stop_steps, default=0) + 1)  # every row runs the slowest's steps
        if len(stop_steps) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(stop_steps)} stop_steps: need one per prompt")
        self.stop_steps = list(stop_steps)
        self.model = model
        self.compiled = use_kernels(model, kernels)
        self.batch = pad_batch(prompts)
        self.kv = BatchedPagedKVCache.for_batch(model.cfg, self.batch.lengths, self.n_steps + 1, block_size,
                                                model.dtype)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.last: list[int] = []  # each row's newest token, collected or not: the next step's input
        self.steps_done = -1  # -1 before the prefill, 0 after it, n after n decode steps

    @property
    def n_steps(self) -> int:
        """Decode steps the batch runs: its slowest row's."""
        return max(self.stop_steps)

    @property
    def done(self) -> bool:
        return self.steps_done == self.n_steps

    @torch.inference_mode()
    def prefill(self) -> Tensor:
        """The padded prefill: every prompt's k/v into its blocks; logits (B, V) at each last token."""
        if self.steps_done != -1:
            raise RuntimeError("prefill() called twice: a static batch is prefilled once")
        step = self.kv.prefill_step(self.batch)
        h = self.model.hidden_states(self.batch.ids, self.batch.positions, self.kv.backend(step))  # (B, T, C)
        return self._collect(logits_at(self.model, h, self.batch.last_index))

    @torch.inference_mode()
    def step(self) -> Tensor:
        """One batched decode step: every row, finished or not, feeds its newest token. Logits (B, V)."""
        if self.steps_done < 0:
            raise RuntimeError("step() before prefill()")
        if self.done:
            raise RuntimeError(f"the batch is done: all {self.n_steps} decode steps have run")
        step = self.kv.decode_step(self.last)
        R = step.positions.shape[0]
        ids = torch.tensor(self.last + [0] * (R - len(self.last)))[:, None]  # (R, 1)
        layer_fn = fused_layer if self.compiled else None
        h = self.model.hidden_states(ids, step.positions, self.kv.backend(step, self.compiled), layer_fn=layer_fn)
        return self._collect(linear(h[:, -1], self.model.lm_head).float())

    def _collect(self, logits: Tensor) -> Tensor:
        logits = logits[: len(self.tokens)]  # (B, V): dummy rows dropped
        self.last = argmax_rows(logits).tolist()
        self.steps_done += 1
        for row, token, budget in zip(self.tokens, self.last, self.stop_steps):
            if self.steps_done <= budget:
                row.append(token)
        return logits

    def run(self) -> list[list[int]]:
        """Prefill, decode to the end, give the blocks back; each row's collected tokens."""
        try:
            self.prefill()
            while not self.done:
                self.step()
        finally:
            self.kv.free()
        return self.tokens


def greedy_generate_batch(model: Llama, prompts: Sequence[Sequence[int]],
                          max_new_tokens: int | Sequence[int] | None = None,
                          stop_steps: Sequence[int] | None = None, block_size: int = 16,
                          kernels: bool | None = None) -> list[list[int]]:
    """Greedy tokens for every prompt, in one static batch. Give `max_new_tokens` (one int for all
    rows, or one per row) or `stop_steps` (decode steps per row, max_new_tokens - 1); EOS does not stop.

    Row i's tokens equal prompt i's solo run, whatever else is in the batch."""
    if (max_new_tokens is None) == (stop_steps is None):
        raise ValueError("give exactly one of max_new_tokens and stop_steps")
    if stop_steps is None:
        one = isinstance(max_new_tokens, int) or not isinstance(max_new_tokens, Sequence)
        n = [max_new_tokens] * len(prompts) if one else list(max_new_tokens)
        if len(n) != len(prompts) or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in n):
            raise ValueError(f"max_new_tokens must be an int >= 1, or one for each of the {len(prompts)} prompts, "
                             f"got {max_new_tokens!r}")
        stop_steps = [x - 1 for x in n]
    return StaticBatch(model, prompts, stop_steps, block_size, kernels).run()
