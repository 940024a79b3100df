"""Sampling: parameter validation, each filter's defining property, seeded reproducibility, the batched
sampler (greedy and sampled rows, penalties and seeds in one call, each row as alone, a bad row marked
alone), and a statistical check that `sample` draws from exactly the distribution filtered_probs describes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import kernels
from nanoserve.sampling import (
    ARGMAX_CHUNK,
    GREEDY_BELOW,
    INVALID,
    RowSampler,
    SamplingParams,
    apply_repetition_penalty,
    argmax_rows,
    filtered_probs,
    logprobs_of,
    nucleus,
    sample,
)
from nanoserve.stopping import StopChecker

# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("n", 0),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("temperature", "0.7"),  # a string from a config file or a form: refused, not compared
        ("top_k", 1.5),
        ("top_p", None),
        ("seed", 1.5),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", [-1]),
        ("seed", 2**64),  # torch's generators take 64 bits
        ("seed", -(2**63) - 1),
    ],
)
def test_invalid_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_valid_params_and_defaults():
    p = SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=0.0, stop="END")
    assert p.greedy and p.stop == ["END"]  # a single stop string is accepted and listed
    assert not SamplingParams().greedy
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-5).seed == -5


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-300 would turn every logit into inf and the distribution into NaN: below GREEDY_BELOW it is argmax."""
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0]])
    for t in (1e-300, 1e-40, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=t, seed=0)
        assert params.greedy and sample(logits, [RowSampler(params)]) == [1]
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


# ---------------------------------------------------------------- filters

distinct_logits = st.lists(st.integers(-400, 400), min_size=2, max_size=40, unique=True).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32) / 50  # distinct values: no ties at a cut-off
)


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


@settings(max_examples=60, deadline=None)
@given(distinct_logits, st.integers(1, 45))
def test_top_k_keeps_exactly_the_k_largest(logits, k):
    probs = filtered_probs(logits, SamplingParams(top_k=k))
    want = min(k, len(logits))
    assert kept(probs) == set(torch.topk(logits, want).indices.tolist())
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)


