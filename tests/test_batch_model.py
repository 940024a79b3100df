"""Batching on the real SmolLM2: each row's logits and tokens equal its solo run (Days 27-28)."""

import pytest
import torch

from nanoserve.batch import StaticBatch, greedy_generate_batch, padded_prefill, use_kernels
from nanoserve.generate import greedy_ids

TEXTS = [
    "The capital of France is",
    "Hi",
    "Write a short poem about the sea, the sky and the wind, in four lines.",
    "1 2 3",
    "a",
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "Why?",
    "List three colors:",
]
NEW = 12
NEAR_TIE = 1e-3  # the project's rule: a reference top1 - top2 gap below this is a genuine near-tie


@pytest.fixture(scope="module")
def prompts(tok):
    ps = [tok.encode(t) for t in TEXTS]
    assert sorted(len(p) for p in ps)[:2] == [1, 1]  # some rows are a single token
    return ps


@pytest.fixture(scope="module")
def solo(model, prompts):
    """Each prompt alone: its tokens and the top1 - top2 logit gap at every step."""
    out = []
    for p in prompts:
        sb = StaticBatch(model, [p], [NEW - 1])
        logits = [sb.prefill()] + [sb.step() for _ in range(NEW - 1)]
        top2 = torch.cat(logits).topk(2, dim=-1).values
        out.append((sb.tokens[0], (top2[:, 0] - top2[:, 1]).tolist()))
    return out


def test_padded_prefill_logits_equal_each_solo_run_and_the_reference(model, hf_model, prompts):
    logits = padded_prefill(model, prompts)  # (B, V), one forward of a ragged batch
    for i, p in enumerate(prompts):
        assert torch.equal(logits[i], padded_prefill(model, [p])[0])
        with torch.inference_mode():
            ref = hf_model(torch.tensor([p])).logits[0, -1]
        assert (logits[i] - ref).abs().max().item() < 1e-4


def test_solo_runs_have_no_near_tie(solo):
    """So the comparisons below are exact on every token, not only up to a near-tie."""
    assert min(min(gaps) for _, gaps in solo) > NEAR_TIE


@pytest.mark.parametrize("batch_size", range(1, 9))
def test_every_row_equals_its_solo_run_at_every_batch_size(model, prompts, solo, batch_size):
    rows = [(i * 3 + batch_size) % len(prompts) for i in range(batch_size)]  # a different mix per size
    out = greedy_generate_batch(model, [prompts[i] for i in rows], max_new_tokens=NEW)
    for i, tokens in zip(rows, out):
        assert torch.equal(torch.tensor(tokens), torch.tensor(solo[i][0])), (batch_size, i)


def test_ragged_budgets_and_the_single_sequence_path_agree(model, prompts, solo):
    budgets = [NEW, 2, 5, 1, NEW, 3, 7, 4]
    out = greedy_generate_batch(model, prompts, max_new_tokens=budgets)
    for i, (p, n, tokens) in enumerate(zip(prompts, budgets, out)):
        assert tokens == solo[i][0][:n]
        if n == NEW:
            assert tokens == greedy_ids(model, p, n)  # Day 08's loop: no cache, no batch


@pytest.mark.parametrize("kernels", [False, None], ids=["torch-ops", "default"])
def test_rows_of_two_batches_are_bit_identical(model, prompts, kernels):
    """Any two batches of two or more rows run every row through the same kernels: equal logits."""
    def logits(ps):
        sb = StaticBatch(model, ps, [3] * len(ps), kernels=kernels)
        return torch.stack([sb.prefill()] + [sb.step() for _ in range(3)], 1)  # (B, 4, V)
    a, b = logits(prompts[:3]), logits(prompts[2:8])
    assert torch.equal(a[2], b[0])


@pytest.mark.parametrize("kernels", [False, None], ids=["torch-ops", "default"])
def test_a_row_is_bit_identical_beside_a_much_longer_row(model, tok, prompts, kernels):
    """The decode step's gathered rectangle is as wide as the longest row: a short row's keys then sit
    beside hundreds of masked ones. Masked keys add exact zeros, so its logits do not move."""
    long = tok.encode("Once upon a time, in a small village by the river, there lived an old miller " * 12)
    def logits(ps):
        sb = StaticBatch(model, ps, [4] * len(ps), block_size=16, kernels=kernels)
        return torch.stack([sb.prefill()] + [sb.step() for _ in range(4)], 1)  # (B, 5, V)
    narrow, wide = logits([prompts[0], prompts[3]]), logits([prompts[0], long])
    assert len(long) > 150
    assert torch.equal(narrow[0], wide[0])


@pytest.mark.parametrize("kernels", [False, True])
def test_decode_logits_match_the_reference_on_both_paths(model, hf_model, prompts, kernels):
    """Each decode step's logits, torch ops or compiled glue, against transformers on the whole sequence so far.
    Both paths sit about 1e-4 from it (fp32 products in other orders); 2.5e-4 is the stated bound."""
    if kernels and not use_kernels(model):
        pytest.skip("no compiled kernels on this machine")
    rows = prompts[:4]
    sb = StaticBatch(model, rows, [5] * len(rows), kernels=kernels)
    logits = torch.stack([sb.prefill()] + [sb.step() for _ in range(5)], 1)  # (B, 6, V)
    for i, p in enumerate(rows):
        with torch.inference_mode():
            ref = hf_model(torch.tensor([p + sb.tokens[i][:-1]])).logits[0, len(p) - 1:]  # (6, V)
        assert (logits[i] - ref).abs().max().item() < 2.5e-4, i


def test_torch_ops_path_gives_every_solo_token(model, prompts, solo):
    """The compiled path is the default; the torch-ops path (no compiler, NANOSERVE_KERNELS=0) gives the same tokens."""
    out = greedy_generate_batch(model, prompts, max_new_tokens=NEW, kernels=False)
    assert out == [tokens for tokens, _ in solo]
