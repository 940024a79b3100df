// The weight product on GGUF's blocks as they lie (nanoserve/kernels/quant.py says why).
//
// A block holds 32 consecutive weights of one row:
//   Q4_1  fp16 d, fp16 m, 16 bytes of nibbles   weight j = d * (qs[j] & 15) + m, weight j + 16 = d * (qs[j] >> 4) + m
//   Q8_0  fp16 d, 32 signed bytes               weight j = d * q[j]
// d * q is exact in fp32 (11 bits times at most 8), so d * q + m rounds once however it is computed:
// the weights expanded here are the very numbers the fp32 conversion holds.
//
// out[b, o] = x[b] . w[o]. Each dot product keeps 32 running sums, one per position in a block (sum j
// takes weight j of every block, in block order, by fused multiply-add), then adds them in a fixed tree.
// AVX-512, AVX2 and the portable loop run that same arithmetic, so they give the same bits, and a row's
// result never depends on the other rows of x: batching cannot change it.
//
// Q5_0, Q4_K and Q6_K (further down) are read as groups of 32 weights and summed the same way. Every format enters
// through one table, KERNELS: its bytes and weights a block, and on each road its product and its expansion.
#include "nanoserve.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;            // weights per block
constexpr int64_t Q4_1_BYTES = 20;    // 2 + 2 + 16
constexpr int64_t Q8_0_BYTES = 34;    // 2 + 32
constexpr int64_t ROWS_PER_TASK = 16; // weight rows one thread takes at a time (their blocks stay in L1)
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
constexpr int64_t PREFETCH = PREFETCH_BYTES;  // how far ahead of the block in use its row's bytes are asked for

enum class Fmt { Q4_1, Q8_0 };

// fp16 -> fp32 as a lookup in a table of all 65536 halves (256 KB, mostly in cache): one load that
// broadcasts straight into a vector register, where a conversion instruction would compete with the
// block's shuffles for the same port.
float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // a subnormal half is a normal float
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while ((m & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct HalfTable {
  float value[65536];
  HalfTable() { for (uint32_t h = 0; h < 65536; ++h) value[h] = half_to_float(static_cast<uint16_t>(h)); }
};
const HalfTable HALVES;

inline const float* fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return &HALVES.value[h];
}

// The 32 sums s[0..31] added in one fixed tree: s[j] + s[j + 16], then halves of what is left.
float reduce32(const float* s) {
  float t[16];
  for (int j = 0; j < 16; ++j) t[j] = s[j] + s[j + 16];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) t[j] = t[j] + t[j + w];
  return t[0];
}

#if defined(__AVX512F__) || defined(__AVX2__)
// reduce32's tree from its second level on, in registers: t holds s[j] + s[j + 16] (then + s[j + 8]).
inline float reduce8(__m256 t) {
  __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // + t[j + 4]
  u = _mm_add_ps(u, _mm_movehl_ps(u, u));                                         // + t[j + 2]
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));                        // + t[1]
}
#endif
#if defined(__AVX512F__)
inline float reduce16(__m512 t) {
  return reduce8(_mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1)));  // t[j] + t[j + 8]
}
#endif

// G weight rows (row g's nb blocks at w + g * row_bytes) against R rows of x (row r at x + r * ldx):
// out[r * ldo + g] = x[r] . w[g]. Each block is expanded once into registers and used by all R rows.
#if defined(__AVX512F__)

template <Fmt F>
inline void expand(const uint8_t* blk, __m512& w0, __m512& w1) {
  if constexpr (F == Fmt::Q4_1) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // the block's 16 possible weights, d * q + m for q = 0..15, then each nibble looks its weight up
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(*fp16(blk)), iota, _mm512_set1_ps(*fp16(blk + 2)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    w0 = _mm512_permutexvar_ps(q, table);                         // uses bits 0-3 of each index: the low nibble
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);   // the high nibble
  } else {
    const __m512 d = _mm512_set1_ps(*fp16(blk));
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  }
}

