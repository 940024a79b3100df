"""Choosing the next token from logits (Day 09).

`SamplingParams` has vLLM's names. Each filter reshapes the distribution the way
the field means it: a grammar's mask (structured outputs: forbidden tokens at -inf),
repetition penalty (CTRL / transformers: positive logits of generated and prompt
tokens divided by the penalty, negative ones multiplied), presence and frequency
penalties (OpenAI's: minus presence for a token generated at all, minus frequency per
time), temperature, top-k (keep the k most likely), top-p (keep the smallest set whose
mass reaches p), min-p (drop tokens below min_p x the top probability). Temperature 0
(or below `GREEDY_BELOW`) is the greedy path: argmax, no randomness, no generator touched.

`sample` chooses for every row of a step at once: greedy and sampled rows, each with
its own parameters and its own seeded generator (`RowSampler`), so a sequence's tokens
do not depend on the rows beside it. `filtered_probs` is one row's distribution, the
same arithmetic, for the notebooks' sliders and the statistical test. `logprobs_of` is
what a request asking for log-probabilities gets: the log-softmax of the step's logits
as the model produced them, before any of the above.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import kernels
from .structured import StructuredOutputsParams, apply_bitmask_

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy: logits / 1e-300 would be inf, and the step's probabilities NaN."""

SEED_BITS = 64
MAX_LOGPROBS = 20
"""The most log-probabilities a request may ask for per token (vLLM's default max_logprobs)."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError naming the field."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # the sampled token's log-probability and this many of the likeliest
    prompt_logprobs: int | None = None  # the same for every prompt token (after the first)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # noqa: E731 (numpy's too)
        whole = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool)  # noqa: E731
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        checks = [  # each condition is evaluated only if the ones before it held: a type first, then a range
            ("temperature", lambda: real(t) and t >= 0, "must be a number >= 0 (0 means greedy)"),
            ("top_k", lambda: whole(k) and (k == -1 or k >= 0), "must be an int >= 0, or -1 for off"),
            ("top_p", lambda: real(p) and 0.0 < p <= 1.0, "must be a number in (0, 1]"),
            ("min_p", lambda: real(m) and 0.0 <= m <= 1.0, "must be a number in [0, 1]"),
            ("repetition_penalty", lambda: real(r) and 0.01 <= r <= 10, "must be a number in [0.01, 10] (1 means off)"),
            ("presence_penalty", lambda: real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be a number in [-2, 2]"),
            ("frequency_penalty", lambda: real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be a number in [-2, 2]"),
            ("seed", lambda: self.seed is None or (whole(self.seed) and -(1 << 63) <= self.seed < (1 << SEED_BITS)),
             "must be an int that fits in 64 bits, or None"),
            ("max_tokens", lambda: whole(self.max_tokens) and self.max_tokens >= 1, "must be an int >= 1"),
            ("n", lambda: whole(self.n) and self.n >= 1, "must be an int >= 1"),
            ("stop", lambda: all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", lambda: all(whole(i) and i >= 0 for i in self.stop_token_ids),
             "must be token ids (ints >= 0)"),
            ("logprobs", lambda: self.logprobs is None or (whole(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"must be an int in [0, {MAX_LOGPROBS}], or None"),
            ("prompt_logprobs", lambda: self.prompt_logprobs is None
             or (whole(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"must be an int in [0, {MAX_LOGPROBS}], or None"),
            ("structured_outputs", lambda: self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "must be StructuredOutputsParams"),
        ]
        for name, ok, why in checks:
            if not ok():
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or so small that dividing by it would overflow every logit (as vLLM)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the logits as they come: nothing reshapes them first (a grammar's mask included)."""
        return self.greedy and not self.penalized and self.structured_outputs is None


ARGMAX_CHUNK = 1024


