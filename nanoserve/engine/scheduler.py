"""The scheduler: who runs in the next step, and how many of their tokens (Days 30-35).

Iteration-level scheduling (Orca's idea, vLLM's design): the batch is rebuilt every step. A
finished request leaves at once and a waiting one takes its place; there is no static batch to
wait out. One budget bounds a step, `max_num_batched_tokens`, shared by decode tokens and prompt
chunks, and at most `max_num_seqs` requests run at once.

Each step, in vLLM V1's order:
1. running requests first, oldest first: each gets what it has left to compute (one token for a
   decoding request, the rest of its prompt, or as much as the budget allows: a chunk). If the pool
   has no room for it, the newest running request is preempted (its blocks freed, to be recomputed
   later) until there is room, or the request itself is the newest and waits.
2. then waiting requests, first come first served, while budget, blocks and `max_num_seqs` allow.
   At admission the prefix cache is asked first: full blocks already computed for the same tokens
   are shared, not recomputed. A preempted request goes back to the head of the queue.

With a TPOT target (`SchedulerConfig.tpot_slo_ms`, Sarathi-Serve's idea) the budget shrinks while any
running request decodes: to the tokens a step can carry within the target by the engine's measured
step cost (`StepCost`), never below those decodes and `MIN_PREFILL_TOKENS` of prompt, so prompts still
move. Long prompts then arrive in smaller chunks and the decodes beside them keep their pace.

A running request that has speculative drafts (`Request.spec_token_ids`) gets them too, budget and
blocks permitting: 1 + k tokens, all verified in the one forward.

The scheduler holds no tensors: it plans with the block manager's counts, and says which tokens of
which request the step computes and which blocks the storage must copy first. After the forward the
engine hands back what was sampled, and `update_from_output` does the bookkeeping (vLLM V1's shape):
tokens computed, rejected drafts' blocks given back, full blocks named for prefix caching, a request's
other samples forked from its prompt, tokens appended, finished requests out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from ..kv.blocks import BlockManager
from ..kv.hybrid import HybridBlockManager
from ..sampling import INVALID
from .outputs import StepOutput
from .request import FinishReason, Request, RequestStatus
from .step_cost import StepCost

MIN_PREFILL_TOKENS = 16  # prompt tokens a step under a TPOT target still carries, however slow it has been


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, from its `start`-th token on: its own tokens, then `num_drafts`
    speculative ones. `completes`: it reaches the request's last token, so the step samples for it.
    `num_logits`: rows of logits the step needs, at the chunk's end: one after its last token and one after
    each draft, or every row of a prompt whose log-probabilities are asked for."""

    request: Request
    start: int
    token_ids: list[int]
    num_drafts: int = 0
    completes: bool = False
    num_logits: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        """Of the num_logits rows, the last ones the sampler chooses from (the rest score prompt tokens)."""
        return 1 + self.num_drafts if self.completes else 0

    @property
    def is_decode(self) -> bool:
        """One token (and its drafts) after everything else is computed: a decode step, in the old words."""
        return self.num_tokens - self.num_drafts == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks to compute (running requests first), the block copies the storage
    makes before the forward, and who was admitted and preempted. `num_steps` > 1: every chunk is one
    decode token, and the step runs that many forwards, each one's argmax the next one's input."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decoding requests: their last token and their drafts."""
        return sum(c.num_tokens for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(c.num_drafts for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


class Scheduler:
    """Waiting and running queues over one block manager."""

    def __init__(self, manager: BlockManager | HybridBlockManager, config: SchedulerConfig | None = None):
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at first admissions
        self.prefix_hit_tokens = 0  # of those, found
        self.just_finished: list[Request] = []  # sequences finished since the engine last looked
        self.step_cost = StepCost()  # fed by the engine after each step; read under a TPOT target

    def add(self, request: Request, step: int = 0) -> None:
        """Queue a request (the engine has checked it can ever be served)."""
        request.move(RequestStatus.WAITING, step)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def schedule(self, step: int = 0) -> SchedulerOutput:
        """Plan one step: running requests first (preempting the newest when blocks run out), then
        waiting ones FCFS. The chosen tokens already have their slots when this returns."""
        out = SchedulerOutput()
        budget = self.token_budget()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_to_compute, budget)
            drafts = min(len(req.spec_token_ids), budget - n) if n == req.num_tokens_to_compute else 0
            if drafts and self.manager.blocks_to_append(req.table, n + drafts) > self.manager.pool.num_free:
                drafts = 0  # no room to verify drafts: decode the one token, preempting no one for them
            while self.manager.blocks_to_append(req.table, n) > self.manager.pool.num_free:
                victim = self.running.pop()  # the newest running request makes room
                self._preempt(victim, step)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._append(req, n, out, drafts)
                budget -= n + drafts
                i += 1
                continue
            break  # req itself was the newest and is now waiting
        while self.waiting and budget > 0 and not out.preempted:
            req = self.waiting[0]
            if len(self.running) + 1 + len(req.forks) > self.config.max_num_seqs:
                break  # a request's samples all run together, once its prompt is in
            if not self._admit(req, budget, out, step):
                break
            budget -= out.chunks[-1].num_tokens
        if self.config.num_scheduler_steps > 1:
            self._look_ahead(out)
        return out

    def token_budget(self) -> int:
        """This step's tokens: max_num_batched_tokens, or under a TPOT target while a running request decodes, what
        the measured step cost says fits the target (at least the decodes and MIN_PREFILL_TOKENS of prompt)."""
        cap, target = self.config.max_num_batched_tokens, self.config.tpot_slo_ms
        if target is None:
            return cap
        decoding = sum(1 + len(r.spec_token_ids) for r in self.running if r.num_tokens_to_compute == 1)
        fits = self.step_cost.tokens_within(target / 1e3) if decoding else None
        if fits is None:  # no decode to protect, or no step measured yet
            return cap
        return min(cap, max(fits, decoding + MIN_PREFILL_TOKENS))

    def _look_ahead(self, out: SchedulerOutput) -> None:
        """Multi-step decoding (vLLM V0's `num_scheduler_steps`): when no one waits and every chunk is a decode
        token of a request that takes the argmax as it comes (no penalties, grammar or log-probabilities), the
        step runs up to num_scheduler_steps forwards in one call, and this gives each request slots for the
        tokens after its first. Never past a request's last token, nor into blocks the pool does not have;
        tokens after a stop are dropped by the bookkeeping, with the request's blocks."""
        plain = lambda c: (c.is_decode and c.completes and not c.num_drafts  # noqa: E731
                           and c.request.params.plain_greedy and c.request.params.logprobs is None)
        if self.waiting or not out.chunks or not all(map(plain, out.chunks)):
            return
        k = min(self.config.num_scheduler_steps,
                *(c.request.max_new_tokens - c.request.num_output_tokens for c in out.chunks))
        need = sum(self.manager.blocks_to_append(c.request.table, k - 1) for c in out.chunks)
        if k < 2 or need > self.manager.pool.num_free:
            return
        for c in out.chunks:  # placeholders: the bookkeeping names these slots' tokens once they are chosen
            out.copies.extend(self.manager.append_slots(c.request.table, [INVALID] * (k - 1))[1])
        out.num_steps = k

    def _admit(self, req: Request, budget: int, out: SchedulerOutput, step: int) -> bool:
        """Give the head of the queue its cached prefix and a first chunk, if blocks and budget allow."""
        table = self.manager.new_table()
        # a prompt whose log-probabilities are asked for is computed whole: cached blocks have no logits
        hit = 0 if req.collects_prompt_logprobs else self.manager.match_prefix(table, req.all_token_ids)
        left = req.num_tokens - hit
        n = min(left, budget)
        if (n < left and not self.config.chunked_prefill) or \
                self.manager.blocks_to_append(table, n) > self.manager.pool.num_free:
            self.manager.free(table)  # not now: the hit blocks go back, still cached
            return False
        self.waiting.popleft()
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit
            self.prefix_queried_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += hit
        req.table, req.num_computed_tokens = table, hit
        req.move(RequestStatus.RUNNING, step)
        self.running.append(req)
        out.admitted.append(req)
        self._append(req, n, out)
        return True

    def _append(self, req: Request, n: int, out: SchedulerOutput, drafts: int = 0) -> None:
        start = req.num_computed_tokens
        tokens = req.token_ids(start, start + n) + req.spec_token_ids[:drafts]
        _, copies = self.manager.append_slots(req.table, tokens)
        out.copies.extend(copies)
        completes = start + n == req.num_tokens
        scoring = req.collects_prompt_logprobs and start < req.num_prompt_tokens
        num_logits = len(tokens) if scoring else (1 + drafts if completes else 0)
        out.chunks.append(ScheduledChunk(req, start, tokens, drafts, completes, num_logits))

    def _preempt(self, req: Request, step: int) -> None:
        """Free the request's blocks and put it at the head of the queue, to be recomputed."""
        self.manager.free(req.table)
        req.table, req.num_computed_tokens, req.spec_token_ids = None, 0, []
        req.prompt_logprobs_partial = []  # recomputed from the start, scored again
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.move(RequestStatus.PREEMPTED, step)
        self.waiting.appendleft(req)

    def update_from_output(self, plan: SchedulerOutput, sampled: Mapping[Request, list[int]], now: float,
                           step: int = 0, logprobs: Mapping[Request, list] | None = None) -> list[StepOutput]:
        """The after-step bookkeeping, in plan order: each chunk's tokens are computed; a chunk with drafts
        keeps those its sampled tokens agree with and gives back the blocks of the rest; newly full blocks
        are named for prefix caching; a request whose prompt is now in forks its other samples; each
        sequence appends its sampled tokens (up to a stop) and ends if it is done. `sampled[seq]`: the
        tokens the step chose for it (verified drafts then the bonus token; `[INVALID]`: it failed), `logprobs[seq]`
        their log-probabilities where asked for."""
        logprobs = logprobs or {}
        outputs = []
        for c in plan.chunks:
            req = c.request
            req.num_computed_tokens += c.num_tokens
            tokens = sampled.get(req)
            if plan.num_steps > 1:  # the step's later forwards computed the tokens it chose before its last
                ran = len(tokens)  # fewer than planned where every request met a stop token early
                req.num_computed_tokens += ran - 1
                self.manager.truncate(req.table, req.num_computed_tokens)  # the slots of forwards not run
                req.table.token_ids[req.num_computed_tokens - ran + 1:] = tokens[:-1]
            if c.num_drafts:
                accepted = len(tokens) - 1 if tokens and tokens[0] != INVALID else 0
                req.num_computed_tokens -= c.num_drafts - accepted
                self.manager.truncate(req.table, req.num_computed_tokens)
                req.num_draft_tokens += c.num_drafts
                req.num_accepted_tokens += accepted
            req.spec_token_ids = []
            self.manager.commit(req.table)  # newly full blocks become findable by later prompts
            if not c.completes:
                continue
            seqs = [req]
            if req.forks:  # its prompt is in: the other samples start from a fork of its blocks
                for f in req.forks:
                    f.table, f.num_computed_tokens = self.manager.fork(req.table), req.num_computed_tokens
                    f.num_cached_tokens = req.num_cached_tokens
                    f.move(RequestStatus.RUNNING, step)
                    self.running.append(f)
                seqs += req.forks
                req.forks = []
            for seq in seqs:
                outputs.append(self._append_tokens(seq, sampled.get(seq, [INVALID]), now, step, logprobs.get(seq)))
        return outputs

    def _append_tokens(self, seq: Request, tokens: list[int], now: float, step: int,
                       logprobs: list | None = None) -> StepOutput:
        """Append a sequence's sampled tokens, stopping at the first that ends it; end it if it is done."""
        new, text = [], ""
        if tokens and tokens[0] == INVALID:
            seq.error = seq.error or ("the step's logits for this request could not be sampled (not finite, or "
                                      "no token allowed)")
            seq.finish_time = now
            self.finish(seq, FinishReason.ERROR, step)
            return seq.output(new, text)
        for t in tokens:
            if seq.matcher is not None and not seq.matcher.consume(t):
                seq.error = f"token {t} broke the output's {seq.matcher.kind} constraint: " \
                            f"{seq.matcher.error or 'the grammar does not allow it'}"
                seq.finish_time = now
                self.finish(seq, FinishReason.ERROR, step)
                return seq.output(new, text)
            text += seq.append_token(t, now)
            new.append(t)
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is not None:
            seq.finish_time = now
            self.finish(seq, step=step)
        return seq.output(new, text, logprobs[:len(new)] if logprobs is not None else None)

    def finish(self, req: Request, reason: FinishReason | None = None, step: int = 0) -> None:
        """Take a request out of the queues and give its blocks back (done, or aborted)."""
        if reason is not None:
            req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.table is not None:
            self.manager.free(req.table)
            req.table = None
        req.spec_token_ids = []
        req.move(RequestStatus.FINISHED, step)
        self.just_finished.append(req)
