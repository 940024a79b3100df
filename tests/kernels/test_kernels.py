"""The compiled kernels against the torch ops they replace, their refusals of bad input, and the engine
without them (no compiler, NANOSERVE_KERNELS=0). Their attention is compared with the other two
implementations in tests/attention/."""

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanoserve import kernels
from nanoserve.engine import ModelRunner
from nanoserve.kv import KVStorage
from nanoserve.model import apply_rope, rms_norm
from nanoserve.model import ops as model_ops
from nanoserve.stages import StaticBatch, greedy_generate_batch

HAVE_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))

@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
def test_the_kernels_build_where_there_is_a_compiler():
    """Where the engine could have them, it must: a broken build would silently cost every step its speed."""
    assert kernels.load() is not None, kernels.unavailable_reason()
    assert kernels.unavailable_reason() is None and kernels.available()


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_is_the_residual_add_and_torch_rms_norm(compiled, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 96, generator=g) * 3
    r = torch.randn(5, 3, 96, generator=g) if with_residual else None
    w = torch.rand(96, generator=g) + 0.5
    x0 = x.clone()
    out, h = kernels.add_rms_norm(x, r, w, 1e-5)
    want = x0 + r if with_residual else x0
    assert torch.equal(out, want)  # one fp32 add: exact
    assert torch.equal(x, x0)  # x itself is not written
    torch.testing.assert_close(h, rms_norm(want, w, 1e-5), atol=2e-6, rtol=2e-6)


def rope_inputs(seed: int, B: int, T: int, H: int, K: int, D: int):
    """A random qkv (B, T, H + 2K, D) and cos/sin (B, T, 1, D) of random angles."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, H + 2 * K, D, generator=g)
    angles = torch.rand(B, T, D // 2, generator=g) * 50
    angles = torch.cat([angles, angles], -1)
    return qkv, angles.cos()[:, :, None], angles.sin()[:, :, None]


def test_rope_rotates_the_q_and_k_heads_in_place_and_leaves_v(compiled):
    B, T, H, K, D = 3, 4, 6, 2, 16
    qkv, cos, sin = rope_inputs(1, B, T, H, K, D)
    want = apply_rope(qkv[:, :, : H + K], cos, sin)
    v = qkv[:, :, H + K:].clone()
    out = kernels.rope_(qkv.view(B * T, H + 2 * K, D), cos.reshape(B * T, D), sin.reshape(B * T, D), H + K)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :, : H + K], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, :, H + K:], v)


def test_rope_rounding_to_bf16_is_torchs_rounding_bit_for_bit(compiled):
    """round_bf16: q, k and v take a bf16 cache's numbers in the rope call, exactly as .to(bf16).to(fp32) gives
    them: ties to even, infinities and NaNs, signed zeros, subnormals, an odd-sized tail."""
    g = torch.Generator().manual_seed(4)
    N, HT, D = 5, 3, 22  # 330 numbers: whole vector lanes, then a tail
    qkv = torch.randn(N, HT, D, generator=g) * 10.0 ** torch.randint(-40, 38, (N, HT, D), generator=g)
    flat = qkv.view(-1)
    flat[:8] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 1e-40])
    flat[-1] = float("nan")
    flat[-2] = 1 + 2**-8
    want = qkv.to(torch.bfloat16).to(torch.float32)
    kernels.rope_(qkv, torch.ones(N, D), torch.zeros(N, D), 0, round_bf16=True)  # no head rotated: the rounding
    nan = want.isnan()  # (a NaN stays a NaN; its payload bits are torch's own choice, vector or scalar)
    assert torch.equal(qkv.isnan(), nan) and nan.sum() == 2
    assert torch.equal(qkv[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_rope_qk_rounds_to_a_bf16_cache_the_same_on_both_roads(compiled):
    H, K = 6, 2
    qkv, cos, sin = rope_inputs(5, 2, 3, H, K, 16)
    for road in (False, True):  # each road: its own rotation's numbers, then exactly their bf16 rounding
        rounded = model_ops.rope_qk(qkv.clone(), cos, sin, H, K, compiled=road, round_to=torch.bfloat16)
        exact = model_ops.rope_qk(qkv.clone(), cos, sin, H, K, compiled=road)
        assert all(torch.equal(a, b.to(torch.bfloat16).float()) for a, b in zip(rounded, exact))
        assert all(torch.equal(a, b) for a, b in zip(exact, model_ops.rope_qk(qkv.clone(), cos, sin, H, K, road,
                                                                      round_to=torch.float32)))


def test_silu_mul_is_swiglu_including_far_out_inputs(compiled):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(7, 2, 2 * 40, generator=g) * 4
    gate_up[0, 0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # past the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels.silu_mul(gate_up)
    assert out.shape == (7, 2, 40) and torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=2e-6)


def test_gelu_tanh_mul_is_geglu_including_far_out_inputs(compiled):
    """Gemma's GeGLU: the kernel's x / (1 + e^(-2u)) is torch's 0.5 x (1 + tanh(u)) to fp32 rounding."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(7, 2, 2 * 40, generator=g) * 4
    gate_up[0, 0, :4] = torch.tensor([-200.0, -9.0, 9.0, 200.0])  # past the exp's clamps, and the cube's
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels.gelu_tanh_mul(gate_up)
    assert out.shape == (7, 2, 40) and torch.isfinite(out).all()
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, atol=1e-6, rtol=2e-6)
    assert torch.equal(model_ops.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up)  # torch's road
    with pytest.raises(RuntimeError, match="gate_up: last dim 5 is not even"):
        kernels.gelu_tanh_mul(torch.randn(2, 5))


