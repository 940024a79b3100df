// A whole prompt's causal attention in bf16 (Day 42): the model's bf16 format carried into attention's products.
//
// q, k and v are rounded to bf16; AVX512_BF16's vdpbf16ps sums pairs of bf16 products into fp32 lanes, so the
// scores q.k are fp32 sums of exact products (then scaled in fp32); the softmax runs in fp32; its weights are
// rounded to bf16 for the value sums, which are fp32 again. The loop is flash attention's: a task takes MR query
// rows of one head through their keys in chunks of KC, keeping each row's running max, sum and output, so no T x T
// matrix is written; the sum divides the same rounded weights the values were summed with.
//
// Layouts, packed once per call so every inner loop reads consecutive memory:
//   q  [head][row][D]            bf16, D consecutive dims (read two at a time, broadcast to every lane)
//   k  [kv head][block][D/2][KB] pairs of dims (2i, 2i+1) of KB keys: one register holds a dim pair of KB keys
//   v  [kv head][key/2][D]       pairs of keys (2j, 2j+1) of each dim: one register holds 16 dims of a key pair
#include "nanoserve.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NANOSERVE_BF16_X86 1
#endif

namespace {

constexpr int64_t MR = 8;   // query rows per task, all of one head
constexpr int64_t KB = 16;  // keys per register of scores
constexpr int64_t KC = 64;  // keys per softmax update

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct Packed {
  std::vector<uint16_t> q;  // [H][Tq][D]
  std::vector<uint16_t> k;  // [K][Tk / KB][D / 2][KB][2]
  std::vector<uint16_t> v;  // [K][Tk / 2][D][2]
  int64_t T, Tq, Tk, H, K, D;
};

Packed pack(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  Packed p;
  p.T = q.size(0), p.H = q.size(1), p.K = k.size(1), p.D = q.size(2);
  p.Tq = round_up(p.T, MR), p.Tk = round_up(p.T, KC);
  const int64_t T = p.T, H = p.H, K = p.K, D = p.D, Tq = p.Tq, Tk = p.Tk;
  p.q.assign(H * Tq * D, 0), p.k.assign(K * Tk * D, 0), p.v.assign(K * Tk * D, 0);
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const int64_t qt = q.stride(0), qh = q.stride(1), kt = k.stride(0), kh = k.stride(1), vt = v.stride(0),
                vh = v.stride(1);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) p.q[(h * Tq + t) * D + d] = narrow_bf16(qd[t * qt + h * qh + d]);
      for (int64_t g = 0; g < K; ++g)
        for (int64_t d = 0; d < D; ++d) {
          p.k[(((g * (Tk / KB) + t / KB) * (D / 2) + d / 2) * KB + t % KB) * 2 + d % 2] =
              narrow_bf16(kd[t * kt + g * kh + d]);
          p.v[((g * (Tk / 2) + t / 2) * D + d) * 2 + t % 2] = narrow_bf16(vd[t * vt + g * vh + d]);
        }
    }
  });
  return p;
}

#ifdef NANOSERVE_BF16_X86
#define BF16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// e^x lane by lane (Cephes' expf polynomial, as kernels.cpp's fast_exp), exactly 0 below -87.3 (so a masked
// score of -inf gives a weight of 0).
BF16_TARGET inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(bits));
}

