"""Prompt-lookup speculative decoding: the same tokens as plain greedy decoding, fewer forwards.

- `propose` against a brute-force lookup (hypothesis), and by hand;
- the loop on a scripted model whose every next token is known (logits one-hot): its tokens, text and
  stop equal `stream_generate`'s exactly, whatever the drafts, stops and max_tokens; the accounting adds up;
- `BlockManager.truncate`: rejected drafts' blocks go back, committed tokens cannot be cut;
- the real model: copy-heavy and chat prompts give plain greedy's tokens (up to the first genuine near-tie
  of plain's own logits), the copy prompt speculates, no block leaks and the cache holds the right K/V.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prompts import near_tie_horizon

from nanoserve.config import ModelConfig
from nanoserve.engine.session import PagedSession, paged_session
from nanoserve.generate import generate, stream_generate
from nanoserve.kv.blocks import BlockManager
from nanoserve.kv.prefix import chain_hashes
from nanoserve.sampling import SamplingParams
from nanoserve.spec import (
    Proposal,
    SpecConfig,
    SpecStats,
    expected_tokens_per_forward,
    propose,
    speculative_generate,
    stream_speculative,
)

# ---- the lookup ------------------------------------------------------------------------------------------


def brute_force(tokens, k, max_ngram, min_ngram):
    """The definition, written the slow way: n from max_ngram down, the latest earlier place first."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return Proposal(n, start, tokens[start + n:start + n + k])
    return None


def test_propose_by_hand():
    assert propose([1, 2, 3, 9, 1, 2], k=3, max_ngram=3, min_ngram=1) == Proposal(2, 0, [3, 9, 1])
    assert propose([1, 2, 3, 4], k=3, max_ngram=3, min_ngram=1) is None  # nothing repeats
    assert propose([5, 1, 7, 1], k=2, max_ngram=3, min_ngram=1) == Proposal(1, 1, [7, 1])
    assert propose([5, 1, 7, 1], k=2, max_ngram=3, min_ngram=2) is None  # a unigram is too short
    assert propose([4, 4, 4], k=5, max_ngram=2, min_ngram=1) == Proposal(2, 0, [4])  # overlapping, draft cut short
    # the latest earlier occurrence wins among equally long ones
    assert propose([1, 2, 8, 1, 2, 9, 1, 2], k=1, max_ngram=2, min_ngram=2) == Proposal(2, 3, [9])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_propose_equals_brute_force(tokens, k, max_ngram, extra):
    min_ngram = max(1, max_ngram - extra)
    got = propose(tokens, k, max_ngram, min_ngram)
    assert got == brute_force(tokens, k, max_ngram, min_ngram)
    if got is not None:
        assert 1 <= len(got.tokens) <= k and min_ngram <= got.ngram <= max_ngram
        assert tokens[got.start:got.start + got.ngram] == tokens[-got.ngram:]


def test_expected_tokens_per_forward():
    assert expected_tokens_per_forward(0.0, 5) == 1.0  # every draft wrong: the model's own token only
    assert expected_tokens_per_forward(1.0, 5) == 6.0  # every draft right, plus the bonus
    assert expected_tokens_per_forward(0.5, 2) == 1.75
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_forward(1.5, 2)


def test_bad_config_and_sampled_params_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpecConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig(num_speculative_tokens=0)
    model = SimpleNamespace(cfg=ModelConfig.tiny())
    with pytest.raises(ValueError, match="greedy only"):
        next(stream_speculative(model, [1, 2, 3], SamplingParams(temperature=0.7)))


# ---- rolling the cache back -----------------------------------------------------------------------------


def test_truncate_frees_the_rejected_drafts_blocks():
    m = BlockManager(num_blocks=6, block_size=4)
    t = m.new_table()
    m.append_slots(t, list(range(6)))
    m.commit(t)  # block 0 is named
    m.append_slots(t, [7, 8, 9, 10, 11])  # 11 tokens: 3 blocks
    assert len(t.blocks) == 3 and m.pool.num_free == 3
    m.truncate(t, 7)
    assert t.token_ids == [0, 1, 2, 3, 4, 5, 7] and len(t.blocks) == 2 and m.pool.num_free == 4
    m.pool.check()
    with pytest.raises(ValueError, match="committed"):
        m.truncate(t, 3)  # block 0 is named in the prefix cache: its tokens cannot change
    with pytest.raises(ValueError, match="held"):
        m.truncate(t, 8)
    m.free(t)
    assert m.pool.num_free == 6
    m.pool.check()


