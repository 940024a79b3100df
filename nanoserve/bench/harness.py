"""The real model, the workloads the commands run, and what they time, as closures (Day 26): what is timed is
the loop generation runs (a `StaticBatch`, an `LLMEngine`); transformers' `generate` is the reference."""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config import EngineConfig, ModelConfig, SchedulerConfig
from ..engine import LLMEngine
from ..engine.request import Request
from ..generate import stream_generate
from ..model import Llama
from ..model.fetch import ensure_model
from ..sampling import SamplingParams
from ..stages import Session, StaticBatch, stream_session
from ..tokenizer import Tokenizer
from .batchbench import BatchScaling, BatchTiming, fit_batch_scaling, time_static_batch
from .command import engine_config
from .roofline import forward_flops
from .timing import DEFAULT_CLOCK, Clock, RequestTiming, StreamTimer

SWEEP_SIZES = (1, 2, 4, 8, 16, 32)
BLOCKING_LENS = (4,) * 7 + (32,)  # Day 29's blocking run: seven rows of 4 tokens behind one of 32

# one prompt per row of the blocking run; the sweep replicates the first
PROMPTS = ("The capital of France is", "Write a haiku about the sea.", "What is two plus two?",
           "Name three colors of the rainbow.", "Once upon a time, in a small village by the river,",
           "Explain in one sentence why the sky is blue.", "List the days of the week:",
           "A recipe for pancakes needs flour, eggs and")

# long prompts are cut from it, repeated: ordinary prose, not one token over and over
PASSAGE = ("The lighthouse on the northern cape was built in 1858 from granite quarried on the island itself. "
           "For ninety years a keeper climbed its one hundred and twelve steps every evening to light the lamp, "
           "wind the clockwork that turned the lens, and write the weather in a log that still survives. "
           "Ships rounding the cape in winter storms steered by its flash, one long and two short every twenty "
           "seconds, and the keepers' families grew vegetables in the lee of the tower where the wind could not "
           "reach them. When the light was automated the last keeper left a note in the log: the lamp is clean, "
           "the stairs are swept, and the gulls are fed. ")


