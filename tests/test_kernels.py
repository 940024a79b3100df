"""The compiled decode kernels against the torch ops they replace, and the batch built on them (Day 29)."""

import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from nanoserve import kernels
from nanoserve.batch import StaticBatch, decode_attention, greedy_generate_batch, key_bias, use_kernels, value_bags
from nanoserve.model import Llama, apply_rope, rms_norm

HAVE_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(scope="module")
def ext():
    module = kernels.load()
    if module is None:
        pytest.skip(f"no compiled kernels here: {kernels.unavailable_reason()}")
    return module


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
def test_the_kernels_build_where_there_is_a_compiler():
    """Where the engine could have them, it must: a broken build would silently cost the batch its speed."""
    assert kernels.load() is not None, kernels.unavailable_reason()


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_is_the_residual_add_and_torch_rms_norm(ext, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 96, generator=g) * 3
    r = torch.randn(5, 3, 96, generator=g) if with_residual else None
    w = torch.rand(96, generator=g) + 0.5
    x0 = x.clone()
    out, h = ext.add_rms_norm(x, r, w, 1e-5)
    want = x0 + r if with_residual else x0
    assert torch.equal(out, want)  # one fp32 add: exact
    assert torch.equal(x, x0)  # x itself is not written
    torch.testing.assert_close(h, rms_norm(want, w, 1e-5), atol=2e-6, rtol=2e-6)


def test_rope_rotates_the_q_and_k_heads_in_place_and_leaves_v(ext):
    g = torch.Generator().manual_seed(1)
    B, T, H, K, D = 3, 4, 6, 2, 16
    qkv = torch.randn(B, T, H + 2 * K, D, generator=g)
    angles = torch.rand(B, T, D // 2, generator=g) * 50
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    want = apply_rope(qkv[:, :, : H + K], cos, sin)
    v = qkv[:, :, H + K:].clone()
    ext.rope_(qkv, cos.reshape(B * T, D), sin.reshape(B * T, D), H + K)
    torch.testing.assert_close(qkv[:, :, : H + K], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, :, H + K:], v)


def test_silu_mul_is_swiglu_including_far_out_inputs(ext):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(7, 2, 2 * 40, generator=g) * 4
    gate_up[0, 0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # past the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    out = ext.silu_mul(gate_up)
    assert out.shape == (7, 2, 40) and torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=2e-6)


