"""The per-operation profile of one decode step (Day 12): grouping, arithmetic, and that it changes nothing."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from nanoserve.bench.profile import (
    GROUPS,
    GroupRow,
    OpCall,
    flops_by_group,
    profile_forward,
    summarize,
    weight_bytes_by_group,
    weight_group,
    weight_rates,
)


def ticking_clock():
    """A fake clock that advances one second per reading: every op call then costs exactly 1."""
    counter = itertools.count()
    return lambda: float(next(counter))


@pytest.mark.parametrize(
    "name, group",
    [
        ("layers.0.wqkv", "qkv"), ("layers.12.wo", "o_proj"), ("layers.1.w_gate_up", "mlp"),
        ("layers.1.w_down", "mlp"), ("layers.3.attn_norm", "norms"), ("norm", "norms"), ("lm_head", "lm_head"),
        ("embed", "lm_head"), ("model.layers.0.self_attn.q_proj", "qkv"), ("inv_freq", None),
    ],
)
def test_weight_group(name, group):
    assert weight_group(name) == group


def test_summarize_medians_and_shares():
    runs = [
        [OpCall("qkv", "linear", 1.0), OpCall("mlp", "linear", 3.0), OpCall("mlp", "silu", 1.0)],
        [OpCall("qkv", "linear", 2.0), OpCall("mlp", "linear", 6.0), OpCall("mlp", "silu", 2.0)],
        [OpCall("qkv", "linear", 9.0), OpCall("mlp", "linear", 3.0), OpCall("mlp", "silu", 1.0)],
    ]
    rows = {r.group: r for r in summarize(runs)}
    assert list(rows) == list(GROUPS)  # every group reported, in the fixed order
    assert rows["qkv"].seconds == 2.0 and rows["mlp"].seconds == 4.0  # per-group medians: (1,2,9) and (4,8,4)
    assert rows["qkv"].share == pytest.approx(2 / 6) and rows["mlp"].share == pytest.approx(4 / 6)
    assert rows["mlp"].calls == 2 and rows["attention"].calls == 0 and rows["attention"].share == 0.0
    assert sum(r.share for r in rows.values()) == pytest.approx(1.0)


def test_summarize_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one run"):
        summarize([])
    with pytest.raises(ValueError, match="'bogus'"):
        summarize([[OpCall("bogus", "add", 1.0)]])


# the kernels a matrix product may reach: F.linear (GEMM), oneDNN, or model.matmul's one-row roads (embedding_bag, bmm)
PRODUCTS = {"linear", "onednn_linear", "embedding_bag", "matmul", "mm", "addmm", "bmm"}


@pytest.mark.parametrize("T", [1, 5])
def test_profile_groups_every_matrix_product_by_its_weight(tiny_model, T, road):
    L = tiny_model.cfg.n_layers
    rows, calls = profile_forward(tiny_model, torch.arange(1, T + 1)[None], repeats=2, clock=ticking_clock(),
                                  compiled=road == "compiled")
    products = Counter(c.group for c in calls if c.op in PRODUCTS)
    assert products == {"qkv": L, "o_proj": L, "mlp": 2 * L, "lm_head": 1}
    assert Counter(c.group for c in calls if c.op == "embedding") == {"embedding": 1}
    assert {c.group for c in calls if c.op == "scaled_dot_product_attention"} == {"attention"}
    # with one tick per call, a group's seconds are its call count: the arithmetic is exact
    for r in rows:
        assert r.seconds == r.calls
    # every stage of the block is seen, and almost nothing is left unexplained
    by = {r.group: r for r in rows}
    for g in ("embedding", "norms", "qkv", "rope", "attention", "o_proj", "mlp", "lm_head"):
        assert by[g].calls > 0, g
    assert by["other"].calls <= 8


def test_profile_sees_every_norm_and_rope(tiny_model, road):
    _, calls = profile_forward(tiny_model, torch.tensor([[3, 1, 4, 1, 5, 9]]), repeats=1, warmup=0,
                               compiled=road == "compiled")
    groups = Counter(c.group for c in calls)
    L = tiny_model.cfg.n_layers
    assert groups["norms"] >= 2 * L + 1  # at least one op for each of two norms per block and the final one
    assert groups["rope"] >= L  # q and k are rotated in every block
    assert all(c.seconds >= 0 for c in calls)


def test_profiling_does_not_change_the_forward(tiny_model):
    ids = torch.tensor([[7, 8, 9, 10]])
    with torch.inference_mode():
        before = tiny_model(ids, last_only=True)
    profile_forward(tiny_model, ids, repeats=1)
    with torch.inference_mode():
        assert torch.equal(tiny_model(ids, last_only=True), before)


def test_profile_accepts_a_kv_backend_and_positions(tiny_model):
    seen = []

    def backend(layer, q, k, v):  # a trivial backend: records its calls, returns zeros
        seen.append(layer)
        return torch.zeros(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])

    rows, calls = profile_forward(tiny_model, torch.tensor([[4]]), positions=torch.tensor([[17]]), kv=backend,
                                  repeats=1, warmup=1, clock=ticking_clock())
    assert seen == 2 * list(range(tiny_model.cfg.n_layers))  # warm-up run, measured run
    assert Counter(c.group for c in calls if c.op == "zeros") == {"attention": tiny_model.cfg.n_layers}


def test_profile_rejects_bad_repeats(tiny_model):
    with pytest.raises(ValueError, match="repeats"):
        profile_forward(tiny_model, torch.tensor([[1]]), repeats=0)


def test_weight_bytes_by_group_adds_up(tiny_model):
    cfg = tiny_model.cfg
    n = 7
    b = weight_bytes_by_group(tiny_model, n)
    per = 4  # fp32
    assert b["qkv"] == cfg.n_layers * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.hidden_size * per
    assert b["mlp"] == cfg.n_layers * 3 * cfg.hidden_size * cfg.intermediate_size * per
    assert b["embedding"] == n * cfg.hidden_size * per  # only the rows looked up
    assert b["attention"] == b["rope"] == b["other"] == 0
    if cfg.tie_word_embeddings:  # every parameter once, plus the looked-up rows read a second time
        assert sum(b.values()) == tiny_model.weight_bytes() + n * cfg.hidden_size * per


def test_weight_rates():
    rows = [GroupRow("mlp", 0.02, 0.5, 3), GroupRow("attention", 0.01, 0.25, 2), GroupRow("qkv", 0.0, 0.0, 0)]
    rates = weight_rates(rows, {"mlp": 4_000_000, "attention": 0, "qkv": 10})
    assert rates == {"mlp": 200_000_000.0}  # groups without weights or without time have no rate


def test_flops_by_group_counts_multiply_adds(tiny_model):
    cfg = tiny_model.cfg
    per = 4  # fp32 bytes per weight
    for T in (1, 9):
        f, b = flops_by_group(cfg, T), weight_bytes_by_group(tiny_model, T)
        for g in ("qkv", "o_proj", "mlp"):  # a matrix product: 2 FLOPs per weight per token
            assert f[g] == 2 * T * b[g] // per
        assert f["lm_head"] == 2 * cfg.vocab_size * cfg.hidden_size  # last_only: one row, whatever T
    # causal attention: query t attends to t + 1 keys, q.k and p.v each 2 FLOPs per (query, key, dim)
    one, two = flops_by_group(cfg, 1)["attention"], flops_by_group(cfg, 2)["attention"]
    assert one == 4 * cfg.n_heads * cfg.head_dim * cfg.n_layers and two == 3 * one
