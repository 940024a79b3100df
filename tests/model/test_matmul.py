"""The weight products: every road of `linear` against F.linear and fp64, batch invariance of products of
two or more rows, the [in, out] layout, and oneDNN's packed copies."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from nanoserve import kernels
from nanoserve.config import ModelConfig
from nanoserve.kernels import int8
from nanoserve.model import Llama, linear, linear_weight
from nanoserve.model import matmul as mm
from nanoserve.model.weights import load_model, save_checkpoint


def random_linear_weight(n_out: int, n_in: int, g: torch.Generator) -> torch.nn.Parameter:
    """A model-layout weight ((out, in) shape, [in, out] memory) with values of a trained layer's scale."""
    w = linear_weight(n_out, n_in)
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=g) / n_in**0.5)
    return w


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])
def test_linear_agrees_with_f_linear_on_every_road(shape):
    """One row (the bag or bmm), several rows (oneDNN when present), gradients on (F.linear)."""
    g = torch.Generator().manual_seed(0)
    w = random_linear_weight(*shape, g)
    x = torch.randn(2, 9, shape[1], generator=g)
    ref = F.linear(x.double(), w.double())
    with torch.inference_mode():
        for rows in (x[:1, :1], x[:1], x):
            torch.testing.assert_close(linear(rows, w).double(), ref[: rows.shape[0], : rows.shape[1]],
                                       atol=1e-5, rtol=1e-5)
    y = linear(x, w)  # gradients on: F.linear, which has a backward
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


@pytest.mark.parametrize("road", ["bag", "bmm"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49152, 576)])
def test_bothone_row_roads_agree_with_fp64(road, shape):
    """Whichever road this CPU picks (matmul.ONE_ROW), both must be right on every machine: summed in
    small partial sums, both stay within 1.5e-6 of fp64 on outputs of order 1 to 4."""
    g = torch.Generator().manual_seed(3)
    w = random_linear_weight(*shape, g)
    x = torch.randn(1, 1, shape[1], generator=g)
    ref = F.linear(x.double(), w.double())
    with torch.inference_mode():
        y = (mm.bag_linear if road == "bag" else mm.bmm_linear)(x, w)
    assert y.shape == (1, 1, shape[0]) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1.5e-6


def testone_row_road_is_chosen_per_cpu():
    assert mm.ONE_ROW in ("bag", "bmm")
    g = torch.Generator().manual_seed(6)
    w = random_linear_weight(64, 576, g)
    x = torch.randn(1, 576, generator=g)
    with torch.inference_mode():
        want = mm.bmm_linear(x, w) if mm.ONE_ROW == "bmm" else mm.bag_linear(x, w)
        assert torch.equal(linear(x, w), want)


def test_one_row_bmm_road_falls_back_to_the_bag_when_slices_do_not_fit(monkeypatch):
    """bmm needs in-features divisible by BMM_ROWS; another width takes the bag, with the same answer."""
    g = torch.Generator().manual_seed(4)
    w = random_linear_weight(64, 100, g)
    x = torch.randn(1, 100, generator=g)
    monkeypatch.setattr(mm, "ONE_ROW", "bmm")
    with torch.inference_mode():
        assert torch.equal(mm.linear(x, w), mm.bag_linear(x, w))


def test_linear_rows_do_not_depend_on_the_other_rows():
    """Batch invariance: a row's product is bit-identical whatever else is in the call, for every call of
    ROW_MULTIPLE-multiple rows (both kernels), and for any 2+ rows under oneDNN."""
    g = torch.Generator().manual_seed(1)
    w = random_linear_weight(3072, 576, g)
    x = torch.randn(32, 576, generator=g)
    with torch.inference_mode():
        full = linear(x, w)
        sizes = range(2, 33) if mm.ONEDNN else range(mm.ROW_MULTIPLE, 33, mm.ROW_MULTIPLE)
        for m in sizes:
            assert torch.equal(linear(x[:m], w), full[:m]), m
        perm = torch.randperm(32, generator=g)
        assert torch.equal(linear(x[perm], w), full[perm])


def test_forward_rows_rounds_batches_up_but_leaves_one_alone():
    assert [mm.forward_rows(b) for b in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 4, 4, 4, 8, 8, 12, 32]
    assert mm.ROW_MULTIPLE == 4


def test_this_torch_has_onednn():
    """The engine's products of two or more rows are oneDNN's on every x86 and ARM build of torch;
    without it they fall back to F.linear, which the invariance above then holds only per ROW_MULTIPLE."""
    assert mm.ONEDNN


