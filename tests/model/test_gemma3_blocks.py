"""Gemma 3 on its GGUF's own blocks (Q5_0, Q8_0, Q4_K, Q6_K): each matrix the fp32 conversion's numbers exactly,
transformers' logits and greedy tokens on the engine with fp32 activations, and with int8 activations logits within
a stated distance of those and each request's tokens whatever its batch. A made-up file checks the same without
the download, and that a format with no kernel is expanded to fp32 with one line saying so."""

import warnings

import pytest
import torch
from test_fetch import write_tiny_gemma3_gguf
from test_gemma3 import GEMMA_PROMPTS, GEMMA_TOL

import nanoserve
from nanoserve import LLM, SamplingParams
from nanoserve.model import fetch, load_model
from nanoserve.model.gguf_weights import load_gguf
from nanoserve.model.matmul import BlockWeight, RowGroups, linear

TINY_FORMATS = {"token_embd.weight": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0",
                "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K",
                "blk.1.ffn_up.weight": "Q4_0", "blk.2.attn_v.weight": "Q5_0"}


def _numbers(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, BlockWeight | RowGroups) else w.detach()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma-blocks")
    gguf = write_tiny_gemma3_gguf(tmp / "tiny.gguf", formats=TINY_FORMATS, ffn=256)
    return gguf, fetch.convert_gguf(gguf, tmp / "folder")


def test_a_made_up_file_on_blocks_is_its_conversions_numbers(tiny_files):
    gguf, folder = tiny_files
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        blocks = load_gguf(gguf)
    dense = load_model(folder)
    lines = [str(w.message) for w in seen]
    assert lines == ["tiny.gguf: 1 Q4_0 matrices (blk.1.ffn_up.weight, ...) have no block kernel; expanded to fp32 "
                     "(0.1 MB)"], lines
    b0, b1, b2 = blocks.layers
    assert isinstance(b0.wqkv, RowGroups) and [p.fmt for p in b0.wqkv.parts] == ["q5_0", "q5_0", "q8_0"]
    assert isinstance(b2.wqkv, BlockWeight) and b2.wqkv.fmt == "q5_0"  # one format: one BlockWeight
    assert (b0.wo.fmt, b0.w_gate_up.fmt, b0.w_down.fmt, blocks.embed.fmt) == ("q4_k", "q5_0", "q6_k", "q8_0")
    assert isinstance(b1.w_gate_up, torch.nn.Parameter)  # gate Q5_0 beside up Q4_0: expanded whole
    for mine, theirs in zip(blocks.matrices(), dense.matrices()):
        assert torch.equal(_numbers(mine), theirs.detach())
    for name, p in dense.named_parameters():
        if "norm" in name:
            assert torch.equal(blocks.get_parameter(name), p), name
    assert blocks.num_parameters() == dense.num_parameters() and blocks.matrix_dtype == "gguf blocks"
    ids = torch.randint(0, 275, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(blocks(ids), dense(ids), atol=1e-4, rtol=0)


@pytest.mark.filterwarnings("ignore:tiny.gguf")
def test_row_groups_multiply_as_their_stacked_numbers(tiny_files):
    blocks = load_gguf(tiny_files[0])
    w = blocks.layers[0].wqkv
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), x @ w.dequantize().T, atol=1e-5, rtol=1e-5)
        assert torch.equal(linear(x[2:3], w), linear(x, w)[2:3])  # a row's bits, alone or in a batch
    assert w.nbytes() == sum(p.blocks.numel() for p in w.parts) and tuple(w.shape) == (1536, 64)


def test_a_gemma_gguf_is_a_clear_error_where_it_cannot_be_read(tmp_path, tiny_files):
    cut = write_tiny_gemma3_gguf(tmp_path / "cut.gguf", formats=TINY_FORMATS, ffn=256, drop=("blk.1.attn_v.weight",))
    with pytest.raises(nanoserve.config.CheckpointError, match="cut.gguf: tensor 'blk.1.attn_v.weight' is missing"):
        load_gguf(cut)
    with pytest.raises(fetch.FetchError, match="not a folder converted from a GGUF nanoserve fetches"):
        nanoserve.load(tiny_files[1], weights="gguf")


# ---- the shipped file ---------------------------------------------------------------------------------------

INT8_MAX, INT8_MEAN = 5.0, 0.6
"""Max and mean abs logit difference of int8 activations from the blocks on fp32, SmolLM2's bounds
(tests/test_numerics.py): int8 rounds each product's input by up to 1/254 of its block's largest value
(`kernels.int8`). Measured on Gemma, logits of magnitude 20-40: max 0.6 and mean 0.07 on the short prompts, max 2.1
and mean 0.21 over the 1,547 positions of long_prose."""


@pytest.fixture(scope="module")
def gemma_blocks(gemma_dir):
    return nanoserve.load("gemma3-270m", weights="gguf")[0]


