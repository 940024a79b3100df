"""The offline API, in vLLM's shapes (Day 36): `LLM(...).generate(prompts, SamplingParams(...))`.

    from nanoserve import LLM, SamplingParams          # from vllm import LLM, SamplingParams
    llm = LLM()                                          # the fetched SmolLM2, or LLM(model="folder")
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95)):
        print(out.prompt, out.outputs[0].text)

A prompt is text, `{"prompt_token_ids": [...]}` or (through `LLM.chat`) a list of chat messages.
Every prompt of a call becomes a request of one `LLMEngine`, so the call is continuously batched.
`SamplingParams.n` asks for several samples of one prompt: n requests with the same prompt (sample i
seeded seed + i), the later ones admitted a step after the first so its prompt's full blocks are
found in the prefix cache instead of computed again.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine import LLMEngine, SchedulerConfig
from .sampling import SamplingParams

Prompt = str | dict[str, Any] | Sequence[int]


@dataclass
class CompletionOutput:
    """One sample of one prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token or stop string that ended it


@dataclass
class RequestOutput:
    """Everything one prompt produced (vLLM's RequestOutput): its samples in `outputs`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (the first sample's)


class LLM:
    """A model, its tokenizer and one engine. `model`: a Hugging Face Llama checkpoint folder, or None for
    the fetched SmolLM2. The engine's knobs (max_num_seqs, max_num_batched_tokens, num_blocks, block_size,
    prefix_caching) pass through as keywords; `weights="gguf"` serves the GGUF's own blocks (see `load`)."""

    def __init__(self, model: str | Path | None = None, *, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens, weights: str = "fp32",
                 **engine_kwargs: Any):
        from . import load

        self.model, self.tokenizer = load(model, weights=weights)  # weights="gguf": the shipped blocks
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.engine = LLMEngine(self.model, self.tokenizer, config=config, **engine_kwargs)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs in the prompts' order. One SamplingParams for all, or one per prompt.
        Every prompt is checked before any runs: a bad one raises (naming its index) and nothing is queued."""
        prompts = _as_list(prompts)
        params = _params_for(prompts, sampling_params)
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            try:
                self.engine.check_request(ids, dataclasses.replace(sp, n=1))
            except ValueError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        return self._run([(p if isinstance(p, str) else None, ids, sp)
                          for p, ids, sp in zip(prompts, encoded, params)], use_tqdm)

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
        params = sampling_params or SamplingParams()
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

    def _run(self, jobs: list[tuple[str | None, list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        """Queue every prompt's first sample, step; queue the other samples once the first's prompt is cached."""
        from tqdm.auto import tqdm

        outs, pending = [], []  # pending: (step to add at, output index, sample index, ids, params)
        for k, (text, ids, sp) in enumerate(jobs):
            rid = str(next(self._ids))
            outs.append(RequestOutput(rid, text, ids, [None] * sp.n))  # type: ignore[list-item]
            for i in range(sp.n):
                seed = None if sp.seed is None else sp.seed + i
                pending.append((0 if i == 0 else 1, k, i, ids, dataclasses.replace(sp, n=1, seed=seed)))
        ids_of: dict[str, tuple[int, int]] = {}
        bar = tqdm(total=len(pending), desc="generating", unit="seq", disable=not use_tqdm or len(pending) < 2)
        step = 0
        while pending or self.engine.has_unfinished_requests():
            for job in [j for j in pending if j[0] <= step]:
                pending.remove(job)
                _, k, i, ids, sp = job
                ids_of[self.engine.add_request(ids, sp, f"{outs[k].request_id}-{i}")] = (k, i)
            for out in self.engine.step():
                if out.finished and out.request_id in ids_of:
                    k, i = ids_of.pop(out.request_id)
                    req = self.engine.requests.pop(out.request_id)
                    outs[k].outputs[i] = CompletionOutput(i, req.text, list(req.output_token_ids), out.finish_reason,
                                                          req.stop_reason)
                    if i == 0:
                        outs[k].num_cached_tokens = req.num_cached_tokens
                    bar.update(1)
            step += 1
        bar.close()
        return outs


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
