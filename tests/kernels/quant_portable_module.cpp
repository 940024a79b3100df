// quant.cpp's block product bound alone, for test_quant.py's build of the portable road (no -mavx2).
#include <torch/extension.h>

#include "nanoserve.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear", &block_linear, pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("fmt"),
        pybind11::arg("road") = "");
  m.def("block_dequantize", &block_dequantize);
  m.def("block_kernels", &block_kernels);
}
