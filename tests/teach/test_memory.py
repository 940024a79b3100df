"""The memory arithmetic of Days 14 and 15, pinned exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.cli import main
from nanoserve.config import CacheConfig, ModelConfig
from nanoserve.kv import KVStorage
from nanoserve.kv.groups import kv_cache_groups
from nanoserve.kv.hybrid import HybridBlockManager
from nanoserve.model import Llama
from nanoserve.stages import KVCache
from nanoserve.teach.memory import (
    KNOWN_MODELS,
    CacheCost,
    blocks_needed,
    cache_cost,
    contiguous_usage,
    dtype_bytes,
    fits_contiguous,
    fits_paged,
    human_bytes,
    kv_bytes_per_request,
    kv_bytes_per_token,
    kv_cache_bytes,
    n_parameters,
    paged_usage,
    read_lengths,
    requests_that_fit,
    sample_lengths,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "lengths-lognormal.csv"
lengths_st = st.lists(st.integers(1, 600), min_size=1, max_size=40)


# ---- Day 14: bytes ----------------------------------------------------------------------------------


def test_smollm2_bytes_per_token():
    cfg = KNOWN_MODELS["SmolLM2-135M"]
    assert kv_bytes_per_token(cfg, 4) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(cfg, 2) == 23040
    assert kv_cache_bytes(cfg, context=8192, batch=1, dtype_bytes=4) == 46080 * 8192  # 360 MiB
    assert kv_cache_bytes(cfg, context=100, batch=3, dtype_bytes=4) == 46080 * 300


def test_llama3_8b_is_128_kib_per_token_in_bf16():
    """The figure usually quoted for Llama-3-8B: 2 x 32 layers x 8 KV heads x 128 x 2 bytes."""
    assert kv_bytes_per_token(KNOWN_MODELS["Llama-3-8B"], 2) == 128 * 1024


def test_known_shapes_match_the_real_checkpoint(model_dir):
    real = ModelConfig.from_folder(model_dir)
    known = KNOWN_MODELS["SmolLM2-135M"]
    for field in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "intermediate_size",
                  "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(real, field) == getattr(known, field), field


@pytest.mark.parametrize("name", list(KNOWN_MODELS))
def test_parameter_count_matches_the_model_class(name):
    """n_parameters is the arithmetic; the Llama class built on the meta device is the count it must equal."""
    cfg = KNOWN_MODELS[name]
    with torch.device("meta"):
        model = Llama(cfg)
    assert n_parameters(cfg) == model.num_parameters()


def test_parameter_counts_are_the_published_sizes():
    published = {"SmolLM2-135M": 135e6, "SmolLM2-360M": 362e6, "TinyLlama-1.1B": 1.1e9,
                 "Llama-3.2-1B": 1.24e9, "Llama-3-8B": 8.03e9}
    for name, size in published.items():
        assert n_parameters(KNOWN_MODELS[name]) == pytest.approx(size, rel=0.01), name


def test_against_the_cache_tensors():
    cfg = ModelConfig.tiny()
    for max_len, batch, dtype in [(32, 1, torch.float32), (17, 3, torch.bfloat16)]:
        cache = KVCache(cfg, max_len=max_len, batch=batch, dtype=dtype)
        held = (cache.k.numel() + cache.v.numel()) * cache.k.element_size()
        assert held == kv_cache_bytes(cfg, max_len, batch, dtype_bytes(dtype))
    pool = KVStorage(cfg, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    assert pool.nbytes == kv_cache_bytes(cfg, 5 * 4, 1, 2)  # a paged pool: the same bytes per slot


def test_dtype_bytes():
    assert [dtype_bytes(x) for x in (4, "float32", "bfloat16", "float8", torch.float16)] == [4, 4, 2, 1, 2]
    for bad in ("float13", 0, -2, True, None):
        with pytest.raises(ValueError):
            dtype_bytes(bad)


def test_cache_cost():
    c = cache_cost("SmolLM2-135M", context=8192, batch=1, dtype="float32")
    assert isinstance(c, CacheCost)
    assert (c.bytes_per_token, c.cache_bytes, c.weight_bytes) == (46080, 46080 * 8192, 134515008 * 4)
    assert c.cache_to_weights == pytest.approx(46080 * 8192 / (134515008 * 4))
    assert "SmolLM2-135M" in str(c) and "45 KiB/token" in str(c)
    assert cache_cost(ModelConfig.tiny(), 10).model == "model"
    with pytest.raises(ValueError, match="unknown model"):
        cache_cost("GPT-5", 10)
    with pytest.raises(ValueError, match="context"):
        kv_cache_bytes(ModelConfig.tiny(), -1)


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 999, 46080, 3 * 2**30, 1.5 * 2**40)] == [
        "0 B", "999 B", "45 KiB", "3 GiB", "1.5 TiB"]


# ---- Day 15: waste ----------------------------------------------------------------------------------


def test_worked_examples():
    c = contiguous_usage([5, 16, 17], max_len=32)
    assert (c.used_tokens, c.held_tokens, c.waste_tokens, c.worst_per_request) == (38, 96, 58, 27)
    p = paged_usage([5, 16, 17], block_size=16)
    assert (p.used_tokens, p.held_tokens, p.waste_tokens, p.worst_per_request) == (38, 64, 26, 15)
    assert p.waste_fraction == pytest.approx(26 / 64) and p.utilisation == pytest.approx(38 / 64)
    assert [blocks_needed(n, 16) for n in (1, 15, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="empty"):
        paged_usage([], 16)
    with pytest.raises(ValueError, match="ints >= 1"):
        paged_usage([3, 0], 16)
    with pytest.raises(ValueError, match="block_size"):
        paged_usage([3], 0)
    with pytest.raises(ValueError, match="longer than max_len=10"):
        contiguous_usage([3, 11], 10)
    with pytest.raises(ValueError):
        fits_paged([3], -1, 16)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, block_size=st.integers(1, 256))
def test_paging_wastes_less_than_one_block_per_sequence(lengths, block_size):
    p = paged_usage(lengths, block_size)
    assert p.used_tokens == sum(lengths)
    assert 0 <= p.worst_per_request < block_size
    assert 0 <= p.waste_tokens <= len(lengths) * (block_size - 1)
    assert p.held_tokens % block_size == 0
    assert p.waste_tokens == sum(math.ceil(n / block_size) * block_size - n for n in lengths)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, log2_bs=st.integers(0, 6))
def test_paging_never_holds_more_than_a_max_length_reservation(lengths, log2_bs):
    block_size, max_len = 2**log2_bs, 1024  # block size divides max_len
    c, p = contiguous_usage(lengths, max_len), paged_usage(lengths, block_size)
    assert c.used_tokens == p.used_tokens
    assert p.held_tokens <= c.held_tokens
    assert paged_usage(lengths, 1).waste_tokens == 0


def _admit_one_by_one(lengths, budget_tokens, block_size):
    free, n = budget_tokens // block_size, 0
    while True:
        need = math.ceil(lengths[n % len(lengths)] / block_size)
        if need > free:
            return n
        free -= need
        n += 1


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, budget=st.integers(0, 20000), block_size=st.integers(1, 64))
def test_fits_paged_equals_admitting_one_by_one(lengths, budget, block_size):
    assert fits_paged(lengths, budget, block_size) == _admit_one_by_one(lengths, budget, block_size)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, budget=st.integers(0, 50000), log2_bs=st.integers(0, 6))
def test_paging_admits_at_least_as_many(lengths, budget, log2_bs):
    n_cont = fits_contiguous(budget, 1024)
    assert n_cont == budget // 1024
    assert fits_paged(lengths, budget, 2**log2_bs) >= n_cont
    assert fits_paged(lengths, budget + 1024, 2**log2_bs) >= fits_paged(lengths, budget, 2**log2_bs)


# ---- the length distribution ------------------------------------------------------------------------


def test_sample_lengths_is_deterministic_and_bounded():
    a, b = sample_lengths(300, seed=1, max_len=512), sample_lengths(300, seed=1, max_len=512)
    assert a == b and a != sample_lengths(300, seed=2, max_len=512)
    assert all(1 <= r.prompt_tokens <= 256 and r.output_tokens >= 1 and r.total <= 512 for r in a)


def test_committed_lengths_file_holds_what_the_lengths_command_draws(tmp_path):
    """Running `python -m nanoserve lengths` with the committed file's arguments gives its rows again."""
    again = tmp_path / "again.csv"
    assert main(["lengths", "-n", "1000", "--seed", "0", "--out", str(again)]) == 0
    assert again.read_text().splitlines()[1:] == DATA.read_text().splitlines()[1:]
    rows = read_lengths(DATA)
    assert len(rows) == 1000 and max(r.total for r in rows) <= 2048


