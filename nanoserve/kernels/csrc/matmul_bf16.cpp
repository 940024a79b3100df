// x @ w.T for a bf16 matrix: on a CPU with AVX512_BF16, from a tiled copy on its pair products (the "tiles" road of
// nanoserve/model/matmul.py, at the end of this file); first, stored [in, out], on a CPU whose torch has no bf16
// product of its own worth the name (AVX2: the "widen" road).
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

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>  // (AVX512_BF16's and AMX's intrinsics too, used under target attributes)
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
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
#define NANOSERVE_ROW(k)                                  \
  if constexpr (R > k) {                                  \
    const __m256 s = _mm256_set1_ps(widen(x[k * K + i])); \
    lo##k = _mm256_fmadd_ps(s, a, lo##k);                 \
    hi##k = _mm256_fmadd_ps(s, b, hi##k);                 \
  }
#define NANOSERVE_STORE(k) \
  if constexpr (R > k) store(lo##k, hi##k, out + k * N);

// R rows of x (K each, bf16 numbers held as fp32 or as bf16) times one tile (K rows of TILE weights, consecutive):
// R x TILE outputs in bf16, rows N apart. s * a is exact, so each fused multiply-add rounds once, as a multiply then
// an add would.
template <int R, typename P, typename X>
void tile(const X* x, int64_t K, const P* wt, int64_t N, uint16_t* out) {
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
template <int R, typename P, typename X>
void tile(const X* x, int64_t K, const P* wt, int64_t N, uint16_t* out) {
  float sums[R][TILE] = {};
  for (int64_t i = 0; i < K; ++i)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < TILE; ++l) sums[r][l] += widen(x[r * K + i]) * widen(wt[i * TILE + l]);
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < TILE; ++l) out[r * N + l] = narrow_bf16(sums[r][l]);
}
#endif

// R rows times every tile of a copied panel.
template <int R, typename P, typename X>
void tiles(const X* x, int64_t K, const P* panel, int64_t width, int64_t N, uint16_t* out) {
  for (int64_t t = 0; t * TILE < width; ++t) tile<R>(x, K, panel + t * K * TILE, N, out + t * TILE);
}

// Every row of x times a task's panel, columns j0 .. j0 + width: groups of ROWS, then the rest.
template <typename P, typename X>
void panel_rows(const X* xp, int64_t M, int64_t K, const P* panel, int64_t width, int64_t N, uint16_t* op) {
  int64_t r = 0;
  for (; r + ROWS <= M; r += ROWS) tiles<ROWS>(xp + r * K, K, panel, width, N, op + r * N);
  const X* rest = xp + r * K;
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

// w (N, K) bf16, N a multiple of TILE -> its panels (N / TILE, K, TILE) bf16: tile t's K rows of TILE outputs
// consecutive, the layout copy_panel makes per task. Packed once at load, a task's panel is one contiguous stretch
// that the hardware's prefetchers follow, where the [in, out] matrix hands it pieces of 128 bytes N * 2 bytes apart.
torch::Tensor pack_bf16_panels(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(0) % TILE == 0,
              "pack_bf16_panels: w (N, K) bf16 with N a multiple of 16");
  return w.view({w.size(0) / TILE, TILE, w.size(1)}).transpose(1, 2).contiguous();
}

namespace {

// bf16_panels_linear on raw numbers (step.cpp too): x (M, K) bf16 numbers, held as fp32 or as bf16, times the panels
// of N outputs -> out (M, N) bf16. A task takes PANEL columns: with WIDE_ROWS rows or more, its panel widened once.
template <typename X>
void panels_product(const uint16_t* wp, int64_t N, int64_t K, const X* xp, int64_t M, uint16_t* op, Team* team) {
  for_each_task<std::vector<float>>(team, (N + PANEL - 1) / PANEL, [&](int64_t p, std::vector<float>& wide) {
    const int64_t j0 = p * PANEL, width = std::min(PANEL, N - j0);
    const uint16_t* panel = wp + j0 * K;  // the tiles j0 / TILE .. of K x TILE numbers each
    if (M >= WIDE_ROWS) {
      wide.resize(K * PANEL);
      for (int64_t e = 0; e < width * K; ++e) wide[e] = widen(panel[e]);
      panel_rows(xp, M, K, wide.data(), width, N, op + j0);
    } else {
      panel_rows(xp, M, K, panel, width, N, op + j0);
    }
  });
}

}  // namespace

