"""Prompt-lookup speculative decoding in the engine: the same tokens as plain greedy decoding, fewer steps.

- `propose` against a brute-force lookup (hypothesis), by hand, and `NgramIndex` against `propose`;
- the engine on a scripted model whose every next token is a rule of the sequence it reads back from its
  own paged "cache": several requests, drafts, stops and max_tokens, and its tokens equal plain decoding's
  exactly (a draft left in the cache after its rejection would change them); the accounting adds up;
- `BlockManager.truncate`: rejected drafts' blocks go back, committed tokens cannot be cut;
- the real model: copy-heavy and chat prompts give plain greedy's tokens (up to the first genuine near-tie
  of plain's own logits), the copy prompt speculates, no block leaks and the cache holds the right K/V.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prompts import near_tie_horizon

from nanoserve.config import ModelConfig, SpeculativeConfig
from nanoserve.engine import LLMEngine, ModelRunner
from nanoserve.engine.spec import NgramIndex, Proposal, expected_tokens_per_forward, propose
from nanoserve.generate import generate
from nanoserve.kv.blocks import BlockManager
from nanoserve.kv.prefix import chain_hashes
from nanoserve.loader import load
from nanoserve.model import Llama
from nanoserve.sampling import SamplingParams
from nanoserve.stages import PagedSession, paged_session, run_session

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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 3), st.integers(1, 39))
def test_the_index_proposes_what_propose_scans_for(tokens, k, max_ngram, extra, cut):
    """Extended a piece at a time, as a request's tokens arrive, the index finds propose's proposal at every length."""
    min_ngram = max(1, max_ngram - extra)
    index = NgramIndex(max_ngram, min_ngram)
    for piece in (tokens[:cut], tokens[cut:]):
        index.extend(piece)
        if index.tokens:
            assert index.propose(k) == propose(index.tokens, k, max_ngram, min_ngram)


def test_expected_tokens_per_forward():
    assert expected_tokens_per_forward(0.0, 5) == 1.0  # every draft wrong: the model's own token only
    assert expected_tokens_per_forward(1.0, 5) == 6.0  # every draft right, plus the bonus
    assert expected_tokens_per_forward(0.5, 2) == 1.75
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_forward(1.5, 2)


def test_bad_config_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method='eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.of({"num_spec_tokens": 3})
    assert SpeculativeConfig.of({"num_speculative_tokens": 3}).num_speculative_tokens == 3


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


# ---- the engine on a scripted model -----------------------------------------------------------------------

V = 32


class ScriptedRunner:
    """Stands in for the model runner: the next token after position p is rule(tokens at 0..p), as one-hot
    logits, where the tokens are read back from its own slots (written by each step, as K/V would be). A
    rejected draft left in a block the engine reuses would be read back, and change the tokens."""

    compiled, last_prepare_s, last_sample_s, last_argmax = False, 0.0, 0.0, None

    def __init__(self, rule, block_size):
        self.rule, self.bs, self.slots = rule, block_size, {}

    def execute(self, chunks, copies=(), num_logits=None):
        for src, dst in copies:
            for i in range(self.bs):
                if src * self.bs + i in self.slots:
                    self.slots[dst * self.bs + i] = self.slots[src * self.bs + i]
        rows = []
        for c, m in zip(chunks, num_logits or [1] * len(chunks)):
            slot = lambda p, c=c: c.block_table[p // self.bs] * self.bs + p % self.bs  # noqa: E731
            for i, t in enumerate(c.token_ids):
                self.slots[slot(c.num_computed + i)] = t
            end = c.num_computed + len(c.token_ids)
            for p in range(end - m, end):
                seq = [self.slots[slot(q)] for q in range(p + 1)]
                rows.append(torch.nn.functional.one_hot(torch.tensor(self.rule(seq)), V).float())
        return torch.stack(rows) if rows else torch.zeros(0, V)

    def execute_model(self, chunks, copies, num_logits, batch):
        return ModelRunner.sample(self, self.execute(chunks, copies, num_logits), batch)  # the runner's own sampler


def copy_rule(period: int, twist: int):
    """Repeat the sequence with a period, except at positions divisible by `twist` (a draft will miss)."""
    def rule(seq):
        nxt = seq[-period] if len(seq) >= period else 1
        return (nxt + 1) % V if len(seq) % twist == 0 else nxt
    return rule


def run_scripted(rule, prompts, params, spec, block_size=4, budget=64, eos=None):
    """Each prompt through one engine whose runner is the script: each request's tokens and finish reason."""
    cfg = ModelConfig.tiny(vocab_size=V, eos_token_id=[] if eos is None else [eos])
    engine = LLMEngine(Llama.random(cfg), block_size=block_size, num_blocks=200, max_num_batched_tokens=budget,
                       speculative_config=spec)
    engine.runner = ScriptedRunner(rule, block_size)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.check_idle()
    return [(out[i], engine.requests[i].finish_reason.value) for i in ids], engine


@settings(max_examples=80, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=12), min_size=1, max_size=4),
       period=st.integers(1, 6), twist=st.integers(2, 9), max_tokens=st.integers(1, 30),
       eos=st.sampled_from([None, 0, 5]), stop_id=st.sampled_from([None, 3]), k=st.integers(1, 6),
       lookup=st.sampled_from([(1, 1), (3, 1), (3, 2)]), block_size=st.sampled_from([1, 4, 16]),
       budget=st.integers(4, 40))
