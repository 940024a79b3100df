"""The reference check the days use: the near-tie rule on made-up logits, and transformers' greedy tokens."""

import pytest
import torch

from nanoserve.teach.reference import assert_same_greedy, near_tie_horizon, reference_greedy, reference_greedy_batch

CLEAR, TIE = torch.tensor([3.0, 1.0, 0.0]), torch.tensor([2.0, 2.0 - 1e-4, 0.0])


def test_near_tie_horizon_is_the_first_close_step():
    assert near_tie_horizon([CLEAR, CLEAR, TIE, CLEAR]) == 2
    assert near_tie_horizon([CLEAR] * 3) == 3
    assert near_tie_horizon([TIE]) == 0


def test_assert_same_greedy_compares_up_to_the_first_near_tie():
    assert assert_same_greedy([5, 6, 7], [5, 6, 7], [CLEAR] * 3) == 3
    assert assert_same_greedy([5, 6, 9, 1], [5, 6, 7], [CLEAR, CLEAR, TIE]) == 2  # parted at the tie: fine
    with pytest.raises(AssertionError, match="step 1"):
        assert_same_greedy([5, 8, 7], [5, 6, 7], [CLEAR] * 3)
    with pytest.raises(AssertionError, match="step 2"):
        assert_same_greedy([5, 6], [5, 6, 7], [CLEAR] * 3)  # ours stopped early
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_greedy([5, 6, 7, 8], [5, 6, 7], [CLEAR] * 3)  # ours ran past where the reference stopped


def test_reference_greedy_is_transformers_generate(hf_model, tok):
    ids = tok.encode("The capital of France is")
    tokens, logits = reference_greedy(hf_model, ids, 6, ignore_eos=True)
    assert len(tokens) == len(logits) == 6
    assert tokens == [int(x.argmax()) for x in logits]


def test_reference_greedy_batch_is_each_prompt_alone(hf_model, tok):
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    if")]
    batch = reference_greedy_batch(hf_model, prompts, 6, ignore_eos=True)
    for p, (tokens, logits) in zip(prompts, batch):
        alone, alone_logits = reference_greedy(hf_model, p, 6, ignore_eos=True)
        assert assert_same_greedy(tokens, alone, alone_logits) > 0
        assert len(logits) == len(tokens) == 6
        torch.testing.assert_close(logits[0], alone_logits[0], atol=1e-3, rtol=0)


def test_reference_greedy_batch_cuts_a_row_at_its_eos(hf_model, tok):
    chat = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    (tokens, logits), _ = reference_greedy_batch(hf_model, [chat, tok.encode("Once upon a time")], 24)
    assert tokens[-1] == tok.eos_id
    assert len(logits) == len(tokens) < 24
