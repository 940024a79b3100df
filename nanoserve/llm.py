"""The offline API, in vLLM's shapes (Day 36): `LLM(...).generate(prompts, SamplingParams(...))`.

    from nanoserve import LLM, SamplingParams          # from vllm import LLM, SamplingParams
    llm = LLM()                                          # the fetched SmolLM2, or LLM(model="folder")
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95)):
        print(out.prompt, out.outputs[0].text)

A prompt is text, `{"prompt_token_ids": [...]}` or (through `LLM.chat`) a list of chat messages.
Every prompt of a call becomes a request of one `LLMEngine`, so the call is continuously batched.
`SamplingParams.n` asks for several samples of one prompt: the engine computes the prompt once and
forks its blocks for the other samples (sample i seeded (seed + i) mod 2**64).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .config import generation_defaults
from .engine import LLMEngine
from .engine.outputs import CompletionOutput, RequestOutput
from .loader import load
from .model.fetch import model_folder
from .sampling import SamplingParams

Prompt = str | dict[str, Any] | Sequence[int]


class LLM:
    """A model, its tokenizer and one engine. `model`: a Hugging Face checkpoint folder, a model's name
    ("smollm2-135m"; `fetch.MODELS`), or None for the fetched SmolLM2; `weights="gguf"` serves the GGUF's own
    blocks, with `activations="int8"` their
    products on int8 activations, `dtype="bfloat16"` bf16 matrices and K/V, `kv_cache_dtype="bfloat16"` a bf16
    K/V cache alone (each opt-in, faster, not exact; see `load`). The engine's options
    are vLLM's keywords (`max_num_seqs`, `max_num_batched_tokens`, `block_size`, `num_blocks`,
    `kv_cache_bytes`, `enable_prefix_caching`, `speculative_config`; `config.EngineConfig`), and nanoserve's
    `num_scheduler_steps` and `tpot_slo_ms` (a time-per-token target that sizes prompt chunks, Day 32)."""

    def __init__(self, model: str | Path | None = None, *, weights: str = "fp32", activations: str = "fp32",
                 dtype: str = "float32", kv_cache_dtype: str = "auto", **engine_options: Any):
        folder = model_folder(model)
        self.model, self.tokenizer = load(folder, dtype=dtype, weights=weights, activations=activations,
                                          kv_cache_dtype=kv_cache_dtype)
        self.engine = LLMEngine(self.model, self.tokenizer, **engine_options)
        self.sampling_defaults = generation_defaults(folder)  # the checkpoint's recommended sampling, if any
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's recommended sampling (its generation_config.json), else OpenAI's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs in the prompts' order. One SamplingParams for all, or one per prompt.
        Every prompt is checked before any runs: a bad one raises (naming its index) and nothing is queued."""
        from tqdm.auto import tqdm

        prompts = _as_list(prompts)
        params = _params_for(prompts, sampling_params if sampling_params is not None
                             else self.get_default_sampling_params())
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            try:
                self.engine.check_request(ids, sp)
            except ValueError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        outs: dict[str, RequestOutput] = {}
        for p, ids, sp in zip(prompts, encoded, params):
            rid = self.engine.add_request(ids, sp, f"llm-{next(self._ids)}")
            outs[rid] = RequestOutput(rid, p if isinstance(p, str) else None, ids, [None] * sp.n)  # type: ignore[list-item]
        bar = tqdm(total=sum(sp.n for sp in params), desc="generating", unit="seq",
                   disable=not use_tqdm or len(prompts) * params[0].n < 2)
        done: dict[tuple[str, int], CompletionOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id not in outs:
                        continue
                    c = done.setdefault((out.request_id, out.index), CompletionOutput(out.index, "", []))
                    c.add(out)
                    if out.prompt_logprobs is not None:
                        outs[out.request_id].prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        outs[out.request_id].outputs[out.index] = c
                        outs[out.request_id].num_cached_tokens = out.num_cached_tokens
                        bar.update(1)
        finally:
            bar.close()
            for rid, o in outs.items():  # interrupted: nothing of this call stays queued
                if any(c is None for c in o.outputs):
                    self.engine.abort(rid)
        return list(outs.values())

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, each rendered with the
        model's chat template and answered as the assistant."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """One prompt's text as it is generated, piece by piece (each a whole number of characters)."""
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: a stream carries one sample")
        rid = self.engine.add_request(self._encode(prompt, 0), params, f"stream-{next(self._ids)}")
        try:
            while not self.engine.requests[rid].finished:
                for out in self.engine.step():
                    if out.request_id == rid and out.new_text:
                        yield out.new_text
        finally:
            if not self.engine.requests[rid].finished:  # the caller stopped reading: free its blocks
                self.engine.abort(rid)

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index}: empty text: at least one token is needed")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"], index)
            raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids', got {list(prompt)}")
        return list(prompt)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them. A flat list of ints is one prompt of token ids."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts


def _params_for(prompts: list[Prompt],
                params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * len(prompts)
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
    return params