def bf16_case(n: int = 9, C: int = 200) -> torch.Tensor:
    """Numbers with ties, a NaN and infinities among them: what the narrowing to bf16 must round as torch does."""
    x = torch.randn(n, C, generator=torch.Generator().manual_seed(3)) * 4
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2 ** -8])  # 1 + 2^-8: a tie
    return x


def test_silu_mul_in_bf16_is_the_fp32_loop_rounded_once(compiled):
    """A bf16 model's gate_up comes back from its product in bf16 and its down product takes bf16: the kernel
    gives the bits of widening, the fp32 loop, and torch's rounding to bf16 (no second rounding anywhere)."""
    gate_up = bf16_case(9, 2 * 100).bfloat16()
    out = kernels.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, kernels.silu_mul(gate_up.float()).bfloat16(), atol=0, rtol=0, equal_nan=True)
    assert torch.equal(model_ops.silu_mul(gate_up, compiled=False)[1:], F.silu(gate_up[1:, :100].float()).mul(
        gate_up[1:, 100:].float()).bfloat16())  # torch's road: the same arithmetic in torch's ops


def test_add_rms_norm_widens_a_bf16_residual_and_rounds_h_once(compiled):
    x = bf16_case()[1:]
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    w = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(5)) + 0.5
    out, h = kernels.add_rms_norm(x, r, w, 1e-5, torch.bfloat16)
    out32, h32 = kernels.add_rms_norm(x, r.float(), w, 1e-5)
    assert h.dtype == torch.bfloat16 and torch.equal(out, out32) and torch.equal(h, h32.bfloat16())
    assert torch.equal(kernels.add_rms_norm(x, None, w, 1e-5, torch.bfloat16)[1], kernels.add_rms_norm(
        x, None, w, 1e-5)[1].bfloat16())


def test_bf16_rows_are_narrowed_from_any_address(compiled):
    """add_rms_norm narrows h from a row buffer of its own, whose address depends on the row's width: every width
    gives the fp32 loop's numbers rounded once (a narrowing that assumed an aligned buffer faulted on some)."""
    for C in range(1, 130):
        x = torch.randn(3, C, generator=torch.Generator().manual_seed(C))
        w = torch.rand(C, generator=torch.Generator().manual_seed(C + 1)) + 0.5
        h = kernels.add_rms_norm(x, None, w, 1e-5, torch.bfloat16)[1]
        assert torch.equal(h, kernels.add_rms_norm(x, None, w, 1e-5)[1].bfloat16()), C
        gate_up = x.repeat(1, 2).bfloat16()
        assert torch.equal(kernels.silu_mul(gate_up), kernels.silu_mul(gate_up.float()).bfloat16()), C


