"""The model on GGUF's blocks: the same numbers as the fp32 conversion, logits inside the fp64 bounds every
fp32 forward meets (not looser ones), and transformers' greedy tokens on every engine road, from
`nanoserve.load(weights="gguf")` with the same API as the fp32 model."""

import pytest
import torch
from prompts import MAX_NEW, PROMPTS, near_tie_horizon, prompt_ids

import nanoserve
from nanoserve import LLM, SamplingParams, generate
from nanoserve.config import CheckpointError
from nanoserve.engine import LLMEngine
from nanoserve.kernels import int8, quant
from nanoserve.model import Llama
from nanoserve.model.gguf_weights import load_gguf, set_activations, to_blocks
from nanoserve.model.matmul import BlockWeight

# ---- a tiny model on blocks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tiny_cfg):
    """A tiny model on blocks, and the same model with each block matrix expanded back to fp32."""
    blocks = to_blocks(Llama.random(tiny_cfg, seed=3))
    dense = Llama.random(tiny_cfg, seed=3)
    with torch.no_grad():
        for mine, theirs in zip(blocks.matrices(), dense.matrices()):
            theirs.copy_(mine.dequantize())
    return blocks, dense


def test_to_blocks_holds_every_matrix_as_blocks_and_counts_their_bytes(tiny_pair, tiny_cfg):
    blocks, dense = tiny_pair
    assert all(isinstance(w, BlockWeight) for w in blocks.matrices()) and blocks.embed is blocks.lm_head
    assert blocks.lm_head.fmt == "q8_0" and blocks.layers[0].wqkv.fmt == "q4_1"
    assert blocks.num_parameters() == dense.num_parameters() and blocks.dtype == torch.float32
    assert blocks.weight_bytes() < dense.weight_bytes() / 3.5


def test_tiny_blocks_forward_is_the_dense_forward_of_the_same_numbers(tiny_pair):
    blocks, dense = tiny_pair
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(blocks(ids), dense(ids), atol=2e-5, rtol=0)


def test_a_gguf_that_is_not_there_or_not_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match="weights='int3'"):
        nanoserve.load(weights="int3")
    with pytest.raises(ValueError, match="do not hold q4_1 rows of 64"):
        BlockWeight(torch.zeros(4, 41, dtype=torch.uint8), "q4_1", 64)


# ---- the shipped checkpoint ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_model(model_dir):
    return nanoserve.load(model_dir, weights="gguf")[0]


def test_every_matrix_is_the_fp32_conversions_numbers_exactly(gguf_model, model):
    """Same file, two holders: each block expands to exactly what the conversion wrote (q/k rows included)."""
    assert [w.fmt for w in gguf_model.matrices()[:4]] == ["q4_1"] * 4 and gguf_model.lm_head.fmt == "q8_0"
    for mine, theirs in zip(gguf_model.matrices(), model.matrices()):
        assert torch.equal(mine.dequantize(), theirs.detach())
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(gguf_model.get_parameter(name), p)
    assert gguf_model.num_parameters() == model.num_parameters()
    assert gguf_model.weight_bytes() < model.weight_bytes() / 5


@pytest.mark.parametrize("name", PROMPTS)
def test_gguf_logits_are_inside_the_same_fp64_bounds(gguf_model, model, tok, fp64_logits, fp64_tol, name):
    """The bounds the fp32 model meets (tests/model/test_llama.py), unchanged: these are the same numbers."""
    last_tol, any_tol = fp64_tol
    ids = prompt_ids(tok, name)
    exact = fp64_logits(ids)
    with torch.inference_mode():
        every = gguf_model(torch.tensor([ids]))[0].double()
        last = gguf_model(torch.tensor([ids]), last_only=True)[0].double()
        fp32 = model(torch.tensor([ids]), last_only=True)[0].double()
    assert (last - exact[-1]).abs().max().item() < last_tol
    assert (every - exact).abs().max().item() < any_tol
    assert (last - fp32).abs().max().item() < 2 * last_tol  # nanoserve fp32: same numbers, another order


@pytest.mark.parametrize("name", PROMPTS)
def test_generate_on_blocks_gives_transformers_greedy_tokens(gguf_model, tok, hf_greedy, name):
    ids, ref_tokens, ref_logits = hf_greedy[name]
    mine = generate(gguf_model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW), tok).token_ids
    h = near_tie_horizon(ref_logits)
    assert mine[:h] == ref_tokens[:h]
    if h == len(ref_tokens):
        assert mine == ref_tokens
    assert h >= min(16, len(ref_tokens))


def test_the_engine_on_blocks_gives_each_request_its_tokens(gguf_model, tok, hf_greedy):
    """Requests batched, chunked and arriving together: each gets transformers' tokens for its prompt alone."""
    engine = LLMEngine(gguf_model, tok, max_num_seqs=4, max_num_batched_tokens=96, num_blocks=64)
    rid = {name: engine.add_request(hf_greedy[name][0], SamplingParams(temperature=0, max_tokens=MAX_NEW))
           for name in PROMPTS}
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for name, r in rid.items():
        _, ref_tokens, ref_logits = hf_greedy[name]
        h = near_tie_horizon(ref_logits)
        assert out[r][:h] == ref_tokens[:h], name
    engine.check_idle()


def test_llm_serves_the_blocks_with_the_same_api(gguf_model, tok):
    llm = LLM(weights="gguf", num_blocks=64)
    assert isinstance(llm.model.lm_head, BlockWeight)
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["The capital of France is", "def fibonacci(n):\n"]
    for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert o.outputs[0].token_ids == generate(gguf_model, tok.encode(p), params, tok).token_ids
    assert quant.load() is not None or quant.unavailable_reason()


@pytest.mark.skipif(not int8.packed_here(), reason="packed copies are the x86 roads'")
def test_pack_false_keeps_no_packed_copy_and_the_same_logits(model_dir):
    """`load(pack=False)` trades the int8 copies' memory for their speed; the numbers stay the same."""
    packed = nanoserve.load(model_dir, weights="gguf", activations="int8")[0]
    bare = nanoserve.load(model_dir, weights="gguf", activations="int8", pack=False)[0]
    assert all(w.int8_packed() is not None for w in packed.block_weights())
    assert all(w.int8_packed() is None for w in bare.block_weights())
    ids = torch.tensor([[1, 504, 3458, 314, 4455, 282]])
    with torch.inference_mode():
        assert torch.equal(packed(ids), bare(ids))


@pytest.mark.skipif(not int8.packed_here(), reason="packed copies are the x86 roads'")
def test_int8_packed_copies_lie_side_by_side_in_one_buffer_with_the_packs_bytes(tiny_cfg):
    """Every int8 matrix's packed copy is made when the activations are set, all in one buffer (on 2 MB pages where
    the OS gives them), each the bytes `int8.pack` makes of its blocks; switching away and back packs them again."""
    model = to_blocks(Llama.random(tiny_cfg, seed=3), activations="int8")
    mats = model.block_weights()
    packed = [w.int8_packed() for w in mats]
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
    assert all(p.data_ptr() % 64 == 0 and torch.equal(p, int8.pack(w.blocks, w.fmt)) for w, p in zip(mats, packed))
    set_activations(model, "fp32")
    assert all(w.int8_packed() is None for w in mats)
    set_activations(model, "int8")
    again = [w.int8_packed() for w in mats]
    assert all(torch.equal(a, p) for a, p in zip(again, packed))