def test_committed_lengths_file_opens_with_the_command_that_wrote_it(tmp_path):
    """The CSV's first line is a command that runs today and writes exactly this file (its --out aside)."""
    first = DATA.read_text().splitlines()[0]
    prefix = "# command: python -m nanoserve lengths "
    assert first.startswith(prefix), f"{DATA.name} opens with {first!r}, not a `python -m nanoserve lengths` command"
    argv = first.removeprefix("# command: python -m nanoserve ").split()
    argv[argv.index("--out") + 1] = str(tmp_path / "again.csv")
    assert main(argv) == 0
    assert (tmp_path / "again.csv").read_text().splitlines()[1:] == DATA.read_text().splitlines()[1:]


def test_read_lengths_names_the_bad_row(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("# comment\nrequest,prompt_tokens,output_tokens\n0,5,6\n1,x,7\n")
    with pytest.raises(ValueError, match="bad.csv: row"):
        read_lengths(bad)


# ---- sliding windows ---------------------------------------------------------------------------------

GEMMA3_270M = ModelConfig.tiny_gemma3(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
    max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])
"""Gemma 3 270M's shape (its config.json): 18 layers, every 6th full, the others a window of 512."""


@pytest.mark.parametrize("context", [1024, 4096, 16384])
def test_a_windowed_request_holds_3_18_plus_15_18_of_the_window(context):
    full = kv_bytes_per_request(GEMMA3_270M, context, windowed=False)
    assert full == kv_cache_bytes(GEMMA3_270M, context) == 18 * 2 * 256 * 4 * context
    windowed = kv_bytes_per_request(GEMMA3_270M, context)
    assert windowed / full == pytest.approx(3 / 18 + 15 / 18 * 512 / context, rel=1e-12)
    pool = 1 << 30
    assert requests_that_fit(GEMMA3_270M, pool, context, windowed=False) == pool // full
    assert requests_that_fit(GEMMA3_270M, pool, context) == pool // windowed
    assert requests_that_fit(ModelConfig.tiny(), pool, context) == requests_that_fit(  # no window: no change
        ModelConfig.tiny(), pool, context, windowed=False)


@pytest.mark.parametrize("context", [1024, 4096, 16384])
def test_the_block_rounded_bytes_are_what_the_hybrid_manager_holds(context):
    """Gemma 3 270M's six groups on a pool of blocks of 16: a request prefilled in chunks of 256 holds, once its
    context is in, exactly the blocks `kv_bytes_per_request(block_size=16)` counts."""
    groups = kv_cache_groups(GEMMA3_270M)
    m = HybridBlockManager(groups, num_blocks=8000, block_size=16, prefix_caching=False)
    t = m.new_table()
    for s in range(0, context, 256):
        m.append_slots(t, list(range(s, s + 256)))
        m.commit(t)
    held = m.num_held(t) * CacheConfig(block_size=16).bytes_per_block(GEMMA3_270M, 4, len(groups))
    assert held == kv_bytes_per_request(GEMMA3_270M, context, block_size=16)
    assert held < kv_bytes_per_request(GEMMA3_270M, context, block_size=16, windowed=False)
