"""The engine: requests in, tokens out, one scheduled step at a time (Days 30-36, 40).

    engine = LLMEngine(model, tokenizer)                   # or LLMEngine(model, tokenizer, max_num_seqs=8, ...)
    rid = engine.add_request("What is 2+2?", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():        # this step's new tokens, per sequence
            ...
    engine.abort(rid)                     # frees its blocks at once

This is the package's one generation loop: `generate`, the CLI, `LLM` and the server all run their
requests through it, one request or many. A step: the scheduler plans (`Scheduler.schedule`), the
model runner computes every scheduled chunk in one forward (whole prompts, chunks of prompts, decode
tokens and speculative drafts side by side) and, in one sampler call, chooses a token for every
sequence whose chunk reached its last token (`ModelRunner.execute_model`, as vLLM V1's: the engine
lays out how each is chosen, `SamplingBatch`, and never holds the logits), and the scheduler does the
bookkeeping (`Scheduler.update_from_output`). With speculative decoding on, each greedy sequence then drafts its
next tokens by prompt lookup (`engine.spec`), to be verified in the next step. With `num_scheduler_steps`
= k > 1, a step in which every running sequence decodes greedily and no one waits runs up to k forwards,
each fed the last one's argmax, in one call (`ModelRunner.decode`): the host's work once per k tokens.

The runner is batch-invariant, so a sequence's logits, and so its tokens, do not depend on what
shares its steps (up to how its prompt was chunked, a rounding-level difference).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..attention import Chunk
from ..config import EngineConfig
from ..kv.blocks import BlockManager, RequestTooLarge
from ..kv.groups import kv_cache_groups, single_group
from ..kv.hybrid import HybridBlockManager
from ..kv.storage import KVStorage
from ..model import Llama
from ..sampling import INVALID, SEED_BITS, SamplingParams
from ..structured import GrammarCompiler, GrammarError, words
from ..tokenizer import Tokenizer
from .checks import check_prompt
from .model_runner import ModelRunner, RunnerOutput, SamplingBatch
from .outputs import StepOutput
from .request import FinishReason, Request
from .scheduler import Scheduler, SchedulerOutput
from .spec import NgramIndex
from .threads import ThreadPolicy


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed of a request seeded `seed`: seed + index, wrapped into 64 bits so that every seed a
    request may give (up to 2**64 - 1) stays one for all its samples: sample_seed(2**64 - 1, 1) == 0."""
    return None if seed is None else (seed + index) % (1 << SEED_BITS)


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
    sample_s: float  # sampling, bookkeeping, outputs, drafting
    scheduled: tuple[tuple[str, int, int], ...] = ()  # (sequence id, first token, tokens) per chunk
    num_draft_tokens: int = 0  # speculative drafts verified this step
    num_accepted_tokens: int = 0  # ... and accepted
    num_steps: int = 1  # forwards run (num_scheduler_steps: several decode forwards in one call)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s

    @property
    def overhead_s(self) -> float:
        """Host time outside the forward: what the scheduler and its bookkeeping cost this step."""
        return self.schedule_s + self.prepare_s + self.sample_s


