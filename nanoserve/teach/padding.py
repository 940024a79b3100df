"""The padded rectangle: how prompts of different lengths would share one (B, T) tensor (Day 27).

The engine never pads a step: `attention.prepare` lays the prompts end to end. This helper
builds the rectangle a padded batch would be, so the day can draw it and count what it wastes.

>>> b = pad_batch([[5, 6, 7], [8]], multiple=2)
>>> b.ids.tolist(), b.key_mask.int().tolist(), b.last_index.tolist(), round(b.padding_share, 3)
([[5, 6, 7, 0], [8, 0, 0, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]], [2, 0], 0.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PaddedBatch:
    """Prompts as one right-padded rectangle."""

    ids: Tensor  # (B, T) token ids, pad_id after each row's end
    key_mask: Tensor  # (B, T) True on real tokens
    lengths: list[int]  # real tokens per row

    @property
    def last_index(self) -> Tensor:
        """(B,) where each row's next-token logits would be read: its last real token."""
        return torch.tensor(self.lengths) - 1

    @property
    def padding_share(self) -> float:
        """Share of the rectangle's positions that are padding: work a padded forward does for nothing."""
        return 1 - sum(self.lengths) / self.ids.numel()


def pad_batch(prompts: Sequence[Sequence[int]], pad_id: int = 0, multiple: int = 1) -> PaddedBatch:
    """Right-pad prompts into (B, T), T the longest prompt rounded up to `multiple`."""
    lengths = [len(p) for p in prompts]
    if not lengths or min(lengths) == 0:
        raise ValueError(f"need at least one prompt, each of at least one token, got lengths {lengths}")
    B, T = len(prompts), -(-max(lengths) // multiple) * multiple
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    key_mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return PaddedBatch(ids, key_mask, lengths)
