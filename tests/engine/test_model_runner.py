"""The model runner on the tiny model: one step of any mix of requests gives each request the logits of
its own sequence, and the same bits whatever else is in a step of two or more tokens (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nanoserve.attention import Chunk, PagedAttention, prepare
from nanoserve.engine import ModelRunner, model_runner
from nanoserve.engine.model_runner import logit_rows
from nanoserve.kv import BlockManager, KVStorage
from nanoserve.model import Llama
from nanoserve.model import matmul as mm
from nanoserve.model.matmul import forward_rows

KERNELS = {"compiled": None, "torch-ops": False}  # the `road` fixture's name -> ModelRunner's compiled=


def ids_of(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool(model, num_blocks: int, block_size: int, compiled=None, **kw) -> tuple[BlockManager, ModelRunner]:
    """A paged pool as the engine splits it: the bookkeeping (a block manager) and a runner owning the tensors."""
    storage = KVStorage(model.cfg, num_blocks, block_size)
    return BlockManager(num_blocks, block_size), ModelRunner(model, storage, compiled, **kw)


def test_runner_roads(tiny_model, road):
    manager, runner = pool(tiny_model, 4, 4, KERNELS[road])
    assert (runner.compiled, runner.attention) == ((True, "compiled") if road == "compiled" else (False, "torch"))
    assert ModelRunner(tiny_model, runner.storage, KERNELS[road], attention="reference").attention == "reference"
    with pytest.raises(ValueError, match="compiled='fast': None, True, False or 'ops'"):
        ModelRunner(tiny_model, runner.storage, "fast")


def test_a_mixed_step_gives_each_request_its_own_sequences_logits(tiny_model, road):
    """A prompt, a chunk after cached context and a decode token in one step: each request's logits are
    those of the model's no-cache forward over its whole sequence, to fp32 rounding."""
    manager, runner = pool(tiny_model, 32, 4, KERNELS[road])
    seqs = [ids_of(9, 1), ids_of(14, 2), ids_of(6, 3)]
    cached = [0, 8, 5]  # request 0 is a whole prompt, 1 a chunk of 6 after 8, 2 one decode token after 5
    tables = [manager.new_table() for _ in seqs]
    for t, s, c in zip(tables, seqs, cached):
        if c:
            manager.append_slots(t, s[:c])
            runner.execute([Chunk(s[:c], 0, t.blocks)])
    chunks = []
    for t, s, c in zip(tables, seqs, cached):
        manager.append_slots(t, s[c:])
        chunks.append(Chunk(s[c:], c, t.blocks))
    logits = runner.execute(chunks)
    assert logits.shape == (3, tiny_model.cfg.vocab_size) and logits.dtype == torch.float32
    with torch.inference_mode():
        for r, s in enumerate(seqs):
            want = tiny_model(torch.tensor([s]), last_only=True)[0]
            torch.testing.assert_close(logits[r], want, atol=2e-5, rtol=0)


def test_num_logits_reads_the_last_rows_of_each_request(tiny_model, road):
    """Speculative verification reads several rows of one request, none of a prompt's middle chunk: each row
    is that position's logits (the whole sequence's forward there), and one row per request is the default."""
    manager, runner = pool(tiny_model, 32, 4, KERNELS[road])
    a, b, c = ids_of(7, 5), ids_of(10, 6), ids_of(5, 7)
    tables = [manager.new_table() for _ in range(3)]
    manager.append_slots(tables[1], b[:6])
    runner.execute([Chunk(b[:6], 0, tables[1].blocks)])
    chunks = []
    for t, ids, start in zip(tables, (a, b[6:], c), (0, 6, 0)):
        manager.append_slots(t, ids)
        chunks.append(Chunk(ids, start, t.blocks))
    logits = runner.execute(chunks, num_logits=[0, 3, 1])  # none of a, the last 3 of b, the last of c
    assert logits.shape == (4, tiny_model.cfg.vocab_size)
    with torch.inference_mode():
        every_b = tiny_model(torch.tensor([b]))[0]
        torch.testing.assert_close(logits[:3], every_b[-3:], atol=2e-5, rtol=0)
        torch.testing.assert_close(logits[3], tiny_model(torch.tensor([c]), last_only=True)[0], atol=2e-5, rtol=0)
    _, md = prepare([Chunk(ids_of(n, 9), 0, list(range(4))) for n in (7, 4, 5)], 4)
    assert logit_rows(md, [0, 3, 1]).tolist() == [8, 9, 10, 15]
    assert logit_rows(md, [1, 1, 1]).tolist() == md.last_rows.tolist() == [6, 10, 15]
    with pytest.raises(ValueError, match="num_logits has 2 entries for 3 requests"):
        logit_rows(md, [1, 1])
    assert runner.execute([Chunk([1], 7, tables[0].blocks)], manager.append_slots(tables[0], [1])[1],
                          num_logits=[0]).shape == (0, tiny_model.cfg.vocab_size)