def test_scripted_model_gives_plain_greedys_tokens_and_stops(prompts, period, twist, max_tokens, eos, stop_id, k,
                                                            lookup, block_size, budget):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[] if stop_id is None else [stop_id])
    rule = copy_rule(period, twist)
    plain, _ = run_scripted(rule, prompts, params, None, block_size, budget, eos)
    spec = SpeculativeConfig("ngram", k, lookup[0], lookup[1])
    got, engine = run_scripted(rule, prompts, params, spec, block_size, budget, eos)
    assert got == plain
    drafted = sum(r.num_draft_tokens for r in engine.history)
    accepted = sum(r.num_accepted_tokens for r in engine.history)
    assert 0 <= accepted <= drafted
    assert sum(r.num_accepted_tokens for r in engine.requests.values()) == accepted
    assert sum(r.num_draft_tokens for r in engine.requests.values()) == drafted


def test_a_perfectly_predictable_sequence_takes_few_steps():
    prompt = [1, 2, 3, 4, 1, 2, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=25)
    spec = SpeculativeConfig("ngram", 4, 3, 1)
    [(tokens, reason)], engine = run_scripted(copy_rule(4, 10**9), [prompt], params, spec)
    assert tokens == [1, 2, 3, 4] * 6 + [1] and reason == "length"
    steps = list(engine.history)[1:]  # after the prefill
    assert len(steps) == 5 and all(r.num_accepted_tokens == r.num_draft_tokens == 4 for r in steps[:-1])


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
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


class Recording(PagedSession):
    """Day 18's paged session, keeping the logits it returned (plain greedy's, to find its near-ties)."""

    def __init__(self, session):
        super().__init__(session.manager, session.runner)
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
    """Plain greedy per prompt: the engine's tokens, and a paged session's per-step logits (its near-ties)."""
    out = {}
    for name, text in REAL_PROMPTS.items():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        session = Recording(paged_session(model, len(ids) + MAX_NEW))
        stage = run_session(model, session, ids, params).token_ids
        out[name] = (ids, generate(model, ids, params).token_ids, session.logits, stage)
    return out


def spec_engine_run(model, ids, params, tok=None):
    """One request through an engine with drafts on: its output, and the engine (for its accounting)."""
    engine = LLMEngine(model, tok, num_blocks=64, speculative_config=SPEC)
    rid = engine.add_request(ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.requests[rid], engine


@pytest.mark.parametrize("name", REAL_PROMPTS)
def test_speculative_tokens_equal_plain_greedy(model, plain, name):
    ids, ref, ref_logits, stage = plain[name]
    req, engine = spec_engine_run(model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    h = near_tie_horizon(ref_logits)
    assert req.output_token_ids[:h] == ref[:h] == stage[:h]
    if h == len(ref):
        assert req.output_token_ids == ref
    assert h >= min(32, len(ref))  # the comparison is never vacuous
    acceptance = req.num_accepted_tokens / max(1, req.num_draft_tokens)
    if name == "copy":  # text that copies its prompt is where the drafts land
        assert acceptance > 0.5 and len(req.output_token_ids) / (len(engine.history) - 1) > 2
    if name == "summary":
        assert req.num_accepted_tokens > 0
    engine.check_idle()


@pytest.mark.parametrize("fmt", [dict(dtype="bfloat16"),
                                 dict(weights="gguf", activations="int8", kv_cache_dtype="bfloat16")])
def test_speculative_tokens_are_plain_greedys_in_the_rounded_formats_too(model_dir, fmt):
    """bf16 and int8 round their numbers, so a last-bit difference between a verify step and a decode step can
    change a rounded value and then a token. A verify step computes each row as a decode step does: the tokens
    are plain greedy's, every one."""
    rounded, tok = load(model_dir, **fmt)
    for name in ("copy", "summary"):
        ids = tok.encode_chat([{"role": "user", "content": REAL_PROMPTS[name]}])
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        req, engine = spec_engine_run(rounded, ids, params)
        assert req.num_accepted_tokens > 0
        assert req.output_token_ids == generate(rounded, ids, params).token_ids
        engine.check_idle()


def test_rollback_leaves_the_sequences_own_kv_and_no_leak(model, plain):
    """Mid-request, after drafts were rejected: the block table holds prompt + output (the newest token's
    K/V is the next step's), its full blocks are named by the right hashes, and its keys are what a fresh
    prefill of that sequence computes. At the end every block is back."""
    ids, _, _, _ = plain["summary"]  # a prompt whose drafts are sometimes rejected
    engine = LLMEngine(model, num_blocks=64, speculative_config=SPEC)
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    req = engine.requests[rid]
    while req.num_draft_tokens <= req.num_accepted_tokens or req.num_output_tokens < 24:
        engine.step()
    assert not req.finished
    t, storage = req.table, engine.runner.storage
    assert t.token_ids == (ids + req.output_token_ids)[:-1] == (ids + req.output_token_ids)[:req.num_computed_tokens]
    assert t.hashes == chain_hashes(t.token_ids, engine.manager.block_size)
    k = torch.cat([storage.gather(layer, t.blocks, t.num_tokens)[0] for layer in range(model.cfg.n_layers)])
    fresh = paged_session(model, t.num_tokens + 1)
    fresh.prefill(t.token_ids)
    ft = fresh.table
    want = torch.cat([fresh.runner.storage.gather(layer, ft.blocks, ft.num_tokens)[0]
                      for layer in range(model.cfg.n_layers)])
    torch.testing.assert_close(k, want, atol=1e-4, rtol=1e-4)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_idle()


def test_stop_strings_and_eos_end_where_plain_generate_ends(model, tok, plain):
    ids = plain["copy"][0]
    for params in (SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=["lamp"]),  # inside an accepted run
                   SamplingParams(temperature=0, max_tokens=23)):
        want = generate(model, ids, params, tok)
        got = generate(model, ids, params, tok, speculative_config=SPEC)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
