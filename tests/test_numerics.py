"""The opt-in formats against their exact counterparts, on the shared prompts (tests/prompts.py): int8 activations
on the GGUF blocks (against fp32 activations on the same blocks), bf16 (against fp32), and a bf16 K/V cache alone
(on the blocks, against their fp32 cache). Each format's logits
stay within a stated tolerance; fp32 stays exact (the parity tests elsewhere are unchanged); a CPU without the
format's instructions falls back to the numbers of the format's reference; greedy tokens agree up to a first
divergence, which is reported, and which must fall where the exact logits' lead is within the format's error."""

import pytest
import torch
from prompts import NEAR_TIE, PROMPTS, prompt_ids

import nanoserve
from nanoserve import LLM, SamplingParams, generate, kernels
from nanoserve.bench.harness import prose
from nanoserve.cli import build_parser
from nanoserve.engine import LLMEngine
from nanoserve.kernels import int8
from nanoserve.model import Llama
from nanoserve.model import matmul as mm
from nanoserve.model.gguf_weights import set_activations, to_blocks
from nanoserve.model.matmul import BlockWeight
from nanoserve.stages import StaticBatch, paged_session

# Tolerances: max and mean |logit - exact logit| over every position of every shared prompt (logits' spread is 3-9).
# int8: before each of a layer's 4 products every activation moves by up to half its block's step, max|x| / 254
# (`int8.error_bound`), through 30 layers; measured here, max 2.3 and mean 0.28, at the chat prompts. bf16: the
# matrices and each product's input and output rounded to 8 bits (2^-9 relative), q/K/V and a prompt's softmax
# weights too; measured, max 0.63 and mean 0.14. Each bound is about twice what was measured, room for another
# CPU's summation order and bf16 kernel; a broken scale, rounding or conversion moves logits by tens.
INT8_MAX, INT8_MEAN = 5.0, 0.6
BF16_MAX, BF16_MEAN = 1.5, 0.25
# A bf16 K/V cache alone (on the blocks): q, k, v rounded to 8 bits after RoPE; measured max 0.35, mean 0.036.
KV16_MAX, KV16_MEAN = 0.75, 0.08
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def logit_errors(exact: Llama, other: Llama, tok) -> list[tuple[str, float, float]]:
    """(prompt, max |error|, mean |error|) of other's logits against exact's, every position of each shared prompt."""
    out = []
    with torch.inference_mode():
        for name in PROMPTS:
            ids = torch.tensor([prompt_ids(tok, name)])
            err = (other(ids)[0] - exact(ids)[0]).abs()
            out.append((name, float(err.max()), float(err.mean())))
    return out


def check_divergence(exact: Llama, other: Llama, tok, name: str, record) -> None:
    """Greedy tokens of `other` against `exact`'s on one prompt: equal up to the first divergence, reported; there,
    on the shared context, exact's lead of its token over other's must be within twice other's error (else other
    did not compute that context's logits)."""
    ids = prompt_ids(tok, name)
    a, b = generate(exact, ids, GREEDY, tok).token_ids, generate(other, ids, GREEDY, tok).token_ids
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    record(name, "none" if n is None else n)
    if n is None:
        return
    assert a[:n] == b[:n]
    with torch.inference_mode():  # each model's logits on the road generate took (the engine's paged attention)
        la, lb = (paged_session(m, len(ids) + n + 1).prefill(ids + a[:n]).flatten() for m in (exact, other))
    gap = float(la[a[n]] - la[b[n]])
    assert lb.argmax() == b[n] and 0 <= gap <= 2 * float((la - lb).abs().max()) + 1e-6
    record(f"{name} gap", f"{gap:.4g}{' (near-tie)' if gap < NEAR_TIE else ''}")


# ---- int8 activations on the blocks -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_blocks(model_dir):
    return nanoserve.load(model_dir, weights="gguf")[0], nanoserve.load(model_dir, weights="gguf",
                                                                      activations="int8")[0]


