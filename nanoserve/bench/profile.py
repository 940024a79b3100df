"""Where the time of one decode step goes (Day 12): every torch call the forward makes is timed under a
`TorchFunctionMode` and filed under a group (GROUPS): `F.embedding` is embedding; a call touching a weight's memory
is that weight's group; all the KV backend does is attention; calls from a function named for norm or rope go
there; anything else to the group of the call before it. On a GPU each call is synchronized around."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..attention.causal import KVBackend, no_cache_backend
from ..config import ModelConfig
from ..model import Llama
from .roofline import forward_flops_by_group
from .timing import Clock

GROUPS = ("embedding", "norms", "qkv", "rope", "attention", "o_proj", "mlp", "lm_head", "other")


@dataclass(frozen=True)
class OpCall:
    group: str
    op: str
    seconds: float


@dataclass(frozen=True)
class GroupRow:
    group: str
    seconds: float  # median over repeats of the group's summed op time
    share: float  # of the total over all groups
    calls: int  # torch calls per forward


def weight_group(name: str) -> str | None:
    """The op group of a parameter, from its name in `model.named_parameters()` (None: no group)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in leaf:
        return "norms"
    if "qkv" in leaf or leaf in ("q_proj", "k_proj", "v_proj"):
        return "qkv"
    if leaf in ("wo", "o_proj"):
        return "o_proj"
    if any(s in leaf for s in ("gate", "up", "down", "mlp")):
        return "mlp"
    if "lm_head" in leaf or "embed" in leaf:
        return "lm_head"  # a linear with the (tied) table is the head; the lookup is caught by op name
    return None


def weight_bytes_by_group(model: Llama, n_tokens: int) -> dict[str, int]:
    """Weight bytes each group reads in one forward of `n_tokens`: a product all its weight, the lookup T rows."""
    out = dict.fromkeys(GROUPS, 0)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        group = weight_group(name)
        if group is None or id(p) in seen or (p is model.embed and p is not model.lm_head):
            continue  # an untied input table is read one row per token, counted below
        seen.add(id(p))
        out[group] += p.numel() * p.element_size()
    out["embedding"] = n_tokens * model.embed.shape[-1] * model.embed.element_size()
    return out


def flops_by_group(cfg: ModelConfig, n_tokens: int) -> dict[str, int]:
    """`roofline`'s FLOPs of one forward of `n_tokens` with `last_only`, for every group."""
    return dict.fromkeys(GROUPS, 0) | forward_flops_by_group(cfg, n_tokens)


def summarize(runs: Sequence[Sequence[OpCall]], groups: Sequence[str] = GROUPS) -> list[GroupRow]:
    """Per-group median seconds over repeated runs, and each group's share of the total."""
    if not runs:
        raise ValueError("summarize needs at least one run")
    unknown = {c.group for run in runs for c in run} - set(groups)
    if unknown:
        raise ValueError(f"op groups {sorted(unknown)} are not among {list(groups)}")
    medians = {g: statistics.median(sum(c.seconds for c in run if c.group == g) for run in runs) for g in groups}
    total = sum(medians.values())
    calls = {g: sum(1 for c in runs[0] if c.group == g) for g in groups}
    return [GroupRow(g, medians[g], medians[g] / total if total > 0 else 0.0, calls[g]) for g in groups]


_TORCH_DIR = os.path.dirname(torch.__file__)


def _storage(t: Tensor) -> int:
    # the address of a tensor's memory: the same for a parameter and every view of it
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, wrapper subclasses)
        return -1


def _caller_name() -> str:
    # the innermost function outside torch and this module that made the current torch call
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else ""


class _GroupingMode(TorchFunctionMode):
    def __init__(self, weights: dict[int, str], clock: Clock, sync: Callable[[], None]):
        super().__init__()
        self.weights = weights  # storage address of a parameter -> its group
        self.clock, self.sync = clock, sync
        self.calls: list[OpCall] = []
        self.in_attention = False
        self.last = "other"

    def group_of(self, func: Callable, args: tuple) -> str:
        name = getattr(func, "__name__", "")
        if self.in_attention:
            return "attention"
        if name == "embedding":
            return "embedding"
        if name != "__get__":  # reading an attribute (w.dtype, w.shape) is not work on the weight
            for a in args:
                if isinstance(a, Tensor) and (group := self.weights.get(_storage(a))) is not None:
                    return group
        caller = _caller_name().lower()
        if "norm" in caller:
            return "norms"
        if "rope" in caller or "rotary" in caller:
            return "rope"
        return self.last

    def __torch_function__(self, func, types, args=(), kwargs=None):
        group = self.group_of(func, args)
        self.sync()
        t0 = self.clock()
        out = func(*args, **(kwargs or {}))
        self.sync()
        self.calls.append(OpCall(group, getattr(func, "__name__", str(func)), self.clock() - t0))
        self.last = group
        return out

    def attention(self, kv: KVBackend) -> KVBackend:
        def backend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.in_attention = True
            try:
                return kv(layer, q, k, v)
            finally:
                self.in_attention, self.last = False, "attention"

        return backend


@torch.inference_mode()
def profile_forward(
    model: Llama, ids: Tensor, positions: Tensor | None = None, kv: KVBackend | None = None,
    repeats: int = 5, warmup: int = 1, clock: Clock = time.perf_counter, compiled: bool | None = None,
) -> tuple[list[GroupRow], list[OpCall]]:
    """Profile `model(ids, positions, kv, last_only=True, compiled=compiled)`, ids (B, T); no `kv`: the no-cache
    backend, a Day 08 step (a `kv` must be reusable across runs). The table (median of `repeats` after `warmup`),
    and one run's calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if ids.dim() == 1:
        ids = ids[None]
    weights = {_storage(p): g for n, p in model.named_parameters(remove_duplicate=False)
               if (g := weight_group(n)) is not None}
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    base_kv = kv or no_cache_backend()
    runs: list[list[OpCall]] = []
    for i in range(warmup + repeats):
        mode = _GroupingMode(weights, clock, sync)
        with mode:
            model(ids, positions, kv=mode.attention(base_kv), last_only=True, compiled=compiled)
        if i >= warmup:
            runs.append(mode.calls)
    return summarize(runs), runs[-1]


def weight_rates(rows: Sequence[GroupRow], weight_bytes: dict[str, int]) -> dict[str, float]:
    """Weight bytes per second each group streamed: for a one-token step, to hold against memory bandwidth."""
    return {r.group: weight_bytes[r.group] / r.seconds for r in rows
            if weight_bytes.get(r.group, 0) > 0 and r.seconds > 0}