// (The loops over g and r are unrolled by name: it is what lets the compiler keep acc in registers.)
template <Fmt F, int G, int R>
void row_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int64_t BYTES = F == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  __m512 acc[2 * G * R];  // (g, r)'s two sums at 2 * (g * R + r)
#pragma GCC unroll 16
  for (int i = 0; i < 2 * G * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = w + g * row_bytes + b * BYTES;
      __m512 w0, w1;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
      expand<F>(blk, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + b * QK;
        __m512* a = acc + 2 * (g * R + r);
        a[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a[0]);
        a[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a[1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r * ldo + g] = reduce16(_mm512_add_ps(acc[2 * (g * R + r)], acc[2 * (g * R + r) + 1]));
}
constexpr int TILE = 8;  // rows of x per expanded block: 16 accumulators of the 32 registers
// weight rows taken together for R rows of x: a dot product is a chain of dependent adds, so a few rows of x
// alone leave the FMA units waiting on each chain; a second weight row gives them independent chains to
// overlap (more rows would be more streams from memory at once, which measured slower)
constexpr int rows_together(int R) { return R <= 4 ? 2 : 1; }

// More rows of x than two tiles would expand each block again for every tile. So a task's weight rows are expanded
// once into floats (`wf`, on 64-byte lines, so that no load of a block straddles two), and the rows of x pass over
// them EXPANDED_TILE at a time, EXPANDED_G weight rows together: per block, 2 G weights and 2 R inputs loaded for
// 2 G R products (24 accumulators, 4 weights and 2 inputs of the 32 registers). The same products, in the same
// order, as row_tile's, so the same bits.
constexpr int EXPANDED_G = 2, EXPANDED_TILE = 6;

template <Fmt F>
void expand_row(const uint8_t* w, int64_t nb, float* wf) {
  constexpr int64_t BYTES = F == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    __m512 w0, w1;
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    expand<F>(blk, w0, w1);
    _mm512_store_ps(wf + b * QK, w0);
    _mm512_store_ps(wf + b * QK + 16, w1);
  }
}

// G expanded weight rows (row g at wf + g * nb * 32) against R rows of x: out[r * ldo + g] = x[r] . wf[g].
template <int G, int R>
void expanded_tile(const float* wf, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  const int64_t K = nb * QK;
  __m512 acc[2 * G * R];  // (g, r)'s two sums at 2 * (g * R + r), as in row_tile
#pragma GCC unroll 24
  for (int i = 0; i < 2 * G * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 wv[2 * G];
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      wv[2 * g] = _mm512_load_ps(wf + g * K + b * QK);
      wv[2 * g + 1] = _mm512_load_ps(wf + g * K + b * QK + 16);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * ldx + b * QK), x1 = _mm512_loadu_ps(x + r * ldx + b * QK + 16);
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) {
        __m512* a = acc + 2 * (g * R + r);
        a[0] = _mm512_fmadd_ps(wv[2 * g], x0, a[0]);
        a[1] = _mm512_fmadd_ps(wv[2 * g + 1], x1, a[1]);
      }
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) out[r * ldo + g] = reduce16(_mm512_add_ps(acc[2 * (g * R + r)], acc[2 * (g * R + r) + 1]));
}

// Expanded weight rows 0..n against `rows` (1..EXPANDED_TILE) rows of x, EXPANDED_G weight rows at a time.
template <int R = EXPANDED_TILE>
void expanded_rows(int rows, int64_t n, const float* wf, int64_t nb, const float* x, int64_t ldx, float* out,
                   int64_t ldo) {
  if constexpr (R > 0) {
    if (rows != R) return expanded_rows<R - 1>(rows, n, wf, nb, x, ldx, out, ldo);
    const int64_t K = nb * QK;
    int64_t g = 0;
    for (; g + EXPANDED_G <= n; g += EXPANDED_G) expanded_tile<EXPANDED_G, R>(wf + g * K, nb, x, ldx, out + g, ldo);
    for (; g < n; ++g) expanded_tile<1, R>(wf + g * K, nb, x, ldx, out + g, ldo);
  }
}

#elif defined(__AVX2__)

template <Fmt F>
inline void expand(const uint8_t* blk, __m256 w[4]) {
  const __m128i* qp = reinterpret_cast<const __m128i*>(blk + (F == Fmt::Q4_1 ? 4 : 2));
  if constexpr (F == Fmt::Q4_1) {
    const __m256 d = _mm256_set1_ps(*fp16(blk)), m = _mm256_set1_ps(*fp16(blk + 2));
    const __m128i q = _mm_loadu_si128(qp), low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
  } else {
    const __m256 d = _mm256_set1_ps(*fp16(blk));
    const __m128i q0 = _mm_loadu_si128(qp), q1 = _mm_loadu_si128(qp + 1);
    w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
    w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))));
    w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
    w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))));
  }
}