class LLMEngine:
    """A model, a paged pool (the scheduler's block manager, the runner's storage), a scheduler, and the
    requests in flight. `config` (an EngineConfig), or vLLM's flat keywords for it (`max_num_seqs=8`,
    `num_blocks=64`, `speculative_config={...}`; see `EngineConfig.from_kwargs`). A model with sliding layers gets a
    block table per KV cache group (`kv.hybrid`): its windows give their blocks back while a request runs."""

    def __init__(self, model: Llama, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter, **options: object):
        if config is not None and options:
            raise TypeError(f"give an EngineConfig or keywords for one, not both ({sorted(options)})")
        self.config = config = config if config is not None else EngineConfig.from_kwargs(**options)
        self.model, self.tokenizer, self.clock = model, tokenizer, clock
        cfg, cache = model.cfg, config.cache
        # a block table per KV cache group where sliding layers can give back what their window left behind
        groups = single_group(cfg) if cache.disable_hybrid_kv_cache_manager else kv_cache_groups(cfg)
        num_blocks = cache.blocks_for(cfg, model.kv_dtype.itemsize, config.scheduler.max_num_seqs, len(groups))
        self.manager: BlockManager | HybridBlockManager = BlockManager(
            num_blocks, cache.block_size, cache.prefix_caching) if len(groups) == 1 else \
            HybridBlockManager(groups, num_blocks, cache.block_size, cache.prefix_caching)
        self.runner = ModelRunner(model, KVStorage(cfg, num_blocks, cache.block_size, model.kv_dtype, groups=groups),
                                  config.compiled, batch_invariant=config.batch_invariant)
        self.scheduler = Scheduler(self.manager, config.scheduler)
        self.threads: ThreadPolicy | None = None  # "auto": steps run on the cores other programs leave free
        if config.threads == "auto":
            self.threads = ThreadPolicy()
        elif config.threads is not None:
            torch.set_num_threads(config.threads)
        self.grammars: GrammarCompiler | None = None  # made when a request first asks for structured outputs
        self.requests: dict[str, Request] = {}  # sequence id -> its state: the unfinished, and the last finished
        self.history: deque[StepRecord] = deque(maxlen=config.history_kept)
        self._finished: deque[str] = deque()
        self._ids = itertools.count()
        self.steps = 0

    # ---- requests in ---------------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], params: SamplingParams, field: str = "structured_outputs") -> int:
        """Refuse, with the reason, a request no step could ever serve: an empty or too long prompt, one the
        pool cannot hold even alone, bad parameters, a grammar no output satisfies (GrammarError naming `field`).
        Returns how many tokens it may generate."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        cfg, sched = self.model.cfg, self.config.scheduler
        check_prompt(prompt, cfg.max_position_embeddings, cfg.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer to see the text")
        bad = [i for i in params.stop_token_ids if i >= cfg.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids={bad[:5]}: outside the vocabulary [0, {cfg.vocab_size})")
        if params.structured_outputs is not None:  # compile (and keep) the grammar, take its first step and token
            self._matcher(params, field).check_start()
        if params.n > sched.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n}: the samples of a request run together, and at most "
                             f"max_num_seqs={sched.max_num_seqs} run at once")
        max_new = min(params.max_tokens, cfg.max_position_embeddings - len(prompt))
        need = len(prompt) + max_new
        held = self.manager.max_blocks_held(need, sched.max_num_batched_tokens)
        if held > self.manager.num_blocks:
            raise RequestTooLarge(
                f"a request of {len(prompt)} prompt tokens and up to {max_new} new ones needs "
                f"{held} blocks of {self.manager.block_size} tokens; the pool has "
                f"{self.manager.num_blocks} in all")
        if not sched.chunked_prefill and need > sched.max_num_batched_tokens:
            raise RequestTooLarge(
                f"without chunked prefill a request is computed in one step: {len(prompt)} prompt tokens and up "
                f"to {max_new} new ones (recomputed whole after a preemption) exceed max_num_batched_tokens="
                f"{sched.max_num_batched_tokens}")
        return max_new

    def _matcher(self, params: SamplingParams, field: str = "structured_outputs"):
        """A fresh grammar matcher for a request's structured outputs."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the engine's tokenizer to match tokens to the grammar")
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.model.cfg.eos_token_id)
        return self.grammars.matcher(params.structured_outputs, field)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text, with a tokenizer, or token ids); returns its id. What no step could ever
        serve is refused at once (`check_request`); the requests already queued are untouched. With
        params.n > 1 the request is n sequences, sample i seeded (seed + i) mod 2**64 (a seed near the top of
        its range wraps, as torch wraps a negative one), computing the prompt once."""
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
        if any(not r.finished for r in self.sequences(rid)):
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        eos, now = self.model.cfg.eos_token_id, self.clock()
        seqs = []
        for i in range(params.n):
            p = params if params.n == 1 else replace(params, seed=sample_seed(params.seed, i))
            seqs.append(Request(rid, list(prompt), p, max_new, eos, self.tokenizer, arrival_time=now, index=i,
                                seq_id=rid if params.n == 1 else f"{rid}/{i}",
                                matcher=self._matcher(p) if p.structured_outputs is not None else None))
        for seq in seqs:
            self.requests[seq.seq_id] = seq
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0], self.steps)
        return rid

    def sequences(self, request_id: str) -> list[Request]:
        """The request's sequences the engine holds: one, or its n samples."""
        one = self.requests.get(request_id)
        if one is not None and one.request_id == request_id:
            return [one]
        n = self.config.scheduler.max_num_seqs  # a request has at most this many samples
        return [r for i in range(n) if (r := self.requests.get(f"{request_id}/{i}")) is not None]

    def sequence(self, request_id: str, index: int = 0) -> Request:
        """Sample `index` of a request (KeyError if the engine no longer holds it)."""
        one = self.requests.get(request_id)
        return one if one is not None and index == 0 else self.requests[f"{request_id}/{index}"]

    def abort(self, request_id: str) -> None:
        """End a request (all its samples) now: its blocks go back to the pool at once. Aborting a finished
        one does nothing."""
        seqs = self.sequences(str(request_id))
        if not seqs:
            raise KeyError(f"no request {request_id!r} in the engine")
        for seq in seqs:
            if not seq.finished:
                seq.finish_time = self.clock()
                self.scheduler.finish(seq, FinishReason.ABORT, self.steps)
        self._retire()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's `reset_prefix_cache` does: a benchmark that replays the same
        prompts at another rate then measures them as new ones. Only when no request holds blocks (False, nothing
        done, otherwise)."""
        return self.manager.reset_prefix_cache()

    @property
    def num_unfinished_requests(self) -> int:
        """Sequences waiting or running (a request's waiting samples included)."""
        s = self.scheduler
        return sum(1 + len(r.forks) for r in s.waiting) + len(s.running)

    # ---- the step ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule; the runner's forward and sampling; the bookkeeping; drafts. Reports what changed, per sequence."""
        if self.threads is not None:
            self.threads.adjust()
        t0 = self.clock()
        plan = self.scheduler.schedule(self.steps)
        t1 = self.clock()
        outputs, t2, prep, samp, accepted, forwards = [], t1, 0.0, 0.0, 0, 1
        if plan.chunks:
            chunks = [Chunk(c.token_ids, c.start, c.request.table.blocks) for c in plan.chunks]
            if plan.num_steps > 1:  # greedy decodes only: each forward's argmax is the next one's input
                stops = [c.request.stopper.stop_ids for c in plan.chunks]
                tokens = self.runner.decode(chunks, plan.copies, plan.num_steps, stops).T.tolist()
                forwards = len(tokens[0])  # fewer than planned where every request met a stop token
                t2, prep = self.clock(), self.runner.last_prepare_s
                sampled, logprobs = {c.request: t for c, t in zip(plan.chunks, tokens)}, {}
            else:
                tb = self.clock()
                batch, owners, scored = self._sampling_batch(plan)  # grammars' masks filled while laying it out
                tb = self.clock() - tb
                out = self.runner.execute_model(chunks, plan.copies, [c.num_logits for c in plan.chunks], batch)
                t2, prep, samp = self.clock(), self.runner.last_prepare_s, self.runner.last_sample_s + tb
                sampled, logprobs = self._take(plan, out, owners, scored)
            accepted = sum(len(sampled[c.request]) - 1 for c in plan.chunks if c.num_drafts and c.request in sampled)
            outputs = self.scheduler.update_from_output(plan, sampled, t2, self.steps, logprobs)
            self._retire()
            if self.config.speculative is not None:
                self._draft()
        t3 = self.clock()
        if plan.chunks and plan.num_steps == 1:  # the scheduler's measure of what a step of so many tokens costs
            self.scheduler.step_cost.observe(plan.num_tokens, t3 - t0)
        self.history.append(StepRecord(
            self.steps, len(plan.chunks), plan.num_decode_tokens, plan.num_tokens - plan.num_decode_tokens,
            len(plan.admitted), len(plan.preempted), t1 - t0, prep, t2 - t1 - prep - samp, t3 - t2 + samp,
            tuple((c.request.seq_id, c.start, c.num_tokens) for c in plan.chunks), plan.num_draft_tokens,
            accepted, forwards))
        self.steps += 1
        return outputs

    def _sampling_batch(self, plan: SchedulerOutput) -> tuple[SamplingBatch, list[Request], list]:
        """How the runner chooses this step's tokens: a pick per sampled token (a request's waiting samples read
        its prompt's row), k + 1 for a sequence with k drafts, each constrained one with its grammar's mask, and
        the prompt rows asked to be scored. Returns it with each pick's sequence and each score's request."""
        batch, owners, scored = SamplingBatch(), [], []  # scored: (chunk, whether it has rows to score)
        at = 0
        for c in plan.chunks:
            prompt_rows = c.num_logits - c.num_sampled  # the chunk's prompt rows: each scores the token after it
            n = min(prompt_rows, c.request.num_prompt_tokens - 1 - c.start) if prompt_rows else 0
            if n > 0:
                targets = c.request.prompt_token_ids[c.start + 1:c.start + 1 + n]
                batch.scores.append((at, targets, c.request.params.prompt_logprobs))
            if prompt_rows:
                scored.append((c, n > 0))
            at += prompt_rows
            if not c.completes:
                continue
            for seq in [c.request, *c.request.forks]:
                for i in range(c.num_sampled):
                    constrained = seq.matcher is not None
                    batch.add(at + i, seq.sampler, seq.all_token_ids if seq.params.repetition_penalty != 1.0 else (),
                              seq.output_token_ids, self._mask(seq) if constrained else None, constrained,
                              seq.params.logprobs)
                    owners.append(seq)
            at += c.num_sampled
        return batch, owners, scored

    def _take(self, plan: SchedulerOutput, out: RunnerOutput, owners: list[Request], scored: list
              ) -> tuple[dict[Request, list[int]], dict[Request, list]]:
        """The runner's choices, per sequence: its tokens (the drafts its argmax agreed with, then its own next
        token) and, where asked for, their log-probabilities; scored prompt rows go to their requests."""
        scores = iter(out.prompt_logprobs)
        for c, has_rows in scored:
            if has_rows:
                c.request.prompt_logprobs_partial += next(scores)
            self._prompt_scored(c)
        chosen: dict[Request, list[int]] = {}
        logprobs: dict[Request, list] = {}
        for i, (seq, t) in enumerate(zip(owners, out.tokens)):
            chosen.setdefault(seq, []).append(t)
            if i in out.logprobs:
                logprobs.setdefault(seq, []).append(out.logprobs[i])
        self._accept_drafts(plan, chosen)
        return chosen, logprobs

    def _accept_drafts(self, plan: SchedulerOutput, chosen: dict[Request, list[int]]) -> None:
        """A draft stands while the model's own choice after the tokens before it agrees with it; the first
        disagreement is replaced by that choice, and what follows is dropped."""
        for c in plan.chunks:
            if c.num_drafts and c.request in chosen:
                got = chosen[c.request]
                n = 0
                while n < c.num_drafts and got[n] == c.token_ids[-c.num_drafts + n] and got[n] != INVALID:
                    n += 1
                chosen[c.request] = got[:n + 1]

    def _mask(self, seq: Request) -> torch.Tensor | None:
        """The tokens a constrained sequence may take next, as a bitmask; None if its grammar failed."""
        mask = torch.empty(words(self.model.cfg.vocab_size), dtype=torch.int32)
        try:
            seq.matcher.fill(mask)
        except GrammarError as e:
            seq.error = str(e)
            return None
        return mask

    @staticmethod
    def _prompt_scored(c) -> None:
        """Once a request's whole prompt has been scored, its log-probabilities are whole (its forks' too)."""
        req = c.request
        if c.start + len(c.token_ids) >= req.num_prompt_tokens:
            req.prompt_logprobs = [None, *req.prompt_logprobs_partial]
            req.prompt_logprobs_partial = []
            for f in req.forks:
                f.prompt_logprobs = req.prompt_logprobs

    def _draft(self) -> None:
        """Each running greedy sequence that is decoding proposes its next tokens by prompt lookup."""
        spec, cfg = self.config.speculative, self.model.cfg
        for req in self.scheduler.running:
            if not req.params.plain_greedy or req.num_tokens_to_compute != 1 or req.forks:
                continue
            if req.ngrams is None:
                req.ngrams = NgramIndex(spec.prompt_lookup_max, spec.prompt_lookup_min)
            req.ngrams.extend(req.token_ids(len(req.ngrams.tokens)))
            k = min(spec.num_speculative_tokens, req.max_new_tokens - req.num_output_tokens - 1,
                    cfg.max_position_embeddings - req.num_tokens)
            proposal = req.ngrams.propose(k)
            req.spec_token_ids = proposal.tokens if proposal is not None else []

    def _retire(self) -> None:
        """Keep the last `finished_kept` finished sequences for reading; forget older ones."""
        self._finished.extend(r.seq_id for r in self.scheduler.just_finished)
        self.scheduler.just_finished.clear()
        while len(self._finished) > self.config.finished_kept:
            old = self.requests.get(self._finished.popleft())
            if old is not None and old.finished:
                del self.requests[old.seq_id]

    def check_idle(self) -> None:
        """Assert that no request holds a block once all are done: the pool is whole (tests call it)."""
        assert not self.has_unfinished_requests(), "requests are still in flight"
        pool = self.manager.pool
        pool.check()
        assert all(r == 0 for r in pool.refcount), "a block is still referenced"
        assert pool.num_free == pool.num_blocks, "a block leaked"