def argmax_rows(logits: Tensor, compiled: bool | None = None) -> Tensor:
    """logits (B, V) -> (B,) each row's argmax, the first index of its largest value, as argmax gives.

    torch's argmax keeps an index beside every comparison and is slow for it; its max alone (amax)
    is vectorised and several times faster. So: the max of each chunk of ARGMAX_CHUNK logits, the first chunk
    holding the row's max, then argmax within that chunk only. Exact: no arithmetic, only
    comparisons, and the first maximal chunk holds the first maximal index (a NaN, which argmax
    counts as largest, propagates through amax the same way).
    """
    B, V = logits.shape
    if kernels.resolve(compiled) and kernels.fits(logits) and V > 0:  # the same answer, in one pass of comparisons
        return kernels.argmax_rows(logits)
    if V % ARGMAX_CHUNK or V < 4 * ARGMAX_CHUNK:
        return logits.argmax(-1)
    chunks = logits.view(B, V // ARGMAX_CHUNK, ARGMAX_CHUNK)  # splitting a dim: a view, whatever the strides
    first = chunks.amax(-1).argmax(-1)  # (B,) the first chunk holding each row's max
    within = chunks[torch.arange(B), first].argmax(-1)
    return first * ARGMAX_CHUNK + within


def apply_repetition_penalty(logits: Tensor, seen: Sequence[int], penalty: float) -> Tensor:
    """logits (V,): positive logits of seen ids are divided by `penalty`, negative ones multiplied (a copy)."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    return _penalize(logits.clone(), seen, penalty)


def _penalize(row: Tensor, seen: Sequence[int], penalty: float) -> Tensor:
    """`apply_repetition_penalty` in place on row (V,)."""
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=row.device)
    vals = row[idx]
    row[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return row


def _penalize_all(row: Tensor, params: SamplingParams, seen: Sequence[int], generated: Sequence[int]) -> None:
    """Every penalty a row asks for, in place on its logits (V,): repetition over the prompt and the output
    (`seen`), presence and frequency over the output alone (`generated`), as OpenAI defines them."""
    if params.repetition_penalty != 1.0 and len(seen):
        _penalize(row, seen, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        ids, counts = torch.tensor(list(generated), dtype=torch.long).unique(return_counts=True)
        row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)


def _shape(x: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Sampled rows' logits x (R, V), penalties already applied, -> their unnormalised probabilities (R, V):
    temperature, top-k, softmax, top-p, min-p, each row with its own parameters."""
    R, V = x.shape
    x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype)[:, None]
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    if min(ks) < V:  # each row's k-th largest logit, from one topk of the largest k asked for
        kth = torch.topk(x, max(ks), dim=-1).values.gather(1, torch.tensor(ks)[:, None] - 1)  # (R, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        limit = torch.tensor([params[i].top_p for i in top_p], dtype=torch.float64)[:, None]  # 5e-324 is no 0
        probs[top_p] = nucleus(probs[top_p], limit)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype)[:, None]
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs


NUCLEUS_HEADS = (64, 1024)
"""How much of a row `nucleus` sorts before it sorts the whole row (a nucleus is mostly a few dozen tokens)."""


def nucleus(probs: Tensor, limit: Tensor) -> Tensor:
    """Top-p: probs (r, V) with each token zeroed where the tokens ahead of it in descending order hold `limit`
    (r, 1) of the mass. Sorting all V tokens is the sampler's slowest part, so the largest few come first: once
    the last of them is cut, every later token is (its mass-before is no smaller), and a row sorted that far
    has its answer, bit for bit the full sort's. Only the rows it does not settle are sorted further."""
    out, todo, V = torch.zeros_like(probs), torch.arange(len(probs)), probs.shape[1]
    for m in (*(h for h in NUCLEUS_HEADS if h < V), V):
        rows = probs if len(todo) == len(probs) else probs[todo]
        head, order = rows.topk(m, dim=-1) if m < V else rows.sort(dim=-1, descending=True)
        cut = (head.cumsum(-1) - head).double() >= limit[todo]  # mass of the tokens ahead reaches the limit
        done = cut[:, -1] | (m == V)
        flat = (todo[done, None] * V + order[done]).view(-1)  # the kept head's places in `out`
        out.view(-1)[flat] = head[done].masked_fill(cut[done], 0.0).view(-1)
        todo = todo[~done]
        if not len(todo):
            break
    return out


def filtered_probs(logits: Tensor, params: SamplingParams, seen: Sequence[int] = (),
                   generated: Sequence[int] = ()) -> Tensor:
    """The distribution one sampled token is drawn from: logits (V,) -> probabilities (V,), by the very
    arithmetic `sample` runs. With a greedy temperature it is one-hot on the (penalised) argmax."""
    x = logits.float().clone()
    _penalize_all(x, params, seen, generated)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.shape[-1]).float()
    probs = _shape(x[None], [params])[0]
    return probs / probs.sum()


class RowSampler:
    """One sequence's sampling state: its parameters and its own seeded generator, so its tokens do not
    depend on what else runs (run to run, or in a batch)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed % (1 << SEED_BITS))
            else:
                self.generator.seed()

    def uniform(self) -> float:
        """The next number in [0, 1) of this sequence's own stream."""
        assert self.generator is not None
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


INVALID = -1
"""`sample`'s token for a row whose distribution is not a distribution (NaN or no mass): its request fails."""