def prose(tok: Tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """n_tokens of PASSAGE repeated, from token `offset` on."""
    ids = tok.encode(PASSAGE * ((offset + n_tokens) // 50 + 2), add_special_tokens=False)
    return ids[offset:offset + n_tokens]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)

    def flops(self, cfg: ModelConfig) -> float:
        """FLOPs of the useful work: each prompt once (giving the first token), then each later token once."""
        return sum(forward_flops(cfg, len(p)) + sum(forward_flops(cfg, 1, len(p) + j) for j in range(n - 1))
                   for p, n in zip(self.prompts, self.max_tokens))


def ragged_workload(tok: Tokenizer, n: int = 32, prompt_range: tuple[int, int] = (20, 300),
                    output_range: tuple[int, int] = (8, 128), seed: int = 0) -> Workload:
    """n requests, prompt and output lengths uniform in their ranges, each prompt from its own offset into the
    passage (no two share a first block)."""
    rng = random.Random(seed)
    offsets = rng.sample(range(len(tok.encode(PASSAGE, add_special_tokens=False))), n)
    prompts = [prose(tok, rng.randint(*prompt_range), o) for o in offsets]
    return Workload("ragged", prompts, [rng.randint(*output_range) for _ in range(n)])


def prompt_heavy_workload(tok: Tokenizer, n: int = 32, seed: int = 0) -> Workload:
    """n requests whose prompts (100-300 tokens) outweigh their outputs (30-100): chat with context, RAG, summaries.
    Prefill dominates the work, so it is the load that tests a step's compute and a TPOT target."""
    return replace(ragged_workload(tok, n, (100, 300), (30, 100), seed), name="prompt-heavy")


def uniform_workload(tok: Tokenizer, n: int = 32, prompt_tokens: int = 160, max_tokens: int = 68,
                     seed: int = 0) -> Workload:
    """n requests of one prompt and output length: static batching wastes nothing on them."""
    return replace(ragged_workload(tok, n, (prompt_tokens, prompt_tokens), (max_tokens, max_tokens), seed),
                   name="uniform")


def greedy(max_tokens: int) -> SamplingParams:
    """The requests every command sends: greedy, EOS ignored (the length is the request's)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def timed_greedy(model: Llama, prompt_ids: list[int], new_tokens: int, session: Session | None = None,
                 clock: Clock = DEFAULT_CLOCK) -> tuple[list[int], RequestTiming]:
    """Greedy ids of exactly `new_tokens` and their timing, a StreamTimer.token() per token: with no session the
    engine's road (`stream_generate`), with one a course stage's loop over it."""
    timer, ids = StreamTimer(clock), []
    timer.start()
    for step in stream_generate(model, prompt_ids, greedy(new_tokens)) if session is None else \
            stream_session(model, session, prompt_ids, greedy(new_tokens)):
        for t in step.new_token_ids:
            timer.token()
            ids.append(t)
    return ids, timer.finish()


def run_requests(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 arrivals: Sequence[float] | None = None) -> tuple[float, list[Request]]:
    """Add request i once arrivals[i] seconds have passed (default: all at once), step while any is unfinished;
    the clock at the start and the requests, taken out of the engine."""
    clock, arrivals = engine.clock, arrivals if arrivals is not None else [0.0] * len(prompts)
    t0, ids = clock(), []
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        while len(ids) < len(prompts) and arrivals[len(ids)] <= clock() - t0:
            ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
        if engine.has_unfinished_requests():
            engine.step()
        elif len(ids) < len(prompts):
            time.sleep(max(0.0, arrivals[len(ids)] - (clock() - t0)))
    return t0, [engine.requests.pop(i) for i in ids]


def decode_steps(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list:
    """The requests run to the end, all at once (an idle engine); for each decode step every one of them is in,
    the `step()` call's whole time (its StepRecord's `total_s` leaves out the call's entry and exit) and its
    StepRecord."""
    ids, walls = [engine.add_request(p, sp) for p, sp in zip(prompts, params)], []
    while engine.has_unfinished_requests():
        t0 = engine.clock()
        engine.step()
        walls.append(engine.clock() - t0)
    for i in ids:
        engine.requests.pop(i)
    return [(w, r) for w, r in zip(walls, list(engine.history)[-len(walls):])
            if r.num_prefill_tokens == 0 and r.num_requests == len(prompts)]


def median_decode_step(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                       ) -> tuple[float, float]:
    """Over `decode_steps`, the median `step()` call, timed whole, and the median of its part after the forward (s)."""
    steps = decode_steps(engine, prompts, params)
    return statistics.median(w for w, _ in steps), statistics.median(r.sample_s for _, r in steps)


def build_batched_decode(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                         block_size: int = 16, compiled: bool | str | None = None) -> StaticBatch:
    """The batch `greedy_generate_batch(model, prompts, stop_steps=stop_steps)` runs, its `prefill` and `step` to
    hand to a timer; its `tokens`, after the whole run, are that function's output."""
    return StaticBatch(model, prompts, list(stop_steps), block_size, compiled)


def time_model_batch(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                     clock: Clock = DEFAULT_CLOCK, block_size: int = 16, compiled: bool | str | None = None,
                     ) -> tuple[BatchTiming, list[list[int]]]:
    """Time one static batch: the prefill, every decode step, and row i's budget of stop_steps[i] steps. A
    finished row stays in every forward (its slot, its blocks) until the slowest is done: the timing charges it."""
    batch = build_batched_decode(model, prompts, stop_steps, block_size, compiled)
    try:
        return time_static_batch(batch.prefill, batch.step, batch.stop_steps, clock), batch.tokens
    finally:
        batch.kv.free()


def time_engine_batch(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                      clock: Clock = DEFAULT_CLOCK, config: EngineConfig | SchedulerConfig | None = None,
                      ) -> tuple[BatchTiming, list[list[int]]]:
    """The rows of `time_model_batch` through the scheduled engine: its first step is every prompt, then each step
    decodes the rows still running; row i generates stop_steps[i] + 1 tokens and is handed back when done."""
    engine = LLMEngine(model, config=engine_config(config), clock=clock)
    ids = [engine.add_request(p, greedy(n + 1)) for p, n in zip(prompts, stop_steps)]
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
    timings: dict[int, BatchTiming]
    tokens: dict[int, list[list[int]]] = field(repr=False)

    @property
    def scaling(self) -> BatchScaling:
        sizes = sorted(self.timings)
        return fit_batch_scaling(sizes, [self.timings[b].median_step_s for b in sizes])


def sweep_batch_sizes(model: Llama, prompt: Sequence[int], batch_sizes: Sequence[int] = SWEEP_SIZES,
                      steps: int = 32, warmup: bool = True, clock: Clock = DEFAULT_CLOCK,
                      compiled: bool | str | None = None) -> Sweep:
    """`prompt` replicated B times, every row `steps` steps, per B (`warmup`: an untimed short run first)."""
    timings, tokens = {}, {}
    for b in batch_sizes:
        if warmup:
            time_model_batch(model, [prompt] * b, [2] * b, compiled=compiled)
        timings[b], tokens[b] = time_model_batch(model, [prompt] * b, [steps] * b, clock, compiled=compiled)
    return Sweep(timings, tokens)


def load_hf_model(folder: str | Path | None = None, attn: str | None = None):
    """transformers' model on the same checkpoint folder (default: the fetched one), with `attn` its attention."""
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("the transformers baseline needs transformers: pip install 'nanoserve[test]'") from e
    model = transformers.AutoModelForCausalLM.from_pretrained(folder or ensure_model(), dtype=torch.float32).eval()
    if attn is not None:
        model.set_attn_implementation(attn)
    return model


def hf_generate(hf_model, prompts: Sequence[Sequence[int]], new_tokens: int, clock: Clock = DEFAULT_CLOCK,
                pad_id: int = 0) -> tuple[float, list[float], list[list[int]]]:
    """transformers' `generate` on one batch, greedy, EOS off, left-padded, `new_tokens` per row: the clock at the
    start, a reading whenever it has new logits (as `StaticBatch.step` is timed), each row's tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(clock())
            return scores

    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts])  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    config = copy.deepcopy(hf_model.generation_config)  # [] (not None): no EOS
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=[],
                  max_new_tokens=new_tokens, pad_token_id=pad_id)
    start = clock()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, generation_config=config,
                                logits_processor=LogitsProcessorList([Stamp()]))
    return start, stamps, out[:, T:].tolist()


def time_hf_generate(hf_model, prompts: Sequence[Sequence[int]], steps: int, clock: Clock = DEFAULT_CLOCK,
                     pad_id: int = 0) -> tuple[BatchTiming, list[list[int]]]:
    """`hf_generate` as a BatchTiming of `steps` decode steps."""
    start, stamps, tokens = hf_generate(hf_model, prompts, steps + 1, clock, pad_id)
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    return BatchTiming(prefill_s=stamps[0] - start, step_s=step_s, row_steps=[steps] * len(prompts)), tokens