# ---- the loop on a scripted model -----------------------------------------------------------------------

V = 32


class ScriptedSession:
    """A 'model' whose next token is rule(sequence so far), as one-hot logits; it keeps a block table's
    worth of bookkeeping (the token list) so rollbacks can be checked. Plain and speculative decoding must
    then agree exactly."""

    def __init__(self, rule):
        self.rule, self.ids, self.freed = rule, [], False

    def _logits(self, seq):
        return torch.nn.functional.one_hot(torch.tensor(self.rule(seq)), V).float()

    def prefill(self, ids):
        self.ids = list(ids)
        return self._logits(self.ids)

    def decode(self, token):
        self.ids.append(token)
        return self._logits(self.ids)

    def extend(self, ids):
        rows = []
        for t in ids:
            self.ids.append(t)
            rows.append(self._logits(self.ids))
        return torch.stack(rows)

    def truncate(self, n):
        assert n <= len(self.ids)
        del self.ids[n:]

    def free(self):
        self.freed = True


def copy_rule(period: int, twist: int):
    """Repeat the sequence with a period, except at positions divisible by `twist` (a draft will miss)."""
    def rule(seq):
        nxt = seq[-period] if len(seq) >= period else 1
        return (nxt + 1) % V if len(seq) % twist == 0 else nxt
    return rule


@settings(max_examples=120, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=12), period=st.integers(1, 6),
       twist=st.integers(2, 9), max_tokens=st.integers(1, 30), eos=st.sampled_from([None, 0, 5]),
       stop_id=st.sampled_from([None, 3]), k=st.integers(1, 6), lookup=st.sampled_from([(1, 1), (3, 1), (3, 2)]))
def test_scripted_model_gives_plain_greedys_tokens_and_stop(prompt, period, twist, max_tokens, eos, stop_id, k,
                                                           lookup):
    cfg = ModelConfig.tiny()
    cfg = SimpleNamespace(**{**vars(cfg), "vocab_size": V, "eos_token_id": [] if eos is None else [eos]})
    model = SimpleNamespace(cfg=cfg)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[] if stop_id is None else [stop_id])
    rule = copy_rule(period, twist)
    plain = list(stream_generate(model, prompt, params, session=ScriptedSession(rule)))
    session, stats = ScriptedSession(rule), SpecStats()
    config = SpecConfig(k, lookup[0], lookup[1])
    spec = list(stream_speculative(model, prompt, params, config=config, session=session, stats=stats))
    assert [(s.token_id, s.finish_reason) for s in spec] == [(s.token_id, s.finish_reason) for s in plain]
    assert session.freed
    # accounting: every token after the first came from a forward; the last forward may be cut by a stop
    produced = sum(len(s.tokens) for s in stats.steps)
    assert produced >= len(spec) - 1 and produced - max((len(s.tokens) for s in stats.steps), default=1) < len(spec)
    assert 0 <= stats.accepted <= stats.proposed
    for s in stats.steps:
        assert len(s.tokens) == s.accepted + 1 and (s.proposal is not None or s.accepted == 0)
        if s.proposal:
            assert s.tokens[:s.accepted] == s.proposal.tokens[:s.accepted] and len(s.proposal.tokens) <= k
    # the cache holds prompt + every yielded token but the last (whose K/V a next step would write),
    # or more only when a stop cut the last forward short
    assert session.ids[:len(prompt) + len(spec) - 1] == prompt + [s.token_id for s in spec[:-1]]


def test_a_perfectly_predictable_sequence_takes_few_forwards():
    cfg = SimpleNamespace(**{**vars(ModelConfig.tiny()), "vocab_size": V, "eos_token_id": []})
    model = SimpleNamespace(cfg=cfg)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4]
    stats = SpecStats()
    out = list(stream_speculative(model, prompt, SamplingParams(temperature=0, max_tokens=25),
                                  config=SpecConfig(4, 3, 1), session=ScriptedSession(copy_rule(4, 10**9)),
                                  stats=stats))
    assert [s.token_id for s in out] == [1, 2, 3, 4] * 6 + [1]
    assert stats.acceptance_rate == 1.0 and stats.forwards == 5 and stats.tokens_per_forward == 24 / 5


# ---- the real model ---------------------------------------------------------------------------------------

