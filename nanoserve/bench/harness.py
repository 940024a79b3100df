"""The harness: the real model and a real batched pool, handed to measuring code as closures (Day 26).

A benchmark that times a function called in isolation measures that function. The harness
builds exactly what generation builds, a `StaticBatch` (its prompts' prefill into a real
`BatchedPagedKVCache`, then batched decode steps, each through the ModelRunner), and hands
the stdlib timing core (`batchbench.time_static_batch`) its two bound methods. What gets
timed is the loop `greedy_generate_batch` runs, and the tokens it collects are that
function's tokens.

    build_batched_decode  one static batch, as a prefill() and a step() closure
    time_model_batch      time it: a BatchTiming (prefill, every step, each row's budget) and the tokens
    sweep_batch_sizes     uniform batches of 1, 2, 4, ... rows: throughput against batch size
    time_hf_generate      transformers' static batched generate on the same checkpoint, timed per step
    time_engine_batch     the same rows through the scheduled engine (Day 31): the same BatchTiming

transformers is imported only inside the two functions that use it: it is the reference, not a dependency.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import EngineConfig, SchedulerConfig
from ..engine import LLMEngine
from ..model import Llama
from ..sampling import SamplingParams
from ..stages import StaticBatch
from .batchbench import BatchScaling, BatchTiming, fit_batch_scaling, time_static_batch
from .timing import DEFAULT_CLOCK, Clock

SWEEP_SIZES = (1, 2, 4, 8, 16, 32)
BLOCKING_LENS = (4,) * 7 + (32,)  # Day 29's blocking run: seven rows of 4 tokens behind one of 32

PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "What is two plus two?",
    "Name three colors of the rainbow.",
    "Once upon a time, in a small village by the river,",
    "Explain in one sentence why the sky is blue.",
    "List the days of the week:",
    "A recipe for pancakes needs flour, eggs and",
)
"""Eight short prompts, one per row of the blocking run; the sweep replicates the first."""


@dataclass
class BatchedDecode:
    """One real static batch as two closures: `prefill()` once, then `step()` row_steps-max times."""

    batch: StaticBatch
    prefill: Callable[[], object]
    step: Callable[[], object]
    row_steps: list[int]

    @property
    def tokens(self) -> list[list[int]]:
        """What each row has collected so far: after the whole run, greedy_generate_batch's output."""
        return self.batch.tokens

    def free(self) -> None:
        self.batch.kv.free()


def build_batched_decode(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                         block_size: int = 16, kernels: bool | None = None,
                         compiled_step: bool | None = None) -> BatchedDecode:
    """Stand up the batch `greedy_generate_batch(model, prompts, stop_steps=stop_steps)` runs."""
    batch = StaticBatch(model, prompts, list(stop_steps), block_size, kernels, compiled_step)
    return BatchedDecode(batch, batch.prefill, batch.step, list(stop_steps))


def time_model_batch(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                     clock: Clock = DEFAULT_CLOCK, block_size: int = 16, kernels: bool | None = None,
                     compiled_step: bool | None = None) -> tuple[BatchTiming, list[list[int]]]:
    """Time one static batch: the prefill, every decode step, and row i's budget of stop_steps[i] steps.

    Rows stop on their step budget, not on EOS; a finished row stays in every forward (it keeps
    its slot and its blocks) until the slowest row is done, which is what the timing charges."""
    run = build_batched_decode(model, prompts, stop_steps, block_size, kernels, compiled_step)
    try:
        timing = time_static_batch(run.prefill, run.step, run.row_steps, clock)
    finally:
        run.free()
    return timing, run.tokens


def time_engine_batch(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                      clock: Clock = DEFAULT_CLOCK, config: SchedulerConfig | None = None,
                      kernels: bool | None = None) -> tuple[BatchTiming, list[list[int]]]:
    """The rows of `time_model_batch`, all arriving at once, through the scheduled engine: its first step
    is every prompt (the prefill), then each step decodes the rows still running. Row i generates
    stop_steps[i] + 1 tokens, as in the static batch, and is handed back the step it is done."""
    engine = LLMEngine(model, config=EngineConfig(scheduler=config or SchedulerConfig(), kernels=kernels), clock=clock)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
           for p, n in zip(prompts, stop_steps)]
    t0 = clock()
    engine.step()
    if engine.history[0].num_prefill_tokens != sum(len(p) for p in prompts):
        raise ValueError("the prompts did not fit one step: raise max_num_batched_tokens or max_num_seqs")
    prefill_s, step_s, step_rows = clock() - t0, [], []
    while engine.has_unfinished_requests():
        t = clock()
        engine.step()
        step_s.append(clock() - t)
        step_rows.append(engine.history[-1].num_decode_tokens)
    tokens = [engine.requests[i].output_token_ids for i in ids]
    timing = BatchTiming(prefill_s, step_s, [len(t) - 1 for t in tokens], step_rows, returns_rows_when_done=True)
    return timing, tokens


@dataclass
class Sweep:
    """Uniform batches (every issued token useful), one BatchTiming per batch size."""

    timings: dict[int, BatchTiming]
    tokens: dict[int, list[list[int]]] = field(repr=False)

    @property
    def scaling(self) -> BatchScaling:
        sizes = sorted(self.timings)
        return fit_batch_scaling(sizes, [self.timings[b].median_step_s for b in sizes])


def warm_up(model: Llama, prompt: Sequence[int], batch_size: int, steps: int = 2, kernels: bool | None = None) -> None:
    """A short untimed run of the same shape, so allocator growth is not in the first timed step."""
    time_model_batch(model, [prompt] * batch_size, [steps] * batch_size, kernels=kernels)


def sweep_batch_sizes(model: Llama, prompt: Sequence[int], batch_sizes: Sequence[int] = SWEEP_SIZES,
                      steps: int = 32, warmup: bool = True, clock: Clock = DEFAULT_CLOCK,
                      kernels: bool | None = None) -> Sweep:
    """Throughput against batch size: `prompt` replicated B times, every row decoding `steps` steps."""
    timings, tokens = {}, {}
    for b in batch_sizes:
        if warmup:
            warm_up(model, prompt, b, kernels=kernels)
        timings[b], tokens[b] = time_model_batch(model, [prompt] * b, [steps] * b, clock, kernels=kernels)
    return Sweep(timings, tokens)


# ---- the reference: transformers' static batched generate ----------------------------------------


def load_hf_model(folder: str | Path):
    """transformers' model on the same checkpoint folder, imported only when asked for."""
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("the transformers baseline needs transformers: pip install 'nanoserve[test]'") from e
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def time_hf_generate(hf_model, prompts: Sequence[Sequence[int]], steps: int, clock: Clock = DEFAULT_CLOCK,
                     pad_id: int = 0) -> tuple[BatchTiming, list[list[int]]]:
    """transformers' `generate` on one static batch (greedy, its own KV cache), `steps` decode steps.

    A logits processor reads the clock each time generate has new logits: once after the prefill,
    then once per decode step, so each step is timed from logits to logits as `StaticBatch.step` is
    (forward plus the loop's own bookkeeping). Prompts are left-padded, as transformers expects."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(clock())
            return scores

    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts])  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    config = copy.deepcopy(hf_model.generation_config)  # greedy, exactly steps + 1 tokens; [] (not None): no EOS
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=[],
                  max_new_tokens=steps + 1, pad_token_id=pad_id)
    start = clock()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, generation_config=config,
                                logits_processor=LogitsProcessorList([Stamp()]))
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    timing = BatchTiming(prefill_s=stamps[0] - start, step_s=step_s, row_steps=[steps] * len(prompts))
    return timing, out[:, T:].tolist()
