// x @ w.T for an fp32 matrix (nanoserve/model/matmul.py's "tiles" road, on x86 CPUs), with one summation order
// for every row count.
//
// out[r, j] = the sum over slices of SLICE inputs, in order, of each slice's in-order fused multiply-add
// chain: p_s = fma(x[r, i], w[i, j], ...) for i in the slice, from 0; out = ((p_0 + p_1) + p_2) + ... A row's
// sums never meet another row's and their order never depends on how many rows share the call, so a row gets
// the same bits alone as in a batch of 300: batch invariance by construction, with no rows added. The slices
// keep each chain short, which rounds about four times less than one chain over all the inputs.
//
// w is read from a copy in tiles (`pack_fp32`): the weights of TILE consecutive outputs, K rows of TILE
// numbers, one contiguous stretch. One row of x then streams each tile front to back (memory-bound, as a
// decode step is); many rows take the tiles one at a time (AVX2) or two at a time (AVX-512, whose vector is one
// tile), and every group of rows reads them from the cache. A tile of the copy past w's last output holds zeros.
#include "nanoserve.h"

#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;   // outputs a tile holds: two 8-float vectors
constexpr int64_t SLICE = 64;  // inputs one chain of sums runs over
constexpr int ROWS = 6;        // rows of x a register tile holds for many rows: 12 sums in 16 registers
constexpr int64_t TASKS_PER_THREAD = 4;  // tile runs per thread: even ends when a core is shared

#if defined(__AVX2__) && defined(__FMA__)
// R rows of x times T consecutive tiles: 2 * R * T <= 12 sums in registers, written out as named values
// (the compiler keeps an array of them in memory). Sum k = 2 * (r * T + t) + half.
#define NS_SUM(k) __m256 s##k = _mm256_setzero_ps();
#define NS_FMA(r, t)                                                                                       \
  if constexpr (R > r && T > t) {                                                                          \
    constexpr int k = 2 * (r * T + t);                                                                     \
    const __m256 b = _mm256_broadcast_ss(x + r * K + i);                                                   \
    const __m256 lo = t == 0 ? w0 : t == 1 ? w2 : t == 2 ? w4 : w6;                                        \
    const __m256 hi = t == 0 ? w1 : t == 1 ? w3 : t == 2 ? w5 : w7;                                        \
    if constexpr (k == 0) { s0 = _mm256_fmadd_ps(b, lo, s0); s1 = _mm256_fmadd_ps(b, hi, s1); }          \
    if constexpr (k == 2) { s2 = _mm256_fmadd_ps(b, lo, s2); s3 = _mm256_fmadd_ps(b, hi, s3); }          \
    if constexpr (k == 4) { s4 = _mm256_fmadd_ps(b, lo, s4); s5 = _mm256_fmadd_ps(b, hi, s5); }          \
    if constexpr (k == 6) { s6 = _mm256_fmadd_ps(b, lo, s6); s7 = _mm256_fmadd_ps(b, hi, s7); }          \
    if constexpr (k == 8) { s8 = _mm256_fmadd_ps(b, lo, s8); s9 = _mm256_fmadd_ps(b, hi, s9); }          \
    if constexpr (k == 10) { s10 = _mm256_fmadd_ps(b, lo, s10); s11 = _mm256_fmadd_ps(b, hi, s11); }     \
  }
#define NS_ADD(r, t)                                                                                       \
  if constexpr (R > r && T > t) {                                                                          \
    constexpr int k = 2 * (r * T + t);                                                                     \
    const __m256 lo = k == 0 ? s0 : k == 2 ? s2 : k == 4 ? s4 : k == 6 ? s6 : k == 8 ? s8 : s10;           \
    const __m256 hi = k == 0 ? s1 : k == 2 ? s3 : k == 4 ? s5 : k == 6 ? s7 : k == 8 ? s9 : s11;           \
    float* o = out + r * N + t * TILE;                                                                     \
    if (first) {                                                                                           \
      _mm256_storeu_ps(o, lo);                                                                             \
      _mm256_storeu_ps(o + 8, hi);                                                                         \
    } else {                                                                                               \
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), lo));                                          \
      _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), hi));                                  \
    }                                                                                                      \
  }

