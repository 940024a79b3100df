"""The real-model prompts the parity tests share (1 to 500 tokens, plain text, code and chat), and the
near-tie rule they are compared by."""

import torch

NEAR_TIE = 1e-3  # a reference top1 - top2 logit gap below this is a genuine near-tie
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


def near_tie_horizon(ref_logits: list[torch.Tensor], gap: float = NEAR_TIE) -> int:
    """How many leading steps the reference chose clearly: the index of the first step whose
    top1 - top2 logit gap is below `gap` (or the number of steps if there is none).
    Tokens before it must match exactly; from it on two correct fp32 paths may diverge."""
    for i, logits in enumerate(ref_logits):
        top2 = torch.topk(logits.float().flatten(), 2).values
        if float(top2[0] - top2[1]) < gap:
            return i
    return len(ref_logits)