@settings(max_examples=60, deadline=None)
@given(distinct_logits, st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_set_reaching_p(logits, p):
    full = torch.softmax(logits.double(), -1)
    probs = filtered_probs(logits, SamplingParams(top_p=p))
    keep = kept(probs)
    order = torch.argsort(full, descending=True).tolist()
    assert keep == set(order[: len(keep)])  # a most-likely prefix
    mass = float(full[list(keep)].sum())
    smallest = float(full[order[len(keep) - 1]])
    assert mass >= p - 1e-6  # reaches p ...
    assert mass - smallest < p + 1e-6  # ... and without its least likely member it would not
    # renormalized over the kept set, proportional to the original probabilities
    torch.testing.assert_close(probs[list(keep)].double(), full[list(keep)] / mass, atol=1e-6, rtol=1e-5)


def test_nucleus_sorts_a_head_first_and_gives_the_full_sorts_bits():
    """Rows whose nucleus is a few tokens, hundreds, and thousands (settled by the first head, the second, and
    the full sort) at the model's vocabulary size: the same bits as sorting every row whole."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g) * torch.tensor([[8.0], [8.0], [3.0], [3.0], [0.5], [0.5]])
    probs = torch.softmax(logits, -1)
    limit = torch.tensor([[0.5], [0.95], [0.5], [0.9], [0.3], [0.9]], dtype=torch.float64)
    order = probs.sort(dim=-1, descending=True)
    mass_before = order.values.cumsum(-1) - order.values
    want = probs.scatter(1, order.indices, order.values.masked_fill(mass_before.double() >= limit, 0.0))
    kept = (want > 0).sum(-1).tolist()
    assert min(kept) < 64 and any(64 < k < 1024 for k in kept) and max(kept) > 1024, kept  # every tier is used
    assert torch.equal(nucleus(probs, limit), want)
    assert torch.equal(nucleus(probs[2:4], limit[2:4]), want[2:4])


def test_top_p_worked_example():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.75))) == {0, 1}
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.85))) == {0, 1, 2}
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.4))) == {0}


@settings(max_examples=60, deadline=None)
@given(distinct_logits, st.floats(0.001, 0.999), st.floats(0.3, 2.0))
def test_min_p_drops_tokens_below_fraction_of_top(logits, min_p, temperature):
    base = torch.softmax(logits / temperature, -1)
    probs = filtered_probs(logits, SamplingParams(min_p=min_p, temperature=temperature))
    want = set(torch.nonzero(base >= min_p * base.max()).flatten().tolist())
    # a token whose ratio to the top sits within rounding of min_p may land either side
    edge = set(torch.nonzero((base / base.max() - min_p).abs() < 1e-6).flatten().tolist())
    assert kept(probs) - edge == want - edge


def test_temperature_zero_is_one_hot_on_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    probs = filtered_probs(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    # and the greedy sampler never touches randomness: any seed gives the argmax
    assert {sample(logits[None], [RowSampler(SamplingParams(temperature=0.0, seed=s))])[0] for s in range(5)} == {1}
    assert RowSampler(SamplingParams(temperature=0.0, seed=3)).generator is None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), chunks=st.integers(1, 8),
       ties=st.booleans(), nans=st.integers(0, 2), neg_inf_row=st.booleans())
@pytest.mark.parametrize("compiled", [True, False])
def test_argmax_rows_is_argmax(compiled, seed, rows, chunks, ties, nans, neg_inf_row):
    """Both roads (the compiled kernel, and torch's chunked one) pick exactly what torch's argmax picks: the
    first maximal index, ties across and within chunks included, NaN counted as largest, an all -inf row at 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, chunks * ARGMAX_CHUNK, generator=g)
    if ties:  # the maximum repeated at several places, in several chunks
        at = torch.randint(0, logits.shape[1], (rows, 4), generator=g)
        logits.scatter_(1, at, logits.max().item() + 1)
    for _ in range(nans):
        at = torch.randint(0, logits.numel(), (1,), generator=g).item()
        logits.view(-1)[at] = math.nan
    if neg_inf_row:
        logits[-1] = -math.inf
    assert torch.equal(argmax_rows(logits, compiled=compiled), logits.argmax(-1))


def test_argmax_rows_other_widths_and_strided_logits():
    logits = torch.randn(3, ARGMAX_CHUNK * 4 + 7)  # not a whole number of chunks: plain argmax
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    strided = torch.randn(ARGMAX_CHUNK * 4, 3).t()  # rows not contiguous
    assert torch.equal(argmax_rows(strided), strided.argmax(-1))


@pytest.mark.parametrize("width", [1, 3, 16, 17, 33])
def test_argmax_rows_short_rows_and_a_nan_in_the_tail(width):
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(width))
    logits[1, -1] = math.nan  # past the last whole vector of the compiled road
    logits[2] = -math.inf
    logits[3, 0] = logits[3].max() + 1
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 4.0])
    for t in (0.5, 1.0, 3.0):
        torch.testing.assert_close(filtered_probs(logits, SamplingParams(temperature=t)), torch.softmax(logits / t, -1))


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]  # seen ids 0 and 1 both made less likely
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0]  # input untouched
    probs = filtered_probs(logits, SamplingParams(repetition_penalty=2.0), seen=[0, 1])
    torch.testing.assert_close(probs, torch.softmax(out, -1))
    # a penalty below 1 rewards repetition, again in the right direction for both signs
    assert apply_repetition_penalty(logits, [0, 1], 0.5).tolist() == [4.0, -1.0, 1.0, -1.0]
    # greedy with a penalty: the argmax moves off the repeated token
    penalised = RowSampler(SamplingParams(temperature=0, repetition_penalty=2.0))
    assert sample(torch.tensor([[2.0, 1.5]]), [penalised], [[0]]) == [1]


# ---------------------------------------------------------------- seeded reproducibility


def draws(params: SamplingParams, logits: torch.Tensor, n: int, seen=()) -> list[int]:
    """n tokens from one row's sampler, one `sample` call each, as a sequence draws them step by step."""
    row = RowSampler(params)
    return [sample(logits[None], [row], [seen])[0] for _ in range(n)]


