"""The compiled kernels against the torch ops they replace, their refusals of bad input, and the engine
without them (no compiler, NANOSERVE_KERNELS=0). Their attention is compared with the other two
implementations in tests/attention/."""

import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanoserve import kernels
from nanoserve.engine import ModelRunner, StaticBatch, greedy_generate_batch
from nanoserve.kv import PagedKVCache
from nanoserve.model import apply_rope, rms_norm
from nanoserve.model import ops as model_ops

HAVE_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))

@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
def test_the_kernels_build_where_there_is_a_compiler():
    """Where the engine could have them, it must: a broken build would silently cost every step its speed."""
    assert kernels.load() is not None, kernels.unavailable_reason()
    assert kernels.unavailable_reason() is None and kernels.enabled()


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


def test_rope_rotates_the_q_and_k_heads_in_place_and_leaves_v(compiled):
    g = torch.Generator().manual_seed(1)
    B, T, H, K, D = 3, 4, 6, 2, 16
    qkv = torch.randn(B, T, H + 2 * K, D, generator=g)
    angles = torch.rand(B, T, D // 2, generator=g) * 50
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    want = apply_rope(qkv[:, :, : H + K], cos, sin)
    v = qkv[:, :, H + K:].clone()
    out = kernels.rope_(qkv.view(B * T, H + 2 * K, D), cos.reshape(B * T, D), sin.reshape(B * T, D), H + K)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :, : H + K], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, :, H + K:], v)


def test_silu_mul_is_swiglu_including_far_out_inputs(compiled):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(7, 2, 2 * 40, generator=g) * 4
    gate_up[0, 0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # past the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels.silu_mul(gate_up)
    assert out.shape == (7, 2, 40) and torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=2e-6)


def test_the_kernels_refuse_the_wrong_dtype_or_layout(compiled):
    with pytest.raises(RuntimeError, match="x: expected a float32 CPU tensor"):
        kernels.add_rms_norm(torch.ones(2, 8, dtype=torch.float64), None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up: expected a contiguous tensor"):
        kernels.silu_mul(torch.ones(8, 4).t())
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
    (dict(k_pool=lambda c: c["k_pool"].half()), "k_pool: expected a float32 CPU tensor"),
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
])
def test_paged_attention_refuses_bad_input_with_a_clear_error(compiled, change, match):
    case = attention_case()
    case.update({k: f(case) for k, f in change.items()})
    with pytest.raises(RuntimeError, match=match):
        kernels.paged_attention(**case)


# ---- the engine with and without them -----------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [29]]


def step_logits(model, prompts, steps, kernels_on):
    sb = StaticBatch(model, prompts, [steps] * len(prompts), block_size=4, kernels=kernels_on)
    return torch.stack([sb.prefill()] + [sb.step() for _ in range(steps)], 1)  # (B, steps + 1, V)


def test_compiled_steps_agree_with_torch_ops_steps(compiled, tiny_model):
    """Same weights, same products: the two roads differ only by the small ops' and attention's fp32 rounding."""
    sb = StaticBatch(tiny_model, PROMPTS, [6] * len(PROMPTS), block_size=4, kernels=True)
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
        model_ops.add_rms_norm(torch.ones(2, 8), None, torch.ones(8), 1e-5)
        model_ops.silu_mul(torch.ones(2, 8))
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
        assert not kernels.enabled() and kernels.describe() == "torch ops (OSError: no compiler found)"
        out = greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=4)
    monkeypatch.setattr(kernels, "_state", {"reason": "x"})  # still unavailable, compare with the torch path
    assert out == greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=4, kernels=False)
    with pytest.raises(RuntimeError, match="compiled kernels are unavailable: x"):
        StaticBatch(tiny_model, PROMPTS, [1] * len(PROMPTS), kernels=True)
    cache = PagedKVCache(tiny_model.cfg, 4, 4)
    assert ModelRunner(tiny_model, cache).attention == "torch"
    with pytest.raises(ValueError, match="attention='compiled' needs the compiled kernels on"):
        ModelRunner(tiny_model, cache, attention="compiled")
    with pytest.raises(RuntimeError, match="compiled kernels are unavailable: x"):
        kernels.silu_mul(torch.ones(2, 4))


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
    before = kernels.build_dir("k", a)
    assert before != kernels.build_dir("k", b)
    a.write_text("int f() { return 2; }")
    assert kernels.build_dir("k", a) != before
    assert kernels.build_dir("k", a) == kernels.build_dir("k", a)