// Rows x[0..R) (K apart) times tiles wt[0..T) (K * TILE apart) into out (rows N apart, TILE * T columns).
template <int R, int T>
void micro(const float* x, int64_t K, const float* wt, int64_t N, float* out) {
  static_assert(R * T <= 6 && T <= 4, "at most 12 sums and 4 tiles");
  for (int64_t i0 = 0; i0 < K; i0 += SLICE) {
    const bool first = i0 == 0;
    NS_SUM(0) NS_SUM(1) NS_SUM(2) NS_SUM(3) NS_SUM(4) NS_SUM(5) NS_SUM(6) NS_SUM(7) NS_SUM(8) NS_SUM(9)
    NS_SUM(10) NS_SUM(11)
    for (int64_t i = i0, i1 = std::min(K, i0 + SLICE); i < i1; ++i) {
      const float* p = wt + i * TILE;
      const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
      __m256 w2 = w0, w3 = w1, w4 = w0, w5 = w1, w6 = w0, w7 = w1;
      if constexpr (T > 1) w2 = _mm256_loadu_ps(p + K * TILE), w3 = _mm256_loadu_ps(p + K * TILE + 8);
      if constexpr (T > 2) w4 = _mm256_loadu_ps(p + 2 * K * TILE), w5 = _mm256_loadu_ps(p + 2 * K * TILE + 8);
      if constexpr (T > 3) w6 = _mm256_loadu_ps(p + 3 * K * TILE), w7 = _mm256_loadu_ps(p + 3 * K * TILE + 8);
      NS_FMA(0, 0) NS_FMA(0, 1) NS_FMA(0, 2) NS_FMA(0, 3) NS_FMA(1, 0) NS_FMA(1, 1) NS_FMA(1, 2)
      NS_FMA(2, 0) NS_FMA(2, 1) NS_FMA(3, 0) NS_FMA(4, 0) NS_FMA(5, 0)
    }
    NS_ADD(0, 0) NS_ADD(0, 1) NS_ADD(0, 2) NS_ADD(0, 3) NS_ADD(1, 0) NS_ADD(1, 1) NS_ADD(1, 2)
    NS_ADD(2, 0) NS_ADD(2, 1) NS_ADD(3, 0) NS_ADD(4, 0) NS_ADD(5, 0)
  }
}
#else
// The same sums, one output at a time: std::fma rounds once, as the vector FMA does, so the bits agree.
template <int R, int T>
void micro(const float* x, int64_t K, const float* wt, int64_t N, float* out) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < T * TILE; ++j) {
      const float* w = wt + (j / TILE) * K * TILE + j % TILE;
      float total = 0.0f;
      for (int64_t i0 = 0; i0 < K; i0 += SLICE) {
        float s = 0.0f;
        for (int64_t i = i0, i1 = std::min(K, i0 + SLICE); i < i1; ++i) s = std::fma(x[r * K + i], w[i * TILE], s);
        total = i0 == 0 ? s : total + s;
      }
      out[r * N + j] = total;
    }
}
#endif

#if defined(__AVX512F__)
// AVX-512: a tile is one 16-float vector, so R rows times T tiles hold R * T sums (up to 24 of 32 registers).
// Each lane takes the same fused multiply-adds in the same order as above: the same bits.
template <int R, int T>
void micro16(const float* x, int64_t K, const float* wt, int64_t N, float* out, const float* next = nullptr) {
  static_assert(R * T <= 24, "at most 24 sums");
  for (int64_t i0 = 0; i0 < K; i0 += SLICE) {
    __m512 s[R][T];
#pragma GCC unroll 24
    for (int k = 0; k < R * T; ++k) s[k / T][k % T] = _mm512_setzero_ps();
    for (int64_t i = i0, i1 = std::min(K, i0 + SLICE); i < i1; ++i) {
      __m512 w[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) w[t] = _mm512_loadu_ps(wt + t * K * TILE + i * TILE);
      if (next != nullptr)  // the next tiles, asked for from memory while these are computed on
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t)
          _mm_prefetch(reinterpret_cast<const char*>(next + t * K * TILE + i * TILE), _MM_HINT_T1);
#pragma GCC unroll 24
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(x[r * K + i]);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) s[r][t] = _mm512_fmadd_ps(b, w[t], s[r][t]);
      }
    }
#pragma GCC unroll 24
    for (int k = 0; k < R * T; ++k) {
      float* o = out + (k / T) * N + (k % T) * TILE;
      _mm512_storeu_ps(o, i0 == 0 ? s[k / T][k % T] : _mm512_add_ps(_mm512_loadu_ps(o), s[k / T][k % T]));
    }
  }
}
#endif

// R rows times n tiles, T at a time (T independent chains per row keep the FMA units busy at one row).
template <int R, int T>
void row_tiles(const float* x, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  int64_t t = 0;
  for (; t + T <= n; t += T) micro<R, T>(x, K, wt + t * K * TILE, N, out + t * TILE);
  for (; t < n; ++t) micro<R, 1>(x, K, wt + t * K * TILE, N, out + t * TILE);
}

#if defined(__AVX512F__)
template <int R, int T>
void row_tiles16(const float* x, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  int64_t t = 0;
  for (; t + T <= n; t += T) micro16<R, T>(x, K, wt + t * K * TILE, N, out + t * TILE);
  for (; t < n; ++t) micro16<R, 1>(x, K, wt + t * K * TILE, N, out + t * TILE);
}

constexpr int MANY = 12;  // rows of x a register tile holds for many rows: 12 rows times 2 tiles