def in_order_bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16_linear's definition in torch: x rounded to bf16, each output the running fp32 sum, input by input, of
    exact products, rounded to bf16 once."""
    xb, wf = x.bfloat16().float(), w.float()
    out = torch.zeros(x.shape[0], w.shape[0])
    for i in range(x.shape[1]):
        out += xb[:, i:i + 1] * wf[:, i]  # a product of two bf16 numbers: exact in fp32
    return out.bfloat16()


@pytest.mark.parametrize("N", [16, 64, 96, 101, 3])
def test_bf16_linear_is_the_in_order_fp32_sum_rounded_once_for_any_rows(compiled, N):
    """Row counts 1..13 (whole register tiles of 6 rows and each remainder) and 47..53 (either side of 48, where
    the panel is widened in the copy instead of in registers), whole and partial column panels and columns past
    the last tile: the definition's bits, and a row's bits alone are its bits among others (batching cannot move
    a bf16 model's tokens)."""
    g = torch.Generator().manual_seed(N)
    w = (torch.randn(48, N, generator=g) * 0.1).bfloat16().t()  # (N, 48) stored [in, out], as load() keeps it
    x = torch.randn(53, 48, generator=g) * 3
    full = kernels.bf16_linear(x, w)
    assert full.dtype == torch.bfloat16 and torch.equal(full, in_order_bf16_product(x, w))
    for m in [*range(1, 14), *range(47, 53)]:
        assert torch.equal(kernels.bf16_linear(x[:m], w), full[:m]), m
    assert torch.equal(kernels.bf16_linear(x[5:6], w), full[5:6])
    with pytest.raises(RuntimeError, match="w bf16, stored \\[in, out\\]"):
        kernels.bf16_linear(x, w.contiguous())


@pytest.mark.parametrize("N", [16, 64, 96, 1040])
def test_bf16_panels_give_bf16_linears_bits_for_any_rows(compiled, N):
    """The panels packed at load (`pack_bf16_panels`) are the matrix read in another order of bytes, not of sums:
    bf16_panels_linear gives bf16_linear's bits, and the definition's, for every row count either side of the
    register tile's 6 and of 48 (where the panel is widened once), whole and partial panels of 64 columns."""
    g = torch.Generator().manual_seed(N)
    w = (torch.randn(48, N, generator=g) * 0.1).bfloat16().t()  # (N, 48) stored [in, out], as load() keeps it
    panels = kernels.pack_bf16_panels(w)
    assert panels.shape == (N // 16, 48, 16) and torch.equal(panels[-1, :, 3], w[N - 16 + 3])
    x = torch.randn(53, 48, generator=g) * 3
    assert torch.equal(kernels.bf16_panels_linear(x, panels), in_order_bf16_product(x, w))
    for m in [*range(1, 14), *range(47, 53)]:
        assert torch.equal(kernels.bf16_panels_linear(x[:m], panels), kernels.bf16_linear(x[:m], w)), m
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        kernels.pack_bf16_panels(w[:15])
    with pytest.raises(RuntimeError, match="x \\(M, K\\) for panels of K inputs"):
        kernels.bf16_panels_linear(x[:, :40], panels)


def sliced_fma_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32_linear's definition in torch: each output the in-order sum of its slices of 64 inputs, each slice a
    chain of fused multiply-adds from 0 (the product is exact in float64, the sum then rounded once to fp32)."""
    out = None
    for i0 in range(0, x.shape[1], 64):
        s = torch.zeros(x.shape[0], w.shape[0])
        for i in range(i0, min(x.shape[1], i0 + 64)):
            s = (x[:, i:i + 1].double() * w[:, i].double() + s.double()).float()
        out = s if out is None else out + s
    return out


@pytest.mark.parametrize("N", [16, 64, 96, 101, 3])
def test_fp32_linear_is_its_sliced_order_for_any_rows(compiled, N):
    """Rows 1..40 (one row's 4-tile chains, each few-row shape, whole register groups, of 6 rows on AVX2 and 12
    on AVX-512, and their remainders), a last slice shorter than 64 (K = 150) and a last tile past N: the
    definition's bits, a row's bits alone are its bits among others, and within fp32 rounding of fp64."""
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, 150, generator=g) / 150**0.5
    x = torch.randn(40, 150, generator=g)
    tiles = kernels.pack_fp32(w)
    assert tiles.shape == (-(-N // 16), 150, 16)
    full = kernels.fp32_linear(x, tiles, N)
    assert full.shape == (40, N) and torch.equal(full, sliced_fma_product(x, w))
    for m in range(1, 40):
        assert torch.equal(kernels.fp32_linear(x[:m], tiles, N), full[:m]), m
    assert torch.equal(kernels.fp32_linear(x[7:8], tiles, N), full[7:8])
    assert (full.double() - x.double() @ w.double().T).abs().max().item() < 1e-5
    assert kernels.fp32_linear(x[:0], tiles, N).shape == (0, N)
    with pytest.raises(RuntimeError, match="tiles \\(ceil\\(N / 16\\), K, 16\\) from pack_fp32"):
        kernels.fp32_linear(x[:, :149], tiles, N)


@pytest.mark.parametrize("unit", ["amx", "avx512-bf16"])
@pytest.mark.parametrize("N,K", [(16, 150), (96, 64), (101, 151), (3, 2), (70, 576)])
def test_bf16_tiles_give_a_row_its_bits_for_any_rows_within_bf16_rounding(compiled, unit, N, K):
    """Each unit on the bf16 tiles (AMX's tile unit: chunks of 16 pairs, then the rest one by one; AVX512_BF16's
    pair products): rows 1..40 (every register and tile shape and remainder, both of AMX's row loops), an odd K (a
    zero pairs the last input) and a last tile past N. A row's bits alone are its bits among others; each output is
    within its bf16 rounding (2^-8 relative) of the fp64 sum of the same bf16 numbers, plus fp32's chain error."""
    if unit not in kernels.bf16_tiles_units():
        pytest.skip(f"no {unit} here: bf16 products take another unit, oneDNN or the widening kernel")
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(40, K, generator=g).bfloat16()
    tiles = kernels.pack_bf16(w)
    assert tiles.shape == (-(-N // 16), -(-K // 2), 16, 2) and tiles.dtype == torch.bfloat16
    full = kernels.bf16_tiles_linear(x, tiles, N, unit)
    assert full.shape == (40, N) and full.dtype == torch.bfloat16
    for m in range(1, 40):
        assert torch.equal(kernels.bf16_tiles_linear(x[:m], tiles, N, unit), full[:m]), m
    assert torch.equal(kernels.bf16_tiles_linear(x[7:8], tiles, N, unit), full[7:8])
    ref, size = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert bool(((full.double() - ref).abs() <= 2**-8 * ref.abs() + K * 2**-24 * size).all())
    assert kernels.bf16_tiles_linear(x[:0], tiles, N, unit).shape == (0, N)
    if unit == kernels.bf16_tiles_units()[0]:
        assert torch.equal(kernels.bf16_tiles_linear(x, tiles, N), full)  # the unit taken when none is named
    with pytest.raises(RuntimeError, match="tiles \\(ceil\\(N / 16\\), ceil\\(K / 2\\), 16, 2\\) from pack_bf16"):
        kernels.bf16_tiles_linear(x[:, :K - 2], tiles, N)
    with pytest.raises(RuntimeError, match="x \\(M, K\\) bf16"):
        kernels.bf16_tiles_linear(x.float(), tiles, N)
    with pytest.raises(RuntimeError, match="unit 'vnni' is not one of this CPU's"):
        kernels.bf16_tiles_linear(x, tiles, N, "vnni")


def test_the_kernels_refuse_the_wrong_dtype_or_layout(compiled):
    with pytest.raises(RuntimeError, match="x: expected a float32 CPU tensor"):
        kernels.add_rms_norm(torch.ones(2, 8, dtype=torch.float64), None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up: expected a contiguous float32 or bfloat16 CPU tensor"):
        kernels.silu_mul(torch.ones(8, 4).t())
    with pytest.raises(RuntimeError, match="residual: expected a contiguous float32 or bfloat16 tensor"):
        kernels.add_rms_norm(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight: expected 8 numbers, got 7"):
        kernels.add_rms_norm(torch.ones(2, 8), None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="residual: shape"):
        kernels.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin: expected 2 x 16 numbers"):
        kernels.rope_(torch.ones(2, 3, 16), torch.ones(3, 16), torch.ones(3, 16), 2)


# ---- paged_attention's refusals: every table it is handed is checked before anything is read ---------


def attention_case(lens=(5, 3), T=(1, 2), n_blocks=6, bs=4, H=4, K=2, D=16):
    """Two requests, request r with T[r] query rows at the end of its lens[r] tokens, blocks 0.. in order."""
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(2, n_blocks, bs, K, D, generator=g)
    W = max(-(-n // bs) for n in lens)
    tables = torch.arange(len(lens) * W).view(len(lens), W) % n_blocks
    qsl = torch.tensor([0] + list(torch.tensor(T).cumsum(0).tolist()))
    q = torch.randn(int(qsl[-1]), H, D, generator=g)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, query_start_loc=qsl, seq_lens=torch.tensor(lens),
                block_tables=tables, scale=D**-0.5)


def test_paged_attention_case_runs(compiled):
    out = kernels.paged_attention(**attention_case())
    assert out.shape == (3, 4 * 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("change, match", [
    (dict(q=lambda c: c["q"].double()), "q: expected a float32 CPU tensor, got Double"),
    (dict(k_pool=lambda c: c["k_pool"].half()), "k_pool/v_pool: expected contiguous float32 or bfloat16"),
    (dict(k_pool=lambda c: c["k_pool"].bfloat16()), "pools of one dtype, got BFloat16 and Float"),
    (dict(seq_lens=lambda c: c["seq_lens"].int()), "seq_lens: expected contiguous int64"),
    (dict(block_tables=lambda c: c["block_tables"].int()), "block_tables: expected contiguous int64"),
    (dict(block_tables=lambda c: torch.tensor([[0, 9], [2, 3]])), "request 0: block 9 is not in the pool of 6"),
    (dict(block_tables=lambda c: torch.tensor([[0, 1], [-1, 3]])), "request 1: block -1 is not in the pool of 6"),
    (dict(seq_lens=lambda c: torch.tensor([5, 1])), "request 1: sequence length 1 outside 2..8"),
    (dict(seq_lens=lambda c: torch.tensor([9, 3])), "request 0: sequence length 9 outside 1..8"),
    (dict(query_start_loc=lambda c: torch.tensor([1, 2, 3])), "query_start_loc: expected to start at 0"),
    (dict(query_start_loc=lambda c: torch.tensor([0, 1, 9])), "end by row 3"),
    (dict(query_start_loc=lambda c: torch.tensor([0, 1])), "query_start_loc: expected 3 contiguous int64"),
    (dict(query_start_loc=lambda c: torch.tensor([0, 2, 2])), "request 1: no query rows"),
    (dict(q=lambda c: c["q"][:, :3]), "do not fit q's"),
    (dict(v_pool=lambda c: c["v_pool"][:5]), "k/v pools .* of one shape"),
    (dict(block_tables=lambda c: c["block_tables"][:, :1].contiguous()), "request 0: sequence length 5 outside 1..4"),
    (dict(block_tables=lambda c: c["block_tables"][:1]), "block_tables: expected contiguous int64 .2, W."),
    (dict(block_tables=lambda c: c["block_tables"].t()), "block_tables: expected contiguous int64"),
])
def test_paged_attention_refuses_bad_input_with_a_clear_error(compiled, change, match):
    case = attention_case()
    case.update({k: f(case) for k, f in change.items()})
    with pytest.raises(RuntimeError, match=match):
        kernels.paged_attention(**case)


# ---- the engine with and without them -----------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [29]]


def step_logits(model, prompts, steps, kernels_on):
    sb = StaticBatch(model, prompts, [steps] * len(prompts), block_size=4, compiled=kernels_on)
    return torch.stack([sb.prefill()] + [sb.step() for _ in range(steps)], 1)  # (B, steps + 1, V)


def test_compiled_steps_agree_with_torch_ops_steps(compiled, tiny_model):
    """Same weights, same products: the two roads differ only by the small ops' and attention's fp32 rounding."""
    sb = StaticBatch(tiny_model, PROMPTS, [6] * len(PROMPTS), block_size=4, compiled=True)
    assert sb.compiled and sb.runner.attention == "compiled"
    fast, ref = step_logits(tiny_model, PROMPTS, 6, True), step_logits(tiny_model, PROMPTS, 6, False)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-5)


def test_compiled_rows_are_bit_identical_in_any_batch(compiled, tiny_model):
    a, b, c = (step_logits(tiny_model, ps, 5, True) for ps in (PROMPTS[:3], PROMPTS[2:], PROMPTS))
    assert torch.equal(a[2], b[0]) and torch.equal(c[3], b[1])


def test_use_kernels_follows_the_request_and_the_model(compiled):
    """None: where they can run; True insists (and says why it cannot); False never."""
    assert kernels.use_kernels(torch.float32) and kernels.use_kernels(torch.float32, True)
    assert not kernels.use_kernels(torch.float32, False)
    assert not kernels.use_kernels(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 only; this model is torch.bfloat16"):
        kernels.use_kernels(torch.bfloat16, True)


def test_the_kernels_are_seen_by_torch_function_modes(compiled):
    """Each call goes through handle_torch_function, as torch's ops do: the Day 12 profiler sees it by name."""
    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Watch():
        model_ops.add_rms_norm(torch.ones(2, 8), None, torch.ones(8), 1e-5, compiled=True)
        model_ops.silu_mul(torch.ones(2, 8), compiled=True)
    assert "add_rms_norm" in seen and "silu_mul" in seen


def test_without_the_kernels_the_engine_runs_on_torch_ops(tiny_model, monkeypatch):
    """A failed build says why, once, and costs speed, not tokens."""
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise OSError("no compiler found")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(OSError: no compiler found\); the engine runs on torch"):
        assert kernels.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert kernels.load() is None
        assert not kernels.available() and kernels.describe() == "torch ops (OSError: no compiler found)"
        out = greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=4)
    monkeypatch.setattr(kernels, "_state", {"reason": "x"})  # still unavailable, compare with the torch path
    assert out == greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=4, compiled=False)
    with pytest.raises(RuntimeError, match="compiled kernels are unavailable: x"):
        StaticBatch(tiny_model, PROMPTS, [1] * len(PROMPTS), compiled=True)
    storage = KVStorage(tiny_model.cfg, 4, 4)
    assert ModelRunner(tiny_model, storage).attention == "torch"
    with pytest.raises(ValueError, match="attention='compiled' needs the compiled kernels on"):
        ModelRunner(tiny_model, storage, attention="compiled")
    with pytest.raises(RuntimeError, match="compiled kernels are unavailable: x"):
        kernels.silu_mul(torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="compiled kernels are unavailable: x"):
        kernels.paged_attention(**attention_case())


def test_the_environment_switch_turns_them_off_quietly(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.load() is None
    assert kernels.unavailable_reason() == "NANOSERVE_KERNELS=0"


def test_build_flags_name_the_vector_unit_and_keep_torchs_rounding():
    name, flags = kernels.build_flags()
    assert "-ffp-contract=off" in flags and "-O3" in flags
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        assert name == f"nanoserve_kernels_{capability.lower()}"
    assert kernels.build_dir(name).name.startswith(f"{name}-py")


def test_describe_says_what_runs(compiled):
    name, _ = kernels.build_flags()
    assert kernels.describe().startswith(f"compiled kernels {name} (")


def test_cpp_source_returns_one_whole_function_with_its_comment():
    src = kernels.cpp_source("silu_mul")
    assert src.startswith("// SwiGLU's middle") and "torch::Tensor silu_mul(torch::Tensor gate_up) {" in src
    assert src.endswith("\n}") and "paged_attention" not in src
    attn = kernels.cpp_source("paged_attention")
    assert attn.startswith("// Attention of a step's query tokens") and attn.endswith("\n}")
    assert "torch::Tensor paged_attention(" in attn and "silu_mul" not in attn
    with pytest.raises(KeyError, match="no function 'nope'"):
        kernels.cpp_source("nope")
    step = kernels.cpp_source("BlockModel::step", "step.cpp")
    assert step.startswith("// One step:") and "torch::Tensor> BlockModel::step(\n" in step and step.endswith("\n}")
    tile = kernels.cpp_source("pair_micro", "matmul_bf16.cpp")  # a template: its template line, then its comment
    assert tile.startswith("// Rows x[0..R)")
    assert "\ntemplate <int R, int T>\nNANOSERVE_TILES_BF16 void pair_micro(" in tile
    row = kernels.cpp_source("row_tile", "quant.cpp")  # a file with one definition per road: the first
    assert "\ntemplate <Fmt F, int G, int R>\nvoid row_tile(" in row and row.count(" row_tile(") == 1


def test_a_failed_build_is_reported_by_the_compilers_error_line(monkeypatch):
    """A build that fails names the compiler's error, not the command line that ninja echoes first."""
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'x': [1/2] c++ -O3 -c kernels.cpp -o kernels.o\n"
                           "FAILED: kernels.o\nkernels.cpp:12:3: error: 'vec' was not declared in this scope\n"
                           "ninja: build stopped: subcommand failed.")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(RuntimeWarning, match="kernels.cpp:12:3: error: 'vec' was not declared in this scope"):
        assert kernels.load() is None


def test_build_dir_is_one_per_source_text_and_path(tmp_path):
    """Two clones, or two versions of the source, must not rebuild over each other's library."""
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }")
    b.write_text("int f() { return 1; }")
    before = kernels.build_dir("k", [a])
    assert before != kernels.build_dir("k", [b])
    a.write_text("int f() { return 2; }")
    assert kernels.build_dir("k", [a]) != before
    assert kernels.build_dir("k", [a]) == kernels.build_dir("k", [a])


# ---- paged_attention against the reference gather, and split-K -------------------------------------------


def ragged_case(lens, T, bs, H=6, K=2, D=32, seed=0, spare=3):
    """Requests of `lens` tokens, request r's last T[r] of them as query rows, their blocks scattered over a
    shuffled pool (`spare` blocks nobody owns), tables padded with block 0 past their end."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    n_blocks = sum(need) + spare
    k_pool, v_pool = torch.randn(2, n_blocks, bs, K, D, generator=g)
    perm = torch.randperm(n_blocks, generator=g)
    W = max(need)
    tables = torch.zeros(len(lens), W, dtype=torch.long)
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = perm[at: at + n]
        at += n
    qsl = torch.tensor([0] + list(torch.tensor(T).cumsum(0).tolist()))
    q = torch.randn(int(qsl[-1]), H, D, generator=g)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, query_start_loc=qsl, seq_lens=torch.tensor(lens),
                block_tables=tables, scale=D**-0.5)


def gathered(case):
    """The reference read (Day 18): each request's blocks gathered into a copy, then SDPA over it."""
    from nanoserve.attention.causal import causal_attention
    from nanoserve.attention.reference import gather_blocks

    q, qsl = case["q"], case["query_start_loc"].tolist()
    out = []
    for r, n in enumerate(case["seq_lens"].tolist()):
        s, e = qsl[r], qsl[r + 1]
        kc, vc = gather_blocks(case["k_pool"], case["v_pool"], case["block_tables"][r], n)
        out.append(causal_attention(q[None, s:e], kc[None], vc[None])[0])
    return torch.cat(out)


@pytest.mark.parametrize("bs", [1, 16, 256])
@pytest.mark.parametrize("split_keys", [0, 7, 64])
def test_paged_attention_is_the_reference_gather(compiled, bs, split_keys):
    """Ragged requests, contexts not a multiple of the block, decode rows, chunks after cached context and whole
    prompts in one call; with split-K off, and with pieces that do not divide the contexts or the blocks."""
    lens, T = [1, 37, 300, 5, 129, 17, 200], [1, 1, 1, 5, 20, 3, 1]
    case = ragged_case(lens, T, bs, seed=bs + split_keys)
    out = kernels.paged_attention(**case, split_keys=split_keys)
    torch.testing.assert_close(out, gathered(case), atol=2e-6, rtol=1e-5)


def windowed(case, window):
    """Each query over the keys of its window only: the gathered read with SDPA's mask (p - window < key <= p)."""
    from nanoserve.attention.reference import gather_blocks

    q, qsl, out = case["q"], case["query_start_loc"].tolist(), []
    for r, n in enumerate(case["seq_lens"].tolist()):
        s, e = qsl[r], qsl[r + 1]
        table = case["block_tables"][r].clamp(min=0)  # freed blocks (-1) lie wholly before every query's window
        kc, vc = gather_blocks(case["k_pool"], case["v_pool"], table, n)  # (n, K, D)
        qpos, kpos = torch.arange(n - (e - s), n)[:, None], torch.arange(n)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], kc.transpose(0, 1)[None],
                                           vc.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(e - s, -1))
    return torch.cat(out)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_a_window_reads_only_its_keys_and_a_row_keeps_its_bits_in_any_batch(compiled, window, bs):
    """A sliding layer's rows (decode rows, chunks crossing the window's edge, whole prompts) against the masked
    reference; blocks wholly before a request's first window freed (-1), as the hybrid KV manager leaves them; a
    row alone gives the bits it gives in the batch."""
    lens, T = [1, 37, 300, 5, 129, 17, 200], [1, 1, 1, 5, 20, 3, 1]
    case = ragged_case(lens, T, bs, H=8, K=1, D=32, seed=window + bs)
    for r, (n, t) in enumerate(zip(lens, T)):
        case["block_tables"][r, : max(0, n - t - window + 1) // bs] = -1
    out = kernels.paged_attention(**case, window=window)
    torch.testing.assert_close(out, windowed(case, window), atol=2e-6, rtol=1e-5)
    qsl = case["query_start_loc"]
    for r in (2, 4):
        s, e = int(qsl[r]), int(qsl[r + 1])
        alone = dict(case, q=case["q"][s:e], query_start_loc=torch.tensor([0, e - s]),
                     seq_lens=case["seq_lens"][r:r + 1], block_tables=case["block_tables"][r:r + 1])
        assert torch.equal(kernels.paged_attention(**alone, window=window), out[s:e])


def test_a_window_wider_than_split_k_is_refused(compiled):
    case = ragged_case([40], [1], 4)
    with pytest.raises(RuntimeError, match="window: expected 0 .none. or 1..16 .split_keys. positions, got 17"):
        kernels.paged_attention(**case, split_keys=16, window=17)
    case["block_tables"][0, 0] = -1  # no window: every block is read
    with pytest.raises(RuntimeError, match="request 0: block -1 is not in the pool"):
        kernels.paged_attention(**case)


@pytest.mark.parametrize("H, K, D", [(4, 4, 16), (9, 3, 64), (8, 1, 20), (4, 1, 256)])
def test_paged_attention_takes_any_grouping_and_head_dim(compiled, H, K, D):
    """MHA, SmolLM2's 9-over-3 grouping, one kv head for all; a head_dim that is not a multiple of the vector;
    Gemma 3's four heads of 256 over one kv head (sixteen registers a key on AVX-512)."""
    case = ragged_case([70, 3, 45], [1, 3, 6], 16, H=H, K=K, D=D, seed=H * D)
    for split_keys in (0, 16):
        torch.testing.assert_close(kernels.paged_attention(**case, split_keys=split_keys), gathered(case),
                                   atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("split_keys", [0, 16])
def test_a_bf16_pool_gives_the_bits_of_an_fp32_pool_of_the_same_numbers(compiled, split_keys):
    """bf16 K/V (`dtype="bfloat16"`) are read widened to fp32, exactly: the same loops then give the same bits as
    an fp32 pool holding those numbers, in every kind of row (decode, split-K, chunk, whole prompt)."""
    case = ragged_case([1, 37, 300, 5, 129], [1, 1, 1, 5, 20], 16, H=9, K=3, D=64, seed=3)
    half = dict(case, k_pool=case["k_pool"].bfloat16(), v_pool=case["v_pool"].bfloat16())
    widened = dict(case, k_pool=half["k_pool"].float(), v_pool=half["v_pool"].float())
    assert torch.equal(kernels.paged_attention(**half, split_keys=split_keys),
                       kernels.paged_attention(**widened, split_keys=split_keys))


def test_split_k_takes_rows_longer_than_one_piece_only(compiled):
    """A row of at most split_keys keys runs the unsplit loops: the same bits. Any longer row, a decode token's
    or a prompt's, is read in pieces, merged: equal to rounding, not to the bit."""
    case = ragged_case([64, 65, 200], [1, 1, 150], 16, seed=4)
    whole, split = (kernels.paged_attention(**case, split_keys=s) for s in (0, 64))
    assert torch.equal(split[0], whole[0])  # 64 keys
    assert not torch.equal(split[1], whole[1])  # 65 keys: two pieces
    assert torch.equal(split[2:15], whole[2:15])  # the prompt's first 13 queries: 51..63 keys
    torch.testing.assert_close(split[1:], whole[1:], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_keys", [0, 48])
def test_every_query_gets_the_bits_of_a_decode_row(compiled, dtype, split_keys):
    """Each row of a request's queries (a decode token and its drafts, a chunk, a whole prompt) gets the bits
    that query gets alone as a decode row over its own keys: a verified draft is plain decoding's, and a prompt's
    rows do not depend on how it was cut into chunks."""
    for T in (2, 6, 16, 17, 40, 90):
        case = ragged_case([40, 90], [1, T], 16, H=9, K=3, D=64, seed=T)
        case = dict(case, k_pool=case["k_pool"].to(dtype), v_pool=case["v_pool"].to(dtype))
        out = kernels.paged_attention(**case, split_keys=split_keys)
        for i in range(T):
            row = 1 + i
            alone = dict(case, q=case["q"][row:row + 1], query_start_loc=torch.tensor([0, 1]),
                         seq_lens=torch.tensor([90 - T + i + 1]), block_tables=case["block_tables"][1:])
            assert torch.equal(kernels.paged_attention(**alone, split_keys=split_keys)[0], out[row]), (T, i)


def test_the_default_piece_is_split_keys(compiled):
    case = ragged_case([kernels.SPLIT_KEYS * 2 + 33], [1], 16, seed=5)
    assert torch.equal(kernels.paged_attention(**case), kernels.paged_attention(**case, split_keys=kernels.SPLIT_KEYS))


def one_request(case, r):
    """Request r of a case on its own: its rows, its length, its table."""
    qsl = case["query_start_loc"]
    s, e = int(qsl[r]), int(qsl[r + 1])
    return dict(case, q=case["q"][s:e], query_start_loc=torch.tensor([0, e - s]), seq_lens=case["seq_lens"][r:r + 1],
                block_tables=case["block_tables"][r:r + 1])


@pytest.mark.parametrize("split_keys", [0, 48])
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(compiled, split_keys):
    """Batch invariance, split-K included: pieces are fixed by a row's own length, merged in a fixed order."""
    lens, T = [500, 3, 97, 260, 1, 33], [1, 1, 1, 4, 1, 2]
    case = ragged_case(lens, T, 16, seed=6)
    qsl = case["query_start_loc"].tolist()
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            runs.append(kernels.paged_attention(**case, split_keys=split_keys))
            for r in range(len(lens)):
                alone = kernels.paged_attention(**one_request(case, r), split_keys=split_keys)
                assert torch.equal(alone, runs[-1][qsl[r]:qsl[r + 1]]), (n, r)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(runs[0], other) for other in runs[1:])
    padded = dict(case, q=torch.cat([case["q"], torch.randn(3, *case["q"].shape[1:])]))  # padding rows after
    out = kernels.paged_attention(**padded, split_keys=split_keys)
    assert torch.equal(out[:qsl[-1]], runs[0]) and not out[qsl[-1]:].any()


def test_split_keys_must_not_be_negative(compiled):
    with pytest.raises(RuntimeError, match="split_keys: expected 0 .never split. or a piece size, got -1"):
        kernels.paged_attention(**attention_case(), split_keys=-1)


def test_split_k_steps_agree_with_torch_ops_steps_and_keep_rows_invariant(compiled):
    """Decode rows past SPLIT_KEYS keys take split-K inside real steps: the same logits as torch's ops to fp32
    rounding, and a long row's bits the same alone as beside others."""
    from nanoserve.config import ModelConfig
    from nanoserve.model import Llama

    model = Llama.random(ModelConfig.tiny(max_position_embeddings=2048), seed=3)
    g = torch.Generator().manual_seed(0)
    long_a, short, long_b = (torch.randint(3, 250, (n,), generator=g).tolist()
                             for n in (kernels.SPLIT_KEYS + 150, 30, kernels.SPLIT_KEYS - 2))
    prompts = [long_a, short, long_b]  # long_b crosses SPLIT_KEYS while it decodes
    fast, ref = step_logits(model, prompts, 4, True), step_logits(model, prompts, 4, False)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-5)
    # batches of two or more rows: a batch of one runs the weight products' one-row kernel (model.matmul)
    assert torch.equal(step_logits(model, [short, long_a], 4, True)[1], fast[0])
    assert torch.equal(step_logits(model, [long_b, short], 4, True)[0], fast[2])


def test_huge_pages_start_on_a_2mb_boundary_and_ask_linux_for_its_2mb_pages():
    buf = kernels.huge_pages(5 * kernels.HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * kernels.HUGE_PAGE + 100
    assert buf.data_ptr() % kernels.HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform == "linux" and thp.exists() and "[never]" not in thp.read_text():
        # the madvise is recorded on the mapping holding the buffer ("hg" among its VmFlags)
        at = buf.data_ptr()
        mapping = None
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= at < hi
            elif line.startswith("VmFlags") and mapping:
                assert " hg" in line
                break
        else:
            pytest.fail("no mapping holds the buffer")


def test_side_by_side_copies_into_one_buffer_each_on_a_64_byte_boundary():
    parts = [torch.arange(10, dtype=torch.uint8), torch.randn(3, 5), torch.arange(7, dtype=torch.int64)]
    out = kernels.side_by_side(parts)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    for a, b in zip(parts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b) and b.data_ptr() % 64 == 0
