"""bench decode's arithmetic (rows, paired ratios, the winner per batch size), its CSV round trip, the command
line it registers, and that every road times what it names (sane numbers on a tiny model: nothing is judged on its
speed); the measuring itself runs as `python -m nanoserve bench decode`, never in a test."""

import math

import pytest
import torch
import transformers

from nanoserve.bench import decode
from nanoserve.cli import build_parser
from nanoserve.model.weights import save_checkpoint

STEPS = {("nanoserve", "fp32", 1, 128): 0.040, ("nanoserve", "gguf", 1, 128): 0.010,
         ("llama.cpp", "gguf", 1, 128): 0.0125, ("transformers", "fp32", 1, 128): 0.050,
         ("nanoserve", "fp32", 8, 128): 0.050, ("nanoserve", "gguf", 8, 128): 0.040,
         ("nanoserve", "fp32", 32, 128): 0.080, ("nanoserve", "gguf", 32, 128): 0.100}
RUNS = {key: [(0.5, step)] for key, step in STEPS.items()}  # one round: (prefill s, step s)
BYTES = {("nanoserve", "fp32"): 5e8, ("nanoserve", "gguf"): 1e8, ("llama.cpp", "gguf"): 1e8,
         ("transformers", "fp32"): 5e8}


def test_rows_divide_numbers_of_the_same_run():
    rows = {(r.engine, r.weights, r.batch): r for r in decode.make_rows(RUNS, BYTES, bandwidth=20e9)}
    blocks = rows[("nanoserve", "gguf", 1)]
    assert blocks.tok_s == 100 and blocks.vs_nanoserve_fp32 == 4 and math.isclose(blocks.vs_llama_cpp, 1.25)
    assert blocks.vs_transformers == 5 and blocks.prefill_tok_s == 256  # 128 tokens in 0.5 s
    assert rows[("nanoserve", "gguf", 8)].prefill_tok_s == 2048  # 8 rows of them
    assert math.isclose(blocks.weight_gb_s, 10) and math.isclose(blocks.bandwidth_frac, 0.5)
    assert rows[("nanoserve", "fp32", 8)].tok_s == 160 and math.isnan(rows[("nanoserve", "gguf", 8)].vs_llama_cpp)
    curves = decode.by_batch(list(rows.values()))
    assert curves == {"fp32": {1: 25.0, 8: 160.0, 32: 400.0}, "gguf": {1: 100.0, 8: 200.0, 32: 320.0}}


def test_the_csv_round_trips_with_its_header(tmp_path):
    rows = decode.make_rows(RUNS, BYTES, bandwidth=20e9)
    path = tmp_path / "d.csv"
    decode.write_csv(path, rows, {"command": "python -m nanoserve bench decode", "llama_cpp": "not installed"})
    header, back = decode.read_csv(path)
    assert header["llama_cpp"] == "not installed" and len(back) == len(rows)
    assert all(isinstance(r.batch, int) and isinstance(r.tok_s, float) for r in back)
    assert math.isnan(next(r for r in back if r.batch == 8).vs_llama_cpp)
    assert [(r.engine, r.weights, r.batch) for r in back] == [(r.engine, r.weights, r.batch) for r in rows]
    assert all(math.isclose(a.tok_s, b.tok_s, rel_tol=1e-3) for a, b in zip(back, rows))


def test_the_command_is_registered_with_its_defaults():
    args = build_parser().parse_args(["bench", "decode", "--threads", "1"])
    assert args.what == "decode" and args.contexts == [128, 1024] and args.batch_sizes == [8, 32]
    assert args.out == decode.CSV_PATH and args.threads == 1 and args.model is None
    assert build_parser().parse_args(["bench", "decode", "--model", "gemma3-270m"]).model == "gemma3-270m"


def test_rows_on_int8_activations_keep_the_weights_and_name_the_activations():
    steps = {**STEPS, ("nanoserve", "gguf+int8", 1, 128): 0.008, ("nanoserve", "gguf+int8", 8, 128): 0.030}
    runs = {key: [(0.5, s)] for key, s in steps.items()}
    rows = decode.make_rows(runs, {**BYTES, ("nanoserve", "gguf+int8"): 1e8}, bandwidth=20e9)
    int8 = [r for r in rows if r.activations == "int8"]
    assert [(r.weights, r.batch) for r in int8] == [("gguf", 1), ("gguf", 8)]
    assert int8[0].tok_s == 125 and math.isclose(int8[0].bandwidth_frac, 0.625)
    assert all(r.activations == "fp32" for r in rows if r not in int8)
    assert decode.by_batch(rows)["gguf+int8"] == {1: 125.0, 8: 8 / 0.030}
    args = build_parser().parse_args(["bench", "decode", "--activations", "fp32", "int8"])
    assert args.activations == ["fp32", "int8"] and args.kv_cache_dtype == ["auto"]