def test_int8_activations_are_opt_in_and_say_so(model_dir, on_blocks):
    exact, fast = on_blocks
    assert exact.activations == "fp32" and fast.activations == "int8"
    assert all(w.activations == "int8" for w in fast.block_weights()) and isinstance(fast.lm_head, BlockWeight)
    with pytest.raises(ValueError, match="needs weights='gguf'"):
        nanoserve.load(model_dir, activations="int8")
    with pytest.raises(ValueError, match="expected one of"):
        nanoserve.load(model_dir, weights="gguf", activations="int4")
    with pytest.raises(ValueError, match="needs a model on GGUF blocks"):
        set_activations(Llama.random(nanoserve.config.ModelConfig.tiny()), "int8")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--weights", "gguf", "--activations", "int8"])
    assert (args.weights, args.activations) == ("gguf", "int8")


def test_int8_logits_are_within_tolerance_of_the_blocks_on_fp32(on_blocks, tok):
    for name, worst, mean in logit_errors(*on_blocks, tok):
        assert 0 < worst <= INT8_MAX and mean <= INT8_MEAN, name  # 0 <: it is a different product


def test_every_int8_road_gives_a_model_the_same_logits(tiny_cfg, monkeypatch):
    """A CPU without VNNI takes the AVX2 road, one without AVX2 the portable loop, one without the kernels the torch
    reference: the same bits each time (the products are integers, the fp32 steps fixed), so the same logits as the
    model's own road (on AVX512-VNNI, its packed copies)."""
    model = to_blocks(Llama.random(tiny_cfg, seed=7), activations="int8")
    ids = torch.tensor([[5, 9, 200, 3, 17, 4]])
    with torch.inference_mode():
        want = model(ids)
        real = int8.block_linear_int8
        for road in [*int8.int8_roads(), "torch"]:
            forced = (lambda x, b, f, compiled=None, packed=None: int8.block_linear_int8_reference(x, b, f)) \
                if road == "torch" else (lambda x, b, f, compiled=None, packed=None, road=road: real(x, b, f, road))
            monkeypatch.setattr(int8, "block_linear_int8", forced)
            assert torch.equal(model(ids), want), road
        monkeypatch.setattr(int8, "block_linear_int8", real)


@pytest.fixture
def report(record_property):
    """Record a finding in the test's report (junit's properties; printed too, for `pytest -s`)."""
    def record(key: str, value: object) -> None:
        record_property(key, value)
        print(f"{key}: {value}")
    return record


def test_int8_greedy_tokens_agree_up_to_a_reported_divergence(on_blocks, tok, report):
    for name in ("plain", "code", "chat"):
        check_divergence(*on_blocks, tok, name, lambda k, v: report(f"int8 first divergence, {k}", v))


