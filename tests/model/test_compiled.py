"""The compiled step of a model on blocks (`model.compiled`): the Python forward's logits bit for bit, on decode
steps and chunks after a cached context, ragged batches, any block size; the same K/V written into the pool;
whole prompts and models off blocks left to the Python forward; bad metadata refused by name."""

import pytest
import torch

import nanoserve
from nanoserve.attention import Chunk, prepare
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kv.paged import PagedKVCache
from nanoserve.model import Llama
from nanoserve.model.compiled import BlockStep, applies
from nanoserve.model.gguf_weights import to_blocks


@pytest.fixture(scope="module")
def tiny_blocks(tiny_cfg, compiled):
    return to_blocks(Llama.random(tiny_cfg, seed=5))


def runners(model, num_blocks: int, block_size: int):
    """Two runners on two pools of the same shape: the compiled step, and the Python forward."""
    fast = ModelRunner(model, PagedKVCache(model.cfg, num_blocks, block_size, prefix_caching=False))
    slow = ModelRunner(model, PagedKVCache(model.cfg, num_blocks, block_size, prefix_caching=False),
                       compiled_step=False)
    assert fast.block_step is not None and slow.block_step is None
    return fast, slow


def run_both(fast, slow, prompts, steps, seed=0):
    """Prefill each prompt (the Python forward: whole prompts), then `steps` rounds of mixed work: every request
    decodes one token, except that some take a chunk of several; returns the logits of both runners per step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    tables = [[(fast.cache.new_table(), slow.cache.new_table()) for _ in prompts]]
    for (ft, st), p in zip(tables[0], prompts):
        fast.cache.append(ft, p)
        slow.cache.append(st, p)
    chunks = [(Chunk(p, 0, ft.blocks), Chunk(p, 0, st.blocks)) for (ft, st), p in zip(tables[0], prompts)]
    first = fast.execute([c for c, _ in chunks]), slow.execute([c for _, c in chunks])
    assert torch.equal(*first)
    for _ in range(steps):
        f_chunks, s_chunks = [], []
        for ft, st in tables[0]:
            n = int(torch.randint(1, 4, (1,), generator=g)) if torch.rand(1, generator=g) < 0.3 else 1
            new = torch.randint(3, fast.model.cfg.vocab_size, (n,), generator=g).tolist()
            start = ft.num_tokens
            fast.cache.append(ft, new)
            slow.cache.append(st, new)
            f_chunks.append(Chunk(new, start, ft.blocks))
            s_chunks.append(Chunk(new, start, st.blocks))
        _, md = prepare(f_chunks, fast.cache.block_size)
        assert applies(md)  # every request has keys before its new tokens: the compiled step runs
        out.append((fast.execute(f_chunks), slow.execute(s_chunks)))
    return out


@pytest.mark.parametrize("block_size", [1, 16])
def test_compiled_steps_are_the_python_forward_bit_for_bit(tiny_blocks, block_size):
    fast, slow = runners(tiny_blocks, 400, block_size)
    prompts = [[5, 6, 7], list(range(10, 50)), [9], list(range(60, 77))]
    for f, s in run_both(fast, slow, prompts, steps=12, seed=block_size):
        assert f.shape == s.shape == (len(prompts), tiny_blocks.cfg.vocab_size)
        assert torch.equal(f, s)
    assert torch.equal(fast.cache.storage.k, slow.cache.storage.k)  # the same k/v went into the same slots
    assert torch.equal(fast.cache.storage.v, slow.cache.storage.v)


def test_a_row_has_the_same_bits_alone_and_in_a_batch(tiny_blocks):
    """Batch invariance holds on the compiled road too: one request's decode alone equals its row beside others."""
    fast, _ = runners(tiny_blocks, 200, 4)
    cache = fast.cache
    prompts = [list(range(3, 30)), [4, 5], list(range(40, 49))]
    tables = [cache.new_table() for _ in prompts]
    for t, p in zip(tables, prompts):
        cache.append(t, p)
        fast.execute([Chunk(p, 0, t.blocks)])
    starts = [t.num_tokens for t in tables]
    for t in tables:
        cache.append(t, [7])
    together = fast.execute([Chunk([7], s, t.blocks) for s, t in zip(starts, tables)])
    for r, (s, t) in enumerate(zip(starts, tables)):
        assert torch.equal(fast.execute([Chunk([7], s, t.blocks)])[0], together[r])


def test_whole_prompts_and_models_off_blocks_take_the_python_forward(tiny_model, tiny_blocks):
    _, md = prepare([Chunk([1, 2, 3], 0, [0]), Chunk([4], 5, [1, 2])], 4)
    assert not applies(md)  # the first request is a whole prompt
    _, md = prepare([Chunk([1, 2, 3], 2, [0, 1]), Chunk([4], 5, [1, 2])], 4)
    assert applies(md)
    assert BlockStep.of(tiny_model) is None  # fp32 matrices
    runner = ModelRunner(tiny_blocks, PagedKVCache(tiny_blocks.cfg, 8, 4), kernels=False)
    assert runner.block_step is None  # torch's ops asked for: the Python forward on them


def test_a_slot_outside_the_pool_is_refused_by_name(tiny_blocks):
    fast, _ = runners(tiny_blocks, 4, 4)
    ids, md = prepare([Chunk([1], 3, [0])], 4)
    bad = type(md)(**{**md.__dict__, "slot_mapping": torch.tensor([99])})
    with pytest.raises(RuntimeError, match="slot_mapping: row 0 slot 99 outside the pool of 16 slots"):
        fast.block_step(ids, bad, fast.cache.storage)


def test_the_real_model_on_blocks_steps_compiled_with_the_same_logits(model_dir, tok, compiled):
    model = nanoserve.load(model_dir, weights="gguf")[0]
    fast, slow = runners(model, 64, 16)
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n"), [1] * 40]
    for f, s in run_both(fast, slow, prompts, steps=4):
        assert torch.equal(f, s)