@pytest.fixture(scope="module")
def gemma_int8(gemma_dir):
    return nanoserve.load("gemma3-270m", weights="gguf", activations="int8")[0]


def test_the_shipped_blocks_are_the_folders_numbers(gemma_blocks, gemma):
    fmts = {w.fmt for w in gemma_blocks.block_weights()}
    assert fmts == {"q5_0", "q8_0", "q4_k", "q6_k"} and gemma_blocks.embed.fmt == "q8_0"
    assert sum(isinstance(blk.wqkv, RowGroups) for blk in gemma_blocks.layers) == 9  # v in Q8_0 beside Q5_0 q, k
    for mine, theirs in zip(gemma_blocks.matrices(), gemma.matrices()):
        assert torch.equal(_numbers(mine), theirs.detach())
    for name, p in gemma.named_parameters():
        if "norm" in name:
            assert torch.equal(gemma_blocks.get_parameter(name), p), name
    assert gemma_blocks.num_parameters() == gemma.num_parameters()
    assert gemma_blocks.weight_bytes() < gemma.weight_bytes() / 4


@pytest.mark.parametrize("name", ["plain", "long_prose"])
def test_blocks_logits_match_transformers_at_every_position(gemma_blocks, gemma_int8, hf_gemma, gemma_tok, name):
    """The no-cache forward over the whole prompt on the blocks: transformers' logits within GEMMA_TOL at every
    50th position and the last; int8 activations within INT8_MAX, INT8_MEAN of the blocks' own."""
    ids = torch.tensor([gemma_tok.encode(GEMMA_PROMPTS[name][0])])
    rows = torch.tensor(sorted({*range(0, ids.shape[1], 50), ids.shape[1] - 1}))
    with torch.inference_mode():
        logits = gemma_blocks.logits(gemma_blocks.hidden_states(ids)[0][rows])
        ref = hf_gemma.lm_head(hf_gemma.model(ids).last_hidden_state[0][rows])
        fast = gemma_int8.logits(gemma_int8.hidden_states(ids)[0][rows])
    assert (logits - ref).abs().max() < GEMMA_TOL
    diff = (fast - logits).abs()
    assert 0 < diff.max() <= INT8_MAX and diff.mean() <= INT8_MEAN


def test_the_engine_on_blocks_gives_transformers_greedy_tokens(gemma_dir, hf_gemma):
    """`LLM("gemma3-270m", weights="gguf")`: all five prompts in one batch, prefilled in chunks of 256 that cross the
    window's edge: the reference's greedy tokens up to its first near-tie."""
    from nanoserve.teach.reference import assert_same_greedy, reference_greedy

    llm = LLM("gemma3-270m", weights="gguf", max_num_seqs=8, max_num_batched_tokens=256)
    names = list(GEMMA_PROMPTS)
    outs = llm.generate([GEMMA_PROMPTS[n][0] for n in names],
                        [SamplingParams(temperature=0, max_tokens=GEMMA_PROMPTS[n][1], ignore_eos=True) for n in names],
                        use_tqdm=False)
    for name, out in zip(names, outs):
        ref_tokens, ref_logits = reference_greedy(hf_gemma, out.prompt_token_ids, GEMMA_PROMPTS[name][1],
                                                  ignore_eos=True)
        assert assert_same_greedy(out.outputs[0].token_ids, ref_tokens, ref_logits) >= 4, name
    llm.engine.check_idle()


def test_int8_keeps_each_requests_tokens_whatever_its_batch(gemma_dir):
    """int8 activations on the engine: each request's greedy tokens batched with the others under a small step
    budget (the long prompt cut into chunks beside decode rows) are the tokens it gets alone."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    names = ["plain", "code", "poem", "long_list"]
    busy = LLM("gemma3-270m", weights="gguf", activations="int8", max_num_batched_tokens=128)
    together = [o.outputs[0].token_ids for o in busy.generate([GEMMA_PROMPTS[n][0] for n in names], sp,
                                                               use_tqdm=False)]
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in busy.engine.history)
    alone = LLM("gemma3-270m", weights="gguf", activations="int8", max_num_batched_tokens=2048)
    assert together == [alone.generate([GEMMA_PROMPTS[n][0]], sp, use_tqdm=False)[0].outputs[0].token_ids
                        for n in names]


def test_generate_sizes_its_engine_for_every_kv_cache_group(gemma_blocks, gemma_tok):
    """`generate` (one request, an engine sized for it) on a 1,699-token prompt: room for its blocks in all six KV
    cache groups, and the greedy tokens the engine gives the same request beside others."""
    from nanoserve import generate

    ids = gemma_tok.encode(GEMMA_PROMPTS["long_list"][0])
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = generate(gemma_blocks, ids, sp).token_ids
    llm = LLM("gemma3-270m", weights="gguf")
    together = llm.generate([{"prompt_token_ids": ids}, GEMMA_PROMPTS["plain"][0]], sp, use_tqdm=False)
    assert alone == together[0].outputs[0].token_ids and len(alone) == 6