template <Fmt F, int G, int R>
void row_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int64_t BYTES = F == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  __m256 acc[4 * G * R];  // (g, r)'s four sums at 4 * (g * R + r)
#pragma GCC unroll 16
  for (int i = 0; i < 4 * G * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = w + g * row_bytes + b * BYTES;
      __m256 wv[4];
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
      expand<F>(blk, wv);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + b * QK;
        __m256* a = acc + 4 * (g * R + r);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) a[k] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + 8 * k), a[k]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256* a = acc + 4 * (g * R + r);
      out[r * ldo + g] = reduce8(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
    }
}
constexpr int TILE = 2;  // 8 accumulators and 4 weights of the 16 registers
constexpr int rows_together(int R) { return R == 1 ? 2 : 1; }  // (see the AVX-512 build)

// With more rows of x than two tiles, a Q4_1 block expanded in registers would be expanded again for every tile
// (four times for 8 rows): some 16 instructions for each 8 products. So each weight row is expanded once into
// floats (`wf`, in L1), and the rows of x pass over it two or three at a time (12 accumulators and the block's 4
// weights fill the 16 registers): the same products, in the same order, as row_tile's. (A Q8_0 block expands in
// three instructions per 8 weights, about what reading them back from L1 costs: it keeps row_tile.)
constexpr int EXPANDED_TILE = 3;

template <Fmt F>
void expand_row(const uint8_t* w, int64_t nb, float* wf) {
  constexpr int64_t BYTES = F == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    __m256 wv[4];
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    expand<F>(blk, wv);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(wf + b * QK + 8 * k, wv[k]);
  }
}

template <int R>
void expanded_tile(const float* wf, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 acc[4 * R];
#pragma GCC unroll 12
  for (int i = 0; i < 4 * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 wv[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) wv[k] = _mm256_loadu_ps(wf + b * QK + 8 * k);
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * QK;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[4 * r + k] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + 8 * k), acc[4 * r + k]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    const __m256* a = acc + 4 * r;
    out[r * ldo] = reduce8(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
  }
}

#else  // portable: the same sums, one float at a time

template <Fmt F>
inline void expand(const uint8_t* blk, float wv[32]) {
  const float d = *fp16(blk);
  if constexpr (F == Fmt::Q4_1) {
    const float m = *fp16(blk + 2);
    for (int j = 0; j < 16; ++j) {
      wv[j] = std::fma(d, static_cast<float>(blk[4 + j] & 15), m);
      wv[j + 16] = std::fma(d, static_cast<float>(blk[4 + j] >> 4), m);
    }
  } else {
    for (int j = 0; j < 32; ++j) wv[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
  }
}

template <Fmt F, int G, int R>
void row_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int64_t BYTES = F == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  for (int g = 0; g < G; ++g) {
    float acc[R][32] = {};
    for (int64_t b = 0; b < nb; ++b) {
      float wv[32];
      expand<F>(w + g * row_bytes + b * BYTES, wv);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + b * QK;
        for (int j = 0; j < 32; ++j) acc[r][j] = std::fma(wv[j], xb[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo + g] = reduce32(acc[r]);
  }
}
constexpr int TILE = 4;
constexpr int rows_together(int) { return 1; }

#endif

// Weight rows o0..o1 against `rows` (1..TILE) rows of x: rows_together(rows) weight rows at a time, then one
// at a time for what is left. Each (weight row, x row) dot product is the same arithmetic either way.
template <Fmt F, int R = TILE>
void rows_tile(int rows, const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t nb, const float* x,
               int64_t ldx, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows != R) return rows_tile<F, R - 1>(rows, w, row_bytes, o0, o1, nb, x, ldx, out, ldo);
    constexpr int G = rows_together(R);
    int64_t o = o0;
    for (; o + G <= o1; o += G) row_tile<F, G, R>(w + o * row_bytes, row_bytes, nb, x, ldx, out + o, ldo);
    for (; o < o1; ++o) row_tile<F, 1, R>(w + o * row_bytes, row_bytes, nb, x, ldx, out + o, ldo);
  }
}

