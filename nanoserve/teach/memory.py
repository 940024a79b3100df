"""What a KV cache costs, and what reserving it wastes (Days 14 and 15).

Every token a sequence has seen leaves one key and one value vector per KV head
in every layer, and they stay for as long as the sequence runs:

    bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes

>>> kv_bytes_per_token(KNOWN_MODELS["SmolLM2-135M"], 4)       # 2 * 30 * 3 * 64 * 4
46080

A contiguous cache must reserve a sequence's whole maximum length up front,
because nobody knows how long the answer will be; a paged cache hands out
fixed-size blocks as the sequence grows, so it wastes at most the unfilled tail
of one block per sequence:

>>> contiguous_usage([5, 16, 17], max_len=32).waste_tokens     # 27 + 16 + 15
58
>>> paged_usage([5, 16, 17], block_size=16).waste_tokens       # 11 + 0 + 15
26

Everything here is plain arithmetic on a `ModelConfig` and lists of ints, so
the notebooks' sliders call it directly and the tests pin it exactly. The
length distribution Day 15 uses is drawn by `python -m nanoserve lengths` (see `run`).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig, kv_bytes_per_token
from ..kv.hybrid import num_skipped

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
"""Bytes per element of the dtypes a KV cache is commonly kept in."""

# Published shapes (each model's config.json on the Hugging Face hub).
KNOWN_MODELS: dict[str, ModelConfig] = {
    "SmolLM2-135M": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "SmolLM2-360M": ModelConfig(
        vocab_size=49152, hidden_size=960, intermediate_size=2560, n_layers=32, n_heads=15, n_kv_heads=5,
        head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "TinyLlama-1.1B": ModelConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, n_layers=22, n_heads=32, n_kv_heads=4,
        head_dim=64, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False),
    "Llama-3.2-1B": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, n_layers=16, n_heads=32, n_kv_heads=8,
        head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    "Llama-3-8B": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
}


def dtype_bytes(dtype: int | str | object) -> int:
    """Bytes per element: an int as is, a name from DTYPE_BYTES, or anything with `.itemsize` (torch.dtype)."""
    if isinstance(dtype, bool):
        raise ValueError(f"dtype must be a byte count, a name or a dtype, got {dtype!r}")
    if isinstance(dtype, int):
        n = dtype
    elif isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        n = DTYPE_BYTES[dtype]
    elif isinstance(getattr(dtype, "itemsize", None), int):
        n = dtype.itemsize  # type: ignore[attr-defined]
    else:
        raise ValueError(f"dtype must be a byte count, a name or a dtype, got {dtype!r}")
    if n <= 0:
        raise ValueError(f"dtype bytes must be positive, got {n}")
    return n


def kv_cache_bytes(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of a cache holding `batch` sequences of `context` tokens each."""
    if context < 0 or batch < 0:
        raise ValueError(f"context and batch must be >= 0, got context={context}, batch={batch}")
    return kv_bytes_per_token(cfg, dtype_bytes) * context * batch


def n_parameters(cfg: ModelConfig) -> int:
    """Parameters of a Llama with this shape (no biases; a tied LM head counted once)."""
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * q_out + 2 * cfg.hidden_size * kv_out + q_out * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    per_layer = attn + mlp + 2 * cfg.hidden_size  # two RMSNorm weights
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return embed + cfg.n_layers * per_layer + cfg.hidden_size  # final norm


def human_bytes(n: float) -> str:
    """Binary units, three significant figures: 46080 -> '45 KiB'."""
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"


@dataclass(frozen=True)
class CacheCost:
    """The numbers behind Day 14's slider: one model, context, batch and dtype."""

    model: str
    context: int
    batch: int
    dtype_bytes: int
    bytes_per_token: int
    cache_bytes: int
    weight_bytes: int

    @property
    def cache_to_weights(self) -> float:
        """How many copies of the weights the cache weighs: past 1.0 the cache is the bigger bill."""
        return self.cache_bytes / self.weight_bytes

    def __str__(self) -> str:
        return (f"{self.model}, context {self.context}, batch {self.batch}, {self.dtype_bytes} B/elem: "
                f"{human_bytes(self.bytes_per_token)}/token, cache {human_bytes(self.cache_bytes)}, "
                f"weights {human_bytes(self.weight_bytes)}, cache/weights {self.cache_to_weights:.2f}")


