"""The command line: `python -m nanoserve generate --prompt TEXT [--chat] ...`.

Bad arguments get one line on stderr and exit code 2; the completion streams to stdout.
"""

from __future__ import annotations

import argparse
import sys

from .config import CheckpointError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's usage dump is noise here)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="nanoserve", description="nanoserve: a small LLM inference engine")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("--model", help="HF Llama checkpoint folder (default: the fetched SmolLM2)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (Day 08)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from . import load
    from .generate import stream_generate
    from .sampling import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
            stop=args.stop,
        )
    except ValueError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2
    if not args.prompt:
        print("nanoserve: error: --prompt is empty", file=sys.stderr)
        return 2
    try:
        model, tok = load(args.model)
    except (CheckpointError, OSError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2
    text = args.prompt
    ids = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
    session = None
    if not args.no_cache:
        try:
            from .cache import cached_session

            session = cached_session(model, len(ids) + params.max_tokens)
        except ImportError:
            session = None
    try:
        for step in stream_generate(model, ids, params, tok, session):
            sys.stdout.write(step.text)
            sys.stdout.flush()
    except ValueError as e:
        print(f"\nnanoserve: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0
