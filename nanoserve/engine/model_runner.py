"""The model runner: turns one step's requests into model inputs and runs the forward.

vLLM and nano-vllm call this part the ModelRunner. It owns the paged pool's tensors (`KVStorage`);
the caller (the engine's scheduler, or a course stage) owns the bookkeeping and has already given
every request's new tokens slots in the pool. The runner makes the block copies the bookkeeping
asked for, lays the requests end to end (`attention.prepare`), runs the model once over the flat
list of tokens with the paged attention backend, and returns the logits the caller wants: by
default each request's next-token logits, or the last few rows of a request (speculative
decoding's verification). It decides nothing about who runs: that is the caller's business.

`execute_model` is the engine's call, as in vLLM V1: the step's forward and then its sampling
(`SamplingBatch`, laid out by the engine from its requests), returning tokens and log-probabilities,
so that a step's logits, a row of vocab_size floats per token read, never leave the runner.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import AttentionMetadata, Chunk, PagedAttention, choose, prepare
from ..kernels import use_kernels
from ..kv.storage import KVStorage
from ..model import Llama
from ..model.compiled import BlockStep, applies
from ..model.matmul import forward_rows
from ..sampling import INVALID, RowSampler, argmax_rows, logprobs_of, sample
from .outputs import TokenLogprobs


@dataclass
class SamplingBatch:
    """How a step's tokens are chosen from its logits, laid out by the engine from its requests before the
    forward: a pick per sampled token (the logit row it reads, its sampler, what its penalties read, its grammar's
    mask) and the prompt rows to score. The runner applies it, so the logits stay where they were made."""

    rows: list[int] = field(default_factory=list)  # the logit row each pick reads
    samplers: list[RowSampler] = field(default_factory=list)
    seen: list[Sequence[int]] = field(default_factory=list)  # a pick's tokens so far (the repetition penalty)
    generated: list[Sequence[int]] = field(default_factory=list)  # ... its output alone (presence, frequency)
    masks: dict[int, Tensor | None] = field(default_factory=dict)  # pick -> allowed tokens; None: grammar failed
    logprobs: dict[int, int] = field(default_factory=dict)  # pick -> how many top log-probabilities it asks for
    scores: list[tuple[int, list[int], int]] = field(default_factory=list)  # (first row, prompt tokens, top k)

    def add(self, row: int, sampler: RowSampler, seen: Sequence[int], generated: Sequence[int],
            mask: Tensor | None = None, masked: bool = False, logprobs: int | None = None) -> None:
        """One pick: row `row`'s next token; `masked` with `mask` None marks a grammar that already failed."""
        if masked:
            self.masks[len(self.rows)] = mask
        if logprobs is not None:
            self.logprobs[len(self.rows)] = logprobs
        self.rows.append(row)
        self.samplers.append(sampler)
        self.seen.append(seen)
        self.generated.append(generated)


@dataclass
class RunnerOutput:
    """What a step chose: a token per pick (`INVALID` where its row could not be sampled or its grammar failed),
    the log-probabilities a pick asked for, and each scored prompt range's, row by row."""

    tokens: list[int]
    logprobs: dict[int, TokenLogprobs]
    prompt_logprobs: list[list[TokenLogprobs]]


