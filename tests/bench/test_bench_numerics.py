"""bench numerics' parts on the tiny model: the held-out text, its windows, the accuracy summary and where greedy
texts part. (The command itself is run by hand: it loads every format of the real model.)"""

import math

import torch

from nanoserve.bench import numerics
from nanoserve.config import kv_bytes_per_token
from nanoserve.model import Llama


def test_held_out_text_ships_with_python_and_windows_spread_over_it(tok):
    ids = numerics.held_out_ids(tok)
    assert len(ids) > 50_000  # Python's documentation: plenty of text on any machine, no download
    ws = numerics.windows(ids, 4, 512)
    assert [len(w) for w in ws] == [512] * 4 and ws[0] == ids[:512] and ws[1] != ws[0]


def test_accuracy_is_zero_for_fp32_itself_and_measures_another_format(tiny_model, tiny_cfg):
    other = Llama.random(tiny_cfg, seed=0).cast_matrices(torch.bfloat16)
    texts = [[1, 5, 9, 2, 7, 3], [4, 4, 8, 1]]
    got = numerics.accuracy({"fp32": tiny_model, "bf16": other}, texts)
    assert got["fp32"]["logit_max_err"] == 0 and got["fp32"]["logit_mean_err"] == 0
    assert 0 < got["bf16"]["logit_mean_err"] <= got["bf16"]["logit_max_err"] < 1
    with torch.inference_mode():  # perplexity: e^(mean next-token cross-entropy over every text's positions)
        nll = [torch.nn.functional.cross_entropy(tiny_model(torch.tensor([t]))[0][:-1], torch.tensor(t[1:]),
                                                 reduction="sum") for t in texts]
    assert math.isclose(got["fp32"]["perplexity"], math.exp(float(sum(nll)) / 8), rel_tol=1e-5)
    assert math.isfinite(got["bf16"]["perplexity"]) and got["bf16"]["perplexity"] != got["fp32"]["perplexity"]


def test_divergences_name_the_first_differing_step_and_fp32s_lead_there(tiny_model):
    prompts, ref = [[1, 2, 3], [4, 5]], [[7, 8, 9], [6, 6]]
    rows = numerics.divergences(tiny_model, prompts, ref, [[7, 8, 9], [6, 2]])
    assert rows[0] == dict(prompt=0, first_divergence=None, fp32_lead=None)
    assert rows[1]["first_divergence"] == 1
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([[4, 5, 6]]), last_only=True)[0]
    assert rows[1]["fp32_lead"] == float(logits[6] - logits[2])


def test_decode_speed_counts_every_weight_and_the_context_kv_a_step_reads(tiny_model, tok):
    # a 5-token prompt and 4 new tokens: the first comes from the prefill, then 3 decode steps attend over 6, 7 and
    # 8 keys; the median step reads every weight once and 7 tokens' K/V
    tok_s, read_s = numerics.decode_speed(tiny_model, tok, [[1, 5, 9, 2, 7]], 4)
    kv = kv_bytes_per_token(tiny_model.cfg, 4)
    assert tok_s > 0 and math.isclose(read_s / tok_s, tiny_model.weight_bytes() + 7 * kv, rel_tol=1e-9)
    # three forwards per step: 6 new tokens after the prefill's are two steps, over 6-8 keys and over 9-11 (means
    # 7 and 10): the median step's forward reads 8.5 tokens' K/V
    tok_s, read_s = numerics.decode_speed(tiny_model, tok, [[1, 5, 9, 2, 7]], 7, scheduler_steps=3)
    assert tok_s > 0 and math.isclose(read_s / tok_s, tiny_model.weight_bytes() + 8.5 * kv, rel_tol=1e-9)


def test_a_decodes_bandwidth_is_the_mean_of_one_measured_before_and_one_after(monkeypatch):
    readings, order = iter([40e9, 80e9]), []
    monkeypatch.setattr(numerics, "measure_bandwidth", lambda *a: (order.append("bw") or next(readings), 0.0))
    decode = lambda: order.append("decode") or (500.0, 4e10)  # noqa: E731
    assert numerics.around(decode, True) == (60e9, 500.0, 4e10) and order == ["bw", "decode", "bw"]
    assert numerics.around(decode, False) == (0.0, 500.0, 4e10)  # batch sizes above 1: no bandwidth asked
