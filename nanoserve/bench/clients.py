"""`python -m nanoserve bench clients`: the field's own programs beside `serve`, offline: llama-server built from
the llama-cpp-python sdist into $NANOSERVE_HOME/llama.cpp/ (a peer for `bench arrivals`), GuideLLM and lm-eval as
its clients, unchanged, in their own processes (the model folder's tokenizer, data made here)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..config import nanoserve_home

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the sdist whose vendor/llama.cpp is built: pinned, the same build

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",  # no downloads at run time: the GGUF is a local file
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # the web UI would be fetched from a model hub
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # no model hub


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: Sequence[str] = (), timeout_s: float = 180,
                 command: Sequence[str] | None = None) -> subprocess.Popen:
    """A server in a subprocess (`python -m nanoserve serve` unless `command` says), once its /health answers; its
    stderr to a temporary file (a pipe nobody reads would stall it), quoted if it dies."""
    import httpx

    command = list(command or [sys.executable, "-m", "nanoserve", "serve", "--port", str(port)]) + list(extra)
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{Path(command[0]).name} exited with {proc.returncode}: {log.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def llama_server_path() -> Path | None:
    path = nanoserve_home() / "llama.cpp" / "bin" / "llama-server"
    return path if os.access(path, os.X_OK) else None


def llama_server_version(binary: Path) -> str:
    """The binary's `--version` (llama.cpp's build and commit) and the sdist it came from."""
    r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    build = next((line for line in (r.stdout + r.stderr).splitlines() if line.startswith("version")), "?")
    source = binary.parent / "SOURCE"
    return f"{build} from {source.read_text().splitlines()[0] if source.is_file() else '?'}"


LLAMA_KV_CACHE = "f16"  # llama-server's K/V cache type (its default), named on its command line


def llama_server_argv(binary: Path, gguf: Path, port: int, parallel: int, slot_tokens: int,
                      threads: int) -> list[str]:
    """llama-server on the GGUF with continuous batching over `parallel` slots of `slot_tokens` each, its K/V cache
    in LLAMA_KV_CACHE."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "--cont-batching", "--ctx-size", str(parallel * slot_tokens), "--threads", str(threads),
            "--threads-batch", str(threads), "--cache-type-k", LLAMA_KV_CACHE, "--cache-type-v", LLAMA_KV_CACHE,
            "--no-webui"]