def test_int8_keeps_each_requests_tokens_whatever_the_batch_and_the_chunking(model_dir):
    """int8 rounds every product's input, so a last-bit difference in attention can move a token. Every query row
    is computed alone over its own keys, so batched with others under a small step budget (prompts cut into
    chunks, decode rows beside prompt rows) each request gets the tokens it gets alone."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    busy = LLM(model_dir, weights="gguf", activations="int8", max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": prose(busy.tokenizer, n, offset=o)}
               for n, o in ((30, 0), (200, 17), (75, 40), (5, 90), (600, 3), (120, 60))]
    together = [o.outputs[0].token_ids for o in busy.generate(prompts, sp, use_tqdm=False)]
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in busy.engine.history)  # mixed steps ran
    alone = LLM(model_dir, weights="gguf", activations="int8", max_num_batched_tokens=2048)
    assert together == [alone.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("fmt", [dict(), dict(weights="gguf", activations="int8")])
def test_a_prefix_hit_gives_a_prompt_the_bits_of_computing_it_whole(model_dir, fmt):
    """A prompt whose first 288 tokens are found in the prefix cache computes only the rest, over the cached keys:
    the same tokens and log-probabilities, to the bit, as in an engine that computes it whole."""
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    llm = LLM(model_dir, **fmt)
    system = prose(llm.tokenizer, 300, offset=11)
    llm.generate([{"prompt_token_ids": system + prose(llm.tokenizer, 20, offset=200)}], sp, use_tqdm=False)
    b = {"prompt_token_ids": system + prose(llm.tokenizer, 25, offset=400)}
    (hit,) = llm.generate([b], sp, use_tqdm=False)
    (whole,) = LLM(model_dir, **fmt).generate([b], sp, use_tqdm=False)
    assert hit.num_cached_tokens == 288 and whole.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == whole.outputs[0].token_ids
    assert hit.outputs[0].logprobs == whole.outputs[0].logprobs


def test_llm_takes_the_formats_by_keyword(model_dir):
    llm = LLM(model_dir, weights="gguf", activations="int8", num_blocks=32)
    assert llm.model.activations == "int8"
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


# ---- bf16 matrices and K/V ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense(model_dir):
    return nanoserve.load(model_dir)[0], nanoserve.load(model_dir, dtype="bfloat16")[0]


def test_bf16_is_opt_in_and_says_so(model_dir, dense):
    exact, fast = dense
    assert (exact.matrix_dtype, exact.kv_dtype) == ("float32", torch.float32)
    assert (fast.matrix_dtype, fast.kv_dtype, fast.dtype) == ("bfloat16", torch.bfloat16, torch.float32)
    assert fast.norm.dtype == torch.float32 and all(w.t().is_contiguous() for w in fast.matrices())  # [in, out] kept
    with pytest.raises(ValueError, match="expected 'float32' or 'bfloat16'"):
        nanoserve.load(model_dir, dtype="float16")
    with pytest.raises(ValueError, match="multiplies its blocks in float32"):
        nanoserve.load(model_dir, weights="gguf", dtype="bfloat16")
    assert build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert build_parser().parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("prompt_kernel", [True, False])
def test_bf16_logits_are_within_tolerance_of_fp32(dense, tok, prompt_kernel, monkeypatch):
    """On both roads of a bf16 prompt's attention: the kernel with bf16 products (where the CPU has AVX512_BF16)
    and torch's attention with fp32 weights (every other CPU's road, taken here by switching the kernel off)."""
    if prompt_kernel and not kernels.prompt_attention_bf16_here(dense[1].cfg.head_dim):
        pytest.skip("no AVX512_BF16 here: the other case is this CPU's road")
    if not prompt_kernel:
        monkeypatch.setattr(kernels, "prompt_attention_bf16_here", lambda head_dim: False)
    for name, worst, mean in logit_errors(*dense, tok):
        assert 0 < worst <= BF16_MAX and mean <= BF16_MEAN, name


def test_bf16_greedy_tokens_agree_up_to_a_reported_divergence(dense, tok, report):
    for name in ("plain", "code", "chat"):
        check_divergence(*dense, tok, name, lambda k, v: report(f"bf16 first divergence, {k}", v))


def test_bf16_engine_holds_kv_in_bf16_and_gives_a_request_its_tokens_in_any_batch(model_dir, dense, tok):
    """Half the bytes per cached token, so twice the blocks in the same memory; a request's tokens do not depend on
    what else is in its steps (every bf16 road gives a row the same bits for any row count)."""
    exact, fast = dense
    engines = [LLMEngine(m, tok, kv_cache_bytes=1 << 24) for m in (exact, fast)]
    assert engines[1].runner.storage.k.dtype == torch.bfloat16
    assert engines[1].manager.num_blocks // 2 == engines[0].manager.num_blocks  # (the same bytes, floored)
    prompts = [prompt_ids(tok, name) for name in PROMPTS]
    alone = [engine_greedy(fast, tok, [p])[0] for p in prompts[:2]]
    together = engine_greedy(fast, tok, prompts)
    assert together[:2] == alone


def engine_greedy(model: Llama, tok, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(model, tok)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.requests[i].output_token_ids for i in ids]


def bf16_product_error() -> tuple[str, bool, float]:
    """This process's bf16 road, whether it keeps a copy of the weight (tiles or oneDNN's blocks), and the largest
    relative error of `linear` against the fp64 sum of the same bf16 inputs."""
    g = torch.Generator().manual_seed(0)
    w = mm.linear_weight(96, 64)
    with torch.no_grad():
        w.data = torch.randn(96, 64, generator=g).t().contiguous().t().bfloat16()
    mm.pack(w)
    x = torch.randn(5, 64, generator=g)
    with torch.inference_mode():
        out, ref = mm.linear(x, w), x.bfloat16().double() @ w.double().t()
    worst = float(((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max())
    return mm.bf16_road(), mm.packed(w) is not None or mm.tiled(w) is not None, worst


def test_bf16_products_are_the_reference_product_on_every_road(monkeypatch):
    """The compiled tiles on AVX512_BF16, oneDNN on AVX512_BF16 (the kernels off), oneDNN widening to fp32 (a CPU
    without the instructions, ONEDNN_MAX_CPU_ISA), and fp32's product on widened numbers (no bf16 oneDNN, AVX2
    CPUs): each is x and w in bf16 summed in fp32, its output rounded to bf16, so each is within one bf16 step
    (2^-8 relative) of that sum computed in fp64."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              "from test_numerics import bf16_product_error; print(*bf16_product_error())")
    for isa in ("AVX512_CORE_BF16", "AVX512_CORE", "AVX2"):  # each its own process: oneDNN reads the cap once
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa, NANOSERVE_KERNELS="0")  # (no kernels: oneDNN's roads)
        road, copied, worst = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                             check=True).stdout.split()
        assert road != "tiles" and float(worst) <= 2**-8, (isa, road, copied)
    road, copied, worst = bf16_product_error()  # and this process's own road (the tiles, on AVX512_BF16)
    assert (copied or road == "widen") and worst <= 2**-8, road
    monkeypatch.setattr(mm, "packed", lambda w: None)  # in this process too: no copy -> F.linear's road,
    g = torch.Generator().manual_seed(1)  # or where oneDNN takes no bf16, fp32's on the widened numbers
    w = torch.randn(32, 64, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g)
    F = torch.nn.functional
    with torch.inference_mode():
        ref = F.linear(x.bfloat16().float(), w.float()).bfloat16() if road == "widen" else F.linear(x.bfloat16(), w)
        assert torch.equal(mm.linear(x, w), ref)