def test_same_seed_same_tokens_run_to_run():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    first = draws(params, logits, 200)
    assert draws(params, logits, 200) == first
    assert len(set(first)) > 5  # really random, not stuck on one token
    assert draws(SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4321), logits, 200) != first


def test_sampler_is_not_affected_by_the_global_rng():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    xs = draws(SamplingParams(seed=7), logits, 50)
    torch.manual_seed(999)
    torch.rand(1000)
    assert draws(SamplingParams(seed=7), logits, 50) == xs


def test_one_call_gives_each_row_what_it_gets_alone():
    """Greedy rows, penalised greedy rows and sampled rows (each its own parameters and seed) in one call: each
    row's token equals its token sampled alone, and a row that cannot be sampled is INVALID, alone."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    logits[4, 7] = float("nan")  # a broken row among good ones
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.8),
              SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=1.2, top_p=0.7, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.6, min_p=0.1, seed=4)]
    seen = [[], [int(logits[1].argmax()), 3], [5], [], [], [9, 9]]
    for step in range(5):
        together = sample(logits, [RowSampler(p) for p in params], seen)
        alone = [sample(logits[i:i + 1], [RowSampler(p)], [seen[i]])[0] for i, p in enumerate(params)]
        assert together == alone, step
    assert together[0] == int(logits[0].argmax())
    assert together[1] != int(logits[1].argmax())  # the penalty moved the greedy choice
    assert together[4] == INVALID and all(t != INVALID for i, t in enumerate(together) if i != 4)
    with pytest.raises(ValueError, match="2 samplers for 6 rows"):
        sample(logits, [RowSampler(params[0])] * 2)


# ---------------------------------------------------------------- the statistical test


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of `counts` to `probs`, over the tokens `probs` allows.

    A count on a token with probability 0 is impossible under `probs`: p-value 0. Otherwise the
    statistic sum((O - E)^2 / E) has df = (support - 1); its survival function is the regularized
    upper incomplete gamma Q(df/2, x/2).
    """
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    n = counts.sum().double()
    expected = n * probs[support].double()
    x = float(((counts[support].double() - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2)))


def test_chi_square_helper_is_calibrated():
    # draws from the distribution itself pass, draws from a shifted one fail: the helper can tell
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = torch.bincount(torch.multinomial(p, 20_000, replacement=True, generator=g), minlength=4)
    assert chi_square_p_value(counts, p) > 1e-3
    assert chi_square_p_value(counts, torch.tensor([0.37, 0.31, 0.21, 0.11])) < 1e-6
    assert chi_square_p_value(counts, torch.tensor([0.5, 0.3, 0.2, 0.0])) == 0.0


SMALL_VOCAB_LOGITS = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.7, 0.3, -0.5, -1.0, -3.0, 0.9])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_k=5, seed=12),
        SamplingParams(temperature=1.3, top_p=0.8, seed=13),
        SamplingParams(temperature=1.0, min_p=0.2, seed=14),
        SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.5, seed=15),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "all"],
)
def test_sampled_frequencies_match_filtered_probs(params):
    """N seeded draws from Sampler: the frequencies fit filtered_probs (chi-square p > 1e-3 and every
    token within 5 standard errors), no draw falls outside the filtered support, and the same counts
    clearly reject the unfiltered distribution: the test has the power to see a wrong filter."""
    n = 20_000
    seen = [0, 6]  # the repetition penalty (when set) applies to these
    counts = torch.bincount(torch.tensor(draws(params, SMALL_VOCAB_LOGITS, n, seen)), minlength=len(SMALL_VOCAB_LOGITS))
    probs = filtered_probs(SMALL_VOCAB_LOGITS, params, seen).double()

    assert chi_square_p_value(counts, probs) > 1e-3
    freq = counts.double() / n
    stderr = (probs * (1 - probs) / n).sqrt()
    assert bool(((freq - probs).abs() <= 5 * stderr + 1e-12).all()), (freq, probs)

    # the same counts against a wrong distribution: the plain softmax at temperature 1, no filters
    wrong = torch.softmax(SMALL_VOCAB_LOGITS.double(), -1)
    if not torch.allclose(wrong, probs, atol=1e-3):
        assert chi_square_p_value(counts, wrong) < 1e-6
    # ... and against the right support with its two most likely tokens' mass swapped
    top2 = torch.topk(probs, 2).indices
    swapped = probs.clone()
    swapped[top2] = probs[top2.flip(0)]
    assert chi_square_p_value(counts, swapped) < 1e-6


