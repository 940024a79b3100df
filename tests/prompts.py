"""The real-model prompts the parity tests share (1 to 500 tokens, plain text, code and chat), and the
near-tie rule they are compared by."""

from nanoserve.teach.reference import NEAR_TIE, near_tie_horizon  # noqa: F401 (the tests import them here)

MAX_NEW = 64  # greedy tokens generated per prompt in the parity tests

LONG_TEXT = (
    "The river starts high in the mountains, where snow melts each spring and feeds a hundred small streams. "
    "They join in the valley, turn a mill, pass under an old stone bridge and widen into a slow, brown water "
    "that carries boats, logs and the news of every town along its banks down to the sea. "
)

# name -> (kind, text); kind "chat" wraps the text as one user message in the chat template
PROMPTS = {
    "one_token": ("plain", "Once"),
    "plain": ("plain", "The capital of France is"),
    "code": ("plain", "def fibonacci(n):\n"),
    "chat": ("chat", "What is the capital of France?"),
    "chat_cjk": ("chat", "Write the word 'hello' in Chinese, Japanese and Korean."),
    "long_500": ("plain", LONG_TEXT * 12),
}


def prompt_ids(tok, name: str) -> list[int]:
    """The token ids of PROMPTS[name], the long one cut to 500 tokens."""
    kind, text = PROMPTS[name]
    ids = tok.encode_chat([{"role": "user", "content": text}]) if kind == "chat" else tok.encode(text)
    return ids[:500]