template <Fmt F>
void matmul(const uint8_t* w, int64_t N, int64_t nb, const float* x, int64_t B, float* out, Team* team = nullptr) {
  constexpr int64_t BYTES = F == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  const int64_t K = nb * QK, row_bytes = nb * BYTES;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (F == Fmt::Q4_1 && B > 2 * TILE) {  // each weight row expanded once, then every row of x over it
    parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      std::vector<float> wf(K);
      for (int64_t o = begin; o < end; ++o) {
        expand_row<F>(w + o * row_bytes, nb, wf.data());
        const int64_t tiles = (B + EXPANDED_TILE - 1) / EXPANDED_TILE;  // B >= 5 rows as even tiles of 2 or 3
        for (int64_t t = 0, b0 = 0; t < tiles; ++t) {
          const int64_t rows = B / tiles + (t < B % tiles);
          if (rows == 3) expanded_tile<3>(wf.data(), nb, x + b0 * K, K, out + b0 * N + o, N);
          else expanded_tile<2>(wf.data(), nb, x + b0 * K, K, out + b0 * N + o, N);
          b0 += rows;
        }
      }
    });
    return;
  }
#endif
#if defined(__AVX512F__)
  if (B > 2 * TILE) {  // each task's weight rows expanded once, then every row of x over them
    parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(ROWS_PER_TASK * K + 16);
      float* wf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
      const int64_t tiles = (B + EXPANDED_TILE - 1) / EXPANDED_TILE;  // even tiles of B / tiles rows or one more
      for (int64_t o0 = begin; o0 < end; o0 += ROWS_PER_TASK) {
        const int64_t o1 = std::min(end, o0 + ROWS_PER_TASK);
        for (int64_t o = o0; o < o1; ++o) expand_row<F>(w + o * row_bytes, nb, wf + (o - o0) * K);
        for (int64_t t = 0, b0 = 0; t < tiles; ++t) {
          const int rows = static_cast<int>(B / tiles + (t < B % tiles));
          expanded_rows(rows, o1 - o0, wf, nb, x + b0 * K, K, out + b0 * N + o0, N);
          b0 += rows;
        }
      }
    });
    return;
  }
#endif
  // Threads split the weight rows. A task's rows (a few KB of blocks) stay in cache while every tile
  // of x passes over them, so each block is read from memory once per call, whatever B is.
  parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += ROWS_PER_TASK) {
      const int64_t o1 = std::min(end, o0 + ROWS_PER_TASK);
      for (int64_t b0 = 0; b0 < B; b0 += TILE) {
        const int rows = static_cast<int>(std::min<int64_t>(TILE, B - b0));
        rows_tile<F>(rows, w, row_bytes, o0, o1, nb, x + b0 * K, K, out + b0 * N, N);
      }
    }
  });
}


// ---- Q5_0, Q4_K and Q6_K: a format as data plus an unpacker ----
//
//   Q5_0  22 bytes / 32:   fp16 d, 4 bytes of high bits, 16 of nibbles   weight j = d * (q_j - 16)
//   Q4_K  144 bytes / 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles;
//                          sub-block s of 32: weight = (d * sc_s) * q - dmin * m_s
//   Q6_K  210 bytes / 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d;
//                          sub-block s of 16: weight = (d * sc_s) * (q - 32)
// (kernels/quant.py's unpackers say where each bit lies.) d * sc and the products with q are exact in fp32 (at
// most 11 + 7 + 5 bits), so each weight rounds at most once, at Q4_K's "- dmin * m": the numbers expanded are
// gguf's. Each format's unpacker expands one group of 32 consecutive weights (group s of a block); the product
// around it is the same for all of them and is Q4_1's and Q8_0's arithmetic: 32 running sums, sum j taking weight
// j of every group in row order by fused multiply-add, then reduce32's tree. So every road gives the same bits.
//
// The roads: "avx2" (256-bit; the AVX-512 build runs it too, as these formats have no 512-bit unpacker yet) and
// "portable" (one float at a time, compiled in every build). The table at the end of the file holds them.

