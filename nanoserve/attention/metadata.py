"""One step's attention metadata, in the field's names (vLLM's, FlashAttention's varlen API).

A step is a flat list of N tokens from R requests. Each request contributes any number of
query tokens, the next ones of its sequence after the `num_computed` it already has in the
cache: a whole prompt (num_computed 0), a chunk of one, or one decode token. There is no
prefill or decode phase, only tokens computed and tokens to compute (vLLM V1's view).
`prepare` lays the requests' tokens end to end and describes them:

    query_start_loc (R+1,)  request r owns rows query_start_loc[r] .. query_start_loc[r+1]-1
    seq_lens        (R,)    tokens request r attends over after this step: cached + new
    block_tables    (R, W)  its physical blocks, padded with 0 (never read past seq_lens)
    slot_mapping    (n,)    the pool slot each real token's k/v is written to
    positions       (N,)    each token's position in its own sequence (RoPE reads it)
    last_rows       (R,)    the row of each request's last token (where its next-token logits are read)

A query at position p attends over its request's keys 0..p. N may be more than the n real tokens
(`num_rows`: the model runner pads a step to the row count its products want); the rows past n are
zero and belong to no request.

>>> ids, md = prepare([Chunk([5, 6, 7], 0, [0]), Chunk([8], 4, [1, 2])], block_size=4)
>>> md.query_start_loc.tolist(), md.seq_lens.tolist(), md.positions.tolist(), md.slot_mapping.tolist()
([0, 3, 4], [3, 5], [0, 1, 2, 4], [0, 1, 2, 8])
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: `token_ids` to compute now, after `num_computed` tokens whose
    k/v is already in the blocks of `block_table` (which must also hold slots for the new ones). On a pool of
    several KV cache groups the model runner takes one table per group and prepares each group's step."""

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a step sits and where its request's keys are. Built by `prepare`."""

    query_start_loc: Tensor  # (R+1,) int64
    seq_lens: Tensor  # (R,) int64
    block_tables: Tensor  # (R, W) int64
    slot_mapping: Tensor  # (n,) int64, the real tokens only
    positions: Tensor  # (N,) int64, padding rows at position 0
    last_rows: Tensor  # (R,) int64, the row of each request's last token: where its next-token logits are read
    query_lens: tuple[int, ...]  # the same numbers on the host, for loops that need them
    seq_lens_host: tuple[int, ...]
    block_size: int

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Real tokens in the step (rows past them are padding)."""
        return self.slot_mapping.numel()

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens each request had cached before this step."""
        return tuple(s - q for s, q in zip(self.seq_lens_host, self.query_lens))


def prepare(chunks: Sequence[Chunk], block_size: int, num_rows: int | None = None) -> tuple[Tensor, AttentionMetadata]:
    """The step's input ids (N,) and metadata, for requests in order. Every engine path builds its
    step here: one sequence's prefill or decode, a static batch, the scheduler's mixed steps.
    `num_rows`: N, the rows the step runs (default: its real tokens; more adds zero rows at the end)."""
    if not chunks:
        raise ValueError("a step needs at least one request")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens = []
    for r, c in enumerate(chunks):
        n, start, table = len(c.token_ids), c.num_computed, c.block_table
        if n == 0:
            raise ValueError(f"request {r}: no tokens to compute in this step")
        if start < 0:
            raise ValueError(f"request {r}: num_computed={start} must be >= 0")
        end = start + n
        if -(-end // block_size) > len(table):
            raise ValueError(f"request {r}: {end} tokens need {-(-end // block_size)} blocks of {block_size}, "
                             f"its table has {len(table)}")
        ids.extend(c.token_ids)
        positions.extend(range(start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        starts.append(starts[-1] + n)
        seq_lens.append(end)
    n_real = starts[-1]
    if num_rows is not None and num_rows < n_real:
        raise ValueError(f"num_rows={num_rows} is fewer than the step's {n_real} tokens")
    pad = (num_rows or n_real) - n_real
    width = max(-(-s // block_size) for s in seq_lens)
    R, N = len(chunks), n_real + pad
    tables = [b for c in chunks for b in list(c.block_table[:width]) + [0] * (width - min(width, len(c.block_table)))]
    # one tensor made from one list (through an array of int64: a list's own road converts number by number),
    # cut into the fields as contiguous views: a step's host work is paid every step
    last = [s - 1 for s in starts[1:]]
    flat = torch.frombuffer(array("q", ids + [0] * pad + positions + [0] * pad + starts + seq_lens + slots + last
                                  + tables), dtype=torch.int64)
    ids_t, positions_t, starts_t, lens_t, slots_t, last_t, tables_t = flat.split([N, N, R + 1, R, n_real, R, R * width])
    md = AttentionMetadata(
        query_start_loc=starts_t, seq_lens=lens_t, block_tables=tables_t.view(R, width), slot_mapping=slots_t,
        positions=positions_t, last_rows=last_t, query_lens=tuple(len(c.token_ids) for c in chunks),
        seq_lens_host=tuple(seq_lens), block_size=block_size)
    return ids_t, md