void bf16_panels_product(const uint16_t* panels, int64_t N, int64_t K, const uint16_t* x, int64_t M, uint16_t* out,
                         Team* team) {
  panels_product(panels, N, K, x, M, out, team);
}

// bf16_linear's sums, in the same order (the same bits), with w read from its panels (pack_bf16_panels).
torch::Tensor bf16_panels_linear(torch::Tensor x, torch::Tensor panels) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kBFloat16 && panels.is_contiguous() &&
                  panels.size(2) == TILE,
              "bf16_panels_linear: panels (N / 16, K, 16) bf16 from pack_bf16_panels");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == panels.size(1), "bf16_panels_linear: x (M, K) for panels of K inputs");
  const int64_t M = x.size(0), K = x.size(1), N = panels.size(0) * TILE;
  const torch::Tensor xb = x.to(torch::kBFloat16).contiguous();  // x's bf16 numbers, read as they are
  torch::Tensor out = torch::empty({M, N}, x.options().dtype(torch::kBFloat16));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  panels_product(wp, N, K, xp, M, op, nullptr);
  return out;
}

// On a CPU with AVX512_BF16 (nanoserve/model/matmul.py's "tiles" road for bf16 matrices): w read from a copy in
// tiles (`pack_bf16`), the weights of TILE consecutive outputs for K / 2 pairs of inputs, a pair's two weights
// side by side, so that one 64-byte load holds a pair of inputs for 16 outputs. AVX512_BF16's vdpbf16ps adds a
// pair of exact bf16 products into each fp32 lane: out[r, j] = the fp32 chain over the pairs, in order, of x's
// and w's bf16 numbers, rounded to bf16. A row's chain never depends on which rows share the call or how many,
// so batching cannot change its bits; the layout and the loops are matmul_fp32.cpp's AVX-512 ones, with twice
// the products per instruction and half the bytes per weight.
namespace {

#if defined(__x86_64__) || defined(_M_X64)
#define NANOSERVE_TILES_BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
constexpr int PAIR_MANY = 12;  // rows of x a register tile holds for many rows: 12 rows times 2 tiles
constexpr int64_t PAIR_TASKS_PER_THREAD = 4;

// Rows x[0..R) (P pairs apart) times tiles wt[0..T) (P * TILE pairs apart) into out (bf16, rows N apart). `next`:
// tiles to ask memory for while these are computed on.
template <int R, int T>
NANOSERVE_TILES_BF16 void pair_micro(const uint32_t* x, int64_t P, const uint32_t* wt, int64_t N, uint16_t* out,
                                     const uint32_t* next = nullptr) {
  static_assert(R * T <= 24, "at most 24 sums");
  __m512 s[R][T];
#pragma GCC unroll 24
  for (int k = 0; k < R * T; ++k) s[k / T][k % T] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh w[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) w[t] = (__m512bh)_mm512_loadu_si512(wt + t * P * TILE + p * TILE);
    if (next != nullptr)
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(next + t * P * TILE + p * TILE), _MM_HINT_T1);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * P + p]));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) s[r][t] = _mm512_dpbf16_ps(s[r][t], b, w[t]);
    }
  }
#pragma GCC unroll 24
  for (int k = 0; k < R * T; ++k)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (k / T) * N + (k % T) * TILE),
                        (__m256i)_mm512_cvtneps_pbh(s[k / T][k % T]));
}

template <int R, int T>
NANOSERVE_TILES_BF16 void pair_tiles(const uint32_t* x, int64_t P, const uint32_t* wt, int64_t n, int64_t N,
                                     uint16_t* out) {
  int64_t t = 0;
  for (; t + T <= n; t += T) pair_micro<R, T>(x, P, wt + t * P * TILE, N, out + t * TILE);
  for (; t < n; ++t) pair_micro<R, 1>(x, P, wt + t * P * TILE, N, out + t * TILE);
}