def test_execute_model_samples_in_the_runner_what_the_sampler_would_choose_from_the_logits(tiny_model, road):
    """The engine's call: the forward, then each pick's token (greedy, seeded, a failed grammar's INVALID), the
    log-probabilities asked for and a prompt's scored rows, as `sample` and `logprobs_of` give them from the same
    step's logits: the tokens leave the runner, the logits do not."""
    from nanoserve.engine.model_runner import SamplingBatch
    from nanoserve.sampling import INVALID, RowSampler, SamplingParams, logprobs_of, sample

    def step(runner, manager):
        a, b = ids_of(9, 11), ids_of(6, 12)
        tables = [manager.new_table() for _ in range(2)]
        for t, ids in zip(tables, (a, b)):
            manager.append_slots(t, ids)
        return [Chunk(a, 0, tables[0].blocks), Chunk(b, 0, tables[1].blocks)], a

    def batch(prompt):
        out = SamplingBatch(scores=[(0, prompt[1:5], 2)])  # rows 0-3 of the first request score its tokens 1-4
        out.add(4, RowSampler(SamplingParams(temperature=0)), (), (), logprobs=3)
        out.add(5, RowSampler(SamplingParams(temperature=0.8, top_k=20, seed=7)), (), (), logprobs=0)
        out.add(5, RowSampler(SamplingParams(temperature=0)), (), (), None, masked=True, logprobs=1)  # grammar failed
        return out

    manager, runner = pool(tiny_model, 32, 4, KERNELS[road])
    chunks, prompt = step(runner, manager)
    got = runner.execute_model(chunks, (), [5, 1], batch(prompt))
    manager, plain = pool(tiny_model, 32, 4, KERNELS[road])
    chunks, _ = step(plain, manager)
    logits = plain.execute(chunks, num_logits=[5, 1])
    want = batch(prompt)
    tokens = sample(logits[want.rows], want.samplers, want.seen, plain.compiled, want.generated)
    assert got.tokens == [*tokens[:2], INVALID]
    assert got.logprobs == dict(enumerate(logprobs_of(logits[[4, 5]], tokens[:2], [3, 0], plain.compiled)))
    assert got.prompt_logprobs == [logprobs_of(logits[:4], prompt[1:5], [2] * 4, plain.compiled)]
    assert runner.last_sample_s > 0