def build_llama_server(jobs: int | None = None, spec: str = LLAMA_CPP_PYTHON, verbose: bool = False) -> Path:
    """`pip download` the sdist, unpack it, cmake its vendor/llama.cpp with CMAKE_OPTIONS (output in build.log)
    into bin/llama-server; what is done already is skipped."""
    root = nanoserve_home() / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    name, version = spec.split("==")
    sdist = root / f"{name.replace('-', '_')}-{version}.tar.gz"
    if not sdist.is_file():
        print(f"pip download {spec} (the sdist, about 75 MB) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                        "-d", str(root), spec], check=True)
    src = root / sdist.name.removesuffix(".tar.gz")
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    tree, build, jobs = src / "vendor" / "llama.cpp", src / "build", jobs or os.cpu_count() or 1
    t0, log = time.perf_counter(), root / "build.log"
    with log.open("w") as f:
        for step, cmd in (("configuring", ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_OPTIONS]),
                          (f"building llama-server with {jobs} jobs (minutes)",
                           ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])):
            print(f"cmake: {step} ...", file=sys.stderr, flush=True)
            if subprocess.run(cmd, stdout=None if verbose else f, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed; its output is in {log}")
    (root / "bin").mkdir(exist_ok=True)
    dest = root / "bin" / "llama-server"
    shutil.copy2(build / "bin" / "llama-server", dest)
    (root / "bin" / "SOURCE").write_text(f"{spec}\n{' '.join(CMAKE_OPTIONS)}\n")
    print(f"built {dest} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return dest


def run_guidellm(url: str, tokenizer: str | Path, workdir: str | Path, requests: int = 4, prompt_tokens: int = 64,
                 output_tokens: int = 16, request_format: str = "/v1/completions", timeout_s: float = 900) -> dict:
    """GuideLLM's CLI (openai_http, one request at a time) on `requests` synthetic prompts; its JSON report."""
    report = Path(workdir) / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},request_format={request_format}",
           "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}", "--disable-console"]
    r = subprocess.run(cmd, cwd=workdir, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode != 0 or not report.is_file():
        raise RuntimeError(f"guidellm exited with {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(report.read_text())


def guidellm_summary(report: dict) -> dict:
    """The first benchmark's request counts, medians (ms), and each request's cached tokens from usage."""
    bench = report["benchmarks"][0]
    m, done = bench["metrics"], bench["requests"]["successful"]

    def median(key: str) -> float | None:
        s = (m.get(key) or {}).get("successful") or {}
        return s.get("median") if s.get("count") else None

    return dict(**{k: m["request_totals"][k] for k in ("successful", "errored", "incomplete")},
                ttft_ms=median("time_to_first_token_ms"), itl_ms=median("inter_token_latency_ms"),
                tpot_ms=median("time_per_output_token_ms"), prompt_tokens=median("prompt_token_count"),
                output_tokens=median("output_token_count"),
                cached_tokens=[q["input_metrics"].get("cached_tokens") for q in done])


LM_EVAL_TASKS = {  # two tasks lm-eval loads from local files (`dataset_path: json`): nothing downloaded
    "nanoserve_tiny_choice": (  # loglikelihood: echo=True with logprobs, max_tokens 1
        {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
         "metric_list": [{"metric": "acc"}]},
        [{"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
         {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0}]),
    "nanoserve_tiny_generate": (  # generate_until: a completion with stop strings
        {"output_type": "generate_until", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
         "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False}},
        [{"question": "Q: What is the capital of France?\nA:", "answer": "Paris"}]),
}


def write_lm_eval_tasks(folder: str | Path) -> list[str]:
    """Each of LM_EVAL_TASKS as a YAML (JSON is YAML) beside its JSONL data; the task names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, (fields, docs) in LM_EVAL_TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "doc_to_text": "{{question}}", **fields}
        (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1))
    return list(LM_EVAL_TASKS)


def run_lm_eval(url: str, model: str, tokenizer: str | Path, workdir: str | Path, timeout_s: float = 900) -> dict:
    """lm-eval's `local-completions` on LM_EVAL_TASKS against `url`: its results and samples per task, its log."""
    workdir = Path(workdir)
    tasks = write_lm_eval_tasks(workdir / "tasks")
    args = f"base_url={url}/v1/completions,model={model},tokenizer_backend=huggingface,tokenizer={tokenizer}," \
           "num_concurrent=1,max_retries=1"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--tasks", ",".join(tasks), "--include_path", str(workdir / "tasks"), "--output_path",
           str(workdir / "out"), "--log_samples"]
    r = subprocess.run(cmd, cwd=workdir, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                       timeout=timeout_s)
    results = sorted((workdir / "out").rglob("results_*.json"))
    if r.returncode != 0 or not results:
        raise RuntimeError(f"lm_eval exited with {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    samples = {t: [json.loads(line) for p in (workdir / "out").rglob(f"samples_{t}_*.jsonl")
                   for line in p.read_text().splitlines()] for t in tasks}
    return {"results": json.loads(results[-1].read_text())["results"], "samples": samples, "log": r.stdout}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="client", required=True)
    b = sub.add_parser("build-llama-server", help="build llama-server from the llama-cpp-python sdist")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the cores)")
    b.add_argument("-v", "--verbose", action="store_true", help="show cmake's output")
    for name, about in (("guidellm", "GuideLLM's synthetic benchmark"), ("lm-eval", "lm-eval's local-completions")):
        c = sub.add_parser(name, help=f"{about} against `serve` (started here unless --url)")
        c.add_argument("--url", help="a running OpenAI-compatible server (default: start `serve` here)")
        c.add_argument("--weights", choices=["fp32", "gguf"], default="gguf", help="what the started `serve` loads")
        c.add_argument("--threads", type=int, default=None, help="the started `serve`'s torch threads")
        if name == "guidellm":
            c.add_argument("--requests", type=int, default=4)
            c.add_argument("--prompt-tokens", type=int, default=64)
            c.add_argument("--output-tokens", type=int, default=16)
            c.add_argument("--chat", action="store_true", help="/v1/chat/completions (default: /v1/completions)")


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if args.client == "build-llama-server":
        print(build_llama_server(args.jobs, verbose=args.verbose))
        return 0
    import httpx

    from ..model.fetch import ensure_model

    folder, proc, url = ensure_model(), None, args.url
    if url is None:
        port = free_port()
        proc = start_server(port, ["--weights", args.weights] + (["--threads", str(args.threads)] if args.threads
                                                                  else []))
        url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        with tempfile.TemporaryDirectory() as tmp:
            if args.client == "guidellm":
                route = "/v1/chat/completions" if args.chat else "/v1/completions"
                report = run_guidellm(url, folder, tmp, args.requests, args.prompt_tokens, args.output_tokens, route)
                print(json.dumps(guidellm_summary(report), indent=1))
            else:
                out = run_lm_eval(url, model, folder, tmp)
                print(out["log"])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return 0

