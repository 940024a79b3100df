"""Two model families side by side (Day 43): what each config says, where each model's parameters are, and which
keys each layer reads. Pure functions over configs and models; the notebook draws what they return.

    config_rows(cfgs)             one row per number that differs in kind between families
    parameter_split(model)        parameters by part: embedding (and the tied head), attention, MLP, norms
    attention_spans(cfg, p)       per layer, the first and last key a query at position p reads
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..config import ModelConfig

ROWS = [("layers", "n_layers"), ("hidden size", "hidden_size"), ("MLP size", "intermediate_size"),
        ("query heads", "n_heads"), ("KV heads", "n_kv_heads"), ("head dim", "head_dim"),
        ("vocabulary", "vocab_size"), ("context", "max_position_embeddings"), ("RoPE base", "rope_theta"),
        ("tied head", "tie_word_embeddings")]


def config_rows(cfgs: Mapping[str, ModelConfig]) -> list[tuple[str, ...]]:
    """(what, one value per config) rows: the shared numbers, then the sliding window and the local RoPE base
    ("-" where a family has none)."""
    rows = [(label, *(str(getattr(c, name)) for c in cfgs.values())) for label, name in ROWS]
    sliding = [sum(c.window(i) is not None for i in range(c.n_layers)) for c in cfgs.values()]
    rows.append(("sliding layers", *map(str, sliding)))
    rows.append(("window", *(str(c.sliding_window) if n else "-" for c, n in zip(cfgs.values(), sliding))))
    rows.append(("local RoPE base", *(str(c.rope_local_theta) if n else "-" for c, n in zip(cfgs.values(), sliding))))
    return rows


def parameter_split(model: nn.Module) -> dict[str, int]:
    """Parameters by part. A tied head is the embedding's own table, counted once."""
    parts = {"embedding": 0, "attention": 0, "MLP": 0, "norms": 0}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        leaf = name.rsplit(".", 1)[-1]
        part = ("embedding" if leaf in ("embed", "lm_head") else "norms" if "norm" in leaf else
                "attention" if leaf in ("wqkv", "wo") else "MLP" if leaf in ("w_gate_up", "w_down") else None)
        if part is None:
            raise ValueError(f"{name}: a parameter of no known part")
        parts[part] += p.numel()
    return parts


def attention_spans(cfg: ModelConfig, position: int) -> list[tuple[int, int]]:
    """For each layer, (first, last) key position a query at `position` reads: 0 .. position on a full layer,
    position - window + 1 .. position (not below 0) on a sliding one."""
    if position < 0:
        raise ValueError(f"position={position} must be >= 0")
    spans = []
    for i in range(cfg.n_layers):
        w = cfg.window(i)
        spans.append((0 if w is None else max(0, position - w + 1), position))
    return spans
