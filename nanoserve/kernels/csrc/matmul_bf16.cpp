// x @ w.T for a bf16 matrix stored [in, out], on a CPU whose torch has no bf16 product of its own worth the name
// (AVX2: nanoserve/model/matmul.py's "widen" road).
//
// out[r, j] = the sum over i, in order, of x[r, i] * w[i, j]: x rounded to bf16 first, so each product is of two
// 8-bit mantissas and exact in fp32, the running sum in fp32, the result rounded to bf16. Because the product is
// exact, a fused multiply-add rounds exactly as a multiply then an add: AVX2's FMA and the portable loop give the
// same bits. A row's sums never meet another row's, so its bits do not depend on which rows share the call or how
// many: batching cannot change them. The weight streams as bf16, half fp32's bytes, and is widened in registers.
//
// A task takes a panel of PANEL columns: it copies the panel's K pieces of 128 bytes, which lie N * 2 bytes apart
// (often more than a page, where the hardware's prefetchers stop, and on so few cache sets that they evict each
// other), into a scratch of its own, tile by tile, and every group of rows then reads that from the cache. With
// few rows the copy stays bf16 and each group widens it in registers; with WIDE_ROWS or more, the copy is widened
// to fp32 once, so that the many groups' inner loops are loads and FMAs only. Widening is exact: the same bits.
#include "nanoserve.h"

#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;   // columns a register tile holds: two 8-float vectors per row
constexpr int64_t PANEL = 64;  // columns a task takes: 128 bytes of each weight row
constexpr int ROWS = 6;        // rows of x a register tile holds: 12 sums, 2 weights, 1 broadcast in 16 registers
constexpr int64_t AHEAD = 16;  // weight rows ahead of the one being copied that memory is asked for
constexpr int64_t WIDE_ROWS = 48;  // rows from which the panel is widened once, in the copy