def kept(w: torch.Tensor) -> torch.Tensor | None:
    """The copy `pack` keeps beside w on this CPU: tiles where the fp32 kernel runs (x86), else oneDNN's blocks."""
    return mm.tiled(w) if mm.TILES and kernels.available() else mm.packed(w)


def test_packed_weights_give_the_same_products_and_never_go_stale():
    g = torch.Generator().manual_seed(2)
    w = random_linear_weight(1536, 576, g)
    x = torch.randn(40, 576, generator=g)
    with torch.inference_mode():
        plain = linear(x, w)
        assert kept(w) is None
        assert mm.pack(w) and kept(w) is not None
        full = linear(x, w)
        torch.testing.assert_close(full, plain, atol=1e-5, rtol=1e-5)
        for m in range(2, 41):  # batch invariance holds on the packed copy too
            assert torch.equal(linear(x[:m], w), full[:m]), m
        torch.testing.assert_close(linear(x[:1], w), plain[:1], atol=1e-5, rtol=1e-5)
        if mm.tiled(w) is not None:  # the tiles: one row alone is its bits among 40, with no rows added
            assert torch.equal(linear(x[7:8], w), full[7:8])
            torch.testing.assert_close(linear(x, w, compiled=False), plain, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        w.mul_(2.0)  # a write: the packed copy is now stale and must not be read
    assert kept(w) is None
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), 2 * plain, atol=1e-5, rtol=1e-5)
    assert kept(w.detach().clone()) is None  # a copy of the weight does not inherit the blocked copy
    alive = weakref.ref(w)
    del w
    gc.collect()
    assert alive() is None  # the blocked copy (an attribute of w) does not keep w alive: it goes with it


def test_pack_refuses_what_it_cannot_pack():
    assert not mm.pack(torch.ones(8, 4, dtype=torch.float16))
    assert not mm.pack(torch.ones(8))
    with torch.inference_mode():
        assert not mm.pack(torch.ones(8, 4))  # an inference tensor keeps no version: a write could not be seen


def test_pack_weights_packs_every_matrix_once(tiny_cfg):
    model = Llama.random(tiny_cfg, seed=0)  # its own: the session's tiny model stays unpacked
    added = model.pack_weights()
    mats = [w for blk in model.layers for w in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)]
    mats.append(model.lm_head)
    assert all(kept(w) is not None for w in mats)
    assert model.one_row_same_bits(True) == (mm.TILES and kernels.available())
    assert not model.one_row_same_bits(False)
    assert added == sum(w.numel() * w.element_size() for w in mats)


def test_load_model_packs_by_default(tmp_path, tiny_model):
    folder = save_checkpoint(tiny_model, tmp_path)
    assert kept(load_model(folder).layers[0].wqkv) is not None
    assert kept(load_model(folder, pack=False).layers[0].wqkv) is None


# ---- the [in, out] layout --------------------------------------------------------------------------


def test_linear_weights_are_stored_in_out_and_stay_so(tmp_path, tiny_cfg):
    """Every matrix keeps its (out, in) shape but is contiguous as (in, out), through dtype and load."""
    model = Llama.random(tiny_cfg, seed=0)

    def matrices(m):
        return [p for n, p in m.named_parameters() if p.dim() == 2]

    assert all(p.t().is_contiguous() for p in matrices(model))
    assert model.layers[0].wqkv.shape == (
        (tiny_cfg.n_heads + 2 * tiny_cfg.n_kv_heads) * tiny_cfg.head_dim, tiny_cfg.hidden_size)
    assert all(p.t().is_contiguous() for p in matrices(model.to(torch.bfloat16)))
    loaded = load_model(save_checkpoint(Llama.random(tiny_cfg, seed=0), tmp_path))
    assert all(p.t().is_contiguous() for p in matrices(loaded))
    untied = Llama.random(ModelConfig.tiny(tie_word_embeddings=False))
    assert untied.embed.is_contiguous() and untied.lm_head.t().is_contiguous()  # lookup table stays row-major


def test_linear_one_row_is_the_weighted_row_sum_and_other_layouts_are_f_linear():
    g = torch.Generator().manual_seed(0)
    w = linear_weight(96, 64)
    with torch.no_grad():
        w.copy_(torch.randn(96, 64, generator=g))
    x = torch.randn(1, 1, 64, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)  # the one-row road
    rows = torch.randn(3, 5, 64, generator=g)
    assert torch.equal(linear(rows, w), F.linear(rows, w))  # gradients on: plain F.linear
    row_major = w.detach().contiguous()
    assert torch.equal(linear(x, row_major), F.linear(x, row_major))  # other layouts: plain F.linear
    assert linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    w.grad = None
    linear(x, w).sum().backward()  # still differentiable (the cached indices are ordinary tensors)
    torch.testing.assert_close(w.grad, x.reshape(1, 64).expand(96, 64))


