"""The engine: requests in, tokens out, one scheduled step at a time (Days 30-35).

    engine = LLMEngine(model, tokenizer)
    rid = engine.add_request("What is 2+2?", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():        # this step's new tokens, per request
            ...
    engine.abort(rid)                     # frees its blocks at once

A step: the scheduler plans (`Scheduler.schedule`), the model runner computes every scheduled chunk
in one forward (whole prompts, chunks of prompts and decode tokens side by side), and each request
whose chunk reached its last token samples one: greedy rows by argmax, sampled rows with their own
seeded generator. The runner is batch-invariant, so a request's logits, and so its tokens, do not
depend on what shares its steps (up to how its prompt was chunked, a rounding-level difference).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..attention import Chunk
from ..kv.blocks import RequestTooLarge
from ..kv.paged import PagedKVCache
from ..model import Llama
from ..sampling import SamplingParams, argmax_rows
from ..tokenizer import Tokenizer
from .checks import check_prompt
from .model_runner import ModelRunner
from .request import FinishReason, Request
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

KV_CACHE_BYTES = 1 << 30
"""The pool's default size in bytes (vLLM sizes it from free GPU memory; here a fixed share of RAM)."""


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens and text, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None


@dataclass
class StepRecord:
    """One step, counted and timed: what the scheduler chose and where the time went."""

    step: int
    num_requests: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_admitted: int
    num_preempted: int
    schedule_s: float  # planning: queues, prefix lookups, block bookkeeping
    prepare_s: float  # laying out the step's inputs and metadata (inside the model runner)
    forward_s: float  # the model's forward
    sample_s: float  # sampling, stop checks, outputs
    scheduled: tuple[tuple[str, int, int], ...] = ()  # (request id, first token, tokens) per chunk

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s

    @property
    def overhead_s(self) -> float:
        """Host time outside the forward: what the scheduler and its bookkeeping cost this step."""
        return self.schedule_s + self.prepare_s + self.sample_s