def test_stop_checker_push_detokenizes_and_flushes_at_the_length_limit(tok):
    """push: a token's text (a character split across tokens comes out whole), the stop ids' text never."""
    ids = tok.encode("héllo wörld")
    params = SamplingParams(temperature=0, max_tokens=len(ids))
    stopper = StopChecker(params, eos_ids=[2], max_new=100, tokenizer=tok)
    out = [stopper.push(t) for t in ids]
    assert "".join(t for t, _ in out) == "héllo wörld" and out[-1][1] == "length"
    assert all(r is None for _, r in out[:-1]) and stopper.generated == len(ids)
    eos = StopChecker(params, eos_ids=[2], max_new=100, tokenizer=tok)
    assert eos.push(ids[0])[1] is None and eos.push(2) == ("", "stop")


def _stream(stopper, pieces):
    """Feed pieces through a StopChecker as the generation loop does; return (text out, finish reason)."""
    out = []
    for n, piece in enumerate(pieces, 1):
        text, reason = stopper.check(1000 + n, n, piece)
        out.append(text)
        if reason:
            return "".join(out), reason
    return "".join(out), None


@pytest.mark.parametrize("stop", ["return", "n <", "fib"])
def test_stop_checker_emits_each_character_once_and_stops_before_the_stop_string(stop):
    pieces = ["\n", "de", "f", " fib", "onacci", "(n", "):\n", "    if", " n", " <=", " 1", ":\n", "        return"]
    full = "".join(pieces)
    params = SamplingParams(temperature=0, max_tokens=100, stop=[stop])
    text, reason = _stream(StopChecker(params, eos_ids=[0], max_new=100), pieces)
    assert reason == "stop"
    assert text == full[: full.index(stop)]


def test_stop_checker_releases_held_text_at_the_length_limit():
    pieces = ["a", "b", "c", "d"]
    params = SamplingParams(temperature=0, max_tokens=4, stop=["a long stop string"])
    assert _stream(StopChecker(params, eos_ids=[0], max_new=100), pieces) == ("abcd", "length")


def test_stop_checker_eos_releases_the_held_text():
    stopper = StopChecker(SamplingParams(temperature=0, max_tokens=9, stop=["xyz"]), eos_ids=[0], max_new=100)
    assert stopper.check(5, 1, "ab") == ("", None)  # the last len("xyz") - 1 characters are held back
    assert stopper.check(0, 2, "") == ("ab", "stop")


def test_logprobs_of_ranks_count_every_logit_above_the_token_whether_or_not_it_is_in_the_top_k():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-4, 5, (64, 40), generator=g).float()  # many ties
    logits[3, 7] = math.nan  # a NaN beside finite logits, and a row that is all NaN
    logits[5] = math.nan
    tokens = torch.randint(0, 40, (64,), generator=g).tolist()
    tokens[:8] = logits[:8].nan_to_num(-math.inf).argmax(-1).tolist()  # greedy picks too
    tokens[3] = int(logits[3].nan_to_num(math.inf).argmin())  # the lowest logit, in the row a NaN tops
    for top in ([0] * 64, [1] * 64, [5] * 64, [i % 6 for i in range(64)], [40] * 64):
        out = logprobs_of(logits, tokens, top)
        lse = torch.logsumexp(logits, -1)
        for i, (t, entry) in enumerate(zip(tokens, out)):
            (token, (value, rank)), *others = entry.items()
            assert token == t and rank == int((logits[i] > logits[i, t]).sum()) + 1
            assert value == float(logits[i, t] - lse[i]) or math.isnan(value)
            assert len(entry) <= top[i] + 1


