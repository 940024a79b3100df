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

The scheduler holds no tensors: it plans with the block manager's counts, and says which tokens of
which request the step computes and which blocks the storage must copy first. The engine runs the
step and reports back (`finish`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..kv.blocks import BlockManager
from .request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerConfig:
    """The field's knobs (vLLM's names)."""

    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens one step computes: decode tokens and prompt chunks together
    chunked_prefill: bool = True  # a prompt larger than the budget left is split across steps

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SchedulerConfig.{name}={v!r} must be an int >= 1")


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, from its `start`-th token on."""

    request: Request
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.start + self.num_tokens]

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last token, so its logits are sampled."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One token after everything else is computed: a decode step, in the old words."""
        return self.num_tokens == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks to compute (running requests first), the block copies the storage
    makes before the forward, and who was admitted and preempted."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.is_decode for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


class Scheduler:
    """Waiting and running queues over one block manager."""

    def __init__(self, manager: BlockManager, config: SchedulerConfig | None = None):
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at first admissions
        self.prefix_hit_tokens = 0  # of those, found

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
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_to_compute, budget)
            while self.manager.blocks_to_append(req.table, n) > self.manager.pool.num_free:
                victim = self.running.pop()  # the newest running request makes room
                self._preempt(victim, step)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._append(req, n, out)
                budget -= n
                i += 1
                continue
            break  # req itself was the newest and is now waiting
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if not self._admit(req, budget, out, step):
                break
            budget -= out.chunks[-1].num_tokens
        return out

    def _admit(self, req: Request, budget: int, out: SchedulerOutput, step: int) -> bool:
        """Give the head of the queue its cached prefix and a first chunk, if blocks and budget allow."""
        table = self.manager.new_table()
        hit = self.manager.match_prefix(table, req.all_token_ids)
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

    def _append(self, req: Request, n: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        _, copies = self.manager.append_slots(req.table, req.all_token_ids[start:start + n])
        out.copies.extend(copies)
        out.chunks.append(ScheduledChunk(req, start, n))

    def _preempt(self, req: Request, step: int) -> None:
        """Free the request's blocks and put it at the head of the queue, to be recomputed."""
        self.manager.free(req.table)
        req.table, req.num_computed_tokens = None, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.move(RequestStatus.PREEMPTED, step)
        self.waiting.appendleft(req)

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
        req.move(RequestStatus.FINISHED, step)