class LLMEngine:
    """A model, a paged pool, a scheduler, and the requests in flight.

    `num_blocks` of `block_size` tokens each, by default what `KV_CACHE_BYTES` holds (at most enough
    for max_num_seqs full contexts). `batch_invariant` (default on): a request's bits do not depend
    on its neighbours, so a seeded request samples the same tokens in any company."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None = None, *, config: SchedulerConfig | None = None,
                 num_blocks: int | None = None, block_size: int = 16, prefix_caching: bool = True,
                 kernels: bool | None = None, batch_invariant: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.model, self.tokenizer, self.clock = model, tokenizer, clock
        self.config = config or SchedulerConfig()
        cfg = model.cfg
        if num_blocks is None:
            per_block = 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * model.dtype.itemsize
            full = self.config.max_num_seqs * -(-cfg.max_position_embeddings // block_size)
            num_blocks = max(1, min(full, KV_CACHE_BYTES // per_block))
        self.cache = PagedKVCache(cfg, num_blocks, block_size, dtype=model.dtype, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.cache, self.config)
        self.runner = ModelRunner(model, self.cache, kernels, batch_invariant=batch_invariant)
        self.requests: dict[str, Request] = {}
        self.history: list[StepRecord] = []
        self._ids = itertools.count()
        self.steps = 0

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Refuse, with the reason, a request no step could ever serve: an empty or too long prompt, one the
        pool cannot hold even alone, bad parameters. Returns how many tokens it may generate."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: the engine takes one sample per request; "
                             f"add the prompt n times (with seeds seed, seed+1, ...)")
        cfg = self.model.cfg
        check_prompt(prompt, cfg.max_position_embeddings, cfg.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer to see the text")
        max_new = min(params.max_tokens, cfg.max_position_embeddings - len(prompt))
        need = len(prompt) + max_new
        if self.cache.blocks_needed(need) > self.cache.num_blocks:
            raise RequestTooLarge(
                f"a request of {len(prompt)} prompt tokens and up to {max_new} new ones needs "
                f"{self.cache.blocks_needed(need)} blocks of {self.cache.block_size} tokens; the pool has "
                f"{self.cache.num_blocks} in all")
        if not self.config.chunked_prefill and need > self.config.max_num_batched_tokens:
            raise RequestTooLarge(
                f"without chunked prefill a request is computed in one step: {len(prompt)} prompt tokens and up "
                f"to {max_new} new ones (recomputed whole after a preemption) exceed max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}")
        return max_new

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text, with a tokenizer, or token ids); returns its id. What no step could ever
        serve is refused at once (`check_request`); the requests already queued are untouched."""
        params = params if params is not None else SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs the engine's tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError("prompt is empty: at least one token is needed to produce logits")
            prompt = self.tokenizer.encode(prompt)
        max_new = self.check_request(prompt, params)
        prompt = [int(i) for i in prompt]
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.requests and not self.requests[rid].finished:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        cfg = self.model.cfg
        req = Request(rid, prompt, params, max_new, cfg.eos_token_id, self.tokenizer, arrival_time=self.clock())
        self.requests[rid] = req
        self.scheduler.add(req, self.steps)
        return rid

    def abort(self, request_id: str) -> None:
        """End a request now: its blocks go back to the pool at once. Aborting a finished one does nothing."""
        req = self.requests.get(str(request_id))
        if req is None:
            raise KeyError(f"no request {request_id!r} in the engine")
        if not req.finished:
            req.finish_time = self.clock()
            self.scheduler.finish(req, FinishReason.ABORT, self.steps)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report what changed."""
        t0 = self.clock()
        plan = self.scheduler.schedule(self.steps)
        self.cache.storage.copy_blocks(plan.copies)
        t1 = self.clock()
        logits = self._execute(plan) if plan.chunks else None  # (R, V): each chunk's last token
        t2 = self.clock()
        outputs = self._sample(plan, logits, t2) if plan.chunks else []
        t3 = self.clock()
        prep = self.runner.last_prepare_s if plan.chunks else 0.0
        self.history.append(StepRecord(self.steps, len(plan.chunks), plan.num_decode_tokens, plan.num_prefill_tokens,
                                       len(plan.admitted), len(plan.preempted), t1 - t0, prep, t2 - t1 - prep, t3 - t2,
                                       tuple((c.request.request_id, c.start, c.num_tokens) for c in plan.chunks)))
        self.steps += 1
        return outputs

    def _execute(self, plan: SchedulerOutput) -> torch.Tensor:
        chunks = [Chunk(c.token_ids, c.start, c.request.table.blocks) for c in plan.chunks]
        return self.runner.execute(chunks)

    def _sample(self, plan: SchedulerOutput, logits: torch.Tensor, now: float) -> list[RequestOutput]:
        """Advance every scheduled request; sample for those whose chunk reached their last token."""
        done = [i for i, c in enumerate(plan.chunks) if c.completes]
        greedy = [i for i in done if plan.chunks[i].request.params.greedy
                  and plan.chunks[i].request.params.repetition_penalty == 1.0]
        picks = dict(zip(greedy, argmax_rows(logits[greedy]).tolist())) if greedy else {}
        outputs = []
        for i, c in enumerate(plan.chunks):
            req = c.request
            req.num_computed_tokens += c.num_tokens
            self.cache.commit(req.table)  # newly full blocks become findable by later prompts
            if not c.completes:
                continue
            token = picks[i] if i in picks else req.sampler(logits[i], req.all_token_ids)
            text = req.append_token(token, now)
            if req.finish_reason is not None:
                req.finish_time = now
                self.scheduler.finish(req, step=self.steps)
            outputs.append(RequestOutput(req.request_id, [token], text, req.finished,
                                         req.finish_reason.value if req.finish_reason else None))
        return outputs

    def check_idle(self) -> None:
        """Assert that no request holds a block once all are done: the pool is whole (tests call it)."""
        assert not self.has_unfinished_requests(), "requests are still in flight"
        self.cache.pool.check()
        assert all(r == 0 for r in self.cache.pool.refcount), "a block is still referenced"
        assert self.cache.pool.num_free == self.cache.num_blocks, "a block leaked"
