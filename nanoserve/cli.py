"""The command line: `python -m nanoserve <command>` (or the `nanoserve` script).

    generate       complete a prompt, streamed to stdout
    fetch          fetch + convert a model (idempotent; --model gemma3-270m for Gemma 3)
    kernels        build the compiled kernels now and say where they are
    lengths        draw Day 15's request-length CSV
    bench layout   weight-streaming GB/s of candidate layouts at batch 1 (--rows: more)
    bench paged    paged vs contiguous decode (Day 20)
    bench batch    static batching, measured (Day 29)
    bench engine   the scheduled engine vs static batching and transformers (Days 30-35)
    bench chunked  a long prompt arriving while others decode: chunked prefill per budget (Day 32)
    bench roofline each number format's multiply-add peak, torch's fp32 GEMM, read bandwidth, 1 and 2 threads
    bench decode   one request on every road and batched decode: fp32, the GGUF's blocks, transformers, llama.cpp
    bench attention  one decode step's attention: the gather, torch ops, SDPA, the kernel, split-K (Days 23-24)
    bench arrivals requests arriving over time: TTFT, TPOT, goodput per rate (Days 37, 39)
    bench spec     prompt-lookup speculative decoding vs plain decoding, copy-heavy and chat (Day 40)
    bench outputs  what log-probabilities and structured outputs cost a decode step (Day 41)
    bench shared   one request's decode with and without a busy neighbour process, per thread setting
    bench numerics bf16 and int8 activations against fp32: errors, agreement, perplexity, speed (Day 42)
    bench stall    how late a 5 ms timer and /health answer during a long prefill and a full batch's decode
    bench clients  the field's programs beside serve: llama-server's build, GuideLLM, lm-eval
    serve          an OpenAI-compatible HTTP server (Day 38)

Bad arguments get one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import CheckpointError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's usage dump is noise here)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from . import loader
    from .bench import (
        arrivals,
        attention,
        batch,
        chunked,
        clients,
        decode,
        engine,
        layout,
        numerics,
        outputs,
        paged,
        roofline,
        shared,
        stall,
    )
    from .bench import spec as spec_bench
    from .model import fetch
    from .server import serve as server
    from .teach import memory

    ap = _Parser(prog="nanoserve", description="nanoserve: a small LLM inference engine. Commands:\n\n"
                 + __doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="<command>")
    g = sub.add_parser("generate", help="complete a prompt")
    loader.add_cli_arguments(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the checkpoint's recommendation (generation_config.json), else 1.0")
    g.add_argument("--greedy", action="store_true", help="temperature 0: the likeliest token every step")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--speculative-tokens", type=int, default=0,
                   help="prompt-lookup speculative decoding with this many draft tokens (greedy only; 0: off)")
    fetch.add_arguments(sub.add_parser("fetch", help="fetch + convert the model (idempotent)"))
    k = sub.add_parser("kernels", help="build the compiled kernels now and say where they are")
    k.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    memory.add_arguments(sub.add_parser("lengths", help="draw Day 15's request-length CSV"))
    b = sub.add_parser("bench", help="benchmarks that write a CSV under data/")
    bsub = b.add_subparsers(dest="what", required=True, parser_class=_Parser, metavar="<benchmark>")
    layout.add_arguments(bsub.add_parser("layout", help="weight-streaming GB/s of candidate layouts at batch 1"))
    paged.add_arguments(bsub.add_parser("paged", help="paged vs contiguous decode (Day 20)"))
    batch.add_arguments(bsub.add_parser("batch", help="static batching, measured (Day 29)"))
    engine.add_arguments(bsub.add_parser("engine", help="the scheduled engine vs static batching and transformers"))
    chunked.add_arguments(bsub.add_parser("chunked", help="a long prompt arriving while others decode (Day 32)"))
    roofline.add_arguments(bsub.add_parser("roofline", help="the machine's compute peak per number format, GEMM, "
                                                              "read bandwidth"))
    decode.add_arguments(bsub.add_parser("decode", help="one request on every road, batched decode, vs peers"))
    attention.add_arguments(bsub.add_parser("attention", help="one decode step's attention, every road (Days 23-24)"))
    arrivals.add_arguments(bsub.add_parser("arrivals", help="requests arriving over time: vLLM's metrics per rate"))
    spec_bench.add_arguments(bsub.add_parser("spec", help="prompt-lookup speculative decoding vs plain (Day 40)"))
    outputs.add_arguments(bsub.add_parser("outputs", help="what logprobs and structured outputs cost a step (Day 41)"))
    shared.add_arguments(bsub.add_parser("shared", help="a decode step with and without a busy neighbour process"))
    numerics.add_arguments(bsub.add_parser("numerics", help="bf16 and int8 activations vs fp32: error, speed (Day 42)"))
    stall.add_arguments(bsub.add_parser("stall", help="how late a timer and /health are while the engine computes"))
    clients.add_arguments(bsub.add_parser("clients", help="llama-server's build, GuideLLM and lm-eval against serve"))
    server.add_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server"))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return generate(args)
    if args.command == "fetch":
        from .model import fetch

        return fetch.run(args)
    if args.command == "kernels":
        return build_kernels(args.verbose)
    if args.command == "lengths":
        from .teach import memory

        return memory.run(args, argv)
    if args.command == "serve":
        from .server import serve as server

        return server.run(args)
    import importlib

    return importlib.import_module(f".bench.{args.what}", __package__).run(args, argv)


def generate(args: argparse.Namespace) -> int:

    from .config import generation_defaults
    from .generate import stream_generate
    from .loader import from_cli
    from .model.fetch import model_folder
    from .sampling import SamplingParams

    if not args.prompt:
        print("nanoserve: error: --prompt is empty", file=sys.stderr)
        return 2
    try:
        folder = model_folder(args.model)
        chosen = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                  if getattr(args, k) is not None}
        if args.greedy:
            chosen["temperature"] = 0.0
        params = SamplingParams(**{**generation_defaults(folder), **chosen}, seed=args.seed,
                                max_tokens=args.max_tokens, stop=args.stop)
        model, tok = from_cli(args)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2
    text = args.prompt
    ids = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
    spec = {"num_speculative_tokens": args.speculative_tokens} if args.speculative_tokens else None
    try:
        for step in stream_generate(model, ids, params, tok, spec):
            sys.stdout.write(step.new_text)
            sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other tools do
        sys.stderr.close()
        return 0
    except ValueError as e:
        print(f"\nnanoserve: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0


def build_kernels(verbose: bool = False) -> int:
    """Build the kernels now (they are otherwise built on first use) and say where they are."""
    from . import kernels

    start = time.perf_counter()
    if kernels.load(verbose=verbose) is None:
        print(f"nanoserve kernels: not built ({kernels.unavailable_reason()}); the engine will use torch ops")
        return 0  # not an error: the engine runs without them
    name, flags = kernels.build_flags()
    print(f"nanoserve kernels: {name} ready in {time.perf_counter() - start:.1f} s "
          f"({' '.join(flags)}; {kernels.build_dir(name)})")
    return 0
