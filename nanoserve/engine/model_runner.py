"""The model runner: turns one step's requests into model inputs and runs the forward.

vLLM and nano-vllm call this part the ModelRunner. The caller (a session, a static batch,
later the scheduler) has already given every request's new tokens slots in the pool; the
runner lays the requests end to end (`attention.prepare`), runs the model once over the
flat list of tokens with the paged attention backend, and returns each request's next-token
logits. It decides nothing about who runs: that is the caller's business.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import Chunk, PagedAttention, choose, prepare
from ..kernels import enabled as kernels_enabled
from ..kernels import torch_ops, use_kernels
from ..kv.paged import PagedKVCache
from ..model import Llama
from ..model.compiled import BlockStep, applies


class ModelRunner:
    """Runs steps of `model` on `cache`. A step of two or more tokens gives each request the same bits
    whatever else is in it; a step of one token (one sequence's decode) takes the one-row road.

    `kernels`: the compiled kernels for the layer's small ops and for attention: None where they can
    run (fp32, built), True insists, False runs torch's ops. `attention` picks the attention
    implementation by name ("reference", "torch", "compiled"; `attention.backend`), else the default.
    `batch_invariant`: a step of one token runs as a step of several too, so a request gets the same
    bits alone as beside others (its seeded samples too), at the price of the one-row road's speed.
    `compiled_step`: a model on GGUF blocks runs its steps as one compiled call where it can
    (`model.compiled`: the same logits, bit for bit, without the Python between the calls); False never."""

    def __init__(self, model: Llama, cache: PagedKVCache, kernels: bool | None = None, attention: str | None = None,
                 batch_invariant: bool = False, compiled_step: bool | None = None):
        self.model, self.cache = model, cache
        self.batch_invariant = batch_invariant
        self.kernels = use_kernels(model.dtype, kernels)
        self.attention = choose(self.kernels, attention)
        use_step = compiled_step is not False and self.attention == "compiled"
        self.block_step = BlockStep.of(model) if use_step else None
        self.last_prepare_s = 0.0  # host time laying out the last step's inputs (the engine reports it)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk], all_rows: bool = False) -> Tensor:
        """Run one step; logits (R, V) at each request's last new token, requests in order. `all_rows`:
        logits (n, V) at every new token instead, as speculative decoding's verification reads them."""
        t0 = time.perf_counter()
        ids, md = prepare(chunks, self.cache.block_size, min_rows=2 if self.batch_invariant else 1)
        self.last_prepare_s = time.perf_counter() - t0
        if self.block_step is not None and not all_rows and applies(md) and kernels_enabled():
            return self.block_step(ids, md, self.cache.storage)
        with contextlib.nullcontext() if self.kernels else torch_ops():
            backend = PagedAttention(self.cache.storage, md, self.attention)
            h = self.model.hidden_states(ids[None], md.positions[None], backend)[0]  # (N, C)
            rows = h[:md.num_tokens] if all_rows else h[md.last_rows]  # (n or R, C)
            if len(rows) == 1 and len(ids) > 1:  # one request alone: the head runs the batch's product
                return self.model.logits(F.pad(rows, (0, 0, 0, 1)))[:1]  # kernel, as its row in any batch would
            return self.model.logits(rows)
