"""The course's one-sequence stages (Days 08-21): a Session's two calls, and the loop that makes them.

    prefill(prompt_ids) -> logits of the last prompt position
    decode(token_id)     -> logits after appending one token

`NoCacheSession` (Day 08) recomputes the whole sequence every step: simple, correct, and its cost per
token grows with length. `stages.contiguous.CachedSession` (Day 13) keeps a contiguous cache.
`PagedSession` (Days 17-21) keeps the sequence in a paged pool (a block manager for the bookkeeping,
the model runner's storage for the tensors) that several sessions may share, by `fork` too.

`stream_session` is the loop of Days 08-10 over any of them: prefill, then sample and decode one token
at a time, each token pushed through the same sampler and stop checker the engine uses. The engine
(`LLMEngine`) is where generation runs; these are the stages that led to it, kept because the course
builds them and the instruments compare against them, and tested to give the engine's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from ..attention import Chunk
from ..engine.checks import check_prompt
from ..engine.model_runner import ModelRunner
from ..engine.outputs import CompletionOutput, StepOutput
from ..kv.blocks import BlockManager
from ..kv.storage import KVStorage
from ..model import Llama
from ..sampling import INVALID, RowSampler, SamplingParams, sample
from ..stopping import StopChecker
from ..tokenizer import Tokenizer


class Session(Protocol):
    def prefill(self, ids: list[int]) -> Tensor: ...
    def decode(self, token: int) -> Tensor: ...


class NoCacheSession:
    """Every step runs the full forward over prompt + everything generated so far."""

    def __init__(self, model: Llama):
        self.model = model
        self.ids: list[int] = []

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> Tensor:
        self.ids = list(ids)
        return self.model(torch.tensor([self.ids]), last_only=True)[0]

    @torch.inference_mode()
    def decode(self, token: int) -> Tensor:
        self.ids.append(token)
        return self.model(torch.tensor([self.ids]), last_only=True)[0]


class PagedSession:
    """One sequence in a paged pool: `manager` keeps its block table, `runner` (and its storage) computes its
    steps. Several sessions can share one pool (and, by `fork`, blocks)."""

    def __init__(self, manager: BlockManager, runner: ModelRunner):
        if manager.block_size != runner.block_size or manager.num_blocks != runner.storage.num_blocks:
            raise ValueError("the block manager and the runner's storage describe different pools")
        self.manager, self.runner = manager, runner
        self.table = manager.new_table()
        self.last_logits: Tensor | None = None
        self.prompt_computed = 0  # prompt tokens the last prefill actually ran (the rest were prefix hits)

    @property
    def model(self) -> Llama:
        return self.runner.model

    def prefill(self, ids: list[int]) -> Tensor:
        """Logits (V,) after the prompt. A fork that already holds exactly `ids` returns its parent's."""
        if self.last_logits is not None and self.table.token_ids == list(ids):
            return self.last_logits
        self.free()
        self.manager.check_fits(len(ids))
        hit = self.manager.match_prefix(self.table, ids)
        self.prompt_computed = len(ids) - hit
        return self._forward(list(ids[hit:]))

    def decode(self, token: int) -> Tensor:
        """Append one token: its K/V goes into the next slot; returns the logits (V,) after it."""
        if self.table.num_tokens == 0:
            raise RuntimeError("decode() before prefill(): there is no sequence to extend")
        return self._forward([token])

    def extend(self, ids: list[int]) -> Tensor:
        """Append several tokens in one step; logits (n, V) after each of them. Nothing is committed to the
        prefix cache until `truncate` says how many of them stay (a speculative step's verification)."""
        if self.table.num_tokens == 0:
            raise RuntimeError("extend() before prefill(): there is no sequence to extend")
        start = self.table.num_tokens
        _, copies = self.manager.append_slots(self.table, ids)
        logits = self.runner.execute([Chunk(ids, start, self.table.blocks)], copies, [len(ids)])  # (n, V)
        self.last_logits = None
        return logits

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (drop rejected drafts, free blocks they alone held), then
        name the full blocks that remain."""
        self.manager.truncate(self.table, num_tokens)
        self.manager.commit(self.table)

    def _forward(self, new_ids: list[int]) -> Tensor:
        start = self.table.num_tokens
        _, copies = self.manager.append_slots(self.table, new_ids)  # slots for the new tokens (all or nothing)
        logits = self.runner.execute([Chunk(new_ids, start, self.table.blocks)], copies)[0]  # (V,)
        self.manager.commit(self.table)
        self.last_logits = logits
        return logits

    def fork(self) -> PagedSession:
        """A second session with this one's history and blocks (shared, copied on write)."""
        child = PagedSession(self.manager, self.runner)
        child.table = self.manager.fork(self.table)
        child.last_logits = self.last_logits
        return child

    def free(self) -> None:
        """Give the blocks back (cached full blocks stay findable until evicted)."""
        self.manager.free(self.table)
        self.last_logits = None


def paged_session(model: Llama, max_len: int, block_size: int = 16, prefix_caching: bool = True,
                  compiled: bool | str | None = None, attention: str | None = None) -> PagedSession:
    """A session on its own pool sized for `max_len` tokens: the paged twin of `cached_session`. `compiled`,
    `attention`: the ModelRunner's ("ops": the Python forward on the kernels, whose calls can be counted)."""
    num_blocks = -(-max_len // block_size)
    manager = BlockManager(num_blocks, block_size, prefix_caching)
    runner = ModelRunner(model, KVStorage(model.cfg, num_blocks, block_size, model.kv_dtype), compiled, attention)
    return PagedSession(manager, runner)


def stream_session(model: Llama, session: Session, prompt_ids: list[int], params: SamplingParams | None = None,
                   tokenizer: Tokenizer | None = None) -> Iterator[StepOutput]:
    """The loop of Days 08-10 on one session: a StepOutput per generated token; the last carries a finish_reason."""
    params = params or SamplingParams(temperature=0.0)
    cfg = model.cfg
    check_prompt(prompt_ids, cfg.max_position_embeddings, cfg.vocab_size)
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to see the text")
    stopper = StopChecker(params, cfg.eos_token_id, cfg.max_position_embeddings - len(prompt_ids), tokenizer)
    sampler = RowSampler(params)
    seen = list(prompt_ids)
    logits = session.prefill(list(prompt_ids))
    while True:
        token = sample(logits[None], [sampler], [seen])[0]
        if token == INVALID:
            raise ValueError("the logits could not be sampled (not finite, or no probability mass)")
        seen.append(token)
        text, reason = stopper.push(token)
        yield StepOutput("0", [token], text, reason, num_prompt_tokens=len(prompt_ids),
                         num_output_tokens=len(seen) - len(prompt_ids))
        if reason is not None:
            return
        logits = session.decode(token)


def run_session(model: Llama, session: Session, prompt_ids: list[int], params: SamplingParams | None = None,
                tokenizer: Tokenizer | None = None) -> CompletionOutput:
    """`stream_session` to the end: the completion's ids and text."""
    out = CompletionOutput(0, "", [])
    for step in stream_session(model, session, prompt_ids, params, tokenizer):
        out.add(step)
    return out


def greedy_session_ids(model: Llama, session: Session, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids on one session, EOS ignored: the form the equivalence tests compare across stages."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return run_session(model, session, prompt_ids, params).token_ids
