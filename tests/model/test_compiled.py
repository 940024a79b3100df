"""The compiled step of a model on blocks or tiles (`model.compiled`): the Python forward's logits bit for bit, on
whole prompts, decode steps and chunks after a cached context, ragged batches, any block size, blocks on fp32 or
int8 activations, fp32 or bf16 tiles, bf16 panels; the same K/V written into the pool; whole prompts on a bf16
pool compiled where the CPU has their bf16 kernel, else, and models off blocks and tiles, left to the Python forward;
bad metadata refused by name."""

import os
from contextlib import nullcontext
from unittest import mock

import pytest
import torch

import nanoserve
from nanoserve import kernels
from nanoserve.attention import Chunk, prepare
from nanoserve.config import ModelConfig
from nanoserve.engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kernels import int8
from nanoserve.kv import BlockManager, KVStorage
from nanoserve.model import Llama
from nanoserve.model import matmul as mm
from nanoserve.model.compiled import BlockStep, applies
from nanoserve.model.gguf_weights import set_activations, to_blocks
from nanoserve.model.matmul import tiled


@pytest.fixture(scope="module",
                params=["fp32", "int8", "int8, bf16 K/V", "fp32 tiles", "bf16 tiles", "bf16 panels"])
def tiny_blocks(request, tiny_cfg, compiled):
    """A tiny model on blocks, its products on fp32 activations, then on int8 ones, then with a bf16 K/V cache;
    then an fp32 model with its tiles (x86 CPUs only), a bf16 one with its (AVX512_BF16 only), and a bf16 one with
    the panels of a CPU whose oneDNN takes no bf16 (`bf16_road` "widen", forced: any x86 CPU)."""
    if request.param.endswith(("tiles", "panels")):
        model = Llama.random(tiny_cfg, seed=5)
        if request.param != "fp32 tiles":
            model.cast_matrices(torch.bfloat16)
        with mock.patch.object(mm, "bf16_road", lambda: "widen") if request.param == "bf16 panels" else nullcontext():
            packed = model.pack_weights()
        held = tiled if request.param.endswith("tiles") else mm.panels
        if not packed or held(model.layers[0].wqkv) is None:
            pytest.skip(f"no {request.param} on this CPU")
        return model
    model = to_blocks(Llama.random(tiny_cfg, seed=5), activations=request.param.split(",")[0])
    return model.round_kv(torch.bfloat16) if "bf16" in request.param else model


def runners(model, num_blocks: int, block_size: int):
    """One pool's bookkeeping and two runners, each with its own storage of that pool's shape: the compiled
    step, and the Python forward. A table from the manager names the same slots in both."""
    manager = BlockManager(num_blocks, block_size, prefix_caching=False)
    fast = ModelRunner(model, KVStorage(model.cfg, num_blocks, block_size, model.kv_dtype))
    slow = ModelRunner(model, KVStorage(model.cfg, num_blocks, block_size, model.kv_dtype), compiled="ops")
    assert fast.block_step is not None and slow.block_step is None
    return manager, fast, slow