struct Q5_0 {
  static constexpr int64_t BYTES = 22, WEIGHTS = 32;
  static void unpack(const uint8_t* blk, int, float w[32]) {
    const float d = *fp16(blk);
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(static_cast<int>((blk[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      w[j + 16] = d * static_cast<float>(static_cast<int>((blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
};

struct Q4_K {
  static constexpr int64_t BYTES = 144, WEIGHTS = 256;
  // sub-block s's step d * sc and offset dmin * m (llama.cpp's get_scale_min_k4), both exact
  static void scale_min(const uint8_t* blk, int s, float& step, float& low) {
    const uint8_t* q = blk + 4;
    const int sc = s < 4 ? q[s] & 63 : (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
    const int m = s < 4 ? q[s + 4] & 63 : (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    step = *fp16(blk) * static_cast<float>(sc);
    low = *fp16(blk + 2) * static_cast<float>(m);
  }
  static void unpack(const uint8_t* blk, int s, float w[32]) {
    float step, low;
    scale_min(blk, s, step, low);
    const uint8_t* q = blk + 16 + 32 * (s >> 1);  // sub-blocks 2c and 2c + 1: low and high nibbles of 32 bytes
    const int shift = 4 * (s & 1);
    for (int j = 0; j < 32; ++j) w[j] = std::fma(step, static_cast<float>((q[j] >> shift) & 15), -low);
  }
};

struct Q6_K {
  static constexpr int64_t BYTES = 210, WEIGHTS = 256;
  // group s = 4h + k: ql's 32 bytes at 64h + 32(k & 1) (nibble k >> 1), qh's at 128 + 32h (bits 2k, 2k + 1)
  static void unpack(const uint8_t* blk, int s, float w[32]) {
    const int h = s >> 2, k = s & 3;
    const uint8_t *ql = blk + 64 * h + 32 * (k & 1), *qh = blk + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 2 * s;
    const float d = *fp16(blk + 208), step0 = d * static_cast<float>(sc[0]), step1 = d * static_cast<float>(sc[1]);
    for (int j = 0; j < 32; ++j) {
      const int q = ((ql[j] >> (4 * (k >> 1))) & 15) | (((qh[j] >> (2 * k)) & 3) << 4);
      w[j] = (j < 16 ? step0 : step1) * static_cast<float>(q - 32);
    }
  }
};

// The portable road: G = 1 weight row against R rows of x, one float at a time.
template <class U, int R>
void group_tile_portable(const uint8_t* w, int64_t groups, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int64_t SUBS = U::WEIGHTS / QK;
  float acc[R][32] = {};
  for (int64_t i = 0; i < groups; ++i) {
    float wv[32];
    U::unpack(w + i / SUBS * U::BYTES, static_cast<int>(i % SUBS), wv);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + i * QK;
      for (int j = 0; j < 32; ++j) acc[r][j] = std::fma(wv[j], xb[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = reduce32(acc[r]);
}

template <class U>
void group_matmul_portable(const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B, float* out, Team* team) {
  constexpr int TILE4 = 4;
  const int64_t groups = K / QK, row_bytes = K / U::WEIGHTS * U::BYTES;
  parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t b0 = 0; b0 < B; b0 += TILE4) {
        const int64_t rows = std::min<int64_t>(TILE4, B - b0);
        with_rows<TILE4>(rows, [&](auto R) {
          group_tile_portable<U, decltype(R)::value>(w + o * row_bytes, groups, x + b0 * K, K, out + b0 * N + o, N);
        });
      }
  });
}

template <class U>
void group_expand_portable(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
  const int64_t groups = K / QK, row_bytes = K / U::WEIGHTS * U::BYTES, SUBS = U::WEIGHTS / QK;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < groups; ++g)
      U::unpack(w + ids[i] * row_bytes + g / SUBS * U::BYTES, static_cast<int>(g % SUBS), out + i * K + g * QK);
}

#if defined(__AVX2__)
// The avx2 road. 32 signed bytes (weights j = 0..31 as small integers) times a step, as four vectors of 8 floats.
inline void bytes_times(__m256i q, __m256 step_lo, __m256 step_hi, __m256 w[4]) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_mul_ps(step_lo, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
  w[1] = _mm256_mul_ps(step_lo, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
  w[2] = _mm256_mul_ps(step_hi, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
  w[3] = _mm256_mul_ps(step_hi, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
}

struct Q5_0_avx2 : Q5_0 {
  static void unpack(const uint8_t* blk, int, __m256 w[4]) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)), low = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    // byte j = 0xff where bit j of qh is set (llama.cpp's bytes_from_bits_32)
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i high = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                           _mm256_set1_epi64x(-1));
    // q - 16 as a signed byte: the nibble where the high bit is set, the nibble with 0xf0 (i.e. - 16) where not
    const __m256i q16 = _mm256_or_si256(q, _mm256_andnot_si256(high, _mm256_set1_epi8(static_cast<char>(0xf0))));
    const __m256 d = _mm256_set1_ps(*fp16(blk));
    bytes_times(q16, d, d, w);
  }
};

struct Q4_K_avx2 : Q4_K {
  static void unpack(const uint8_t* blk, int s, __m256 w[4]) {
    float step, low;
    scale_min(blk, s, step, low);
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (s >> 1)));
    q = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (s & 1))), _mm256_set1_epi8(15));
    const __m256 d = _mm256_set1_ps(step), m = _mm256_set1_ps(-low);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
  }
};

struct Q6_K_avx2 : Q6_K {
  static void unpack(const uint8_t* blk, int s, __m256 w[4]) {
    const int h = s >> 2, k = s & 3;
    __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (k & 1)));
    __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k >> 1))), _mm256_set1_epi8(15));
    qh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3)), 4);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(ql, qh), _mm256_set1_epi8(32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 2 * s;
    const float d = *fp16(blk + 208);
    bytes_times(q, _mm256_set1_ps(d * static_cast<float>(sc[0])), _mm256_set1_ps(d * static_cast<float>(sc[1])), w);
  }
};