// MR query rows t0.. of one head (q: their packed rows) over keys 0..t0+MR-1 of its kv head (k, v packed); writes
// each real row's D outputs to out + row * ld.
template <int D>
BF16_TARGET void rows_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t t0, int64_t T,
                           float scale, float* out, int64_t ld) {
  constexpr int D2 = D / 2, DV = D / 16, RG = 16 / DV;  // dim pairs; registers per output row; rows per group
  const int64_t rows = std::min(MR, T - t0), last = t0 + rows - 1;  // the last key any real row sees
  const uint32_t* q2 = reinterpret_cast<const uint32_t*>(q);
  const uint32_t* k2 = reinterpret_cast<const uint32_t*>(k);
  const uint32_t* v2 = reinterpret_cast<const uint32_t*>(v);
  alignas(64) float s[MR][KC];
  alignas(64) uint16_t w[MR][KC];
  alignas(64) float acc[MR][D] = {};
  float m[MR], l[MR] = {}, alpha[MR];
  std::fill(m, m + MR, -std::numeric_limits<float>::infinity());
  for (int64_t c0 = 0; c0 <= last; c0 += KC) {
    const int64_t nk = round_up(std::min(KC, last + 1 - c0), KB);  // keys of this chunk computed
    for (int64_t b = 0; b < nk; b += KB) {  // scores: MR rows x KB keys, one dim pair per step
      __m512 a[MR];
      for (int i = 0; i < MR; ++i) a[i] = _mm512_setzero_ps();
      const uint32_t* kb = k2 + (c0 + b) / KB * D2 * KB;
      for (int j = 0; j < D2; ++j) {
        const __m512bh kj = (__m512bh)_mm512_loadu_si512(kb + j * KB);
        for (int i = 0; i < MR; ++i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(q2[i * D2 + j]), kj);
      }
      for (int i = 0; i < MR; ++i) {  // row t0 + i sees keys up to itself
        const int64_t seen = t0 + i - (c0 + b) + 1;
        const __mmask16 vis = seen >= KB ? 0xffff : seen <= 0 ? 0 : static_cast<__mmask16>((1u << seen) - 1);
        _mm512_store_ps(s[i] + b, _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), vis, a[i], _mm512_set1_ps(scale)));
      }
    }
    for (int i = 0; i < MR; ++i) {  // the softmax's running max and sum; weights rounded to bf16
      __m512 mx = _mm512_set1_ps(m[i]);
      for (int64_t b = 0; b < nk; b += KB) mx = _mm512_max_ps(mx, _mm512_load_ps(s[i] + b));
      const float mnew = _mm512_reduce_max_ps(mx);  // finite: key 0 is in every row's first chunk
      alpha[i] = std::exp(m[i] - mnew);
      m[i] = mnew;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t b = 0; b < nk; b += KB) {
        const __m256bh wb = _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(_mm512_load_ps(s[i] + b), _mm512_set1_ps(mnew))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w[i] + b), (__m256i)wb);
        sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(wb));
      }
      l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    }
    const uint32_t* vc = v2 + c0 / 2 * D;
    for (int g = 0; g < MR; g += RG) {  // values: RG rows x D dims, one key pair per step
      __m512 o[RG][DV];
      for (int r = 0; r < RG; ++r)
        for (int d = 0; d < DV; ++d)
          o[r][d] = _mm512_mul_ps(_mm512_load_ps(acc[g + r] + 16 * d), _mm512_set1_ps(alpha[g + r]));
      for (int64_t j = 0; j < nk / 2; ++j) {
        __m512bh vj[DV];
        for (int d = 0; d < DV; ++d) vj[d] = (__m512bh)_mm512_loadu_si512(vc + j * D + 16 * d);
        for (int r = 0; r < RG; ++r) {
          const __m512bh wr = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const uint32_t*>(w[g + r])[j]);
          for (int d = 0; d < DV; ++d) o[r][d] = _mm512_dpbf16_ps(o[r][d], wr, vj[d]);
        }
      }
      for (int r = 0; r < RG; ++r)
        for (int d = 0; d < DV; ++d) _mm512_store_ps(acc[g + r] + 16 * d, o[r][d]);
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int d = 0; d < D; ++d) out[(t0 + i) * ld + d] = acc[i][d] / l[i];
}
#endif

}  // namespace

bool prompt_attention_bf16_here() {
#ifdef NANOSERVE_BF16_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

torch::Tensor prompt_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(prompt_attention_bf16_here(), "prompt_attention_bf16: this CPU has no AVX512_BF16");
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->dim() == 3 && t->stride(2) == 1,
                name, ": expected a float32 CPU tensor (T, heads, D) with consecutive dims, got ", t->sizes());
  const int64_t T = q.size(0), H = q.size(1), K = k.size(1), D = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D && K > 0 && H % K == 0,
              "k/v: expected (", T, ", K, ", D, ") with K dividing ", H, " query heads, got ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(D == 64 || D == 128, "head_dim ", D, ": this kernel takes 64 or 128");
  auto out = torch::empty({T, H * D}, q.options());
  if (T == 0) return out;
  const Packed p = pack(q, k, v);
#ifdef NANOSERVE_BF16_X86
  const int64_t tiles = p.Tq / MR, n = tiles * H;
  float* o = out.data_ptr<float>();
  // The longest tiles (the last rows, which see the most keys) first, handed out one at a time.
  for_each_task<int>(n, [&](int64_t task, int&) {
    const int64_t tile = tiles - 1 - task / H, h = task % H, g = h / (H / K), t0 = tile * MR;
    const uint16_t* qh = p.q.data() + (h * p.Tq + t0) * D;
    const uint16_t* kg = p.k.data() + g * p.Tk * D;
    const uint16_t* vg = p.v.data() + g * p.Tk * D;
    if (D == 64)
      rows_bf16<64>(qh, kg, vg, t0, T, scale, o + h * D, H * D);
    else
      rows_bf16<128>(qh, kg, vg, t0, T, scale, o + h * D, H * D);
  });
#endif
  return out;
}
