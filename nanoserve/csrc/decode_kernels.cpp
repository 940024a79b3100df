// The glue of a batched decode step, as four loops (nanoserve/kernels.py explains why).
//
// Each loop computes one row (or one row's kv head) from that row's numbers only, in the same
// order whatever the batch, so a row's result never depends on the rows beside it. Loops over a
// row's C or D numbers keep LANES partial sums, added in a fixed order at the end: the compiler
// turns them into vector instructions without being allowed to reorder anything itself.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int LANES = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < LANES; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x in float, to 2 ulp, written so a loop of it vectorizes (std::exp is a library call per number):
// x = n ln2 + r with |r| <= ln2/2, e^r by its degree-7 polynomial (Cephes' expf), 2^n from the exponent bits.
__attribute__((always_inline)) inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // t rounded to an integer (1.5 * 2^23 trick)
  float r = x - n * 0.693359375f;                     // ln2 in two parts: r stays exact
  r = r - n * (-2.12194440e-4f);
  const float r2 = r * r;
  const float p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                    1.6666665459e-1f) * r + 5.0000001201e-1f) * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, ": expected a float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

}  // namespace

// (x + residual, rms_norm(x + residual) * weight) over the last dim; residual may be None (then x as is).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  const int64_t C = x.size(-1), N = x.numel() / C;
  TORCH_CHECK(weight.numel() == C, "weight: expected ", C, " numbers, got ", weight.numel());
  torch::Tensor out = x;
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual: shape ", residual->sizes(), " is not x's ", x.sizes());
    out = torch::empty_like(x);
  }
  auto h = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  for (int64_t i = 0; i < N; ++i) {
    float* o = op + i * C;
    if (rp) {
      const float* a = xp + i * C;
      const float* b = rp + i * C;
      for (int64_t c = 0; c < C; ++c) o[c] = a[c] + b[c];
    }
    const float inv = 1.0f / std::sqrt(dot(o, o, C) / static_cast<float>(C) + feps);
    float* hi = hp + i * C;
    for (int64_t c = 0; c < C; ++c) hi[c] = (o[c] * inv) * wp[c];
  }
  return {out, h};
}

// Rotate the first `heads` heads of qkv (N, heads_total, D) in place by each token's cos/sin (N, D):
// the pairs (x_i, x_{i+D/2}), as apply_rope does.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t D = qkv.size(-1), HT = qkv.size(-2), N = qkv.numel() / (HT * D), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim ", D, ": expected an even number up to 512");
  TORCH_CHECK(0 <= heads && heads <= HT, "heads ", heads, " out of 0..", HT);
  TORCH_CHECK(cos.numel() == N * D && sin.numel() == N * D, "cos/sin: expected ", N, " x ", D, " numbers");
  float* p = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float rotated[512];
  for (int64_t i = 0; i < N; ++i) {
    const float* c = cp + i * D;
    const float* s = sp + i * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = p + (i * HT + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        rotated[d] = x[d] * c[d] - x[d + half] * s[d];
        rotated[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
      }
      std::copy(rotated, rotated + D, x);
    }
  }
}

// SwiGLU's middle: gate_up (..., 2I) -> silu(gate) * up (..., I).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, N = gate_up.numel() / I2;
  TORCH_CHECK(I2 % 2 == 0, "gate_up: last dim ", I2, " is not even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gi = g + i * I2;
      const float* ui = gi + I;
      float* oi = o + i * I;
      for (int64_t c = 0; c < I; ++c) {
        const float x = gi[c];
        oi[c] = x / (1.0f + fast_exp(-x)) * ui[c];
      }
    }
  });
  return out;
}

// One query per row over that row's keys, read where they lie in the paged pool: no gather, no mask.
// q (R, H, D); k_pool/v_pool (blocks, block_size, K, D); block_tables (R, W) int64; context_lens (R,) int64.
// Row r attends over its first context_lens[r] keys, key l in block block_tables[r][l / block_size].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  check_f32(q, "q");
  check_f32(k_pool, "k_pool");
  check_f32(v_pool, "v_pool");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
              "expected q (R, H, D) and k/v pools (blocks, block_size, K, D) of one shape");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_pool.size(0), BS = k_pool.size(1), K = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && K > 0 && H % K == 0, "pool heads/dims (", K, ", ", k_pool.size(3),
              ") do not fit q's (", H, ", ", D, ")");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.size(0) == R &&
                  block_tables.is_contiguous(), "block_tables: expected contiguous int64 (", R, ", W)");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.numel() == R && context_lens.is_contiguous(),
              "context_lens: expected ", R, " contiguous int64");
  const int64_t W = block_tables.size(1), rep = H / K;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= W * BS, "row ", r, ": context length ", lens[r], " outside 1..", W * BS,
                " (its table's ", W, " blocks of ", BS, ")");
    for (int64_t b = 0; b < (lens[r] + BS - 1) / BS; ++b)
      TORCH_CHECK(tables[r * W + b] >= 0 && tables[r * W + b] < NB, "row ", r, ": block ", tables[r * W + b],
                  " is not in the pool of ", NB);
  }
  auto out = torch::zeros({R, H * D}, q.options());
  const float* qd = q.data_ptr<float>();
  const float* kd = k_pool.data_ptr<float>();
  const float* vd = v_pool.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, R * K, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t rg = begin; rg < end; ++rg) {
      const int64_t r = rg / K, g = rg % K, n = lens[r];
      const int64_t* table = tables + r * W;
      auto slot = [&](int64_t l) { return ((table[l / BS] * BS + l % BS) * K + g) * D; };
      scores.resize(rep * n);
      for (int64_t l = 0; l < n; ++l) {  // the group's rep query heads share each key read
        const float* k = kd + slot(l);
        for (int64_t j = 0; j < rep; ++j) scores[j * n + l] = dot(qd + (r * H + g * rep + j) * D, k, D) * fscale;
      }
      for (int64_t j = 0; j < rep; ++j) {
        float* s = scores.data() + j * n;
        float m = s[0];
        for (int64_t l = 1; l < n; ++l) m = std::max(m, s[l]);
        for (int64_t l = 0; l < n; ++l) s[l] = fast_exp(s[l] - m);
        float sum = 0.f;
        for (int64_t l = 0; l < n; ++l) sum += s[l];
        const float inv = 1.0f / sum;
        float* o = od + r * H * D + (g * rep + j) * D;
        for (int64_t l = 0; l < n; ++l) {
          const float* v = vd + slot(l);
          const float p = s[l] * inv;
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, rms_norm(x + residual) * weight)");
  m.def("rope_", &rope_, "rotate the first heads of qkv in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("paged_decode_attention", &paged_decode_attention, "one query per row over its paged keys");
}