// Up to PAIR_MANY - 1 rows times n tiles, at most T at a time and 24 sums (one row: four).
template <int T>
NANOSERVE_TILES_BF16 void pair_rows(const uint32_t* x, int64_t M, int64_t P, const uint32_t* wt, int64_t n,
                                    int64_t N, uint16_t* out) {
  with_rows<PAIR_MANY - 1>(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    pair_tiles<R, R == 1 ? 4 : std::min(T, 24 / R)>(x, P, wt, n, N, out);
  });
}

// Every row times n tiles, two at a time: each group of PAIR_MANY rows, then the rest, reads the pair of tiles
// from the cache; the first group asks for the next pair from memory as it goes.
NANOSERVE_TILES_BF16 void pair_many(const uint32_t* x, int64_t M, int64_t P, const uint32_t* wt, int64_t n, int64_t N,
                                    uint16_t* out) {
  for (int64_t t = 0; t < n; t += 2) {
    const uint32_t *two_tiles = wt + t * P * TILE, *next = t + 2 < n ? two_tiles + 2 * P * TILE : nullptr;
    const bool two = t + 1 < n;
    int64_t r = 0;
    for (; r + PAIR_MANY <= M; r += PAIR_MANY) {
      if (two) pair_micro<PAIR_MANY, 2>(x + r * P, P, two_tiles, N, out + r * N + t * TILE, r == 0 ? next : nullptr);
      else pair_micro<PAIR_MANY, 1>(x + r * P, P, two_tiles, N, out + r * N + t * TILE);
    }
    pair_rows<2>(x + r * P, M - r, P, two_tiles, two ? 2 : 1, N, out + r * N + t * TILE);
  }
}

NANOSERVE_TILES_BF16 void pair_task(const uint32_t* x, int64_t M, int64_t P, const uint32_t* wt, int64_t n, int64_t N,
                                    uint16_t* out) {
  if (M < PAIR_MANY) pair_rows<4>(x, M, P, wt, n, N, out);
  else pair_many(x, M, P, wt, n, N, out);
}

// On a CPU with AMX (Intel's tile unit): the same tiles, each 16 pairs of a tile one B tile (16 rows of 64 bytes, as
// they lie), 16 rows of x one A tile, tdpbf16ps adding their products into a 16 x 16 fp32 C tile. The unit computes
// each row of C from that row of A alone, and the chunks of 16 pairs are taken in order, then the pairs past the
// last whole chunk one by one in fp32: a row's bits never depend on which rows share the call, as on the vector
// road, but they are the unit's own (it adds a pair's products in another order), so one CPU takes one unit for
// every row count (`bf16_tiles_units`). Rows come 32 at a time (two A tiles), tiles two at a time (four C tiles);
// the last rows are copied into zeros so that every A tile is whole.
#define NANOSERVE_AMX_BF16 \
  __attribute__((target("amx-tile,amx-bf16,avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
constexpr int64_t AMX_PAIRS = 16;  // pairs a tdpbf16ps takes: 64 bytes of an A row, 16 rows of B

// C tile c's fp32 sums (c[i][l]: row i, column l of tile wt[c]) plus the pairs past the last whole chunk, one by
// one in order, each product exact, rounded to bf16 into out (rows N apart).
NANOSERVE_AMX_BF16 void amx_finish(const float (*c)[16], const uint32_t* x, int64_t rows, int64_t P, int64_t whole,
                                   const uint32_t* wt, int64_t N, uint16_t* out) {
  for (int64_t i = 0; i < rows; ++i) {
    __m512 s = _mm512_load_ps(c[i]);
    for (int64_t p = whole; p < P; ++p) {
      const uint32_t xp = x[i * P + p];
      const __m512i wp = _mm512_loadu_si512(wt + p * TILE);
      s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(widen(static_cast<uint16_t>(xp))),
                                         _mm512_castsi512_ps(_mm512_slli_epi32(wp, 16))));
      s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(widen(static_cast<uint16_t>(xp >> 16))),
                                         _mm512_castsi512_ps(_mm512_and_si512(wp, _mm512_set1_epi32(-65536)))));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * N), (__m256i)_mm512_cvtneps_pbh(s));
  }
}

