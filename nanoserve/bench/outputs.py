"""`python -m nanoserve bench outputs`: what log-probabilities and structured outputs cost a decode step (Day 41):
B requests decode plain, with `logprobs=5`, constrained to a JSON schema, and half constrained, modes interleaved;
per mode the median step, its part after the forward, and its ratio to plain's in the same round."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from ..engine import LLMEngine
from ..model.base import DecoderLM
from ..sampling import SamplingParams
from ..structured import StructuredOutputsParams
from ..tokenizer import Tokenizer
from .command import common_arguments, csv_header, report, start
from .csvio import write_csv
from .harness import median_decode_step, prose
from .timing import rounds

# output mostly free text inside a string: a long run of ordinary steps under a mask
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "text": {"type": "string", "minLength": 400, "maxLength": 2000}},
          "required": ["title", "text"], "additionalProperties": False}

MODES = ("plain", "logprobs", "json", "half-json")


def params_for(mode: str, i: int, steps: int) -> SamplingParams:
    """Request i's parameters in a mode (greedy, EOS ignored: every request decodes every step)."""
    base = dict(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    if mode == "logprobs":
        return SamplingParams(**base, logprobs=5)
    if mode == "json" or (mode == "half-json" and i % 2 == 0):
        return SamplingParams(**base, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return SamplingParams(**base)


def decode_steps(model: DecoderLM, tok: Tokenizer, prompts: Sequence[list[int]], mode: str, steps: int,
                 ) -> tuple[float, float]:
    """One engine, every prompt at once; its median decode step and that step's part after the forward (s)."""
    engine = LLMEngine(model, tok, max_num_seqs=len(prompts), max_num_batched_tokens=sum(map(len, prompts)) + 64)
    return median_decode_step(engine, prompts, [params_for(mode, i, steps) for i in range(len(prompts))])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common_arguments(ap, "data/bench-outputs.csv", weights="fp32", batch_sizes=[1, 32], prompt_tokens=64, steps=24,
                     rounds=3)


def ask(tok: Tokenizer, text: str) -> list[int]:
    """The request: a chat turn where the model has a chat template, else (a base model) the instruction as text."""
    request = f"Give this a title and retell it, as JSON: {text}"
    return tok.encode_chat([{"role": "user", "content": request}]) if tok.chat_template else tok.encode(request)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    model, tok = start(args)
    text = [tok.decode(prose(tok, args.prompt_tokens, offset=7 * i)) for i in range(max(args.batch_sizes))]
    chat = [ask(tok, t) for t in text]
    decode_steps(model, tok, chat[:2], "json", 2)  # warm up: the grammar library, the kernels
    times = rounds({(b, mode): lambda b=b, mode=mode: decode_steps(model, tok, chat[:b], mode, args.steps)
                    for b in args.batch_sizes for mode in MODES}, args.rounds)  # per round (step, after forward)
    rows = []
    for (b, mode), per_round in times.items():
        plain = times[(b, "plain")]
        rows.append(dict(batch=b, mode=mode, step_ms=statistics.median(s for s, _ in per_round) * 1e3,
                         after_forward_ms=statistics.median(a for _, a in per_round) * 1e3,
                         vs_plain=statistics.median(s / p for (s, _), (p, _) in zip(per_round, plain))))
    meta = csv_header(argv, model=f"{model.cfg.architecture}, vocabulary {model.cfg.vocab_size}, "
                      f"{model.matrix_dtype}, activations {model.activations}", steps=args.steps,
                      rounds=args.rounds, prompt_tokens=args.prompt_tokens,
                      schema="a title and 400-2000 characters of text")
    write_csv(args.out, rows, meta)
    return report(args.out, meta, rows)