// reduce32's tree on the four vectors of sums (positions 0-7, 8-15, 16-23, 24-31)
inline float reduce4x8(const __m256* a) {
  return reduce8(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
}

// G weight rows against R rows of x, each group expanded in registers and used by all R rows.
template <class U, int G, int R>
void group_tile_avx2(const uint8_t* w, int64_t row_bytes, int64_t groups, const float* x, int64_t ldx, float* out,
                     int64_t ldo) {
  constexpr int64_t SUBS = U::WEIGHTS / QK;
  __m256 acc[4 * G * R];  // (g, r)'s four sums at 4 * (g * R + r)
#pragma GCC unroll 16
  for (int i = 0; i < 4 * G * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < groups; ++i) {
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = w + g * row_bytes + i / SUBS * U::BYTES;
      if (i % SUBS == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
      __m256 wv[4];
      U::unpack(blk, static_cast<int>(i % SUBS), wv);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + i * QK;
        __m256* a = acc + 4 * (g * R + r);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) a[k] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + 8 * k), a[k]);
      }
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) out[r * ldo + g] = reduce4x8(acc + 4 * (g * R + r));
}

// One expanded weight row (wf, K floats) against R rows of x: the same sums as group_tile_avx2's.
template <int R>
void group_expanded_tile(const float* wf, int64_t groups, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 acc[4 * R];
#pragma GCC unroll 12
  for (int i = 0; i < 4 * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < groups; ++i) {
    __m256 wv[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) wv[k] = _mm256_loadu_ps(wf + i * QK + 8 * k);
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + i * QK;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[4 * r + k] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + 8 * k), acc[4 * r + k]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) out[r * ldo] = reduce4x8(acc + 4 * r);
}

template <class U>
void group_expand_row_avx2(const uint8_t* w, int64_t groups, float* wf) {
  constexpr int64_t SUBS = U::WEIGHTS / QK;
  for (int64_t i = 0; i < groups; ++i) {
    const uint8_t* blk = w + i / SUBS * U::BYTES;
    if (i % SUBS == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
    __m256 wv[4];
    U::unpack(blk, static_cast<int>(i % SUBS), wv);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(wf + i * QK + 8 * k, wv[k]);
  }
}

// Up to two rows of x: groups expanded in registers (two weight rows at a time for one row of x, as Q4_1's
// rows_together). More: each weight row expanded once into floats (in L1), the rows of x over it three or two at
// a time, as Q4_1's AVX2 road does (an unpacked K-quant group costs more than reading it back).
template <class U>
void group_matmul_avx2(const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B, float* out, Team* team) {
  const int64_t groups = K / QK, row_bytes = K / U::WEIGHTS * U::BYTES;
  if (B <= 2) {
    parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      int64_t o = begin;
      if (B == 1)
        for (; o + 2 <= end; o += 2) group_tile_avx2<U, 2, 1>(w + o * row_bytes, row_bytes, groups, x, K, out + o, N);
      for (; o < end; ++o) {
        if (B == 1) group_tile_avx2<U, 1, 1>(w + o * row_bytes, row_bytes, groups, x, K, out + o, N);
        else group_tile_avx2<U, 1, 2>(w + o * row_bytes, row_bytes, groups, x, K, out + o, N);
      }
    });
    return;
  }
  parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K);
    const int64_t tiles = (B + 2) / 3;  // B >= 3 rows as even tiles of 2 or 3
    for (int64_t o = begin; o < end; ++o) {
      group_expand_row_avx2<U>(w + o * row_bytes, groups, wf.data());
      for (int64_t t = 0, b0 = 0; t < tiles; ++t) {
        const int64_t rows = B / tiles + (t < B % tiles);
        if (rows == 3) group_expanded_tile<3>(wf.data(), groups, x + b0 * K, K, out + b0 * N + o, N);
        else group_expanded_tile<2>(wf.data(), groups, x + b0 * K, K, out + b0 * N + o, N);
        b0 += rows;
      }
    }
  });
}