// Up to MANY - 1 rows times n tiles, at most T at a time and 24 sums (one row: the AVX2 loop's four streams, which
// keep the memory busy).
template <int T>
void rows16(const float* x, int64_t M, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  with_rows<MANY - 1>(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if constexpr (R == 1) row_tiles<1, 4>(x, K, wt, n, N, out);
    else row_tiles16<R, std::min(T, 24 / R)>(x, K, wt, n, N, out);
  });
}

void few_rows(const float* x, int64_t M, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  rows16<4>(x, M, K, wt, n, N, out);
}

// Every row times n tiles, two at a time: each group of MANY rows, then the rows left over, reads the pair from
// the cache. The first group asks for the next pair from memory as it goes, so that no group waits for its tiles.
void many_rows(const float* x, int64_t M, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  for (int64_t t = 0; t < n; t += 2) {
    const float *pair = wt + t * K * TILE, *next = t + 2 < n ? pair + 2 * K * TILE : nullptr;
    const bool two = t + 1 < n;
    int64_t r = 0;
    for (; r + MANY <= M; r += MANY) {
      if (two) micro16<MANY, 2>(x + r * K, K, pair, N, out + r * N + t * TILE, r == 0 ? next : nullptr);
      else micro16<MANY, 1>(x + r * K, K, pair, N, out + r * N + t * TILE);
    }
    rows16<2>(x + r * K, M - r, K, pair, two ? 2 : 1, N, out + r * N + t * TILE);
  }
}
#else
constexpr int MANY = ROWS;

// Up to ROWS - 1 rows times n tiles.
void few_rows(const float* x, int64_t M, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  switch (M) {
    case 5: row_tiles<5, 1>(x, K, wt, n, N, out); break;
    case 4: row_tiles<4, 1>(x, K, wt, n, N, out); break;
    case 3: row_tiles<3, 2>(x, K, wt, n, N, out); break;
    case 2: row_tiles<2, 3>(x, K, wt, n, N, out); break;
    case 1: row_tiles<1, 4>(x, K, wt, n, N, out); break;
    default: break;
  }
}

// Every row times n tiles: tile by tile, each group of ROWS rows reading the tile from the cache.
void many_rows(const float* x, int64_t M, int64_t K, const float* wt, int64_t n, int64_t N, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    int64_t r = 0;
    for (; r + ROWS <= M; r += ROWS) micro<ROWS, 1>(x + r * K, K, wt + t * K * TILE, N, out + r * N + t * TILE);
    few_rows(x + r * K, M - r, K, wt + t * K * TILE, 1, N, out + r * N + t * TILE);
  }
}
#endif

}  // namespace

// w (N, K) fp32 -> its tiles (ceil(N / TILE), K, TILE), the last padded with zero outputs.
torch::Tensor pack_fp32(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat, "pack_fp32: w (N, K) fp32");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE;
  torch::Tensor padded = torch::zeros({tiles * TILE, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({tiles, TILE, K}).transpose(1, 2).contiguous();
}

// x (M, K) fp32 times w's tiles -> (M, N) fp32.
torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor tiles, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "fp32_linear: x (M, K) fp32");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kFloat && tiles.is_contiguous() &&
                  tiles.size(1) == x.size(1) && tiles.size(2) == TILE && tiles.size(0) == (N + TILE - 1) / TILE,
              "fp32_linear: tiles (ceil(N / 16), K, 16) from pack_fp32 for x's K inputs");
  const int64_t M = x.size(0), K = x.size(1), nt = tiles.size(0), width = nt * TILE;
  const torch::Tensor xr = x.contiguous();
  torch::Tensor out = K == 0 ? torch::zeros({M, width}, x.options()) : torch::empty({M, width}, x.options());
  if (M == 0 || K == 0 || nt == 0) return out.narrow(1, 0, N).contiguous();
  fp32_product(tiles.data_ptr<float>(), nt, K, xr.data_ptr<float>(), M, out.data_ptr<float>());
  return width == N ? out : out.narrow(1, 0, N).contiguous();
}

// fp32_linear on raw numbers (step.cpp): x (M, K) times nt tiles -> out (M, nt * TILE).
void fp32_product(const float* tiles, int64_t nt, int64_t K, const float* x, int64_t M, float* out, Team* team) {
  const int64_t want = (team ? team->size : at::get_num_threads()) * TASKS_PER_THREAD, width = nt * TILE;
  const int64_t per = ((nt + want - 1) / want + 3) / 4 * 4;  // tiles a task takes, a multiple of one row's 4
  for_each_task<int>(team, (nt + per - 1) / per, [&](int64_t task, int&) {
    const int64_t t0 = task * per, n = std::min(per, nt - t0);
    if (M < MANY) few_rows(x, M, K, tiles + t0 * K * TILE, n, width, out + t0 * TILE);
    else many_rows(x, M, K, tiles + t0 * K * TILE, n, width, out + t0 * TILE);
  });
}