def test_every_road_of_the_table_gives_the_product_and_road_names_the_one_taken():
    """`ROADS` per format, each road forced on inputs it takes: the product F.linear gives (to fp32's or the
    format's rounding), and `road` names the first that takes x and w, as `linear` runs it."""
    g = torch.Generator().manual_seed(7)
    w = random_linear_weight(64, 128, g)
    x1, x4 = torch.randn(1, 1, 128, generator=g), torch.randn(4, 128, generator=g)
    built = kernels.available()
    tiled_w = random_linear_weight(64, 128, g)
    assert mm.pack(tiled_w) == (mm.TILES and built) or mm.packed(tiled_w) is not None
    blocks = mm.BlockWeight.quantize(torch.randn(64, 128, generator=g), "q8_0")
    blocks_int8 = mm.BlockWeight(blocks.blocks, "q8_0", 128, activations="int8")
    with torch.inference_mode():
        cases = {"fp32": [(x1, w, "bmm" if mm.ONE_ROW == "bmm" else "bag", False), (x4, w, "oneDNN", False),
                          (x4, tiled_w, "tiles" if mm.TILES and built else "oneDNN", True)],
                 "blocks": [(x4, blocks, "block kernel" if built else "dequantized", None),
                            (x4, blocks, "dequantized", False)],
                 "blocks-int8": [(x4, blocks_int8, "int8 kernel" if built else "int8 in torch", None),
                                 (x4, blocks_int8, "int8 in torch", False)]}
        for fmt, rows in cases.items():
            for x, weight, name, compiled in rows:
                assert mm.weight_format(weight) == fmt
                taken = mm.road(x, weight, compiled)
                assert taken.name == name and taken in mm.ROADS[fmt], (fmt, name, taken.name)
                got = mm.linear(x, weight, compiled)
                if fmt == "blocks-int8":  # x rounded to int8 blocks: the same bits as the product's torch reference
                    assert torch.equal(got, int8.block_linear_int8_reference(x, weight.blocks, "q8_0"))
                    continue
                dense = weight.dequantize() if isinstance(weight, mm.BlockWeight) else weight
                torch.testing.assert_close(got, F.linear(x, dense), atol=1e-5, rtol=1e-5)
        for r in mm.ROADS["fp32"][1:]:  # the torch roads, each forced on a row it takes
            if r.takes(x1, w, False):
                torch.testing.assert_close(r.product(x1, w, False), F.linear(x1, w), atol=1e-5, rtol=1e-5)
    assert mm.road(x4, w).name == "F.linear"  # gradients on: the one road with a backward
    assert mm.road(x4, w.bfloat16()).name == "F.linear"
    assert mm.road(x4, w.double()).name == "F.linear" and mm.weight_format(w.double()) == "other"


def test_a_bf16_matrix_on_the_widening_road_reads_its_panels_for_the_same_bits(monkeypatch):
    """Where torch's oneDNN takes no bf16 (forced here on any CPU), `pack` gives a bf16 matrix its panels and
    `linear` reads them: the widening kernel's bits on w itself, for one row and several; written to, w's panels
    are stale and the road goes back to w."""
    if not kernels.available():
        pytest.skip(f"no compiled kernels here: {kernels.unavailable_reason()}")
    monkeypatch.setattr(mm, "bf16_road", lambda: "widen")
    g = torch.Generator().manual_seed(3)
    w = mm.linear_weight(96, 64)
    with torch.no_grad():
        w.data = torch.randn(96, 64, generator=g).t().contiguous().t().bfloat16()
    xs = [torch.randn(1, 64, generator=g), torch.randn(7, 64, generator=g)]
    with torch.inference_mode():
        before = [mm.linear(x, w, True) for x in xs]
        assert mm.road(xs[0], w, True).name == "widening kernel"
    assert mm.pack(w) and mm.panels(w) is not None and mm.tiled(w) is None
    with torch.inference_mode():
        for x, b in zip(xs, before):
            assert mm.road(x, w, True).name == "widening kernel, panels"
            assert torch.equal(mm.linear(x, w, True), b)
        assert mm.road(xs[0], w, False).name == "widened to fp32"  # the kernels off: torch's roads
    with torch.no_grad():
        w.mul_(2)
    assert mm.panels(w) is None
    with torch.inference_mode():
        assert mm.road(xs[0], w, True).name == "widening kernel"