PARAGRAPH = (
    "The lighthouse on the northern cape was built in 1858 from granit quarried on the island itself. "
    "For ninety years a keeper climbed its one hundred and twelve steps every evening to light the lamp, "
    "wind the clockwork that turned the lens, and write the wether in a log that still survives."
)
REAL_PROMPTS = {
    "copy": "Repeat the following paragraph, correcting its spelling mistakes:\n\n" + PARAGRAPH,
    "summary": "Summarize this paragraph in two sentences:\n\n" + PARAGRAPH,
    "chat_sleep": "Give me three tips for sleeping better.",
    "chat_sky": "Why is the sky blue?",
}
MAX_NEW = 48


class Recording(PagedSession):
    """A paged session that keeps the logits it returned (plain greedy's, to find its near-ties)."""

    def __init__(self, model, cache):
        super().__init__(model, cache)
        self.logits = []

    def prefill(self, ids):
        out = super().prefill(ids)
        self.logits.append(out)
        return out

    def decode(self, token):
        out = super().decode(token)
        self.logits.append(out)
        return out


@pytest.fixture(scope="module")
def plain(model, tok):
    """Plain greedy per prompt on generate's own road: (ids, tokens, per-step logits)."""
    out = {}
    for name, text in REAL_PROMPTS.items():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        session = Recording(model, paged_session(model, len(ids) + MAX_NEW).cache)
        toks = generate(model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW), session=session).token_ids
        out[name] = (ids, toks, session.logits)
    return out


@pytest.mark.parametrize("name", REAL_PROMPTS)
def test_speculative_tokens_equal_plain_greedy(model, plain, name):
    ids, ref, ref_logits = plain[name]
    got, stats = speculative_generate(model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    h = near_tie_horizon(ref_logits)
    assert got.token_ids[:h] == ref[:h]
    if h == len(ref):
        assert got.token_ids == ref
    assert h >= min(32, len(ref))  # the comparison is never vacuous
    if name == "copy":  # text that copies its prompt is where the drafts land
        assert stats.acceptance_rate > 0.5 and stats.tokens_per_forward > 2
    if name == "summary":
        assert stats.accepted > 0


def test_same_pool_no_leak_and_the_cache_holds_the_sequences_kv(model, plain):
    ids, ref, _ = plain["summary"]  # a prompt whose drafts are sometimes rejected
    snapshot = {}

    class Watched(PagedSession):
        def free(self):  # look at the cache just before the request gives its blocks back
            if self.table.num_tokens and not snapshot:
                t = self.table
                snapshot.update(tokens=list(t.token_ids), hashes=list(t.hashes), k=torch.cat(
                    [self.cache.gather(layer, t.blocks, t.num_tokens)[0] for layer in range(model.cfg.n_layers)]))
            super().free()

    session = Watched(model, paged_session(model, len(ids) + MAX_NEW).cache)
    pool = session.cache.pool
    got, stats = speculative_generate(model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                                      session=session)
    assert stats.accepted > 0 and stats.proposed > stats.accepted  # drafts were rejected, so rolled back
    assert pool.num_free == pool.num_blocks  # no block leaked
    pool.check()
    # the table held prompt + output (the last token's K/V is written only by a next step; accepted drafts
    # past a stop may follow), and its full blocks were named by the right hashes ...
    n = len(ids) + len(got.token_ids)
    assert snapshot["tokens"][:n - 1] == (ids + got.token_ids)[:n - 1]
    assert snapshot["hashes"] == chain_hashes(snapshot["tokens"], session.cache.block_size)
    # ... and their keys, as a fresh prefill of that sequence computes them
    fresh = paged_session(model, len(snapshot["tokens"]) + 1)
    fresh.prefill(snapshot["tokens"])
    t = fresh.table
    k = torch.cat([fresh.cache.gather(layer, t.blocks, t.num_tokens)[0] for layer in range(model.cfg.n_layers)])
    torch.testing.assert_close(snapshot["k"], k, atol=1e-4, rtol=1e-4)


def test_stop_strings_and_eos_end_where_generate_ends(model, tok, plain):
    ids, _, _ = plain["copy"]
    for params in (SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=["lamp"]),  # inside an accepted run
                   SamplingParams(temperature=0, max_tokens=23)):
        want = generate(model, ids, params, tok)
        got, _ = speculative_generate(model, ids, params, tok)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