def test_rows_on_a_bf16_cache_name_it_beside_the_activations():
    key = decode.weights_key("int8", "bfloat16")
    steps = {**STEPS, ("nanoserve", key, 1, 128): 0.006, ("nanoserve", "gguf+int8", 1, 128): 0.008}
    rows = decode.make_rows({k: [(0.5, s)] for k, s in steps.items()},
                            {**BYTES, ("nanoserve", key): 1e8, ("nanoserve", "gguf+int8"): 1e8}, bandwidth=20e9)
    (half,) = [r for r in rows if r.kv_cache_dtype == "bfloat16"]
    assert (half.weights, half.activations, half.batch, half.step_ms) == ("gguf", "int8", 1, 6.0)
    assert all(r.kv_cache_dtype == "auto" for r in rows if r is not half)
    assert decode.by_batch(rows)[key] == {1: 1 / 0.006} and decode.by_batch(rows)["gguf+int8"] == {1: 125.0}
    assert decode.weights_key() == "gguf" and key == "gguf+int8+kv-bf16"
    args = build_parser().parse_args(["bench", "decode", "--kv-cache-dtype", "auto", "bfloat16"])
    assert args.kv_cache_dtype == ["auto", "bfloat16"]


def test_ratios_pair_rounds_and_medians_are_per_column():
    """Three rounds, each ratio that round's: 2, 2 and 0.5 give a median of 2, where the ratio of the medians
    (0.3 s / 0.2 s) would say 1.5; the step is the median."""
    runs = {("nanoserve", "fp32", 1, 128): [(1.0, 0.1), (1.0, 0.2), (1.0, 0.6)],
            ("transformers", "fp32", 1, 128): [(2.0, 0.2), (2.0, 0.4), (2.0, 0.3)]}
    mine, theirs = decode.make_rows(runs, {("nanoserve", "fp32"): 1e8, ("transformers", "fp32"): 1e8}, 1e9)
    assert mine.vs_transformers == pytest.approx(2.0) and theirs.vs_nanoserve_fp32 == pytest.approx(0.5)
    assert mine.step_ms == pytest.approx(200) and mine.prefill_tok_s == 128 and theirs.prefill_tok_s == 64


@pytest.mark.parametrize("road", ["nanoserve-engine", "nanoserve-contiguous", "nanoserve-nocache"])
def test_every_road_times_a_request(tiny_model, road):
    ttft, tpot = decode.time_road(tiny_model, [5, 6, 7], 3, road)
    assert ttft > 0 and tpot > 0
    with pytest.raises(KeyError):
        decode.time_road(tiny_model, [5, 6, 7], 2, "nanoserve-cache")


def test_the_bare_step_and_transformers_give_a_prefill_and_a_step(tmp_path, tiny_model):
    assert all(s > 0 for s in decode.time_nanoserve(tiny_model, [5, 6, 7], batch=2, steps=3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(save_checkpoint(tiny_model, tmp_path),
                                                           dtype=torch.float32).eval()
    assert all(s > 0 for s in decode.time_transformers(hf, [5, 6, 7], steps=3))


def test_rows_carry_their_prefill_and_step_as_fractions_of_their_formats_peak(tiny_cfg):
    from nanoserve.bench.roofline import forward_flops

    steps = {**STEPS, ("nanoserve", "gguf+int8", 32, 128): 0.050, ("nanoserve", "bf16", 32, 128): 0.060}
    runs = {key: [(0.5, s)] for key, s in steps.items()}
    peaks = {"fp32": 1e9, "int8": 4e9, "bf16": 2e9}
    weight_bytes = {**BYTES, ("nanoserve", "gguf+int8"): 1e8, ("nanoserve", "bf16"): 2.5e8}
    rows = {(r.engine, r.weights, r.activations, r.batch): r
            for r in decode.make_rows(runs, weight_bytes, 20e9, tiny_cfg, peaks)}
    fp32 = rows[("nanoserve", "fp32", "fp32", 32)]
    assert math.isclose(fp32.prefill_peak_frac, 32 * forward_flops(tiny_cfg, 128) / 0.5 / 1e9)
    assert math.isclose(fp32.step_peak_frac, 32 * forward_flops(tiny_cfg, 1, 128) / 0.080 / 1e9)
    int8 = rows[("nanoserve", "gguf", "int8", 32)]  # held to the int8 peak, 4x fp32's here
    assert math.isclose(int8.step_peak_frac, 32 * forward_flops(tiny_cfg, 1, 128) / 0.050 / 4e9)
    assert math.isclose(rows[("llama.cpp", "gguf", "fp32", 1)].step_peak_frac,
                        forward_flops(tiny_cfg, 1, 128) / 0.0125 / 4e9)  # llama.cpp multiplies int8 activations
    bf16 = rows[("nanoserve", "bf16", "fp32", 32)]  # bf16 matrices: held to the bf16 peak
    assert math.isclose(bf16.prefill_peak_frac, 32 * forward_flops(tiny_cfg, 128) / 0.5 / 2e9)
    assert math.isclose(bf16.step_peak_frac, 32 * forward_flops(tiny_cfg, 1, 128) / 0.060 / 2e9)
    assert math.isclose(bf16.vs_nanoserve_fp32, 0.080 / 0.060)
    assert all(math.isnan(r.prefill_peak_frac) for r in decode.make_rows(runs, weight_bytes, 20e9))  # no peaks