template <class U>
void group_expand_avx2(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
  const int64_t groups = K / QK, row_bytes = K / U::WEIGHTS * U::BYTES;
  for (int64_t i = 0; i < n; ++i) group_expand_row_avx2<U>(w + ids[i] * row_bytes, groups, out + i * K);
}
#endif

}  // namespace

// Rows ids[0..n) of a weight (rows of K / 32 blocks) expanded to fp32 into out (n, K), as kernels/quant.py's
// dequantize computes them (d * q, then + m): an embedding lookup on blocks.
void dequantize_rows(const uint8_t* w, bool q4_1, int64_t K, const int64_t* ids, int64_t n, float* out) {
  const int64_t nb = K / QK, bytes = q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + (ids[i] * nb + b) * bytes;
      float* o = out + i * K + b * QK;
      const float d = *fp16(blk);
      if (q4_1) {
        const float m = *fp16(blk + 2);
        for (int j = 0; j < 16; ++j) {
          o[j] = d * static_cast<float>(blk[4 + j] & 15) + m;
          o[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
        }
      } else {
        for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
      }
    }
  }
}

// x (B, K) times a weight of N rows held as blocks (N, K / 32 * block bytes) -> out (B, N): block_linear on
// raw numbers, for callers that have checked the shapes (BlockModel, step.cpp).
void block_product(const uint8_t* w, bool q4_1, int64_t N, int64_t K, const float* x, int64_t B, float* out,
                   Team* team) {
  if (q4_1) matmul<Fmt::Q4_1>(w, N, K / QK, x, B, out, team);
  else matmul<Fmt::Q8_0>(w, N, K / QK, x, B, out, team);
}