class ModelRunner:
    """Runs steps of `model` on the pool `storage`. A step of two or more tokens gives each request the same
    bits whatever else is in it; a step of one token (one sequence's decode) takes the one-row road unless
    `batch_invariant`.

    `compiled`: the compiled kernels, the one switch: None where they can run (fp32, built), True insists, False
    runs torch's ops; "ops" runs them op by op under the Python forward (its calls can be counted, its logits
    compared), never the one-call step. Otherwise a model on GGUF blocks or on tiles runs each step as one compiled
    call where it can (`model.compiled`: the same logits, bit for bit, without the Python between the calls). The
    runner holds the answer (`self.compiled`) and passes it down every forward. `attention` picks the attention
    implementation by name ("reference", "torch", "compiled"; `attention.paged`), else the default.
    `batch_invariant`: a request gets the same bits alone as beside others (its seeded samples too): a step of one
    token runs as a step of several, unless its products give one row those bits already
    (`DecoderLM.one_row_same_bits`: the tiles, fp32 on x86 CPUs or bf16 on AVX512_BF16 ones, bf16's panels on other
    x86 CPUs, or the GGUF block kernels)."""

    def __init__(self, model: Llama, storage: KVStorage, compiled: bool | str | None = None,
                 attention: str | None = None, batch_invariant: bool = False):
        if compiled not in (None, True, False, "ops"):
            raise ValueError(f"compiled={compiled!r}: None, True, False or 'ops'")
        self.model, self.storage = model, storage
        self.batch_invariant = batch_invariant
        self.compiled = use_kernels(model.dtype, None if compiled == "ops" else compiled)
        # read once, not each step (it asks every matrix): a runner's weights are not rewritten under it
        self.one_row_same_bits = model.one_row_same_bits(self.compiled)
        self.attention = choose(self.compiled, attention)
        use_step = compiled != "ops" and self.attention == "compiled"  # (BlockStep.of: Llama's, Gemma's)
        self.block_step = BlockStep.of(model) if use_step else None
        self.last_prepare_s = 0.0  # host time laying out the last step's inputs (the engine reports it)
        self.last_sample_s = 0.0  # ... and choosing its tokens (`execute_model`)
        self.last_argmax: Tensor | None = None  # the last step's argmax of each row it returned, where it has one

    @property
    def block_size(self) -> int:
        return self.storage.block_size

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk], copies: Sequence[tuple[int, int]] = (),
                num_logits: Sequence[int] | None = None) -> Tensor:
        """Copy the blocks `copies` asks for (copy-on-write), then run one step. Logits (R, V) at each request's
        last new token, requests in order; with `num_logits`, logits at the last num_logits[r] tokens of
        request r (0: none), stacked in order (sum, V). `last_argmax` then holds each of those rows' argmax where
        the step found it beside them (the compiled step), else None. On a pool of several KV cache groups
        (`storage.groups`) each chunk's block_table is one table per group (`HybridTable.blocks`)."""
        t0 = time.perf_counter()
        self.last_argmax = None
        self.storage.copy_blocks(copies)
        n = sum(len(c.token_ids) for c in chunks)
        pad_one = self.batch_invariant and not self.one_row_same_bits
        num_rows = forward_rows(max(n, 2 if pad_one else 1))
        groups = None
        if self.storage.num_groups > 1:  # a block table per KV cache group: each group's slots and tables
            steps = [prepare([Chunk(c.token_ids, c.num_computed, c.block_table[g]) for c in chunks],
                             self.block_size, num_rows) for g in range(self.storage.num_groups)]
            (ids, md), groups = steps[0], [m for _, m in steps]
        else:
            ids, md = prepare(chunks, self.block_size, num_rows)
        rows = md.last_rows if num_logits is None else logit_rows(md, num_logits)
        self.last_prepare_s = time.perf_counter() - t0
        if self.block_step is not None and applies(md, self.storage.k.dtype == torch.bfloat16, self.model.cfg.head_dim):
            logits, self.last_argmax = self.block_step(ids, md, self.storage, rows, groups=groups)
            return logits
        backend = PagedAttention(self.storage, md, self.attention, groups)
        h = self.model.hidden_states(ids[None], md.positions[None], backend, compiled=self.compiled)[0]  # (N, C)
        h = h[rows]  # (R, C)
        if len(h) == 0:
            return h.new_zeros(0, self.model.cfg.vocab_size)
        if len(h) == 1 and len(ids) > 1:  # one row of a step of several: the head runs the batch's product
            return self.model.logits(F.pad(h, (0, 0, 0, 1)), self.compiled)[:1]  # kernel, as in any batch
        return self.model.logits(h, self.compiled)

    @torch.inference_mode()
    def execute_model(self, chunks: Sequence[Chunk], copies: Sequence[tuple[int, int]], num_logits: Sequence[int],
                      batch: SamplingBatch) -> RunnerOutput:
        """One step as the engine runs it: `execute`, then choose every pick's token in one sampler call, with
        the log-probabilities asked for, and score the prompt rows `batch.scores` names."""
        logits = self.execute(chunks, copies, num_logits)
        t0 = time.perf_counter()
        out = self.sample(logits, batch)
        self.last_sample_s = time.perf_counter() - t0
        return out

    def sample(self, logits: Tensor, batch: SamplingBatch) -> RunnerOutput:
        """`batch` applied to a step's logits (`execute_model`'s second half)."""
        prompt = [logprobs_of(logits[s:s + len(t)], t, [k] * len(t), self.compiled) for s, t, k in batch.scores]
        if not batch.rows:
            return RunnerOutput([], {}, prompt)
        every = batch.rows == list(range(len(logits)))
        rows, best = (logits, self.last_argmax) if every else (logits[batch.rows], None)
        masks = {i: m for i, m in batch.masks.items() if m is not None}
        tokens = sample(rows, batch.samplers, batch.seen, self.compiled, batch.generated, masks, best)
        for i, m in batch.masks.items():
            if m is None:  # the grammar failed before any token: the request fails, with the grammar's reason
                tokens[i] = INVALID
        wanted = [i for i in batch.logprobs if tokens[i] != INVALID]
        logprobs: dict[int, TokenLogprobs] = {}
        if wanted:
            asked = rows if len(wanted) == len(rows) else rows[wanted]  # no copy when all ask
            lps = logprobs_of(asked, [tokens[i] for i in wanted], [batch.logprobs[i] for i in wanted], self.compiled)
            logprobs = dict(zip(wanted, lps))
        return RunnerOutput(tokens, logprobs, prompt)

    @torch.inference_mode()
    def decode(self, chunks: Sequence[Chunk], copies: Sequence[tuple[int, int]], steps: int,
               stop_ids: Sequence[Collection[int]] = ()) -> Tensor:
        """Up to `steps` decode steps of the chunks' requests, each one token whose table already holds a slot for
        every step's token; each step's input is the argmax of the step before, and the steps end once every
        request has chosen one of its `stop_ids`. Returns the tokens (steps run, R), as that many `execute` calls,
        each given the last one's argmax, would choose them. On the compiled step it is one call: none of the
        host's work runs between its steps."""
        if any(len(c.token_ids) != 1 for c in chunks):
            raise ValueError("decode takes one token per request")
        t0 = time.perf_counter()
        self.storage.copy_blocks(copies)
        stops = [sorted(s) for s in stop_ids] if stop_ids else [[] for _ in chunks]
        if self.block_step is not None and self.storage.num_groups == 1 and not self.block_step.gemma:
            R, W, S = len(chunks), max(len(c.block_table) for c in chunks), max(map(len, stops))
            pad = lambda xs, n: [*xs, *[-1] * (n - len(xs))]  # noqa: E731
            flat = torch.frombuffer(array("q", [c.token_ids[0] for c in chunks] + [c.num_computed for c in chunks]
                                          + [b for c in chunks for b in pad(c.block_table, W)]
                                          + [i for s in stops for i in pad(s, S)]), dtype=torch.int64)
            ids, positions, tables, stop = flat.split([R, R, R * W, R * S])
            self.last_prepare_s = time.perf_counter() - t0
            return self.block_step.decode(ids, positions, tables.view(R, W), stop.view(R, S), self.storage, steps)
        out, ids, done = [], [c.token_ids[0] for c in chunks], [False] * len(chunks)
        for s in range(steps):
            logits = self.execute([Chunk([t], c.num_computed + s, c.block_table) for t, c in zip(ids, chunks)])
            best = self.last_argmax if self.last_argmax is not None else argmax_rows(logits, self.compiled)
            ids = best.tolist()
            out.append(best)
            done = [d or t in stop for d, t, stop in zip(done, ids, stops)]
            if all(done):
                break
        return torch.stack(out)


def logit_rows(md: AttentionMetadata, num_logits: Sequence[int]) -> Tensor:
    """The step's rows at which logits are read: the last num_logits[r] rows of each request r, in order."""
    if len(num_logits) != md.num_requests:
        raise ValueError(f"num_logits has {len(num_logits)} entries for {md.num_requests} requests")
    if all(m == 1 for m in num_logits):  # each request's last row, which prepare has laid out already
        return md.last_rows
    ends = itertools.accumulate(md.query_lens)
    return torch.tensor([e - m + i for e, m in zip(ends, num_logits) for i in range(m)], dtype=torch.long)
