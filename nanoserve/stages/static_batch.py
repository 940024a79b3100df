"""Day 28's stage: many sequences through one forward, the static batch (Days 27-29).

A decode step of one sequence streams every weight from memory to make one token. Batching
is the difference between using the hardware and paying for it: B rows share that one read
of the weights (Day 29 measures how far that holds on this machine).

A static batch is fixed when it starts and runs until its slowest row is done. Its prefill is
one step of every prompt laid end to end (`attention.prepare`: no padding, each prompt's
attention confined to its own tokens); each decode step appends one token to every row. Every
row has its own BlockTable in one shared pool, and each step goes through the same ModelRunner
as the engine's. The engine's scheduler (Days 30-35) replaces it; Day 29 and the benchmarks keep
it to measure against.

Batch invariance: a row's tokens do not depend on what else is in the batch. The products give
a row the same bits for any count of two or more rows (`model.matmul`), and attention computes
each request from its own keys only (`attention.backend`). A batch of one takes the one-row
road, so a solo run agrees with its row in a batch to fp32 rounding (the same tokens, except at
a genuine near-tie).

>>> greedy_generate_batch(model, [tok.encode("Hi"), tok.encode("The capital of France is")],
...                       max_new_tokens=[2, 4])                        # doctest: +SKIP
[[28, 2683], [7042, 30, 378, 2451]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..attention import Chunk
from ..config import ModelConfig
from ..engine.checks import check_prompts
from ..engine.model_runner import ModelRunner
from ..kv.blocks import BlockManager, BlockTable, check_block_size
from ..kv.storage import KVStorage
from ..model import Llama
from ..sampling import argmax_rows


class BatchedPagedKVCache:
    """B rows in one paged pool (a block manager and its storage), each with its own BlockTable, for the
    life of a static batch.

    Row i keeps index i, and its blocks, until `free()`, finished or not: a static batch has no
    way to hand a row's place to another request. That is the limit the scheduler removes."""

    def __init__(self, manager: BlockManager, storage: KVStorage, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.manager, self.storage = manager, storage
        self.tables: list[BlockTable] = [manager.new_table() for _ in range(batch_size)]

    @classmethod
    def for_batch(cls, cfg: ModelConfig, prompt_lens: Sequence[int], max_new_tokens: int,
                  block_size: int = 16, dtype: torch.dtype = torch.float32) -> BatchedPagedKVCache:
        """A pool just large enough for every row's prompt plus `max_new_tokens` (no prefix caching)."""
        check_block_size(block_size)
        blocks = max(1, sum(math.ceil((n + max_new_tokens) / block_size) for n in prompt_lens))
        manager = BlockManager(blocks, block_size, prefix_caching=False)
        return cls(manager, KVStorage(cfg, blocks, block_size, dtype), len(prompt_lens))

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def context_lens(self) -> list[int]:
        return [t.num_tokens for t in self.tables]

    def prefill_chunks(self, prompts: Sequence[Sequence[int]]) -> list[Chunk]:
        """Give every prompt token a slot (allocating blocks); the prefill step's requests."""
        if len(prompts) != self.batch_size:
            raise ValueError(f"{len(prompts)} prompts, the cache has {self.batch_size} rows")
        if any(t.num_tokens for t in self.tables):
            raise ValueError("prefill_chunks needs empty rows: a static batch is prefilled once")
        for table, p in zip(self.tables, prompts):
            self.manager.append_slots(table, list(p))  # fresh blocks: nothing shared, nothing to copy
        return [Chunk(t.token_ids, 0, t.blocks) for t in self.tables]

    def decode_chunks(self, tokens: Sequence[int]) -> list[Chunk]:
        """Append one token per row; the decode step's requests."""
        if len(tokens) != self.batch_size:
            raise ValueError(f"a decode step needs one token per row ({self.batch_size}), got {len(tokens)}")
        if any(t.num_tokens == 0 for t in self.tables):
            raise ValueError("decode_chunks before prefill_chunks: every row needs its prompt first")
        chunks = []
        for table, token in zip(self.tables, tokens):
            self.manager.append_slots(table, [token])
            chunks.append(Chunk([token], table.num_tokens - 1, table.blocks))
        return chunks

    def free(self) -> None:
        """Give every row's blocks back to the pool."""
        for t in self.tables:
            self.manager.free(t)


class StaticBatch:
    """One static batch: fixed when it starts, run until its slowest row is done (Day 28).

    `prefill()` and `step()` are the two calls greedy_generate_batch makes, and the two the
    Day-29 runner times. Row i collects the prefill's token and then one per step for its next
    `stop_steps[i]` steps; after that it keeps its slot, its blocks and its place in every
    forward, and collects nothing. Rows stop on a step budget, not on EOS: output length is
    what Day 29 varies.

    `compiled`: the ModelRunner's switch (None: the compiled kernels where they run, a model on blocks or tiles
    stepped by one compiled call where it can; True insists; False: torch's ops; "ops": the kernels under the
    Python forward). Either way a row's tokens do not depend on the rows beside it.
    """

    def __init__(self, model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                 block_size: int = 16, compiled: bool | str | None = None):
        if not isinstance(stop_steps, Sequence) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stop_steps):
            raise ValueError(f"stop_steps must be a list of ints >= 0 (decode steps per row), got {stop_steps!r}")
        check_prompts(prompts, model.cfg, max(stop_steps, default=0) + 1)  # every row runs the slowest's steps
        if len(stop_steps) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(stop_steps)} stop_steps: need one per prompt")
        self.stop_steps = list(stop_steps)
        self.model = model
        self.prompts = [list(p) for p in prompts]
        self.kv = BatchedPagedKVCache.for_batch(model.cfg, [len(p) for p in prompts], self.n_steps + 1, block_size,
                                                model.kv_dtype)
        self.runner = ModelRunner(model, self.kv.storage, compiled)
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

    @property
    def compiled(self) -> bool:
        """Whether the steps run the compiled kernels."""
        return self.runner.compiled

    def prefill(self) -> Tensor:
        """Every prompt in one step, its k/v into its blocks; logits (B, V) at each prompt's last token."""
        if self.steps_done != -1:
            raise RuntimeError("prefill() called twice: a static batch is prefilled once")
        return self._collect(self.runner.execute(self.kv.prefill_chunks(self.prompts)))

    def step(self) -> Tensor:
        """One batched decode step: every row, finished or not, feeds its newest token. Logits (B, V)."""
        if self.steps_done < 0:
            raise RuntimeError("step() before prefill()")
        if self.done:
            raise RuntimeError(f"the batch is done: all {self.n_steps} decode steps have run")
        return self._collect(self.runner.execute(self.kv.decode_chunks(self.last)))

    def _collect(self, logits: Tensor) -> Tensor:
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
                          compiled: bool | str | None = None) -> list[list[int]]:
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
    return StaticBatch(model, prompts, stop_steps, block_size, compiled).run()