// The panel's columns j0..j0 + width of w's K rows, tile by tile: tile t's K rows of TILE numbers consecutive;
// as bf16 (P uint16_t) or widened to fp32 (P float).
template <typename P>
void copy_panel(const uint16_t* w, int64_t K, int64_t N, int64_t j0, int64_t width, P* panel) {
  const uint16_t* wi = w + j0;
  for (int64_t i = 0; i < K; ++i, wi += N) {
    __builtin_prefetch(wi + AHEAD * N);
    __builtin_prefetch(wi + AHEAD * N + PANEL - 1);
    for (int64_t t = 0; t * TILE < width; ++t) {
      if constexpr (sizeof(P) == 2) {
        std::memcpy(panel + (t * K + i) * TILE, wi + t * TILE, TILE * 2);
      } else {
        for (int64_t l = 0; l < TILE; ++l) panel[(t * K + i) * TILE + l] = widen(wi[t * TILE + l]);
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

inline void store(__m256 lo, __m256 hi, uint16_t* out) {
  alignas(32) float sums[TILE];
  _mm256_store_ps(sums, lo);
  _mm256_store_ps(sums + 8, hi);
  for (int l = 0; l < TILE; ++l) out[l] = narrow_bf16(sums[l]);
}

// One row's two sums, written out for each of the tile's rows so that all twelve stay in registers.
#define NANOSERVE_ROW(k)                                 \
  if constexpr (R > k) {                                 \
    const __m256 s = _mm256_broadcast_ss(x + k * K + i); \
    lo##k = _mm256_fmadd_ps(s, a, lo##k);                \
    hi##k = _mm256_fmadd_ps(s, b, hi##k);                \
  }
#define NANOSERVE_STORE(k) \
  if constexpr (R > k) store(lo##k, hi##k, out + k * N);

// R rows of x (K each) times one tile (K rows of TILE weights, consecutive): R x TILE outputs in bf16, rows N apart.
// s * a is exact, so each fused multiply-add rounds once, as a multiply then an add would.
template <int R, typename P>
void tile(const float* x, int64_t K, const P* wt, int64_t N, uint16_t* out) {
  __m256 lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, lo4, hi4, lo5, hi5;
  lo0 = hi0 = lo1 = hi1 = lo2 = hi2 = lo3 = hi3 = lo4 = hi4 = lo5 = hi5 = _mm256_setzero_ps();
  for (int64_t i = 0; i < K; ++i, wt += TILE) {
    const __m256 a = widen8(wt), b = widen8(wt + 8);
    NANOSERVE_ROW(0) NANOSERVE_ROW(1) NANOSERVE_ROW(2) NANOSERVE_ROW(3) NANOSERVE_ROW(4) NANOSERVE_ROW(5)
  }
  NANOSERVE_STORE(0) NANOSERVE_STORE(1) NANOSERVE_STORE(2) NANOSERVE_STORE(3) NANOSERVE_STORE(4) NANOSERVE_STORE(5)
}
#else
// The same sums, a row and a column at a time (the compiler vectorizes what it can).
template <int R, typename P>
void tile(const float* x, int64_t K, const P* wt, int64_t N, uint16_t* out) {
  float sums[R][TILE] = {};
  for (int64_t i = 0; i < K; ++i)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < TILE; ++l) sums[r][l] += x[r * K + i] * widen(wt[i * TILE + l]);
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < TILE; ++l) out[r * N + l] = narrow_bf16(sums[r][l]);
}
#endif

// R rows times every tile of a copied panel.
template <int R, typename P>
void tiles(const float* x, int64_t K, const P* panel, int64_t width, int64_t N, uint16_t* out) {
  for (int64_t t = 0; t * TILE < width; ++t) tile<R>(x, K, panel + t * K * TILE, N, out + t * TILE);
}

// Every row of x times a task's panel, columns j0 .. j0 + width: groups of ROWS, then the rest.
template <typename P>
void panel_rows(const float* xp, int64_t M, int64_t K, const P* panel, int64_t width, int64_t N, uint16_t* op) {
  int64_t r = 0;
  for (; r + ROWS <= M; r += ROWS) tiles<ROWS>(xp + r * K, K, panel, width, N, op + r * N);
  const float* rest = xp + r * K;
  uint16_t* o = op + r * N;
  switch (M - r) {
    case 5: tiles<5>(rest, K, panel, width, N, o); break;
    case 4: tiles<4>(rest, K, panel, width, N, o); break;
    case 3: tiles<3>(rest, K, panel, width, N, o); break;
    case 2: tiles<2>(rest, K, panel, width, N, o); break;
    case 1: tiles<1>(rest, K, panel, width, N, o); break;
    default: break;
  }
}

// The same sums for columns past the last whole tile, one at a time.
void columns(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, int64_t j0, uint16_t* out) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = j0; j < N; ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < K; ++i) s += x[r * K + i] * widen(w[i * N + j]);
      out[r * N + j] = narrow_bf16(s);
    }
}

struct Panel {
  std::vector<uint16_t> weights;  // a task's copy of its panel, bf16
  std::vector<float> wide;        // or widened
};

}  // namespace

// x (M, K) fp32 or bf16, w (N, K) bf16 stored [in, out] (w.t() contiguous) -> (M, N) bf16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: x (M, K) and w (N, K)");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.t().is_contiguous(), "bf16_linear: w bf16, stored [in, out]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const torch::Tensor xr = x.to(torch::kBFloat16).to(torch::kFloat).contiguous();  // x's bf16 numbers
  torch::Tensor out = torch::empty({M, N}, x.options().dtype(torch::kBFloat16));
  const float* xp = xr.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t whole = N / TILE * TILE, panels = (whole + PANEL - 1) / PANEL;
  for_each_task<Panel>(panels, [&](int64_t p, Panel& scratch) {
    const int64_t j0 = p * PANEL, width = std::min(PANEL, whole - j0);
    if (M >= WIDE_ROWS) {
      scratch.wide.resize(K * PANEL);
      copy_panel(wp, K, N, j0, width, scratch.wide.data());
      panel_rows(xp, M, K, scratch.wide.data(), width, N, op + j0);
    } else {
      scratch.weights.resize(K * PANEL);
      copy_panel(wp, K, N, j0, width, scratch.weights.data());
      panel_rows(xp, M, K, scratch.weights.data(), width, N, op + j0);
    }
  });
  if (whole < N) columns(xp, M, K, wp, N, whole, op);
  return out;
}
