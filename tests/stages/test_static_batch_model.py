"""Batching on the real SmolLM2: each row's logits and tokens equal its solo run (Days 27-28), on both
roads of the small ops and attention, and every step's logits stay near the fp64 reference."""

import pytest
import torch
from prompts import NEAR_TIE

from nanoserve.generate import greedy_ids
from nanoserve.stages import NoCacheSession, StaticBatch, greedy_generate_batch
from nanoserve.stages import greedy_session_ids as session_ids

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

KERNELS = {"compiled": None, "torch-ops": False}  # the `road` fixture's name -> compiled=


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


def batch_logits(model, prompts, steps, compiled, block_size=16):
    sb = StaticBatch(model, prompts, [steps] * len(prompts), block_size=block_size, compiled=compiled)
    return torch.stack([sb.prefill()] + [sb.step() for _ in range(steps)], 1), sb  # (B, steps + 1, V)


def test_the_ragged_prefill_gives_each_row_its_own_prompts_logits(model, prompts, fp64_logits, fp64_tol, road):
    """One step of every prompt laid end to end: each row's last-token logits are its prompt's, near fp64,
    and (a prompt of two or more tokens) the same bits as that prompt prefilled alone."""
    sb = StaticBatch(model, prompts, [1] * len(prompts), compiled=KERNELS[road])
    logits = sb.prefill()  # (B, V)
    for i, p in enumerate(prompts):
        assert (logits[i].double() - fp64_logits(p)[-1]).abs().max().item() < fp64_tol[0], i
        if len(p) > 1:
            assert torch.equal(logits[i], StaticBatch(model, [p], [1], compiled=KERNELS[road]).prefill()[0]), i


def test_solo_runs_have_no_near_tie(solo):
    """So the comparisons below are exact on every token, not only up to a near-tie."""
    assert min(min(gaps) for _, gaps in solo) > NEAR_TIE


@pytest.mark.parametrize("batch_size", range(1, 9))
def test_every_row_equals_its_solo_run_at_every_batch_size(model, prompts, solo, batch_size):
    rows = [(i * 3 + batch_size) % len(prompts) for i in range(batch_size)]  # a different mix per size
    out = greedy_generate_batch(model, [prompts[i] for i in rows], max_new_tokens=NEW)
    for i, tokens in zip(rows, out):
        assert torch.equal(torch.tensor(tokens), torch.tensor(solo[i][0])), (batch_size, i)


def test_ragged_budgets_and_the_single_sequence_paths_agree(model, prompts, solo):
    budgets = [NEW, 2, 5, 1, NEW, 3, 7, 4]
    out = greedy_generate_batch(model, prompts, max_new_tokens=budgets)
    for i, (p, n, tokens) in enumerate(zip(prompts, budgets, out)):
        assert tokens == solo[i][0][:n]
        if n == NEW:
            assert tokens == greedy_ids(model, p, n)  # the engine's road: generate
            assert tokens == session_ids(model, NoCacheSession(model), p, n)  # Day 08's loop: no cache, no batch


def test_rows_of_two_batches_are_bit_identical(model, prompts, road):
    """Any two batches of two or more rows run every row through the same kernels: equal logits."""
    a, _ = batch_logits(model, prompts[:3], 3, KERNELS[road])
    b, _ = batch_logits(model, prompts[2:8], 3, KERNELS[road])
    assert torch.equal(a[2], b[0])


def test_a_row_is_bit_identical_beside_a_much_longer_row(model, tok, prompts, road):
    """A short row's keys sit beside hundreds of another row's (the torch road gathers them into one
    rectangle, masked; the compiled kernel reads each row's own): its logits do not move."""
    long = tok.encode("Once upon a time, in a small village by the river, there lived an old miller " * 12)
    narrow, _ = batch_logits(model, [prompts[0], prompts[3]], 4, KERNELS[road])
    wide, _ = batch_logits(model, [prompts[0], long], 4, KERNELS[road])
    assert len(long) > 150
    assert torch.equal(narrow[0], wide[0])


def test_decode_logits_stay_near_the_fp64_reference(model, prompts, fp64_logits, fp64_tol, road):
    """Each decode step's logits, on either road, against transformers' fp64 forward over the whole
    sequence so far: within the bound every position of a prompt is held to."""
    rows = prompts[:4]
    logits, sb = batch_logits(model, rows, 5, KERNELS[road])  # (B, 6, V)
    for i, p in enumerate(rows):
        exact = fp64_logits(p + sb.tokens[i][:-1])[len(p) - 1:]  # (6, V)
        err = (logits[i].double() - exact).abs().max().item()
        assert err < fp64_tol[1], f"row {i}: {err:.2e}"


def test_torch_ops_road_gives_every_solo_token(model, prompts, solo):
    """The compiled road is the default; the torch-ops road (no compiler, NANOSERVE_KERNELS=0) gives the same tokens."""
    out = greedy_generate_batch(model, prompts, max_new_tokens=NEW, compiled=False)
    assert out == [tokens for tokens, _ in solo]
