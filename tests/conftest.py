"""Shared fixtures: a tiny random model for fast tests, the fetched SmolLM2 for real-model tests,
transformers on the same folder as the reference, and the compiled kernels.

The real checkpoint is fetched and converted on first use (into $NANOSERVE_HOME), so the
suite needs no manual setup step. transformers is imported only here and in tests: it is
the reference implementation, never a runtime dependency. A reference that cannot run is a
failure, not a skip: only tests marked `gpu` skip, and only where there is no CUDA.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from nanoserve import kernels
from nanoserve.config import ModelConfig
from nanoserve.model import Llama

# (the repo's conftest.py sets NANOSERVE_THREADS to a worker's share of the cores under xdist)
torch.set_num_threads(max(1, int(os.environ.get("NANOSERVE_THREADS", torch.get_num_threads()))))

HAVE_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))

REAL_MODEL_FIXTURES = {"model_dir", "model", "tok", "hf_model", "hf_tok", "fp64_logits", "hf_greedy",
                       "gemma_dir", "gemma", "gemma_tok", "hf_gemma"}


def pytest_collection_modifyitems(config, items):
    """Mark real-model tests `model` (so `-m "not model"` runs the fast ones); skip `gpu` tests without CUDA."""
    no_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg) -> Llama:
    """Shared by many tests: never pack, retype or write it (make your own with Llama.random)."""
    return Llama.random(tiny_cfg, seed=0)


@pytest.fixture(scope="session")
def compiled():
    """The compiled kernels' module. Where a C++ compiler exists they must build: a broken build
    would silently put the engine on torch's ops, so it fails here instead of skipping."""
    module = kernels.load()
    if module is None:
        if HAVE_COMPILER:
            pytest.fail(f"a C++ compiler is here but the compiled kernels did not build: "
                        f"{kernels.unavailable_reason()}")
        pytest.skip(f"no C++ compiler, so no compiled kernels: {kernels.unavailable_reason()}")
    return module


@pytest.fixture(params=["compiled", "torch-ops"])
def road(request) -> str:
    """Both roads of the layer's small ops and attention: the compiled kernels (the default where they
    build; then they must) and torch's ops (`compiled=False`)."""
    if request.param == "compiled":
        request.getfixturevalue("compiled")
    return request.param


@pytest.fixture(scope="session")
def model_dir():
    from nanoserve.model.fetch import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def model(model_dir):
    from nanoserve.model import load_model

    return load_model(model_dir)


@pytest.fixture(scope="session")
def tok(model_dir):
    from nanoserve.tokenizer import Tokenizer

    return Tokenizer.from_folder(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from nanoserve.teach.reference import load_reference

    return load_reference(model_dir)


@pytest.fixture(scope="session")
def gemma_dir():
    """The second model, Gemma 3 270M, fetched and converted on first use (as `make model` does)."""
    from nanoserve.model.fetch import ensure_model

    return ensure_model(name="gemma3-270m")


@pytest.fixture(scope="session")
def gemma(gemma_dir):
    from nanoserve.model import load_model

    return load_model(gemma_dir)


@pytest.fixture(scope="session")
def gemma_tok(gemma_dir):
    from nanoserve.tokenizer import Tokenizer

    return Tokenizer.from_folder(gemma_dir)


@pytest.fixture(scope="session")
def hf_gemma(gemma_dir):
    """transformers' Gemma3ForCausalLM on the same converted folder, fp32: Gemma's reference."""
    from nanoserve.teach.reference import load_reference

    return load_reference(gemma_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def fp64_logits(hf_model):
    """ids -> (T, V) logits of transformers' forward in fp64: the exact answer every fp32 forward
    (ours on each road, and transformers' own) is judged against. Computed once per prompt."""
    exact = copy.deepcopy(hf_model).double()
    done: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(ids) -> torch.Tensor:
        key = tuple(int(i) for i in ids)
        if key not in done:
            with torch.inference_mode():
                done[key] = exact(torch.tensor([key])).logits[0]
        return done[key]

    return logits


# Bounds on our fp32 logits against `fp64_logits`, max abs over the vocabulary. Two fp32 forwards
# with different kernels (ours: oneDNN and the compiled glue; transformers': MKL) each round
# differently; both land well inside these. A real bug does not: a wrong norm eps, RoPE frequency,
# mask or head order moves logits by 1e-2 or more.
FP64_LAST_TOL = 1.5e-4
"""At the position generation samples from (the LM head on one row, or on several)."""
FP64_ANY_TOL = 3e-4
"""At any position of a prompt, and at every decode step of every engine road."""


@pytest.fixture(scope="session")
def fp64_tol() -> tuple[float, float]:
    """(last position, any position): the bounds above, for the test modules that compare against fp64."""
    return FP64_LAST_TOL, FP64_ANY_TOL


@pytest.fixture(scope="session")
def hf_greedy(hf_model, tok):
    """transformers' greedy generation of each shared prompt (tests/prompts.py) alone, computed once:
    name -> (prompt ids, new tokens, per-step logits). It stops at EOS or after MAX_NEW tokens."""
    from prompts import MAX_NEW, PROMPTS, prompt_ids

    from nanoserve.teach.reference import reference_greedy

    out = {}
    for name in PROMPTS:
        ids = prompt_ids(tok, name)
        out[name] = (ids, *reference_greedy(hf_model, ids, MAX_NEW))
    return out
