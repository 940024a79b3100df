"""Generation for one prompt: `generate` and `stream_generate` (the README's first road, and the CLI's).

A single request is one request in the engine (`LLMEngine`), which is sized for it: a pool that
holds its prompt and every token it may generate, a step budget that takes its whole prompt at
once. It runs the steps every other road runs (the compiled kernels, the one-call step on GGUF
blocks), so one request is as fast here as it is alone in a server.

>>> generate(model, tok.encode("The capital of France is"), SamplingParams(temperature=0, max_tokens=3),
...          tok).text                                     # doctest: +SKIP
' Paris.'
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from .engine import LLMEngine
from .engine.outputs import CompletionOutput, StepOutput
from .kv.groups import kv_cache_groups
from .model import Llama
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["generate", "greedy_ids", "one_request_engine", "stream_generate"]


def one_request_engine(model: Llama, tokenizer: Tokenizer | None, prompt_len: int, params: SamplingParams,
                       speculative_config: SpeculativeConfig | dict | None = None) -> LLMEngine:
    """An engine sized for one request of `prompt_len` tokens: blocks for its n samples' whole contexts in every
    KV cache group (`kv_cache_groups`: one for Llama, six for Gemma 3), a budget that computes its prompt in one
    step (with room for speculative drafts)."""
    spec = SpeculativeConfig.of(speculative_config)
    block_size = CacheConfig().block_size
    context = min(prompt_len + params.max_tokens, model.cfg.max_position_embeddings)
    per_group = params.n * -(-context // block_size) + params.n  # each sample's context, and a copied tail block
    blocks = len(kv_cache_groups(model.cfg)) * per_group
    budget = max(SchedulerConfig().max_num_batched_tokens,
                 prompt_len + params.n * (1 + (spec.num_speculative_tokens if spec else 0)))
    config = EngineConfig(CacheConfig(block_size, num_blocks=blocks),
                          SchedulerConfig(max_num_seqs=max(params.n, 1), max_num_batched_tokens=budget),
                          speculative=spec)
    return LLMEngine(model, tokenizer, config)


def stream_generate(model: Llama, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    tokenizer: Tokenizer | None = None,
                    speculative_config: SpeculativeConfig | dict | None = None) -> Iterator[StepOutput]:
    """One prompt's StepOutputs as the engine produces them (one token each, or several when speculative
    drafts were accepted); the last carries a finish_reason. Stopping early aborts the request."""
    params = params or SamplingParams(temperature=0.0)
    engine = one_request_engine(model, tokenizer, len(prompt_ids), params, speculative_config)
    engine.check_request(prompt_ids, params)  # token ids only: text is the tokenizer's to encode first
    rid = engine.add_request(prompt_ids, params)
    try:
        while engine.has_unfinished_requests():
            yield from engine.step()
    finally:
        if engine.has_unfinished_requests():
            engine.abort(rid)


def generate(model: Llama, prompt_ids: Sequence[int], params: SamplingParams | None = None,
             tokenizer: Tokenizer | None = None,
             speculative_config: SpeculativeConfig | dict | None = None) -> CompletionOutput:
    """Run `stream_generate` to the end: the completion's ids, text and, if asked for, log-probabilities (one
    sample: params.n must be 1)."""
    params = params or SamplingParams(temperature=0.0)
    if params.n != 1:
        raise ValueError(f"SamplingParams.n={params.n}: generate returns one completion; LLM.generate returns n")
    out = CompletionOutput(0, "", [])
    for step in stream_generate(model, prompt_ids, params, tokenizer, speculative_config):
        out.add(step)
    return out


def greedy_ids(model: Llama, prompt_ids: Sequence[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    """Greedy token ids only (no text), through the engine: the form equivalence tests compare."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return generate(model, prompt_ids, params).token_ids