def cache_cost(model: str | ModelConfig, context: int, batch: int = 1, dtype: int | str | object = 4) -> CacheCost:
    """Cache and weight memory for a model (a KNOWN_MODELS name or a config), weights in the same dtype."""
    if isinstance(model, str):
        if model not in KNOWN_MODELS:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(KNOWN_MODELS)}")
        name, cfg = model, KNOWN_MODELS[model]
    else:
        name, cfg = "model", model
    b = dtype_bytes(dtype)
    return CacheCost(name, context, batch, b, kv_bytes_per_token(cfg, b), kv_cache_bytes(cfg, context, batch, b),
                     n_parameters(cfg) * b)


# ---- sliding windows: what a request holds when its sliding layers keep only their window -----------


def kv_bytes_per_request(cfg: ModelConfig, context: int, dtype_bytes: int = 4, windowed: bool = True,
                         block_size: int | None = None) -> int:
    """KV bytes one request of `context` tokens holds. A full layer keeps every token; a sliding layer, `windowed`,
    only its last `sliding_window` (Gemma 3 270M: 3/18 + 15/18 x 512/context of a full cache). With `block_size`,
    what the paged pool holds with the request's context in: whole blocks, a sliding layer's from the block of
    its next query's first key on (`kv.hybrid`)."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    tokens = 0
    for layer in range(cfg.n_layers):
        w = cfg.window(layer) if windowed else None
        if block_size is None:
            tokens += context if w is None else min(context, w)
        else:
            tokens += (-(-context // block_size) - num_skipped(w, context, block_size)) * block_size
    return tokens * kv_bytes_per_token(cfg, dtype_bytes) // cfg.n_layers


def requests_that_fit(cfg: ModelConfig, pool_bytes: int, context: int, dtype_bytes: int = 4, windowed: bool = True,
                      block_size: int | None = None) -> int:
    """How many requests of `context` tokens a pool of `pool_bytes` holds at once (`kv_bytes_per_request` each)."""
    return pool_bytes // kv_bytes_per_request(cfg, context, dtype_bytes, windowed, block_size)


# ---- Day 15: what a reservation wastes ------------------------------------------------------------


def _check_lengths(lengths: Sequence[int]) -> None:
    if len(lengths) == 0:
        raise ValueError("lengths is empty: give one total length (prompt + output) per request")
    bad = [x for x in lengths if not isinstance(x, int) or isinstance(x, bool) or x < 1]
    if bad:
        raise ValueError(f"lengths must be ints >= 1 (tokens per request), got {bad[:5]}")


@dataclass(frozen=True)
class Usage:
    """Token slots a set of requests fills (`used`) against the slots their scheme holds for them."""

    scheme: str
    n_requests: int
    used_tokens: int
    held_tokens: int
    worst_per_request: int  # the most slots any single request leaves empty

    @property
    def waste_tokens(self) -> int:
        return self.held_tokens - self.used_tokens

    @property
    def waste_fraction(self) -> float:
        """Share of the held memory that holds nothing."""
        return self.waste_tokens / self.held_tokens

    @property
    def utilisation(self) -> float:
        return self.used_tokens / self.held_tokens


def contiguous_usage(lengths: Sequence[int], max_len: int) -> Usage:
    """Every request reserves `max_len` slots up front, because its output length is unknown."""
    _check_lengths(lengths)
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    too_long = [x for x in lengths if x > max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests are longer than max_len={max_len} (e.g. {too_long[0]})")
    return Usage(f"contiguous, max_len {max_len}", len(lengths), sum(lengths), max_len * len(lengths),
                 max_len - min(lengths))


def blocks_needed(length: int, block_size: int) -> int:
    """ceil(length / block_size): blocks a sequence of `length` tokens occupies."""
    return -(-length // block_size)


def paged_usage(lengths: Sequence[int], block_size: int) -> Usage:
    """Each request holds ceil(len / block_size) blocks: at most block_size - 1 empty slots, in its last block."""
    _check_lengths(lengths)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    held = [blocks_needed(x, block_size) * block_size for x in lengths]
    return Usage(f"paged, block {block_size}", len(lengths), sum(lengths), sum(held),
                 max(h - x for h, x in zip(held, lengths)))


def fits_contiguous(budget_tokens: int, max_len: int) -> int:
    """How many requests a cache of `budget_tokens` slots holds at once when each reserves `max_len`."""
    if budget_tokens < 0 or max_len < 1:
        raise ValueError(f"need budget_tokens >= 0 and max_len >= 1, got {budget_tokens}, {max_len}")
    return budget_tokens // max_len


def fits_paged(lengths: Sequence[int], budget_tokens: int, block_size: int) -> int:
    """How many requests fit at their full length in `budget_tokens // block_size` blocks.

    Requests are admitted in the order given, the list repeating as a stream, until the next
    one's blocks do not fit. Counting every request at its final length is paging's worst case:
    a running request holds only the blocks it has filled so far.
    """
    _check_lengths(lengths)
    if budget_tokens < 0 or block_size < 1:
        raise ValueError(f"need budget_tokens >= 0 and block_size >= 1, got {budget_tokens}, {block_size}")
    free = budget_tokens // block_size
    need = [blocks_needed(x, block_size) for x in lengths]
    rounds, free = divmod(free, sum(need))
    n = rounds * len(need)
    for b in need:
        if b > free:
            break
        free -= b
        n += 1
    return n


# ---- a length distribution: data/lengths-lognormal.csv, drawn by `python -m nanoserve lengths` ----


@dataclass(frozen=True)
class RequestLength:
    prompt_tokens: int
    output_tokens: int

    @property
    def total(self) -> int:
        """Slots this request fills at its end: the prompt plus every generated token."""
        return self.prompt_tokens + self.output_tokens


def sample_lengths(n: int, seed: int = 0, prompt_median: float = 100.0, output_median: float = 180.0,
                   sigma: float = 1.0, max_len: int = 2048) -> list[RequestLength]:
    """n requests with lognormal prompt and output lengths (stdlib `random`, so any machine draws the same).

    Lognormal because request lengths in chat traces are: most short, a long right tail. Prompts
    are cut to half of `max_len` and outputs to what is left, as a server with that context would.
    """
    if n < 1 or max_len < 2 or sigma < 0 or prompt_median < 1 or output_median < 1:
        raise ValueError(f"bad sample_lengths arguments: n={n}, max_len={max_len}, sigma={sigma}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(max(1, round(rng.lognormvariate(math.log(prompt_median), sigma))), max_len // 2)
        o = min(max(1, round(rng.lognormvariate(math.log(output_median), sigma))), max_len - p)
        out.append(RequestLength(p, o))
    return out


def write_lengths(path: str | Path, rows: Sequence[RequestLength], header: str) -> None:
    with open(path, "w", newline="") as f:
        f.write(f"# {header}\n")
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["request", "prompt_tokens", "output_tokens"])
        w.writerows([i, r.prompt_tokens, r.output_tokens] for i, r in enumerate(rows))


def read_lengths(path: str | Path) -> list[RequestLength]:
    """Rows of a lengths CSV (columns prompt_tokens, output_tokens; lines starting '#' are comments)."""
    with open(path, newline="") as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        try:
            return [RequestLength(int(r["prompt_tokens"]), int(r["output_tokens"])) for r in rows]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {rows.line_num}: not a lengths row ({e})") from None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="data/lengths-lognormal.csv")
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Draw Day 15's request lengths and write them as CSV, the command in its first line."""
    rows = sample_lengths(args.n, args.seed)
    command = f"python -m nanoserve lengths -n {args.n} --seed {args.seed} --out {args.out}"
    write_lengths(args.out, rows, f"command: {command}")
    totals = [r.total for r in rows]
    print(f"{len(rows)} requests, total tokens min {min(totals)} median {sorted(totals)[len(totals) // 2]} "
          f"max {max(totals)} -> {args.out}")
    return 0