@pytest.mark.parametrize("V", [1, 5, 16, 17, 40, 1000, 49152])
def test_one_kernel_call_reads_what_logprobs_need_as_torch_does(compiled, V):
    """`kernels.logprob_rows`: the log-sum-exp within a few ulp of the exact one (NaN, -inf and +inf rows as
    torch.logsumexp answers them), the token's logit and rank exactly, and torch.topk's k largest, equal logits
    in index order; `logprobs_of` on it gives what it gives on torch's ops."""
    g = torch.Generator().manual_seed(V)
    R = 8
    x = torch.randn(R, V, generator=g) * 6
    x[1] = torch.randint(-3, 4, (V,), generator=g).float()  # ties everywhere
    x[2, ::3] = -math.inf  # a grammar's mask
    x[3] = -math.inf
    x[4, V // 2] = math.inf
    x[5, V - 1] = math.nan
    tokens = torch.randint(0, V, (R,), generator=g)
    tokens[0] = x[0].argmax()
    exact = torch.logsumexp(x.double(), -1)
    for k in sorted({1, min(5, V), min(20, V), V}):
        lse, chosen, rank, values, at = kernels.logprob_rows(x, tokens, k)
        finite = exact.isfinite()
        assert ((lse[finite].double() - exact[finite]).abs() <= 1e-6 * exact[finite].abs().clamp(min=1)).all()
        assert torch.equal(lse[~finite].nan_to_num(), torch.logsumexp(x, -1)[~finite].nan_to_num())
        assert torch.equal(chosen.nan_to_num(), x.gather(1, tokens[:, None])[:, 0].nan_to_num())
        assert torch.equal(rank, (x > chosen[:, None]).sum(-1) + 1)
        assert torch.equal(values.nan_to_num(), x.topk(k, dim=-1).values.nan_to_num())
        assert torch.equal(x.gather(1, at).nan_to_num(), values.nan_to_num())
        for r in range(R):  # equal logits in index order: the pairs (value, -index) fall strictly
            pairs = list(zip(values[r].nan_to_num(math.inf).tolist(), (-at[r]).tolist()))
            assert pairs == sorted(pairs, reverse=True) and len(set(at[r].tolist())) == k
    tie_free = [0, 6, 7]
    top = [min(5, V)] * len(tie_free)
    a = logprobs_of(x[tie_free], tokens[tie_free].tolist(), top, compiled=True)
    b = logprobs_of(x[tie_free], tokens[tie_free].tolist(), top, compiled=False)
    for ea, eb in zip(a, b):
        assert list(ea) == list(eb) and all(ea[t][1] == eb[t][1] and abs(ea[t][0] - eb[t][0]) < 1e-5 for t in ea)
    with pytest.raises(RuntimeError, match=r"tokens\[0\] = -1 is not in"):
        kernels.logprob_rows(x, torch.full((R,), -1), 1)
    with pytest.raises(RuntimeError, match="k: expected 1 <= k"):
        kernels.logprob_rows(x, tokens, V + 1)


# ---------------------------------------------------------------- seeds of n samples

def test_n_samples_of_the_largest_seed_wrap_into_64_bits_and_match_their_solo_runs(tiny_model):
    """Sample i is seeded (seed + i) mod 2**64: seed 2**64 - 1 with n=3 seeds its samples 2**64 - 1, 0 and 1
    (seed + 1 used to overflow SamplingParams and fail the request), each drawing what a request alone with
    that seed draws."""
    from nanoserve.engine import LLMEngine
    from nanoserve.engine.llm_engine import sample_seed

    top = (1 << 64) - 1
    assert [sample_seed(top, i) for i in range(3)] == [top, 0, 1] and sample_seed(None, 2) is None
    params = dict(temperature=1.0, max_tokens=5, ignore_eos=True)
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4)
    rid = engine.add_request([3, 4, 5], SamplingParams(**params, seed=top, n=3))
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            samples.setdefault(out.index, []).extend(out.new_token_ids)
    assert [s.params.seed for s in engine.sequences(rid)] == [top, 0, 1]
    for i, seed in enumerate((top, 0, 1)):
        alone = LLMEngine(tiny_model, num_blocks=32, block_size=4)
        one = alone.add_request([3, 4, 5], SamplingParams(**params, seed=seed))
        tokens = []
        while alone.has_unfinished_requests():
            tokens += [t for out in alone.step() if out.request_id == one for t in out.new_token_ids]
        assert samples[i] == tokens, i
