"""The padded rectangle Day 27 draws: right padding, the key mask, where logits are read, the waste."""

import pytest

from nanoserve.teach.padding import pad_batch


def test_rows_are_right_padded_with_their_mask_and_last_index():
    b = pad_batch([[5, 6, 7], [8], [1, 2]], pad_id=0)
    assert b.ids.tolist() == [[5, 6, 7], [8, 0, 0], [1, 2, 0]]
    assert b.key_mask.int().tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert b.last_index.tolist() == [2, 0, 1]
    assert b.padding_share == pytest.approx(3 / 9)


def test_the_width_rounds_up_to_the_multiple():
    b = pad_batch([[5, 6, 7], [8]], multiple=4)
    assert b.ids.shape == (2, 4) and b.padding_share == pytest.approx(0.5)


@pytest.mark.parametrize("prompts", [[], [[1], []]])
def test_an_empty_batch_or_prompt_is_refused(prompts):
    with pytest.raises(ValueError, match="at least one prompt, each of at least one token"):
        pad_batch(prompts)
