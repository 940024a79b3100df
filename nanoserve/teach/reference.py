"""The reference a day checks its tokens against: transformers on the same checkpoint folder (Days 07-08).

Two correct fp32 forwards round differently, so two greedy runs can part only where the reference's
two best logits nearly tie. The rule the tests use, and the days: tokens must agree exactly up to the
first step whose reference top1 - top2 gap is below `NEAR_TIE`, and wholly when there is none.

    hf = load_reference()
    ref, logits = reference_greedy(hf, prompt_ids, max_new_tokens=24)
    assert_same_greedy(ours, ref, logits)        # raises, naming the first different step

transformers is the reference, imported only when asked for: it is never the engine's dependency.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bench.numerics import NEAR_TIE  # the one definition: a gap below it is a genuine near-tie


def load_reference(folder: str | Path | None = None):
    """transformers' Llama on the checkpoint folder (the fetched SmolLM2 by default), fp32, quietly."""
    import transformers

    from ..bench.harness import load_hf_model
    from ..model.fetch import ensure_model

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return load_hf_model(folder if folder is not None else ensure_model())


def _greedy_config(hf_model, max_new_tokens: int, ignore_eos: bool, pad_id: int | None):
    """The checkpoint's generation config made greedy (its recommended sampling switched off)."""
    config = copy.deepcopy(hf_model.generation_config)
    pad = pad_id if pad_id is not None else (config.pad_token_id if config.pad_token_id is not None else 0)
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=max_new_tokens,
                  pad_token_id=pad)
    if ignore_eos:
        config.update(eos_token_id=[])
    return config


def reference_greedy(hf_model, prompt_ids: Sequence[int], max_new_tokens: int,
                     ignore_eos: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own greedy `generate` on one prompt, alone: its new tokens and each step's logits (V,).
    It stops at the checkpoint's EOS unless `ignore_eos`, or after max_new_tokens."""
    config = _greedy_config(hf_model, max_new_tokens, ignore_eos, None)
    ids = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits]


def reference_greedy_batch(hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           ignore_eos: bool = False, pad_id: int = 0) -> list[tuple[list[int], list[torch.Tensor]]]:
    """`reference_greedy` for several prompts in one left-padded batch (transformers' batched `generate`, its
    attention mask hiding the padding): per prompt, its tokens (up to and with its EOS) and each step's logits.
    The same tokens as each prompt alone up to rounding, so compare them by the near-tie rule too."""
    config = _greedy_config(hf_model, max_new_tokens, ignore_eos, pad_id)
    eos = set(config.eos_token_id if isinstance(config.eos_token_id, list) else
              ([] if config.eos_token_id is None else [config.eos_token_id]))
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts])  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, generation_config=config, output_logits=True,
                                return_dict_in_generate=True)
    result = []
    for b in range(len(prompts)):
        tokens = out.sequences[b, T:].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))  # a finished row pads after
        result.append((tokens[:end], [step[b] for step in out.logits[:end]]))
    return result


def near_tie_horizon(ref_logits: Sequence[torch.Tensor], gap: float = NEAR_TIE) -> int:
    """How many leading steps the reference chose clearly: the first step whose top1 - top2 gap is below
    `gap`, or the number of steps if none is.

    >>> clear, tie = torch.tensor([3.0, 1.0]), torch.tensor([2.0, 2.0])
    >>> near_tie_horizon([clear, clear, tie, clear])
    2
    """
    for i, logits in enumerate(ref_logits):
        top2 = torch.topk(logits.float().flatten(), 2).values
        if float(top2[0] - top2[1]) < gap:
            return i
    return len(ref_logits)


def assert_same_greedy(ours: Sequence[int], ref_tokens: Sequence[int], ref_logits: Sequence[torch.Tensor],
                       gap: float = NEAR_TIE) -> int:
    """Assert our greedy tokens are the reference's up to its first near-tie, and all of them (where it
    stopped too) if there is none. Returns how many tokens were compared."""
    ours, ref = list(ours), list(ref_tokens)
    h = near_tie_horizon(ref_logits, gap)
    if ours[:h] != ref[:h]:
        first = next(i for i in range(h) if i >= len(ours) or ours[i] != ref[i])
        raise AssertionError(f"greedy tokens differ from transformers' at step {first} (no near-tie before it): "
                             f"ours {ours[first:first + 3]}, transformers {ref[first:first + 3]}")
    if h == len(ref) and ours != ref:
        raise AssertionError(f"no near-tie, yet the completions differ after {h} tokens: ours has {len(ours)}, "
                             f"transformers {len(ref)}")
    return h