namespace {

#if defined(__AVX512F__)
constexpr const char* BUILD_ROAD = "avx512";
#elif defined(__AVX2__)
constexpr const char* BUILD_ROAD = "avx2";
#else
constexpr const char* BUILD_ROAD = "portable";
#endif

// x (B, K) times N weight rows of K inputs -> out (B, N); and rows ids[0..n) of a weight expanded to fp32 (n, K).
using Product = void (*)(const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B, float* out, Team* team);
using Expand = void (*)(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out);

struct Kernel {
  const char* fmt;
  const char* road;
  int64_t bytes, weights;  // per block
  Product product;
  Expand expand;
};

// Every format on every road this build has, the best road of a format first. Q4_1 and Q8_0 have one road per build
// (its widest); the others have the avx2 road on x86 builds and the portable one everywhere.
const Kernel KERNELS[] = {
    {"q4_1", BUILD_ROAD, Q4_1_BYTES, QK,
     [](const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B, float* out, Team* team) {
       matmul<Fmt::Q4_1>(w, N, K / QK, x, B, out, team); },
     [](const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
       dequantize_rows(w, true, K, ids, n, out); }},
    {"q8_0", BUILD_ROAD, Q8_0_BYTES, QK,
     [](const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B, float* out, Team* team) {
       matmul<Fmt::Q8_0>(w, N, K / QK, x, B, out, team); },
     [](const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
       dequantize_rows(w, false, K, ids, n, out); }},
#if defined(__AVX2__)
    {"q5_0", "avx2", Q5_0::BYTES, Q5_0::WEIGHTS, group_matmul_avx2<Q5_0_avx2>, group_expand_avx2<Q5_0_avx2>},
    {"q4_k", "avx2", Q4_K::BYTES, Q4_K::WEIGHTS, group_matmul_avx2<Q4_K_avx2>, group_expand_avx2<Q4_K_avx2>},
    {"q6_k", "avx2", Q6_K::BYTES, Q6_K::WEIGHTS, group_matmul_avx2<Q6_K_avx2>, group_expand_avx2<Q6_K_avx2>},
#endif
    {"q5_0", "portable", Q5_0::BYTES, Q5_0::WEIGHTS, group_matmul_portable<Q5_0>, group_expand_portable<Q5_0>},
    {"q4_k", "portable", Q4_K::BYTES, Q4_K::WEIGHTS, group_matmul_portable<Q4_K>, group_expand_portable<Q4_K>},
    {"q6_k", "portable", Q6_K::BYTES, Q6_K::WEIGHTS, group_matmul_portable<Q6_K>, group_expand_portable<Q6_K>},
};

// The kernel for fmt on road ("": the format's best road here), or an error naming what there is.
const Kernel& kernel_for(const std::string& fmt, const std::string& road) {
  std::string known;
  for (const Kernel& k : KERNELS) {
    if (fmt == k.fmt && (road.empty() || road == k.road)) return k;
    known += std::string(known.empty() ? "" : ", ") + k.fmt + "/" + k.road;
  }
  TORCH_CHECK(false, "fmt '", fmt, "' on road '", road.empty() ? "any" : road, "': this build has ", known);
}

// blocks: a contiguous 2-dim uint8 CPU tensor of rows of K inputs in kernel k's format.
void check_blocks(const torch::Tensor& blocks, const Kernel& k, int64_t K) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
              blocks.is_contiguous(), "blocks: expected a contiguous 2-dim uint8 CPU tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  TORCH_CHECK(K % k.weights == 0, "x: last dim ", K, " is not a multiple of the block size ", k.weights, " (", k.fmt,
              ")");
  TORCH_CHECK(blocks.size(1) == K / k.weights * k.bytes, "blocks: rows of ", blocks.size(1), " bytes, expected ",
              K / k.weights * k.bytes, " (", K / k.weights, " ", k.fmt, " blocks of ", k.bytes, " bytes for ", K,
              " inputs)");
}

}  // namespace

// x (..., K) float32 times a weight of N rows held as blocks (N, K / weights a block * block bytes) uint8 -> (..., N),
// on `road` ("": the format's best here).
torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, std::string fmt, std::string road) {
  const Kernel& k = kernel_for(fmt, road);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x: expected a float32 CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "x: expected a contiguous tensor of at least one dim");
  const int64_t K = x.size(-1), N = blocks.dim() == 2 ? blocks.size(0) : 0;
  check_blocks(blocks, k, K);
  const int64_t B = x.numel() / std::max<int64_t>(K, 1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor out = torch::empty(shape, x.options());
  if (B == 0 || N == 0) return out;
  k.product(blocks.data_ptr<uint8_t>(), N, K, x.data_ptr<float>(), B, out.data_ptr<float>(), nullptr);
  return out;
}

// Every row of blocks (N, K / weights a block * bytes) expanded to fp32 (N, K) on `road`, as its product expands
// them: the numbers kernels/quant.py's dequantize computes.
torch::Tensor block_dequantize(torch::Tensor blocks, int64_t K, std::string fmt, std::string road) {
  const Kernel& k = kernel_for(fmt, road);
  check_blocks(blocks, k, K);
  const int64_t N = blocks.size(0);
  torch::Tensor out = torch::empty({N, K}, torch::kFloat32);
  std::vector<int64_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[i] = i;
  if (N > 0 && K > 0) k.expand(blocks.data_ptr<uint8_t>(), K, ids.data(), N, out.data_ptr<float>());
  return out;
}

// The table: (format, road, bytes a block, weights a block) for every kernel this build has, best road first.
std::vector<std::tuple<std::string, std::string, int64_t, int64_t>> block_kernels() {
  std::vector<std::tuple<std::string, std::string, int64_t, int64_t>> out;
  for (const Kernel& k : KERNELS) out.emplace_back(k.fmt, k.road, k.bytes, k.weights);
  return out;
}