def test_the_runner_makes_the_block_copies_before_the_forward(tiny_model):
    """A fork's first write into a shared, partly filled block: the manager says copy it, the runner does,
    before the forward writes the new token, so the parent's keys are untouched and the child's complete."""
    manager, runner = pool(tiny_model, 8, 4)
    parent = manager.new_table()
    ids = ids_of(6, 8)
    manager.append_slots(parent, ids)
    runner.execute([Chunk(ids, 0, parent.blocks)])
    child = manager.fork(parent)
    before = runner.storage.k[:, parent.blocks[1]].clone()
    _, copies = manager.append_slots(child, [9])
    assert copies == [(parent.blocks[1], child.blocks[1])]
    with torch.inference_mode():
        got = runner.execute([Chunk([9], 6, child.blocks)], copies)[0]
        want = tiny_model(torch.tensor([ids + [9]]), last_only=True)[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert torch.equal(runner.storage.k[:, parent.blocks[1]], before)


def test_padding_rows_stay_finite_and_write_nowhere(tiny_model, road):
    manager, runner = pool(tiny_model, 8, 4, KERNELS[road])
    tables = [manager.new_table() for _ in range(3)]
    chunks = []
    for t, n in zip(tables, (3, 1, 5)):
        manager.append_slots(t, ids_of(n, n))
        chunks.append(Chunk(t.token_ids, 0, t.blocks))
    ids, md = prepare(chunks, 4, forward_rows(9))
    assert ids.numel() == 12 and md.num_tokens == 9  # three padding rows
    backend = PagedAttention(runner.storage, md, runner.attention)
    with torch.inference_mode():
        h = tiny_model.hidden_states(ids[None], md.positions[None], backend, compiled=runner.compiled)[0]
    assert torch.isfinite(h).all()
    written = (runner.storage.k.abs().sum((0, 3, 4)) != 0).view(-1)  # slots written, any layer
    assert written.nonzero().view(-1).tolist() == sorted(md.slot_mapping.tolist())


# ---- batch invariance through the whole model ---------------------------------------------------------

request_st = st.tuples(st.integers(0, 30), st.integers(1, 12))  # (cached context, new tokens)
decode_st = st.tuples(st.integers(1, 40), st.just(1))
others_st = st.lists(st.one_of(request_st, decode_st), min_size=0, max_size=3)


class Composition:
    """A step of `target` among `others`, on one pool. The target's cached context is computed once (in
    `context`) and shared by fork, so its K/V are the same bits in every composition; the others'
    contexts are computed in their own steps first."""

    def __init__(self, model, compiled, block_size, target_ids, target_ctx):
        self.model, self.bs = model, block_size
        self.manager, self.runner = pool(model, 200, block_size, compiled)
        self.target_ids, self.target_ctx = target_ids, target_ctx
        self.context = self.manager.new_table()
        if target_ctx:
            self.manager.append_slots(self.context, target_ids[:target_ctx])
            self.runner.execute([Chunk(target_ids[:target_ctx], 0, self.context.blocks)])

    def target_logits(self, others, where, seed):
        tables, chunks, copies = [], [], []
        for i, (ctx, n) in enumerate(others):
            ids = ids_of(ctx + n, seed + i)
            t = self.manager.new_table()
            if ctx:
                self.manager.append_slots(t, ids[:ctx])
                self.runner.execute([Chunk(ids[:ctx], 0, t.blocks)])
            self.manager.append_slots(t, ids[ctx:])
            tables.append(t)
            chunks.append(Chunk(ids[ctx:], ctx, t.blocks))
        mine = self.manager.fork(self.context)
        copies += self.manager.append_slots(mine, self.target_ids[self.target_ctx:])[1]
        chunks.insert(where, Chunk(self.target_ids[self.target_ctx:], self.target_ctx, mine.blocks))
        logits = self.runner.execute(chunks, copies)[where]
        for t in (*tables, mine):
            self.manager.free(t)
        return logits


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.one_of(request_st, decode_st), others=st.tuples(others_st, others_st),
       where=st.tuples(st.integers(0, 3), st.integers(0, 3)), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_a_requests_logits_are_bit_identical_whatever_else_is_in_the_step(tiny_model, road, target, others, where,
                                                                           block_size, seed):
    """Two steps with the same request among different others (or alone), each of two or more tokens: a
    step of one token (one sequence's decode) takes the one-row road and may differ by rounding."""
    ctx, n = target
    assume(all(n + sum(t for _, t in o) >= 2 for o in others))
    run = Composition(tiny_model, KERNELS[road], block_size, ids_of(ctx + n, seed), ctx)
    a = run.target_logits(others[0], min(where[0], len(others[0])), seed + 100)
    b = run.target_logits(others[1], min(where[1], len(others[1])), seed + 200)
    assert torch.equal(a, b)
    run.manager.free(run.context)
    run.manager.pool.check()
    assert run.manager.pool.num_used == 0



def test_a_prompt_alone_is_the_same_bits_as_in_a_batch_and_one_token_alone_the_same_to_rounding(tiny_model, road):
    ids = ids_of(9, 4)
    run = Composition(tiny_model, KERNELS[road], 4, ids, 0)
    alone, beside = run.target_logits([], 0, 1), run.target_logits([(3, 2), (0, 5)], 1, 2)
    assert torch.equal(alone, beside)
    run = Composition(tiny_model, KERNELS[road], 4, ids, 8)
    alone, beside = run.target_logits([], 0, 1), run.target_logits([(3, 1)], 0, 2)
    torch.testing.assert_close(alone, beside, atol=1e-5, rtol=0)


def test_on_the_fp32_tiles_one_token_alone_is_the_same_bits_as_in_a_batch_with_no_rows_added(tiny_cfg, compiled,
                                                                                              monkeypatch):
    """Where every product runs the fp32 tiles (x86 CPUs), a batch-invariant runner steps a lone decode token as
    one row (the memory-bound road a lone request needs) and it still gets the bits it gets beside others."""
    if not mm.TILES:
        pytest.skip("the fp32 tiles are the road of x86 CPUs with AVX2 or AVX-512 only")
    model = Llama.random(tiny_cfg, seed=0)  # its own: packing the shared tiny model would change other tests' roads
    model.pack_weights()
    assert model.one_row_same_bits(True)
    rows = []

    def counting(chunks, block_size, num_rows):
        rows.append(num_rows)
        return prepare(chunks, block_size, num_rows)

    monkeypatch.setattr(model_runner, "prepare", counting)
    run = Composition(model, None, 4, ids_of(9, 4), 8)
    run.runner.batch_invariant = True
    alone = run.target_logits([], 0, 1)
    assert rows[-1] == 1
    assert torch.equal(alone, run.target_logits([(3, 1), (0, 4)], 1, 2))
