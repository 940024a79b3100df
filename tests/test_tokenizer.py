"""The tokenizer against transformers' on the same tokenizer.json, and incremental detokenization."""

from __future__ import annotations

import pytest

from nanoserve.tokenizer import IncrementalDetokenizer, stream_text

TEXTS = [
    "Hello world",
    "The capital of France is",
    "",
    " leading space and trailing space ",
    "tabs\tand\nnewlines\n\n\nand   runs      of spaces",
    "digits 0 7 42 1234567890 3.14159 -12,345.67e-8",
    "café naïve façade Ünïcödé résumé",
    "日本語のテキストと中文文本",
    "emoji 🙂🚀👩‍💻🇫🇷 and ✓ ≠ ∑",
    "code: def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi<|im_end|>\n",  # special tokens written in text become their single ids
    "URLs https://example.com/a?b=c&d=e and e-mails a.b@c.org",
    "MiXeD CaSe, punctuation!!! ... ??? --- ''' \"\"\"",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Japan?"}],
    [
        {"role": "user", "content": "Say hi 🙂"},
        {"role": "assistant", "content": "Hi! 👋"},
        {"role": "user", "content": "Now in 中文, please.\n\nThanks   a lot."},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids)


def _hf_chat_ids(hf_tok, messages, add_generation_prompt):
    out = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    text = tok.apply_chat_template(messages, add_generation_prompt)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.encode_chat(messages, add_generation_prompt) == _hf_chat_ids(hf_tok, messages, add_generation_prompt)


def test_chat_template_errors_name_the_message(tok):
    with pytest.raises(ValueError, match="message 1"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"content": "no role"}])


MULTIBYTE = ["emoji 🙂🚀👩‍💻🇫🇷 end", "日本語のテキストと中文文本", "café ✓ ≠ ∑ 𝔘𝔫𝔦"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_detokenizer_never_splits_a_character(tok, text):
    ids = tok.encode(text)
    # the hard case is really there: some token, decoded alone, is part of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token completed no character and was held back
    assert "".join(pieces) + d.flush() == text
    assert "".join(stream_text(tok, ids)) == text


def test_flush_returns_a_genuinely_broken_tail(tok):
    ids = tok.encode(MULTIBYTE[0])
    # cut the stream where the last character is incomplete: its remaining bytes never arrive
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids[:cut]]
    assert "\ufffd" not in "".join(pieces)  # nothing broken is emitted while the stream runs
    tail = d.flush()  # at the end, what was held back is handed over as decoded, visibly broken
    assert "".join(pieces) + tail == tok.decode(ids[:cut])
    assert tail.endswith("\ufffd")