def paged_case(seed=3, block_size=4, lens=(1, 9, 4, 17, 6), n_blocks=40, H=6, K=2, D=16):
    """A pool of random k/v, and rows whose blocks are scattered through it (a shuffled free list)."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(n_blocks, block_size, K, D, generator=g)
    v_pool = torch.randn(n_blocks, block_size, K, D, generator=g)
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    W = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (W - len(t)) for t in tables])
    q = torch.randn(len(lens), H, D, generator=g)
    return q, k_pool, v_pool, block_tables, torch.tensor(lens)


def reference_attention(q, k_pool, v_pool, block_tables, lens):
    """The torch path's read: gather each row's keys head-major, mask past its length, weighted value sums."""
    R, H, D = q.shape
    _, bs, K, _ = k_pool.shape
    L = block_tables.shape[1] * bs
    pos = torch.arange(L)
    key_slots = block_tables[:, pos // bs] * bs + pos % bs  # (R, L)
    key_rows = (key_slots[:, None, :] * K + torch.arange(K)[None, :, None]).reshape(-1)
    kc = k_pool.view(-1, D).index_select(0, key_rows).view(R, K, L, D)
    mask = pos[None, :] < lens[:, None]
    return decode_attention(q[:, None], kc, v_pool.view(-1, D), value_bags(key_rows, R, K, H // K),
                            key_bias(mask, K)).view(R, H * D)


def test_paged_decode_attention_matches_the_gather_reference(ext):
    q, k_pool, v_pool, tables, lens = paged_case()
    out = ext.paged_decode_attention(q, k_pool, v_pool, tables, lens, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, reference_attention(q, k_pool, v_pool, tables, lens), atol=2e-6, rtol=2e-6)


def test_paged_decode_attention_rows_do_not_depend_on_their_neighbours(ext):
    """A row's output is bit-identical alone, beside other rows, and beside a much longer row."""
    q, k_pool, v_pool, tables, lens = paged_case(lens=(5, 3, 60))
    scale = q.shape[-1] ** -0.5
    together = ext.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale)
    for r in range(3):
        alone = ext.paged_decode_attention(q[r: r + 1], k_pool, v_pool, tables[r: r + 1, : -(-int(lens[r]) // 4)],
                                           lens[r: r + 1], scale)
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("lens, block, match", [
    ((0, 3), None, "context length 0 outside 1..8"),
    ((9, 3), None, "context length 9 outside 1..8"),
    ((5, 3), 99, "block 99 is not in the pool of 40"),
])
def test_paged_decode_attention_refuses_impossible_tables(ext, lens, block, match):
    q, k_pool, v_pool, tables, _ = paged_case(lens=(5, 3))
    if block is not None:
        tables[0, 1] = block
    with pytest.raises(RuntimeError, match=match):
        ext.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 0.25)


def test_the_kernels_refuse_the_wrong_dtype_or_layout(ext):
    with pytest.raises(RuntimeError, match="x: expected a float32 CPU tensor"):
        ext.add_rms_norm(torch.ones(2, 8, dtype=torch.float64), None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up: expected a contiguous tensor"):
        ext.silu_mul(torch.ones(8, 4).t())
    with pytest.raises(RuntimeError, match="weight: expected 8 numbers, got 7"):
        ext.add_rms_norm(torch.ones(2, 8), None, torch.ones(7), 1e-5)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [29]]


def step_logits(model, prompts, steps, kernels_on):
    sb = StaticBatch(model, prompts, [steps] * len(prompts), block_size=4, kernels=kernels_on)
    return torch.stack([sb.prefill()] + [sb.step() for _ in range(steps)], 1)  # (B, steps + 1, V)


def test_compiled_steps_agree_with_torch_ops_steps(ext, tiny_model):
    """Same weights, same products: the two paths differ only by the glue's fp32 rounding."""
    fast, ref = step_logits(tiny_model, PROMPTS, 6, True), step_logits(tiny_model, PROMPTS, 6, False)
    assert torch.equal(fast[:, 0], ref[:, 0])  # the prefill is the same code on both
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-5)


def test_compiled_rows_are_bit_identical_in_any_batch(ext, tiny_model):
    a, b, c = (step_logits(tiny_model, ps, 5, True) for ps in (PROMPTS[:3], PROMPTS[2:], PROMPTS))
    assert torch.equal(a[2], b[0]) and torch.equal(c[3], b[1])


def test_use_kernels_follows_the_request_and_the_model(ext, tiny_model, tiny_cfg):
    assert use_kernels(tiny_model) and use_kernels(tiny_model, True)
    assert not use_kernels(tiny_model, False)
    bf16 = Llama.random(tiny_cfg, dtype=torch.bfloat16)
    assert not use_kernels(bf16)
    with pytest.raises(ValueError, match="fp32 only; this model is torch.bfloat16"):
        use_kernels(bf16, True)


def test_without_the_kernels_the_batch_runs_on_torch_ops(tiny_model, monkeypatch):
    """A failed build says why, once, and costs speed, not tokens."""
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise OSError("no compiler found")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(OSError: no compiler found\); batched decode steps run"):
        assert kernels.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert kernels.load() is None
        out = greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=4)
    monkeypatch.setattr(kernels, "_state", {"reason": "x"})  # still unavailable, compare with the torch path
    assert out == greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=4, kernels=False)
    with pytest.raises(RuntimeError, match="compiled kernels are unavailable: x"):
        StaticBatch(tiny_model, PROMPTS, [1] * len(PROMPTS), kernels=True)


def test_the_environment_switch_turns_them_off_quietly(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.load() is None
    assert kernels.unavailable_reason() == "NANOSERVE_KERNELS=0"


def test_cpp_source_returns_one_whole_function_with_its_comment():
    src = kernels.cpp_source("silu_mul")
    assert src.startswith("// SwiGLU's middle") and "torch::Tensor silu_mul(torch::Tensor gate_up) {" in src
    assert src.endswith("\n}") and "paged_decode_attention" not in src
    with pytest.raises(KeyError, match="no function 'nope'"):
        kernels.cpp_source("nope")