def run_both(manager, fast, slow, prompts, steps, seed=0):
    """Prefill every prompt in one step (whole prompts: compiled on an fp32 pool, the Python forward on a bf16 one),
    then `steps` rounds of mixed work: every request decodes one token, except that some take a chunk of several;
    returns the logits of both runners per step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    tables = [manager.new_table() for _ in prompts]
    for t, p in zip(tables, prompts):
        manager.append_slots(t, p)
    chunks = [Chunk(p, 0, t.blocks) for t, p in zip(tables, prompts)]
    assert torch.equal(fast.execute(chunks), slow.execute(chunks))
    for _ in range(steps):
        chunks = []
        for t in tables:
            n = int(torch.randint(1, 4, (1,), generator=g)) if torch.rand(1, generator=g) < 0.3 else 1
            new = torch.randint(3, fast.model.cfg.vocab_size, (n,), generator=g).tolist()
            start = t.num_tokens
            manager.append_slots(t, new)
            chunks.append(Chunk(new, start, t.blocks))
        _, md = prepare(chunks, manager.block_size)
        assert applies(md)  # every request has keys before its new tokens: the compiled step runs
        logits = fast.execute(chunks)
        # beside the logits, each row's argmax as torch gives it (the first largest), found by the step's threads
        assert torch.equal(fast.last_argmax, logits.argmax(-1)) and slow.last_argmax is None
        out.append((logits, slow.execute(chunks)))
    return out


@pytest.mark.parametrize("block_size", [1, 16])
def test_compiled_steps_are_the_python_forward_bit_for_bit(tiny_blocks, block_size):
    manager, fast, slow = runners(tiny_blocks, 400, block_size)
    prompts = [[5, 6, 7], list(range(10, 50)), [9], list(range(60, 77))]
    for f, s in run_both(manager, fast, slow, prompts, steps=12, seed=block_size):
        assert f.shape == s.shape == (len(prompts), tiny_blocks.cfg.vocab_size)
        assert torch.equal(f, s)
    assert torch.equal(fast.storage.k, slow.storage.k)  # the same k/v went into the same slots
    assert torch.equal(fast.storage.v, slow.storage.v)


def test_the_compiled_step_reads_any_rows_and_none(tiny_blocks):
    """Prompt log-probabilities read every row of a prompt, speculative verification a request's last rows, a
    prompt's middle chunk none: the same bits as the Python forward's rows, and the k/v written either way."""
    manager, fast, slow = runners(tiny_blocks, 64, 4)
    tables = [manager.new_table() for _ in range(2)]
    for t, p in zip(tables, ([5, 6, 7, 8, 9], list(range(20, 31)))):
        manager.append_slots(t, p)
        f, s = (r.execute([Chunk(p, 0, t.blocks)], num_logits=[len(p)]) for r in (fast, slow))  # prompt logprobs
        assert f.shape == (len(p), tiny_blocks.cfg.vocab_size) and torch.equal(f, s)
    chunks = []
    for t, new in zip(tables, ([40, 41, 42, 43], [50, 51])):
        start = t.num_tokens
        manager.append_slots(t, new)
        chunks.append(Chunk(new, start, t.blocks))
    for counts in ([4, 1], [0, 2], [0, 0]):
        f, s = fast.execute(chunks, num_logits=counts), slow.execute(chunks, num_logits=counts)
        assert f.shape == (sum(counts), tiny_blocks.cfg.vocab_size) and torch.equal(f, s)
        assert torch.equal(fast.storage.k, slow.storage.k)


def test_a_lone_request_in_the_engine_takes_the_compiled_step(tiny_blocks, monkeypatch):
    """One request through the engine (generate's road): its decode steps are the one compiled call; told
    `compiled="ops"`, the engine runs the Python forward on the kernels instead, to the same tokens."""
    engine = LLMEngine(tiny_blocks, num_blocks=16, block_size=4)
    calls = []
    real = engine.runner.block_step.__call__
    monkeypatch.setattr(type(engine.runner.block_step), "__call__",
                        lambda self, *a, **kw: calls.append(1) or real(*a, **kw))
    params = nanoserve.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rid = engine.add_request([5, 6, 7], params)
    while engine.has_unfinished_requests():
        engine.step()
    bf16_pool = engine.runner.storage.k.dtype == torch.bfloat16
    assert len(calls) == (5 if bf16_pool else 6)  # a whole prompt on a bf16 pool: its bf16 prompt kernel
    ops = LLMEngine(tiny_blocks, num_blocks=16, block_size=4, compiled="ops")
    assert ops.runner.compiled and ops.runner.block_step is None
    other = ops.add_request([5, 6, 7], params)
    while ops.has_unfinished_requests():
        ops.step()
    assert ops.sequence(other).output_token_ids == engine.sequence(rid).output_token_ids


def test_a_row_has_the_same_bits_alone_and_in_a_batch(tiny_blocks):
    """Batch invariance holds on the compiled road too: one request's decode alone equals its row beside others."""
    manager, fast, _ = runners(tiny_blocks, 200, 4)
    prompts = [list(range(3, 30)), [4, 5], list(range(40, 49))]
    tables = [manager.new_table() for _ in prompts]
    for t, p in zip(tables, prompts):
        manager.append_slots(t, p)
        fast.execute([Chunk(p, 0, t.blocks)])
    starts = [t.num_tokens for t in tables]
    for t in tables:
        manager.append_slots(t, [7])
    together = fast.execute([Chunk([7], s, t.blocks) for s, t in zip(starts, tables)])
    for r, (s, t) in enumerate(zip(starts, tables)):
        assert torch.equal(fast.execute([Chunk([7], s, t.blocks)])[0], together[r])


@pytest.mark.parametrize("kind", ["bf16 tiles", "int8, bf16 K/V"])
def test_whole_prompts_on_a_bf16_pool_take_the_bf16_prompt_kernel_in_the_compiled_step(kind, compiled, monkeypatch):
    """Where the CPU has the prompt kernel with bf16 products, a step holding whole prompts on a bf16 pool runs
    compiled, beside decode rows and a one-token prompt (the paged kernel's): the Python forward's bits."""
    cfg = ModelConfig.tiny(head_dim=64)
    if not kernels.prompt_attention_bf16_here(cfg.head_dim):
        pytest.skip("no AVX512_BF16: whole prompts on a bf16 pool take the Python forward")
    model = Llama.random(cfg, seed=7)
    if kind == "bf16 tiles":
        model.cast_matrices(torch.bfloat16)
        if not model.pack_weights() or tiled(model.layers[0].wqkv) is None:
            pytest.skip("no bf16 tiles on this CPU")
    else:
        model = to_blocks(model, activations="int8").round_kv(torch.bfloat16)
    manager, fast, slow = runners(model, 64, 4)
    calls = []
    real = type(fast.block_step).__call__
    monkeypatch.setattr(type(fast.block_step), "__call__",
                        lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    tables = [manager.new_table() for _ in range(4)]
    steps = [[(0, list(range(5, 30))), (1, [9]), (2, list(range(40, 52)))],  # whole prompts, one of one token
             [(0, [31]), (3, list(range(60, 81))), (1, [10, 11])]]  # a decode row, a whole prompt, a chunk
    for step in steps:
        chunks = []
        for r, new in step:
            start = tables[r].num_tokens
            manager.append_slots(tables[r], new)
            chunks.append(Chunk(new, start, tables[r].blocks))
        _, md = prepare(chunks, manager.block_size)
        assert applies(md, bf16_pool=True, head_dim=cfg.head_dim)
        assert torch.equal(fast.execute(chunks), slow.execute(chunks))
    assert len(calls) == 2  # both steps compiled
    assert torch.equal(fast.storage.k, slow.storage.k) and torch.equal(fast.storage.v, slow.storage.v)


def test_whole_prompts_on_a_bf16_pool_and_models_off_blocks_take_the_python_forward(tiny_model, tiny_blocks):
    _, md = prepare([Chunk([1, 2, 3], 0, [0]), Chunk([4], 5, [1, 2])], 4)
    assert applies(md) and not applies(md, bf16_pool=True)  # the first request is a whole prompt (head_dim 0: no
    assert not applies(md, bf16_pool=True, head_dim=16)  # kernel; 16: none takes it)
    _, md = prepare([Chunk([1, 2, 3], 2, [0, 1]), Chunk([4], 5, [1, 2])], 4)
    assert applies(md) and applies(md, bf16_pool=True)
    assert BlockStep.of(tiny_model) is None  # fp32 matrices without tiles (never packed)
    runner = ModelRunner(tiny_blocks, KVStorage(tiny_blocks.cfg, 8, 4), compiled=False)
    assert runner.block_step is None  # torch's ops asked for: the Python forward on them


def test_a_slot_outside_the_pool_is_refused_by_name(tiny_blocks):
    _, fast, _ = runners(tiny_blocks, 4, 4)
    ids, md = prepare([Chunk([1], 3, [0])], 4)
    bad = type(md)(**{**md.__dict__, "slot_mapping": torch.tensor([99])})
    with pytest.raises(RuntimeError, match="slot_mapping: row 0 slot 99 outside the pool of 16 slots"):
        fast.block_step(ids, bad, fast.storage)


@pytest.mark.skipif(not int8.packed_here(), reason="packed copies are the x86 roads'")
def test_int8_matrices_step_from_packed_copies_and_a_bad_copy_is_refused(tiny_cfg, compiled):
    """On x86 each int8 matrix keeps a packed copy (the same bytes) that the compiled step reads; a copy
    of the wrong size is refused at construction, by matrix, not read past its end."""
    model = to_blocks(Llama.random(tiny_cfg, seed=6), activations="int8")
    mats = model.matrices()
    assert all(m.int8_packed().numel() == -(-m.shape[0] // 4) * 4 * m.blocks.shape[1] + 64 for m in mats)  # a tail
    set_activations(model, "fp32")
    assert all(m.int8_packed() is None for m in mats)  # blocks on fp32 activations read the blocks only
    set_activations(model, "int8")
    assert BlockStep.of(model) is not None
    packed = [m.int8_packed() for m in mats]
    packed[1] = packed[1][:-20]
    norms = [n for blk in model.layers for n in (blk.attn_norm, blk.mlp_norm)] + [model.norm]
    with pytest.raises(RuntimeError, match="packed 1: expected the .* bytes pack_blocks_int8 makes"):
        compiled.BlockModel(model.embed.blocks, model.embed.fmt, [n.detach() for n in norms], [m.blocks for m in mats],
                            [m.fmt for m in mats], [True] * len(mats), packed, tiny_cfg.n_heads, tiny_cfg.n_kv_heads,
                            tiny_cfg.rms_norm_eps, False)


def team_case(model, block_size=4):
    """A runner of the compiled step and a pool holding three requests of 9, 30 and 61 tokens."""
    manager, fast, _ = runners(model, 64, block_size)
    tables = [manager.new_table() for _ in range(3)]
    for t, n in zip(tables, (9, 30, 61)):
        manager.append_slots(t, list(range(3, 3 + n)))
        fast.execute([Chunk(list(range(3, 3 + n)), 0, t.blocks)])
    return manager, fast, tables


@pytest.mark.parametrize("split_keys", [0, 8])
@pytest.mark.parametrize("team", ["torch's threads", "twice the cores"])
def test_a_team_step_has_the_bits_of_one_thread(tiny_blocks, split_keys, team):
    """A decode step of few rows runs as one team of threads meeting between products; split rows' pieces are
    shared among them and merged after. The logits and the k/v written are those of the step on one thread,
    also with more threads than cores (whose waits give their cores away)."""
    threads = torch.get_num_threads()
    size = threads if team == "torch's threads" else 2 * (os.cpu_count() or 1)
    out = {}
    for n_threads in (size, 1):
        torch.set_num_threads(n_threads)
        try:
            manager, fast, tables = team_case(tiny_blocks)
            starts = [t.num_tokens for t in tables]
            new = [[7], [7, 8], [7]]
            for t, ids in zip(tables, new):
                manager.append_slots(t, ids)
            ids, md = prepare([Chunk(x, s, t.blocks) for x, s, t in zip(new, starts, tables)], manager.block_size)
            out[n_threads] = (*fast.block_step(ids, md, fast.storage, split_keys=split_keys), fast.storage.k.clone())
        finally:
            torch.set_num_threads(threads)
    (logits, best, k), (one, best_one, k_one) = out[size], out[1]
    assert logits.shape == (3, tiny_blocks.cfg.vocab_size)
    assert torch.equal(logits, one) and torch.equal(k, k_one)
    assert torch.equal(best, logits.argmax(-1)) and torch.equal(best_one, best)


def test_a_bad_block_in_a_team_step_is_refused_and_the_next_step_runs(tiny_cfg, compiled):
    """A request's block outside the pool is found inside the team's parallel region, where every thread checks
    it: the step raises it by name instead of leaving a thread waiting for another, and the next step runs."""
    manager, fast, tables = team_case(to_blocks(Llama.random(tiny_cfg, seed=9), activations="int8"))
    start = tables[2].num_tokens
    manager.append_slots(tables[2], [7])
    ids, md = prepare([Chunk([7], start, tables[2].blocks)], manager.block_size)
    bad = md.block_tables.clone()
    bad[0, 1] = 99
    with pytest.raises(RuntimeError, match="request 0: block 99 is not in the pool of 64"):
        fast.block_step(ids, type(md)(**{**md.__dict__, "block_tables": bad}), fast.storage)
    assert fast.block_step(ids, md, fast.storage)[0].shape == (1, tiny_cfg.vocab_size)


def test_a_pool_of_another_dtype_than_the_models_cache_is_refused_by_name(tiny_cfg, compiled):
    model = to_blocks(Llama.random(tiny_cfg, seed=8)).round_kv(torch.bfloat16)
    _, md = prepare([Chunk([5], 3, [0])], 4)
    with pytest.raises(RuntimeError, match="k_cache/v_cache: expected contiguous BFloat16"):
        BlockStep.of(model)(torch.tensor([5]), md, KVStorage(model.cfg, 8, 4))  # a float32 pool


@pytest.mark.parametrize("activations, kv", [("fp32", "auto"), ("int8", "auto"), ("int8", "bfloat16")])
def test_the_real_model_on_blocks_steps_compiled_with_the_same_logits(model_dir, tok, compiled, activations, kv):
    model = nanoserve.load(model_dir, weights="gguf", activations=activations, kv_cache_dtype=kv)[0]
    assert model.activations == activations
    manager, fast, slow = runners(model, 64, 16)
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n"), [1] * 40]
    for f, s in run_both(manager, fast, slow, prompts, steps=4):
        assert torch.equal(f, s)
    # a long chunk after a cached context (its step's buffers too large to keep), then a decode step on the kept ones
    t = manager.new_table()
    manager.append_slots(t, [7] * 8)
    for r in (fast, slow):
        r.execute([Chunk([7] * 8, 0, t.blocks)])
    for new in ([11] * 300, [12]):
        start = t.num_tokens
        manager.append_slots(t, new)
        assert torch.equal(fast.execute([Chunk(new, start, t.blocks)]), slow.execute([Chunk(new, start, t.blocks)]))


@pytest.mark.parametrize("road", ["int8", "fp32 tiles"])
def test_the_steps_argmax_takes_the_first_of_tied_logits_across_the_teams_shares(tiny_cfg, compiled, road):
    """The step's threads each find the largest logit in their share of the vocabulary; joined, the first one
    wins a tie, as torch.argmax's does. A head of zeros but for two equal rows far apart (in different threads'
    shares where the team has two or more) ties either those two rows or every zero: the first of them wins."""
    model = Llama.random(ModelConfig.tiny(vocab_size=4096, tie_word_embeddings=False), seed=11)
    with torch.no_grad():
        model.lm_head.zero_()
        model.lm_head[100] = model.lm_head[3000] = torch.randn(tiny_cfg.hidden_size, generator=torch.Generator()
                                                               .manual_seed(0))
    if road == "int8":
        model = to_blocks(model, activations="int8")
    elif not model.pack_weights() or tiled(model.layers[0].wqkv) is None:
        pytest.skip("no fp32 tiles on this CPU")
    manager, fast, _ = runners(model, 16, 4)
    t = manager.new_table()
    for ids in ([5, 6, 7], [8]) + tuple([i] for i in range(9, 17)):  # a prompt, then decode steps
        start = t.num_tokens
        manager.append_slots(t, ids)
        logits = fast.execute([Chunk(ids, start, t.blocks)])
        first = 100 if logits[0, 100] > 0 else 0
        assert logits[0, 3000] == logits[0, 100] and int(fast.last_argmax[0]) == first == int(logits.argmax(-1)[0])


@pytest.mark.parametrize("block_size", [1, 4])
def test_decode_runs_steps_in_one_call_as_step_by_step(tiny_blocks, block_size):
    """`BlockStep.decode` (multi-step decoding): k decode steps in one call, each fed the last one's argmax, choose
    the tokens k compiled steps choose one by one, and write the same k/v into the same slots."""
    manager, fast, _ = runners(tiny_blocks, 200, block_size)
    _, other, _ = runners(tiny_blocks, 200, block_size)
    prompts = [list(range(3, 30)), [4, 5], list(range(40, 49))]
    tables = [manager.new_table() for _ in prompts]
    for t, p in zip(tables, prompts):
        manager.append_slots(t, p)
        for r in (fast, other):
            r.execute([Chunk(p, 0, t.blocks)])
    k, first = 6, [7, 8, 9]
    starts = [t.num_tokens for t in tables]
    for t, i in zip(tables, first):
        manager.append_slots(t, [i] * k)  # a slot for each step's token
    chunks = [Chunk([i], s, t.blocks) for i, s, t in zip(first, starts, tables)]
    together = fast.decode(chunks, [], k)
    ids, one_by_one = first, []
    for s in range(k):
        other.execute([Chunk([i], st + s, t.blocks) for i, st, t in zip(ids, starts, tables)])
        ids = other.last_argmax.tolist()
        one_by_one.append(ids)
    assert together.tolist() == one_by_one
    assert torch.equal(fast.storage.k, other.storage.k) and torch.equal(fast.storage.v, other.storage.v)
    # the steps end once every request has chosen one of its stop tokens
    stops = [{one_by_one[2][0], 10_000}, {one_by_one[4][1]}, {one_by_one[1][2]}]
    end = max(next(s for s in range(k) if one_by_one[s][r] in stops[r]) for r in range(3))
    assert end <= 4 and fast.decode(chunks, [], k, stops).tolist() == one_by_one[:end + 1]
    assert fast.decode(chunks, [], k, stops[:1] + [set(), {1}]).tolist() == one_by_one  # one runs on
    with pytest.raises(RuntimeError, match="block_tables: request 0 has no block for position"):
        fast.decode([Chunk([7], starts[0] + k, tables[0].blocks)], [], 64)
    assert torch.equal(fast.storage.k, other.storage.k)  # refused before any step ran


@pytest.mark.parametrize("weights", ["int8", "fp32 tiles"])
def test_a_long_compiled_step_lets_other_threads_run(model_dir, compiled, weights):
    """The compiled step lets go of Python's GIL while it computes (the server's HTTP thread answers during a long
    prefill): a thread sleeping 5 ms at a time keeps waking while one 1,024-token step runs. Were the GIL held, its
    first wake-up would come only when the step ended, seconds late; the bound is generous for a loaded machine."""
    from nanoserve.bench.stall import probed, timer_lateness

    if weights == "int8":
        model = nanoserve.load(model_dir, weights="gguf", activations="int8")[0]
    else:
        model = nanoserve.load(model_dir)[0]
        if tiled(model.layers[0].wqkv) is None:
            pytest.skip("no fp32 tiles on this CPU")
    manager, fast, _ = runners(model, 160, 16)
    prompt = [(7 * i) % 40000 + 3 for i in range(1024)]
    t = manager.new_table()
    manager.append_slots(t, prompt)
    lateness, step_s = probed(lambda: fast.execute([Chunk(prompt, 0, t.blocks)]), timer_lateness, 0.0)
    assert step_s > 0.3, f"a {step_s:.2f} s step is too short to tell whether the GIL was held"
    assert len(lateness) > 5 and max(lateness) < min(0.25, step_s / 3), (step_s, max(lateness), len(lateness))


def test_gemma_on_int8_blocks_steps_compiled_with_the_python_forwards_logits(gemma_dir, gemma_tok, compiled):
    """Gemma 3 on its GGUF blocks with int8 activations steps compiled (its Q4_K, Q6_K, Q5_0 and Q8_0 matrices, q/k/v
    row groups read as one Q8_0 matrix of the same numbers, QK-norm, four norms a layer, GeGLU, two rope tables) on
    the hybrid pool (a block table per KV cache group, each layer in its group's slot): the Python forward's logits
    bit for bit, through a 700-token prompt prefilled in chunks that cross the 512-position window beside short ones,
    then decode steps and short chunks (a team's step); the same K/V in every group's blocks."""
    from nanoserve.kv.groups import kv_cache_groups
    from nanoserve.kv.hybrid import HybridBlockManager

    model = nanoserve.load(gemma_dir, weights="gguf", activations="int8")[0]
    groups = kv_cache_groups(model.cfg)
    assert len(groups) > 1 and any(g.window for g in groups)
    manager = HybridBlockManager(groups, 400, 16, prefix_caching=False)
    fast = ModelRunner(model, KVStorage(model.cfg, 400, 16, groups=groups))
    slow = ModelRunner(model, KVStorage(model.cfg, 400, 16, groups=groups), compiled="ops")
    assert fast.block_step is not None and fast.block_step.gemma and slow.block_step is None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20000, (700,), generator=g).tolist(), gemma_tok.encode("The capital of France is"),
               [7] * 40]
    tables, done = [manager.new_table() for _ in prompts], [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):  # 256 tokens a step: the window's edge mid-chunk
        chunks = []
        for i, (t, p) in enumerate(zip(tables, prompts)):
            if done[i] < len(p):
                new = p[done[i]:done[i] + 256]
                manager.append_slots(t, new)
                chunks.append(Chunk(new, done[i], t.blocks))
                done[i] += len(new)
        assert torch.equal(fast.execute(chunks), slow.execute(chunks))
    for s in range(4):
        chunks = []
        for t in tables:
            new = torch.randint(3, 20000, (2 if s == 1 else 1,), generator=g).tolist()
            start = t.num_tokens
            manager.append_slots(t, new)
            chunks.append(Chunk(new, start, t.blocks))
        logits = fast.execute(chunks)
        assert torch.equal(logits, slow.execute(chunks)) and torch.equal(fast.last_argmax, logits.argmax(-1))
    assert torch.equal(fast.storage.k, slow.storage.k) and torch.equal(fast.storage.v, slow.storage.v)
    t = tables[1]  # decode steps: one compiled step each (BlockModel.decode runs Llama's steps only)
    chunk = Chunk([5], t.num_tokens, t.blocks)
    manager.append_slots(t, [0, 0])
    assert torch.equal(fast.decode([chunk], [], 2), slow.decode([chunk], [], 2))
    with pytest.raises(RuntimeError, match="decode: a Gemma model's steps run one `step` call each"):
        fast.block_step.compiled.decode(1, torch.tensor([5]), torch.tensor([0]), *model.rope_tables(8),
                                        fast.storage.k, fast.storage.v, torch.zeros(1, 1, dtype=torch.long),
                                        torch.full((1, 1), -1), 0.0625, 0)