def sample(logits: Tensor, rows: Sequence[RowSampler], seen: Sequence[Sequence[int]] | None = None,
           compiled: bool | None = None, generated: Sequence[Sequence[int]] | None = None,
           masks: dict[int, Tensor] | None = None, argmax: Tensor | None = None) -> list[int]:
    """Choose the next token of every row of `logits` (R, V) in one call: plain greedy rows by argmax
    together, the others (a grammar's mask, penalties, temperature, top-k/p, min-p) as one (r, V) batch,
    each sampled row drawn from its own generator by the inverse of its distribution's CDF.
    `seen[i]`: row i's tokens so far (the repetition penalty reads them), `generated[i]` its output alone
    (presence and frequency), `masks[i]`: row i's allowed tokens as a bitmask (`structured`), `argmax`: each
    row's argmax where the step found it already (the compiled step's, `argmax_rows`'s answer). A row that
    cannot be sampled (NaN logits, nothing allowed) gets `INVALID`, alone: the others go on."""
    R = logits.shape[0]
    if len(rows) != R:
        raise ValueError(f"{len(rows)} samplers for {R} rows of logits")
    masks = masks or {}
    free = lambda i: rows[i].params.plain_greedy and i not in masks  # noqa: E731
    plain = [i for i in range(R) if free(i)]
    if len(plain) == R:
        return (argmax_rows(logits, compiled) if argmax is None else argmax).tolist()
    out = [INVALID] * R
    if plain:
        for i, t in zip(plain, (argmax_rows(logits[plain], compiled) if argmax is None else argmax[plain]).tolist()):
            out[i] = t
    rest = [i for i in range(R) if not free(i)]
    x = logits.float() if len(rest) == R else logits[rest].float()  # (r, V); masks and penalties write in a copy
    if x is logits and (masks or any(rows[i].params.penalized for i in rest)):
        x = x.clone()
    if masks:  # every masked row in one pass (a row without a mask allows every token)
        everything = torch.full_like(next(iter(masks.values())), -1)
        apply_bitmask_(x, torch.stack([masks.get(i, everything) for i in rest]), compiled)
    for j, i in enumerate(rest):
        if rows[i].params.penalized:
            _penalize_all(x[j], rows[i].params, seen[i] if seen else (), generated[i] if generated else ())
    ok = torch.isfinite(x.amax(-1))  # (r,): some token is allowed and nothing is NaN
    greedy = [j for j, i in enumerate(rest) if rows[i].params.greedy]
    if greedy:
        for j, t in zip(greedy, argmax_rows(x[greedy], compiled).tolist()):
            out[rest[j]] = t if ok[j] else INVALID
    drawn = [j for j, i in enumerate(rest) if not rows[i].params.greedy]
    if drawn:
        probs = _shape(x if len(drawn) == len(x) else x[drawn], [rows[rest[j]].params for j in drawn])  # (d, V)
        cdf = probs.cumsum(-1, dtype=torch.float64)  # (d, V): float64, so the last tokens' mass is not lost
        total = cdf[:, -1]
        good = torch.isfinite(total) & (total > 0)
        u = torch.tensor([rows[rest[j]].uniform() for j in drawn], dtype=torch.float64)
        picks = torch.searchsorted(cdf, (u * total)[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
        for j, t, g in zip(drawn, picks.tolist(), good.tolist()):
            out[rest[j]] = t if g else INVALID
    return out


def logprobs_of(logits: Tensor, tokens: Sequence[int], top: Sequence[int],
                compiled: bool | None = None) -> list[dict[int, tuple[float, int]]]:
    """Row i's log-softmax (of the logits as the model produced them) at tokens[i], and at its top[i] likeliest
    tokens: {token: (logprob, rank)}, rank 1 the likeliest (ties share the better rank), the chosen token first.
    The log-softmax is logit - logsumexp, taken only where it is read. A token's rank counts the logits above
    it. Where `compiled` (None: where built) one kernel call reads each row for all of it; torch's ops
    instead compare across the vocabulary only the rows whose token is not among the top ones read (a greedy
    token always is)."""
    x = logits.float()
    ids = torch.tensor(list(tokens), dtype=torch.long).clamp(min=0)
    k = min(max(max(top, default=0), 1), x.shape[-1])
    if kernels.resolve(compiled) and kernels.fits(x) and x.dim() == 2 and x.shape[-1] > 0:
        lse, chosen, ranks, values, indices = kernels.logprob_rows(x, ids, k)  # each row read three times
        lse, chosen = lse[:, None], chosen[:, None]
    else:
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (R, 1)
        chosen = x.gather(1, ids[:, None])  # (R, 1)
        values, indices = x.topk(k, dim=-1)
        ranks = (values > chosen).sum(-1) + 1
        outside = (~(chosen[:, 0] >= values[:, -1])).nonzero()[:, 0]  # rows not shown in their top-k (or NaN)
        if outside.numel():
            ranks[outside] = (x[outside] > chosen[outside]).sum(-1) + 1
    mine, ranks = (chosen - lse)[:, 0].tolist(), ranks.tolist()  # to Python once, not row by row
    shown, indices = (values - lse).tolist(), indices.tolist()
    out = []
    for i, t in enumerate(tokens):
        entry = {int(t): (mine[i], ranks[i])}
        for r, (v, tok) in enumerate(zip(shown[i][:top[i]], indices[i][:top[i]])):
            entry.setdefault(tok, (v, r + 1))
        out.append(entry)
    return out