@pytest.mark.parametrize("compiled", [True, False])
def test_the_widened_bf16_road_gives_a_row_its_bits_in_any_batch(monkeypatch, compiled):
    """The road of a CPU whose oneDNN takes no bf16, taken here on any CPU, in the compiled kernel and on torch's
    ops: a row's bf16 output is the same for every row count the engine runs (the kernel: any count; fp32's
    product: a multiple of `ROW_MULTIPLE`), as oneDNN's bf16 product promises, and within one bf16 step of the
    fp64 sum of the same bf16 numbers."""
    if compiled and not kernels.available():
        pytest.skip(f"no compiled kernels here: {kernels.unavailable_reason()}")
    monkeypatch.setattr(mm, "packed", lambda w: None)
    monkeypatch.setattr(mm, "bf16_road", lambda: "widen")
    g = torch.Generator().manual_seed(2)
    w = mm.linear_weight(96, 64)
    with torch.no_grad():
        w.data = torch.randn(96, 64, generator=g).t().contiguous().t().bfloat16()
    x = torch.randn(32, 64, generator=g)
    with torch.inference_mode():
        full = mm.linear(x, w, compiled)
        ref = x.bfloat16().double() @ w.double().t()
        assert full.dtype == torch.bfloat16
        assert float(((full.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max()) <= 2**-8
        if not compiled:  # fp32's product on the widened numbers, rounded
            assert torch.equal(full, mm.linear(x.bfloat16().float(), w.float(), False).bfloat16())
        for n in range(1, 32) if compiled else range(mm.ROW_MULTIPLE, 32, mm.ROW_MULTIPLE):
            assert torch.equal(mm.linear(x[:n], w, compiled), full[:n]), n


def test_llm_takes_bf16_by_keyword(model_dir):
    llm = LLM(model_dir, dtype="bfloat16", num_blocks=32)
    assert llm.model.matrix_dtype == "bfloat16" and llm.engine.runner.storage.k.dtype == torch.bfloat16
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


# ---- a bf16 K/V cache alone (kv_cache_dtype) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def kv16(model_dir):
    """The blocks with their fp32 K/V cache, and with a bf16 one."""
    return (nanoserve.load(model_dir, weights="gguf")[0],
            nanoserve.load(model_dir, weights="gguf", kv_cache_dtype="bfloat16")[0])


def test_a_bf16_kv_cache_is_opt_in_and_says_so(model_dir, kv16, tok):
    """Only the cache changes (the blocks and their products stay); half the bytes per cached token, so twice
    the blocks in the same memory; any weights take it; only bf16 is offered."""
    exact, half = kv16
    assert (exact.kv_dtype, half.kv_dtype) == (torch.float32, torch.bfloat16) and half.dtype == torch.float32
    engines = [LLMEngine(m, tok, kv_cache_bytes=1 << 24) for m in kv16]
    assert engines[1].runner.storage.k.dtype == torch.bfloat16 and engines[1].runner.block_step is not None
    assert engines[1].manager.num_blocks // 2 == engines[0].manager.num_blocks
    assert nanoserve.load(model_dir, kv_cache_dtype="bfloat16")[0].kv_dtype == torch.bfloat16
    mine = Llama.random(nanoserve.config.ModelConfig.tiny())  # (the shared models stay as they are)
    assert mine.round_kv(torch.bfloat16) is mine and mine.kv_dtype == torch.bfloat16
    assert mine.round_kv(torch.float32).kv_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': expected one of"):
        nanoserve.load(model_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="holds float32 or bfloat16"):
        mine.round_kv(torch.float16)
    for cmd in (["generate", "--prompt", "x"], ["serve"]):
        assert build_parser().parse_args([*cmd, "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    assert build_parser().parse_args(["serve", "--weights", "gguf", "--activations", "int8"]).activations == "int8"


def test_the_course_stages_hold_a_models_bf16_cache_too(kv16, tok):
    """Day 18's paged session and Day 28's static batch size their pools by the model's cache dtype: a bf16 cache
    on the blocks runs there (the compiled step reads only its own dtype) with the engine's tokens."""
    half = kv16[1]
    ids = prompt_ids(tok, "plain")
    session = paged_session(half, len(ids) + 8)
    assert session.runner.storage.k.dtype == torch.bfloat16
    session.free()
    (tokens,) = StaticBatch(half, [ids], [6]).run()
    assert tokens == engine_greedy(half, tok, [ids])[0][:len(tokens)] and len(tokens) == 7


def test_bf16_kv_logits_are_within_tolerance_of_the_fp32_cache(kv16, tok):
    for name, worst, mean in logit_errors(*kv16, tok):
        assert 0 < worst <= KV16_MAX and mean <= KV16_MEAN, name


def test_bf16_kv_greedy_tokens_agree_up_to_a_reported_divergence(kv16, tok, report):
    """Through the engine: its decode steps read the bf16 pool (the compiled step on the blocks)."""
    for name in ("plain", "code", "chat"):
        check_divergence(*kv16, tok, name, lambda k, v: report(f"bf16 K/V first divergence, {k}", v))


def test_llm_takes_a_bf16_kv_cache_by_keyword(model_dir):
    llm = LLM(model_dir, weights="gguf", activations="int8", kv_cache_dtype="bfloat16", num_blocks=32)
    assert llm.engine.runner.storage.k.dtype == torch.bfloat16 and llm.model.activations == "int8"
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