// Rows of x against n tiles: up to 16 rows, four tiles at a time (four C tiles, one A); more rows, 32 rows and two
// tiles at a time (two A tiles). Either way each sum takes the same chunks in the same order.
NANOSERVE_AMX_BF16 void amx_task(const uint32_t* x, int64_t M, int64_t P, const uint32_t* wt, int64_t n, int64_t N,
                                 uint16_t* out) {
  AmxTiles cfg;  // C 0-3 and A 4-5 of as many rows as x has, up to 16; B 6-7
  const uint8_t held = static_cast<uint8_t>(std::min<int64_t>(16, M));
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = t < 6 ? held : 16;
  load_tiles(cfg);
  const int64_t whole = P / AMX_PAIRS * AMX_PAIRS, last = M / 32 * 32;
  alignas(64) float c[4][16][16];
  if (M <= 16) {
    for (int64_t t = 0; t < n; t += 4) {
      const int64_t here = std::min<int64_t>(4, n - t);
      const uint32_t* w = wt + t * P * TILE;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t p = 0; p < whole; p += AMX_PAIRS) {
        _tile_loadd(4, x + p, P * 4);
        _tile_loadd(6, w + p * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (here > 1) {
          _tile_loadd(7, w + (P + p) * TILE, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (here > 2) {
          _tile_loadd(6, w + (2 * P + p) * TILE, 64);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (here > 3) {
          _tile_loadd(7, w + (3 * P + p) * TILE, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int64_t h = 0; h < here; ++h) amx_finish(c[h], x, M, P, whole, w + h * P * TILE, N, out + (t + h) * TILE);
    }
    _tile_release();
    return;
  }
  thread_local std::vector<uint32_t> pad;  // the last rows (fewer than 32), then zero rows
  if (last < M) {
    pad.assign(32 * P, 0);
    std::memcpy(pad.data(), x + last * P, (M - last) * P * 4);
  }
  for (int64_t t = 0; t < n; t += 2) {
    const bool two = t + 1 < n;
    const uint32_t* w0 = wt + t * P * TILE;
    const uint32_t* w1 = two ? w0 + P * TILE : w0;
    for (int64_t r = 0; r < M; r += 32) {
      const int64_t rows = std::min<int64_t>(32, M - r);
      const uint32_t* xa = r < last ? x + r * P : pad.data();
      const bool low = rows > 16;  // a second A tile
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t p = 0; p < whole; p += AMX_PAIRS) {
        _tile_loadd(4, xa + p, P * 4);
        _tile_loadd(6, w0 + p * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, w1 + p * TILE, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (low) {
          _tile_loadd(5, xa + 16 * P + p, P * 4);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      uint16_t* o = out + r * N + t * TILE;
      amx_finish(c[0], xa, std::min<int64_t>(16, rows), P, whole, w0, N, o);
      if (two) amx_finish(c[1], xa, std::min<int64_t>(16, rows), P, whole, w1, N, o + TILE);
      if (low) {
        amx_finish(c[2], xa + 16 * P, rows - 16, P, whole, w0, N, o + 16 * N);
        if (two) amx_finish(c[3], xa + 16 * P, rows - 16, P, whole, w1, N, o + 16 * N + TILE);
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

// w (N, K) bf16 -> its tiles (ceil(N / TILE), ceil(K / 2), TILE, 2) bf16: zero outputs past N, a zero input past K.
torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_bf16: w (N, K) bf16");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE, P = (K + 1) / 2;
  torch::Tensor padded = torch::zeros({tiles * TILE, 2 * P}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({tiles, TILE, P, 2}).transpose(1, 2).contiguous();
}

// x (M, K) bf16 times w's tiles -> (M, N) bf16 (the CPU must have AVX512_BF16: `prompt_attention_bf16_here`), on
// `unit` ("": this CPU's first, bf16_tiles_units).
torch::Tensor bf16_tiles_linear(torch::Tensor x, torch::Tensor tiles, int64_t N, std::string unit) {
  TORCH_CHECK(prompt_attention_bf16_here(), "bf16_tiles_linear: this CPU has no AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "bf16_tiles_linear: x (M, K) bf16");
  const int64_t M = x.size(0), K = x.size(1), P = (K + 1) / 2;
  TORCH_CHECK(tiles.dim() == 4 && tiles.scalar_type() == torch::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(1) == P && tiles.size(2) == TILE && tiles.size(3) == 2 &&
                  tiles.size(0) == (N + TILE - 1) / TILE,
              "bf16_tiles_linear: tiles (ceil(N / 16), ceil(K / 2), 16, 2) from pack_bf16 for x's K inputs");
  const int64_t nt = tiles.size(0), width = nt * TILE;
  torch::Tensor xr = x.contiguous();
  if (K % 2) xr = torch::constant_pad_nd(xr, {0, 1});  // an odd K: a zero input pairs the last one
  torch::Tensor out = torch::empty({M, width}, x.options());
  if (M == 0 || nt == 0) return out.narrow(1, 0, N).contiguous();
  if (P == 0) return out.zero_().narrow(1, 0, N).contiguous();
  bf16_tiles_product(static_cast<const uint16_t*>(tiles.data_ptr()), nt, P, static_cast<const uint16_t*>(xr.data_ptr()),
                     M, static_cast<uint16_t*>(out.data_ptr()), nullptr, unit);
  return width == N ? out : out.narrow(1, 0, N).contiguous();
}

// Whether Linux lets this process use AMX's tiles (asked once: the tiles' state is enabled per process), on a CPU
// that has them, unless NANOSERVE_AMX=0.
bool amx_tiles_here() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool here = [] {
    const char* env = std::getenv("NANOSERVE_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return false;  // AMX-TILE
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return here;
#else
  return false;
#endif
}

// Whether the bf16 tiles may take AMX's tile unit: AMX-BF16 and its tiles allowed, beside AVX512_BF16 (amx_finish).
bool bf16_amx_here() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool here = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && amx_tiles_here() &&
           prompt_attention_bf16_here();
  }();
  return here;
#else
  return false;
#endif
}

// The units bf16_tiles_product can take here, the one it takes first.
std::vector<std::string> bf16_tiles_units() {
  std::vector<std::string> units;
  if (bf16_amx_here()) units.emplace_back("amx");
  if (prompt_attention_bf16_here()) units.emplace_back("avx512-bf16");
  return units;
}

// bf16_tiles_linear on raw numbers (step.cpp): x (M, 2P) bf16 times nt tiles of P pairs -> out (M, nt * TILE) bf16,
// on `unit` ("amx" or "avx512-bf16"; "" the first of bf16_tiles_units).
void bf16_tiles_product(const uint16_t* tiles, int64_t nt, int64_t P, const uint16_t* x, int64_t M, uint16_t* out,
                        Team* team, const std::string& unit) {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool amx_first = bf16_amx_here();
  const bool amx = unit.empty() ? amx_first : unit == "amx";
  TORCH_CHECK(unit.empty() || unit == "avx512-bf16" || (unit == "amx" && amx_first),
              "bf16 tiles: unit '", unit, "' is not one of this CPU's (bf16_tiles_units)");
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(tiles);
  const int64_t want = (team ? team->size : at::get_num_threads()) * PAIR_TASKS_PER_THREAD, width = nt * TILE;
  const int64_t per = ((nt + want - 1) / want + 3) / 4 * 4;  // tiles a task takes, a multiple of one row's 4
  for_each_task<int>(team, (nt + per - 1) / per, [&](int64_t task, int&) {
    const int64_t t0 = task * per;
    if (amx) amx_task(xp, M, P, wp + t0 * P * TILE, std::min(per, nt - t0), width, out + t0 * TILE);
    else pair_task(xp, M, P, wp + t0 * P * TILE, std::min(per, nt - t0), width, out + t0 * TILE);
  });
#else
  TORCH_CHECK(false, "bf16_tiles_product: the tiles are an x86 road");
#endif
}
