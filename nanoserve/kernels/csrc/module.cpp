// The Python bindings of the kernels (nanoserve.h lists them).
#include <torch/extension.h>

#include "nanoserve.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The model's step and the large products let go of Python's GIL while they run (they touch tensors only), so
  // the server's HTTP thread answers during a long prefill. The small per-row kernels keep it: releasing and taking
  // it back costs more than they do, and taking it back can wait for a busy thread's switch interval.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, rms_norm(x + residual) * weight)");
  m.def("rope_", &rope_, "rotate the first heads of qkv in place (then, if asked, round it to bf16)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up");
  m.def("paged_attention", &paged_attention, nogil,
        "each query row over its request's paged keys (split-K past split_keys)");
  m.def("prompt_attention_bf16", &prompt_attention_bf16, nogil, "a whole prompt's causal attention, bf16 products");
  m.def("prompt_attention_bf16_here", &prompt_attention_bf16_here, "whether this CPU has AVX512_BF16");
  m.def("bf16_linear", &bf16_linear, nogil, "x @ w.T for a bf16 matrix stored [in, out], fp32 sums, bf16 out");
  m.def("pack_bf16_panels", &pack_bf16_panels, nogil,
        "a bf16 matrix (N, K) as panels (N / 16, K, 16), for bf16_panels_linear");
  m.def("bf16_panels_linear", &bf16_panels_linear, nogil, "bf16_linear's sums, the matrix read from its panels");
  m.def("pack_bf16", &pack_bf16, nogil, "a bf16 matrix (N, K) as tiles (N / 16, K / 2, 16, 2), for bf16_tiles_linear");
  m.def("bf16_tiles_linear", &bf16_tiles_linear, nogil,
        "x @ w.T from w's bf16 tiles on a unit ('' this CPU's first): pair products, fp32 sums, bf16 out",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("N"), pybind11::arg("unit") = "");
  m.def("bf16_tiles_units", &bf16_tiles_units, "the units that multiply bf16 tiles here, the one taken first");
  m.def("int8_amx", &int8_amx, "whether the int8 tiled products take AMX (-1 asks; 0, 1 set): the same bits",
        pybind11::arg("on") = -1);
  m.def("pack_fp32", &pack_fp32, nogil, "an fp32 matrix (N, K) as tiles (N / 16, K, 16), for fp32_linear");
  m.def("fp32_linear", &fp32_linear, nogil, "x @ w.T from w's tiles: sliced in-order sums, the same bits for any rows");
  m.def("argmax_rows", &argmax_rows, "each row's first largest index, a NaN counting as largest");
  m.def("logprob_rows", &logprob_rows, nogil, "each row's log-sum-exp, a token's logit and rank, the top k");
  m.def("apply_bitmask_", &apply_bitmask_, "every logit a row's token bitmask forbids set to -inf, in place");
  m.def("block_linear", &block_linear, nogil, "x @ w.T for a weight held as GGUF blocks (block_kernels lists them)",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("fmt"), pybind11::arg("road") = "");
  m.def("block_dequantize", &block_dequantize, nogil, "GGUF blocks expanded to fp32 as a road's product expands them");
  m.def("block_kernels", &block_kernels, "(format, road, bytes, weights) of each block product, best road first");
  m.def("block_linear_int8", &block_linear_int8, nogil,
        "block_linear with x quantized to int8 blocks (llama.cpp's way)");
  m.def("quantize_activations_int8", &quantize_activations_int8, "x's int8 blocks: (q, d, s)");
  m.def("pack_blocks_int8", &pack_blocks_int8, nogil, "GGUF blocks in an int8 road's packed layout");
  m.def("block_linear_int8_packed", &block_linear_int8_packed, nogil, "block_linear_int8 on packed blocks");
  m.def("int8_packed_here", &int8_packed_here, "whether this CPU's int8 road has a packed layout");
  m.def("int8_road", &int8_road, "the road block_linear_int8 takes on this CPU");
  m.def("int8_roads", &int8_roads, "every road block_linear_int8 can take on this CPU, best first");
  m.def("int8_tiled_rows", &int8_tiled_rows, "rows of x from which the AVX512-VNNI road multiplies tiles");
  m.def("int8_q5_0_blocks", &int8_q5_0_blocks, "whether B rows of x meet a Q5_0 weight's own blocks, not its Q8_0 copy");
  m.def("peak_roads", &peak_roads, "(format, road) of each compute-peak loop this CPU can run, best road first");
  m.def("peak_ops", &peak_ops, nogil, "one run of a format's multiply-add loop on every torch thread: operations done");
  // module_local: two builds of these kernels may be loaded in one process (a build compared with another)
  pybind11::class_<BlockModel>(m, "BlockModel", pybind11::module_local(), "a model on GGUF blocks, stepped by one call")
      .def(pybind11::init<torch::Tensor, std::string, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<std::string>, std::vector<bool>, std::vector<torch::Tensor>, int64_t, int64_t,
                          double, bool, std::vector<int64_t>, double>(),
           pybind11::arg("embed"), pybind11::arg("embed_fmt"), pybind11::arg("norms"), pybind11::arg("blocks"),
           pybind11::arg("fmts"), pybind11::arg("int8"), pybind11::arg("packed"), pybind11::arg("n_heads"),
           pybind11::arg("n_kv_heads"), pybind11::arg("eps"), pybind11::arg("kv_bf16"),
           pybind11::arg("windows") = std::vector<int64_t>{}, pybind11::arg("embed_scale") = 1.0)
      .def("step", &BlockModel::step, nogil, "one step: the embedding rows, every layer, the LM head's logits",
           pybind11::arg("ids"), pybind11::arg("positions"), pybind11::arg("cos_table"), pybind11::arg("sin_table"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slot_mapping"),
           pybind11::arg("query_start_loc"), pybind11::arg("seq_lens"), pybind11::arg("block_tables"),
           pybind11::arg("last_rows"), pybind11::arg("scale"), pybind11::arg("split_keys"),
           pybind11::arg("group_slots") = std::vector<torch::Tensor>{},
           pybind11::arg("group_tables") = std::vector<torch::Tensor>{},
           pybind11::arg("layer_group") = std::vector<int64_t>{}, pybind11::arg("layer_slot") = std::vector<int64_t>{},
           pybind11::arg("cos_local") = pybind11::none(), pybind11::arg("sin_local") = pybind11::none())
      .def("decode", &BlockModel::decode, nogil, "decode steps in a row, each step's input the last one's argmax");
}
