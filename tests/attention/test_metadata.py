"""One step's metadata: `prepare` lays requests end to end, whatever each contributes (a whole prompt,
a chunk after cached context, one decode token), and pads the rows to the count the caller asks for (the
model runner asks for what the products run, `forward_rows`)."""

from __future__ import annotations

import doctest

import pytest
import torch

from nanoserve.attention import Chunk, prepare
from nanoserve.attention import metadata as metadata_module
from nanoserve.model.matmul import forward_rows


def test_docstring_example():
    assert doctest.testmod(metadata_module).failed == 0


def test_whole_prompts():
    ids, md = prepare([Chunk([5, 6, 7], 0, [2]), Chunk([8, 9], 0, [0])], block_size=4, num_rows=forward_rows(5))
    assert ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]  # 5 tokens, run as forward_rows(5) = 8 rows
    assert md.query_start_loc.tolist() == [0, 3, 5] and md.seq_lens.tolist() == [3, 2]
    assert md.positions.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert md.slot_mapping.tolist() == [8, 9, 10, 0, 1]  # block 2's slots, then block 0's
    assert md.block_tables.tolist() == [[2], [0]]
    assert (md.query_lens, md.seq_lens_host, md.context_lens) == ((3, 2), (3, 2), (0, 0))
    assert (md.num_requests, md.num_tokens, md.block_size) == (2, 5, 4)
    assert md.last_rows.tolist() == [2, 4]


def test_a_chunk_after_cached_context():
    """Tokens 5..7 of a sequence whose first 5 are cached: positions from 5, slots in its second block."""
    ids, md = prepare([Chunk([10, 11, 12], 5, [3, 1])], block_size=4, num_rows=4)
    assert md.positions.tolist() == [5, 6, 7, 0]  # 3 real rows + 1 padding row
    assert md.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3]
    assert md.seq_lens.tolist() == [8] and md.context_lens == (5,) and md.query_lens == (3,)
    assert md.last_rows.tolist() == [2]


def test_decode_tokens():
    ids, md = prepare([Chunk([42], 9, [4, 0, 2]), Chunk([43], 0, [5])], block_size=4, num_rows=4)
    assert ids.tolist() == [42, 43, 0, 0]
    assert md.positions.tolist() == [9, 0, 0, 0]
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 5 * 4]
    assert md.seq_lens.tolist() == [10, 1] and md.context_lens == (9, 0)
    assert md.block_tables.tolist() == [[4, 0, 2], [5, 0, 0]]  # padded with block 0, never read past seq_lens


def test_with_no_row_count_there_is_no_padding():
    ids, md = prepare([Chunk([7], 3, [1])], block_size=4)
    assert ids.tolist() == [7] and md.positions.tolist() == [3] and md.slot_mapping.tolist() == [7]
    ids, md = prepare([Chunk([5, 6, 7], 0, [2]), Chunk([8, 9], 0, [0])], block_size=4)
    assert ids.tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="num_rows=4 is fewer than the step's 5 tokens"):
        prepare([Chunk([5, 6, 7], 0, [2]), Chunk([8, 9], 0, [0])], block_size=4, num_rows=4)


def test_a_mixed_step():
    """Decode tokens, a prompt and a chunk in one step: each request's rows, positions and slots its own."""
    chunks = [
        Chunk([1], 6, [7, 3]),  # decode: token 6 of a request with 6 cached
        Chunk([2, 3, 4, 5], 0, [0, 9, 8]),  # a whole prompt; its table holds one block more than it needs
        Chunk([6, 7], 3, [4, 5]),  # a chunk: tokens 3 and 4 after 3 cached, crossing into its second block
    ]
    N = forward_rows(7)
    ids, md = prepare(chunks, block_size=4, num_rows=N)
    assert ids.shape == (N,) and ids.tolist()[:7] == [1, 2, 3, 4, 5, 6, 7]
    assert md.query_start_loc.tolist() == [0, 1, 5, 7]
    assert md.seq_lens.tolist() == [7, 4, 5] and md.context_lens == (6, 0, 3)
    assert md.positions.tolist() == [6, 0, 1, 2, 3, 3, 4] + [0] * (N - 7)
    assert md.slot_mapping.tolist() == [3 * 4 + 2, 0, 1, 2, 3, 4 * 4 + 3, 5 * 4]
    assert md.block_tables.tolist() == [[7, 3], [0, 9], [4, 5]]  # width: the most blocks any request needs
    assert md.last_rows.tolist() == [0, 4, 6]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 13, 32])
def test_padding_rows_sit_at_position_0_with_no_slot(n):
    N = forward_rows(n)
    ids, md = prepare([Chunk(list(range(1, n + 1)), 0, list(range(n)))], block_size=1, num_rows=N)
    assert ids.shape == md.positions.shape == (N,)
    assert md.num_tokens == md.slot_mapping.numel() == n  # padding rows are never written
    assert ids[n:].tolist() == md.positions[n:].tolist() == [0] * (N - n)
    assert md.query_start_loc[-1].item() == n  # and belong to no request


def test_dtypes_are_what_the_kernels_take():
    _, md = prepare([Chunk([1, 2], 0, [0]), Chunk([3], 4, [1, 2])], block_size=4)
    for t in (md.query_start_loc, md.seq_lens, md.block_tables, md.slot_mapping, md.positions):
        assert t.dtype == torch.int64 and t.is_contiguous()


@pytest.mark.parametrize("chunks, match", [
    ([], "a step needs at least one request"),
    ([Chunk([1], 0, [0]), Chunk([], 2, [1])], "request 1: no tokens to compute in this step"),
    ([Chunk([1, 2, 3], 6, [0, 1])], "request 0: 9 tokens need 3 blocks of 4, its table has 2"),
    ([Chunk([1], 0, [])], "request 0: 1 tokens need 1 blocks of 4, its table has 0"),
    ([Chunk([1], -1, [0])], "request 0: num_computed=-1 must be >= 0"),
])
def test_bad_steps_are_refused(chunks, match):
    with pytest.raises(ValueError, match=match):
        prepare(chunks, block_size=4)
