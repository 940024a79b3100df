// The product on GGUF blocks with int8 activations, as llama.cpp multiplies them (nanoserve/kernels/int8.py
// says why and when).
//
// Each row of x is cut into blocks of 32 and each block quantized as ggml's quantize_row_q8_1_ref does:
//   d = max_j |x_j| / 127,  q_j = roundf(x_j * (1 / d)) (halves away from zero),  s = sum_j q_j
// with d kept in fp32 where ggml stores it (and d * s) as fp16. A block holding inf or NaN gets d = NaN and
// q = 0, so its row's products are NaN; a block whose d is below FLT_MIN (whose 1 / d would overflow) gets q = 0.
//
// A weight block and an activation block then meet in integers, and fp32 scales the result. For each
// (weight row, x row), block b in order, with 16 fp32 sums acc[] (block b in lane b % 16):
//   isum         = sum_j qw_j * q_j                        int32, exact (|isum| <= 32 * 128 * 127)
//   c            = (d_w * d) * float(isum)                 fp32, each step rounded
//   c            = c + m_w * (d * float(s))                Q4_1 only: its m term (weight = d_w * qw + m_w)
//   acc[b % 16]  = acc[b % 16] + c
// then out = (u0 + u2) + (u1 + u3), u_j = t_j + t_{j+4}, t_j = acc[j] + acc[j + 8]. (llama.cpp scales each block's
// integer sum the same way, with fp16 d; its order of fp32 adds is its own.)
// Q5_0, Q4_K and Q6_K take the same steps group of 32 by group, with their own scales (see group_rows_scalar); on
// AVX512-VNNI a few rows of x meet Q4_K and Q6_K super-blocks unpacked in registers as they lie (krows_few), and
// one row of x (a read-bound batch-1 step) Q5_0's blocks, eight at a time, where more rows read its packed Q8_0 copy.
//
// Sixteen lanes so that the fp32 work is vector work: the integer sums of sixteen blocks are gathered into one
// register (AVX-512: a quad of 4 blocks of each of four weight rows; AVX2: 8 blocks of one row) and scaled there.
// Three x86 roads compute the integer sums (AVX512-VNNI's 512-bit vpdpbusd, AVX-VNNI's 256-bit one, AVX2's
// vpmaddubsw + vpmaddwd) and one portable loop does; integers are exact and the fp32 steps are these, so all four
// give the same bits, and a row's result depends on that row of x only. Each x86 road is compiled for its own
// instructions (target attributes: this file includes its second half once per road) and the best the CPU has
// is picked at run time, so one build serves CPUs with and without VNNI.
//
// The x86 roads also read packed copies of the blocks (pack_group for AVX512-VNNI, pack_row8 for the 256-bit
// roads): the same bytes, moved once so that weights load as whole registers whose lanes are already one block
// each, and the integer sums need no permute or horizontal add to reach their lanes. Same integers, same fp32
// steps: the same bits again, from fewer instructions.
//
// From TILED_ROWS rows of x (a prompt, a large batch; the K-quants from KQUANT_TILED_ROWS) the AVX512-VNNI road
// unpacks 48 weight rows at a time once into a tile (rows_tiled, krows_tiled): every format has an unpacker into one
// layout (Q4_1 and Q8_0 from their packed quads, Q5_0 as Q8_0, Q4_K and Q6_K from their blocks), turned so that a
// register's 16 lanes are 16 weight rows, and one micro-kernel (otile) multiplies every four rows of x by it, its
// fp32 steps those above (group_c's), lane for lane. The bits do not change. On a CPU with AMX-INT8 (Intel's tile
// unit) the tile is multiplied by 16 rows of x at a time instead, a block's integer sums one tdpbusd (amx_group), the
// fp32 steps otile's: the bits do not change either.
#ifndef NANOSERVE_INT8_ROAD  // ------------------------------------------------------------- the common part

#include "nanoserve.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define NANOSERVE_INT8_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace {
namespace int8q {

constexpr int64_t QK = 32;          // weights (and activations) per block
constexpr int64_t Q4_1_BYTES = 20;  // fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t Q8_0_BYTES = 34;  // fp16 d, 32 signed bytes
constexpr int64_t GROUP = 16;       // fp32 sums per dot product (block b in lane b % 16)
constexpr int64_t QUAD = 128;       // bytes of 4 activation blocks, interleaved (see Acts)
constexpr int64_t ROWS_PER_TASK = 16;
constexpr int64_t GROUPS_PER_TASK = ROWS_PER_TASK / 4;  // a packed product's task: groups of four rows
// Rows of x from which the AVX512-VNNI road unpacks the weight rows once into tiles (rows_tiled; below it the packed
// quads' pstep), and the K-quants (krows_tiled; below it krows_few): where the tiles' unpacking pays for itself.
constexpr int64_t TILED_ROWS = 32;
constexpr int64_t KQUANT_TILED_ROWS = 32;
constexpr int64_t TILE_ROWS = 48;  // weight rows a tile holds (three groups of 16): a tiled product's task
constexpr int64_t NEXT_TILES = 2;   // tasks after its own whose weights a tiled task asks for while it multiplies

constexpr int64_t K8_BYTES = 40;    // fp32 a, fp32 b, 32 signed bytes: a K-quant group as the 256-bit roads pack it

// Q4_K8 and Q6_K8 are Q4_K's and Q6_K's groups of 32 with their integers and scales laid out (`as_k8` in
// kernels/int8.py): a = the group's scale (Q6_K: its first half's), b = Q4_K's -M or Q6_K's second half's scale,
// then qw. Only the 256-bit roads' packed layout holds them (pack_row8); their fp32 steps are group_c's.
enum class Fmt { Q4_1, Q8_0, Q4_K8, Q6_K8 };

constexpr int64_t fmt_bytes(Fmt f) { return f == Fmt::Q4_1 ? Q4_1_BYTES : f == Fmt::Q8_0 ? Q8_0_BYTES : K8_BYTES; }
constexpr bool is_k8(Fmt f) { return f == Fmt::Q4_K8 || f == Fmt::Q6_K8; }

template <Fmt F>
constexpr int64_t block_bytes() { return fmt_bytes(F); }

// x quantized, B rows, as the vector roads read it: 4 blocks to 128 bytes (a quad), the first halves (positions
// 0..15) of blocks 4t..4t+3, then their second halves, zeros padding the row to a whole pair of quads; a weight
// quad split the same way (Q4_1's low and high nibbles) meets it in two 64-byte products. d, ds, s are padded with
// zeros to whole groups of 16.
struct Acts {
  const int8_t* qi;  // (B, kq)
  const float* d;    // (B, ld)
  const float* ds;   // (B, ld) d * float(s): what Q4_1's m term multiplies
  const int32_t* s;  // (B, ld)
  int64_t nb, kq, ld;
  bool biased = false;  // qi holds q + 128 (unsigned bytes): the AVX512-VNNI road's tiled layout (rows_tiled)
  bool amx = false;     // and its blocks in order, 32 bytes each, for AMX's tile unit (tiled_rows' amx_group)
};

// Where block b's first half lies in its row of qi (its second half 64 bytes on).
inline int64_t lo_at(int64_t b) { return (b / 4) * QUAD + (b % 4) * 16; }
// Super-blocks of eight groups krows_few takes x's blocks in (few_x): Q5_0's last may be part of one.
inline int64_t few_supers(const Acts& a) { return (a.nb + 7) / 8; }

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// roundf: to nearest, halves away from zero (v - trunc(v) is exact, so this is roundf for every float).
inline float round_away(float v) {
  const float t = std::trunc(v);
  return std::fabs(v - t) >= 0.5f ? t + std::copysign(1.0f, v) : t;
}

// A non-finite block, as every quantizer writes it.
inline void quantize_bad(int8_t* lo, float* d, int32_t* s, float* ds) {
  std::memset(lo, 0, 16);
  std::memset(lo + 64, 0, 16);
  *d = *ds = NAN;
  *s = 0;
}

// One row of x (nb blocks) -> its blocks in qi (the quad layout), d, s, ds (nb each); the portable quantizer, which
// the vector roads' quantizers match number for number.
void quantize_row_scalar(const float* x, int64_t nb, int8_t* qi, float* d, int32_t* s, float* ds) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    int8_t* lo = qi + lo_at(b);
    float amax = 0.0f;
    int bad = 0;
    for (int j = 0; j < QK; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      bad |= !(std::fabs(xb[j]) <= FLT_MAX);  // inf or NaN
    }
    if (bad) {
      quantize_bad(lo, d + b, s + b, ds + b);
      continue;
    }
    const float db = amax / 127.0f;
    const float id = db >= FLT_MIN ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) {
      // |x_j * id| <= 127 up to rounding, so the clamp never moves a value; it states what the products rely on
      const int v = static_cast<int>(std::min(127.0f, std::max(-127.0f, round_away(xb[j] * id))));
      lo[(j / 16) * 64 + j % 16] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = db;
    s[b] = sum;
    ds[b] = db * static_cast<float>(sum);
  }
}

// The fixed tree over 16 lanes: t_j = a[j] + a[j + 8], then (t_j + t_{j+4}), (+ 2 along), (+ 1 along).
inline float tree16(const float* a) {
  float t[8];
  for (int j = 0; j < 8; ++j) t[j] = a[j] + a[j + 8];
  for (int j = 0; j < 4; ++j) t[j] = t[j] + t[j + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// ---- the portable road: one (weight row, x row) at a time, the same steps one number at a time

template <Fmt F>
float dot_scalar(const uint8_t* w, const Acts& a, int64_t r) {
  float acc[GROUP] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = w + b * block_bytes<F>();
    const int8_t* qx = a.qi + r * a.kq + lo_at(b);  // positions 0..15 at qx[0..15], 16..31 at qx[64..79]
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) {
      if constexpr (F == Fmt::Q4_1) isum += (blk[4 + j] & 15) * qx[j] + (blk[4 + j] >> 4) * qx[64 + j];
      else isum += static_cast<int8_t>(blk[2 + j]) * qx[j] + static_cast<int8_t>(blk[18 + j]) * qx[64 + j];
    }
    float c = half(blk) * a.d[r * a.ld + b] * static_cast<float>(isum);
    if constexpr (F == Fmt::Q4_1) c = c + half(blk + 2) * a.ds[r * a.ld + b];
    acc[b % GROUP] = acc[b % GROUP] + c;
  }
  return tree16(acc);
}

// Weight rows o0..o1 (row o at w + o * row_bytes) against all B rows of x: out[r * N + o].
void rows_scalar(Fmt f, const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a, int64_t B,
                 float* out, int64_t N, const uint8_t*) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r = 0; r < B; ++r)
      out[r * N + o] = f == Fmt::Q4_1 ? dot_scalar<Fmt::Q4_1>(w + o * row_bytes, a, r)
                                      : dot_scalar<Fmt::Q8_0>(w + o * row_bytes, a, r);
}

// ---- Q5_0, Q4_K and Q6_K (quant.cpp's formats read 32 weights a group): group g meets x's block g. With the
// group's integer weights qw (Q5_0: q - 16, Q4_K: q, Q6_K: q - 32) and the integer sums of its halves, i0 over
// positions 0..15 and i1 over 16..31 (exact):
//   Q5_0  c = (d_w * d) * float(i0 + i1)
//   Q4_K  c = (D_s * d) * float(i0 + i1),  c = c + (-M_s) * ds     (D_s = d * sc_s, M_s = dmin * m_s: Q4_1's steps)
//   Q6_K  c = (D_0 * d) * float(i0),  c = c + (D_1 * d) * float(i1) (D_h = d * the half's scale)
//   acc[g % 16] = acc[g % 16] + c, then tree16.
// The fp32 steps are one scalar function on every road; the integer sums are exact however they are taken (the
// portable loop, or AVX2's vpmaddubsw on every x86 road), so every road gives the same bits.
enum class GFmt { Q5_0, Q4_K, Q6_K };

template <GFmt F>
struct GroupFormat {
  static constexpr int64_t BYTES = F == GFmt::Q5_0 ? 22 : F == GFmt::Q4_K ? 144 : 210;
  static constexpr int64_t GROUPS = F == GFmt::Q5_0 ? 1 : 8;  // groups of 32 a block
};

struct GroupScales {
  float a, b;  // Q5_0: d_w; Q4_K: D_s, -M_s; Q6_K: D_0, D_1
};

template <GFmt F>
GroupScales group_scales(const uint8_t* blk, int s) {
  if constexpr (F == GFmt::Q5_0) {
    return {half(blk), 0.0f};
  } else if constexpr (F == GFmt::Q4_K) {
    const uint8_t* q = blk + 4;
    const int sc = s < 4 ? q[s] & 63 : (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
    const int m = s < 4 ? q[s + 4] & 63 : (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    return {half(blk) * static_cast<float>(sc), -(half(blk + 2) * static_cast<float>(m))};
  } else {
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 2 * s;
    const float d = half(blk + 208);
    return {d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1])};
  }
}

// The group's 32 integer weights, in position order.
template <GFmt F>
void group_ints(const uint8_t* blk, int s, int8_t q[32]) {
  if constexpr (F == GFmt::Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(((blk[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      q[j + 16] = static_cast<int8_t>(((blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  } else if constexpr (F == GFmt::Q4_K) {
    const uint8_t* p = blk + 16 + 32 * (s >> 1);
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>((p[j] >> (4 * (s & 1))) & 15);
  } else {
    const int h = s >> 2, k = s & 3;
    const uint8_t *ql = blk + 64 * h + 32 * (k & 1), *qh = blk + 128 + 32 * h;
    for (int j = 0; j < 32; ++j)
      q[j] = static_cast<int8_t>((((ql[j] >> (4 * (k >> 1))) & 15) | (((qh[j] >> (2 * k)) & 3) << 4)) - 32);
  }
}

template <GFmt F>
inline float group_c(GroupScales sc, int32_t i0, int32_t i1, float d, float ds) {
  if constexpr (F == GFmt::Q6_K) {
    const float c = sc.a * d * static_cast<float>(i0);
    return c + sc.b * d * static_cast<float>(i1);
  } else {
    const float c = sc.a * d * static_cast<float>(i0 + i1);
    if constexpr (F == GFmt::Q4_K) return c + sc.b * ds;
    return c;
  }
}

constexpr int GTILE = 4;  // rows of x per unpacked group

// Weight rows o0..o1 against all B rows of x, one group unpacked for up to GTILE rows of x: the portable loop.
template <GFmt F>
void group_rows_scalar(const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a, int64_t B,
                       float* out, int64_t N) {
  using G = GroupFormat<F>;
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r0 = 0; r0 < B; r0 += GTILE) {
      const int R = static_cast<int>(std::min<int64_t>(GTILE, B - r0));
      float acc[GTILE][GROUP] = {};
      for (int64_t g = 0; g < a.nb; ++g) {
        const uint8_t* blk = w + o * row_bytes + g / G::GROUPS * G::BYTES;
        const int s = static_cast<int>(g % G::GROUPS);
        int8_t q[32];
        group_ints<F>(blk, s, q);
        const GroupScales sc = group_scales<F>(blk, s);
        for (int r = 0; r < R; ++r) {
          const int8_t* qx = a.qi + (r0 + r) * a.kq + lo_at(g);  // positions 0..15 at qx[0..15], 16..31 at qx[64..]
          int32_t i0 = 0, i1 = 0;
          for (int j = 0; j < 16; ++j) i0 += q[j] * qx[j], i1 += q[16 + j] * qx[64 + j];
          const int64_t at = (r0 + r) * a.ld + g;
          acc[r][g % GROUP] = acc[r][g % GROUP] + group_c<F>(sc, i0, i1, a.d[at], a.ds[at]);
        }
      }
      for (int r = 0; r < R; ++r) out[(r0 + r) * N + o] = tree16(acc[r]);
    }
}

#ifdef NANOSERVE_INT8_X86
#define GROUP_AVX2 __attribute__((target("avx2,fma,f16c")))
// The group's integer weights as 32 signed bytes, unpacked in a register (quant.cpp's avx2 unpackers, stopped
// before the conversion to floats).
template <GFmt F>
GROUP_AVX2 inline __m256i group_ints_avx2(const uint8_t* blk, int s) {
  if constexpr (F == GFmt::Q5_0) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)), low = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i high = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                           _mm256_set1_epi64x(-1));
    return _mm256_or_si256(q, _mm256_andnot_si256(high, _mm256_set1_epi8(static_cast<char>(0xf0))));
  } else if constexpr (F == GFmt::Q4_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (s >> 1)));
    return _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (s & 1))), _mm256_set1_epi8(15));
  } else {
    const int h = s >> 2, k = s & 3;
    __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (k & 1)));
    __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k >> 1))), _mm256_set1_epi8(15));
    qh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(ql, qh), _mm256_set1_epi8(32));
  }
}

// The scales of groups g..g + 7 of a weight row (g a multiple of 8: for Q4_K and Q6_K one super-block's eight), as
// group_scales gives them, decoded once a super-block with F16C's conversion (the same floats as `half`'s).
GROUP_AVX2 inline float half_f16c(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return _cvtsh_ss(v);
}

template <GFmt F>
GROUP_AVX2 inline void group_scales8(const uint8_t* row, int64_t g, float sa[8], float sb[8]) {
  const auto h = half_f16c;
  if constexpr (F == GFmt::Q5_0) {
    for (int t = 0; t < 8; ++t) sa[t] = h(row + (g + t) * GroupFormat<F>::BYTES), sb[t] = 0.0f;
  } else if constexpr (F == GFmt::Q4_K) {
    const uint8_t* blk = row + g / 8 * GroupFormat<F>::BYTES;
    const uint8_t* q = blk + 4;
    const float d = h(blk), dmin = h(blk + 2);
    for (int s = 0; s < 8; ++s) {
      const int sc = s < 4 ? q[s] & 63 : (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
      const int m = s < 4 ? q[s + 4] & 63 : (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
      sa[s] = d * static_cast<float>(sc), sb[s] = -(dmin * static_cast<float>(m));
    }
  } else {
    const uint8_t* blk = row + g / 8 * GroupFormat<F>::BYTES;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h(blk + 208);
    for (int s = 0; s < 8; ++s) sa[s] = d * static_cast<float>(sc[2 * s]), sb[s] = d * static_cast<float>(sc[2 * s + 1]);
  }
}

GROUP_AVX2 inline int32_t hsum128(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
  return _mm_cvtsi128_si32(v);
}

// The sums of halves of eight groups' products p[0..7] (vpmaddwd's: lanes 0-3 the first half, 4-7 the second): i0 (8)
// and i1 (8), group t in lane t. Integer adds: exact in any order.
GROUP_AVX2 inline void halves8(const __m256i* p, __m256i& i0, __m256i& i1) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  i0 = _mm256_permute2x128_si256(h0, h1, 0x20);  // h0, h1 hold groups 0-3, 4-7: first halves low, second high
  i1 = _mm256_permute2x128_si256(h0, h1, 0x31);
}

// group_c's steps for eight groups in the lanes of a register: scales a and b, x's d and (Q4_K) ds at `ds`, the
// integer sums of each group's halves.
template <GFmt F>
GROUP_AVX2 inline __m256 group_c8(__m256 sa, __m256 sb, __m256 d, const float* ds, __m256i i0, __m256i i1) {
  if constexpr (F == GFmt::Q6_K) {
    const __m256 c = _mm256_mul_ps(_mm256_mul_ps(sa, d), _mm256_cvtepi32_ps(i0));
    return _mm256_add_ps(c, _mm256_mul_ps(_mm256_mul_ps(sb, d), _mm256_cvtepi32_ps(i1)));
  } else {
    const __m256 c = _mm256_mul_ps(_mm256_mul_ps(sa, d), _mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)));
    if constexpr (F == GFmt::Q4_K) return _mm256_add_ps(c, _mm256_mul_ps(sb, _mm256_loadu_ps(ds)));
    return c;
  }
}

// group_rows_scalar's arithmetic with each half's integer sum taken by vpmaddubsw (|qw| <= 32 and |q| <= 127: no
// pair of products saturates 16 bits) and vpmaddwd, eight groups at a time: groups 8c..8c + 7 are lanes 0-7 or
// 8-15 of acc, so their fp32 steps (group_c's, lane by lane) are vector steps. A row's last nb % 8 groups take
// group_c itself.
template <GFmt F>
GROUP_AVX2 void group_rows_avx2(const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a,
                                int64_t B, float* out, int64_t N) {
  using G = GroupFormat<F>;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t qs[8][32];  // eight groups' integer weights
  alignas(32) float sa[8], sb[8];  // and their scales
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r0 = 0; r0 < B; r0 += GTILE) {
      const int R = static_cast<int>(std::min<int64_t>(GTILE, B - r0));
      __m256 accv[GTILE][2];
      for (int r = 0; r < GTILE; ++r) accv[r][0] = accv[r][1] = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= a.nb; g += 8) {
        for (int t = 0; t < 8; ++t) {
          const uint8_t* blk = w + o * row_bytes + (g + t) / G::GROUPS * G::BYTES;
          _mm256_store_si256(reinterpret_cast<__m256i*>(qs[t]),
                             group_ints_avx2<F>(blk, static_cast<int>((g + t) % G::GROUPS)));
        }
        group_scales8<F>(w + o * row_bytes, g, sa, sb);
        const __m256 va = _mm256_load_ps(sa), vb = _mm256_load_ps(sb);
        for (int r = 0; r < R; ++r) {
          const int8_t* qx = a.qi + (r0 + r) * a.kq;
          __m256i p[8];
          for (int t = 0; t < 8; ++t) {
            const int8_t* xb = qx + lo_at(g + t);
            const __m256i x = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 64)),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb)));
            const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(qs[t]));
            p[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), ones);
          }
          __m256i i0, i1;
          halves8(p, i0, i1);
          const int64_t at = (r0 + r) * a.ld + g;
          const __m256 c = group_c8<F>(va, vb, _mm256_loadu_ps(a.d + at), a.ds + at, i0, i1);
          __m256& lane = accv[r][(g / 8) % 2];
          lane = _mm256_add_ps(lane, c);
        }
      }
      alignas(32) float acc[GTILE][GROUP];
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(acc[r], accv[r][0]);
        _mm256_store_ps(acc[r] + 8, accv[r][1]);
      }
      for (; g < a.nb; ++g) {  // the last groups, one at a time
        const uint8_t* blk = w + o * row_bytes + g / G::GROUPS * G::BYTES;
        const int s = static_cast<int>(g % G::GROUPS);
        const __m256i q = group_ints_avx2<F>(blk, s), aq = _mm256_sign_epi8(q, q);
        const GroupScales sc = group_scales<F>(blk, s);
        for (int r = 0; r < R; ++r) {
          const int8_t* qx = a.qi + (r0 + r) * a.kq + lo_at(g);
          const __m256i x = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qx + 64)),
                                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(qx)));
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(x, q)), ones);
          const int32_t i0 = hsum128(_mm256_castsi256_si128(p)), i1 = hsum128(_mm256_extracti128_si256(p, 1));
          const int64_t at = (r0 + r) * a.ld + g;
          acc[r][g % GROUP] = acc[r][g % GROUP] + group_c<F>(sc, i0, i1, a.d[at], a.ds[at]);
        }
      }
      for (int r = 0; r < R; ++r) out[(r0 + r) * N + o] = tree16(acc[r]);
    }
}
#undef GROUP_AVX2
#endif

// (the last argument: the end of the weight's bytes, which a road may not read past)
using RowsFn = void (*)(Fmt, const uint8_t*, int64_t, int64_t, int64_t, const Acts&, int64_t, float*, int64_t,
                        const uint8_t*);
using QuantizeFn = void (*)(const float*, int64_t, int8_t*, float*, int32_t*, float*);

#ifdef NANOSERVE_INT8_X86
// The x86 roads: this file's second half, once per road, each with its instructions enabled.
// Each road asks for a row's bytes PREFETCH ahead of the quad in use, into the cache PREFETCH_HINT names: the
// integer products eat bytes faster than quant.cpp's, so more must be in flight than the hardware's prefetchers
// keep. The AVX512-VNNI road streams fastest asking 8 KB ahead into L1, the AVX2 roads 16 KB ahead into L2. On an
// AMD CPU the AVX512-VNNI road asks with the non-temporal hint instead: the weights, read once a step, then stream
// faster there (a decode step; a prompt's rows reuse each weight from L1 either way), except Q8_0 against one or two
// rows of x, which streams faster unasked (pstep). Only the asking differs, so the numbers do not.
const bool AMD_CPU = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
}();
#define ROAD_PREFETCH(p)                                                            \
  ((NTA_ON_AMD && AMD_CPU) ? _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA) \
                           : _mm_prefetch(reinterpret_cast<const char*>(p), PREFETCH_HINT))
#define NANOSERVE_INT8_ROAD 1
#define INT8_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
namespace avx512_vnni {
constexpr int64_t PREFETCH = 8192;
constexpr _mm_hint PREFETCH_HINT = _MM_HINT_T0;
constexpr bool NTA_ON_AMD = true;
#include __FILE__
}
#undef INT8_TARGET
#undef NANOSERVE_INT8_ROAD
#define NANOSERVE_INT8_ROAD 2
#define INT8_TARGET "avx2,fma,f16c,avxvnni"
namespace avx_vnni {
constexpr int64_t PREFETCH = 16384;
constexpr _mm_hint PREFETCH_HINT = _MM_HINT_T1;
constexpr bool NTA_ON_AMD = false;
#include __FILE__
}
#undef INT8_TARGET
#undef NANOSERVE_INT8_ROAD
#define NANOSERVE_INT8_ROAD 3
#define INT8_TARGET "avx2,fma,f16c"
namespace avx2 {
constexpr int64_t PREFETCH = 16384;
constexpr _mm_hint PREFETCH_HINT = _MM_HINT_T1;
constexpr bool NTA_ON_AMD = false;
#include __FILE__
}
#undef INT8_TARGET
#undef NANOSERVE_INT8_ROAD
#endif


// ---- the packed layout (the AVX512-VNNI road's): the same bytes, moved so that a quad needs no permutes
//
// Rows in groups of four (a last group short of four is padded with zero rows), each group's blocks in quads of
// four (the last maybe n < 4 blocks), quad after quad: 4 rows x n blocks x block bytes, so a group takes the
// bytes of its four rows. In a quad, lane c = j * n + i stands for row j's block i (c = 4j + i when n = 4):
//   Q4_1: 4 registers of 16n bytes, register v lane c = the block's nibble bytes 4v..4v+3 (positions 4v..4v+3
//         low, 16 + 4v.. high); then the 4n fp16 d, then the 4n fp16 m.
//   Q8_0: 8 registers of 16n bytes, register k lane c = the block's weights at positions P(k)..P(k)+3
//         (P(k) = 4k, or 16 + 4(k - 4) from k = 4), each + 128 (unsigned, as vpdpbusd multiplies them); then
//         the 4n fp16 d.
// A short quad's lanes are compact in memory and moved into place as they are loaded.
// A packed weight: (N + 3) / 4 * 4 rows' bytes, then PACK_TAIL zeros, so that the 256-bit roads may load a row's
// short last group's heads as whole registers (the lanes past its blocks are dropped).
constexpr int64_t PACK_TAIL = 64;
inline int64_t packed_bytes(int64_t N, int64_t row_bytes) { return (N + 3) / 4 * 4 * row_bytes + PACK_TAIL; }

void pack_group(Fmt f, const uint8_t* w, int64_t row_bytes, int64_t nb, int rows, uint8_t* out) {
  const int64_t bytes = f == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  uint8_t zero[Q8_0_BYTES] = {};
  for (int64_t t = 0; t < (nb + 3) / 4; ++t) {
    const int64_t n = std::min<int64_t>(4, nb - 4 * t);
    const int regs = f == Fmt::Q4_1 ? 4 : 8;
    for (int j = 0; j < 4; ++j)
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* blk = j < rows ? w + j * row_bytes + (4 * t + i) * bytes : zero;
        const int64_t c = j * n + i;
        for (int k = 0; k < regs; ++k)
          for (int e = 0; e < 4; ++e) {
            const int64_t src = f == Fmt::Q4_1 ? 4 + 4 * k + e : 2 + (k < 4 ? 4 * k : 16 + 4 * (k - 4)) + e;
            const uint8_t v = blk[src];
            out[16 * n * k + 4 * c + e] = f == Fmt::Q4_1 ? v : static_cast<uint8_t>(v ^ 0x80);
          }
        uint8_t* head = out + 16 * n * regs;
        std::memcpy(head + 2 * c, blk, 2);                                  // d
        if (f == Fmt::Q4_1) std::memcpy(head + 8 * n + 2 * c, blk + 2, 2);  // m
      }
    out += 4 * n * bytes;
  }
}

// The 256-bit roads' packed layout: each row on its own, its blocks in groups of eight (the last maybe n < 8),
// group after group, so a row keeps its bytes. In a group, lane i stands for block i:
//   Q4_1: 4 registers of 4n bytes, register k lane i = the block's nibble bytes 4k..4k+3; the n fp16 d; the n m.
//   Q8_0: 8 registers of 4n bytes, register k lane i = the block's weights at positions P(k)..P(k)+3 (signed, as
//         the file has them); the n fp16 d.
//   Q4_K8, Q6_K8: Q8_0's 8 registers; the n fp32 a; the n fp32 b.
void pack_row8(Fmt f, const uint8_t* w, int64_t nb, uint8_t* out) {
  const int64_t bytes = fmt_bytes(f), at = f == Fmt::Q8_0 ? 2 : 8;  // where a block's integers start
  const int regs = f == Fmt::Q4_1 ? 4 : 8;
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t n = std::min<int64_t>(8, nb - b0);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* blk = w + (b0 + i) * bytes;
      for (int k = 0; k < regs; ++k) {
        const int64_t src = f == Fmt::Q4_1 ? 4 + 4 * k : at + (k < 4 ? 4 * k : 16 + 4 * (k - 4));
        std::memcpy(out + 4 * n * k + 4 * i, blk + src, 4);
      }
      uint8_t* head = out + 4 * n * regs;
      if (is_k8(f)) {
        std::memcpy(head + 4 * i, blk, 4);          // a
        std::memcpy(head + 4 * n + 4 * i, blk + 4, 4);  // b
        continue;
      }
      std::memcpy(head + 2 * i, blk, 2);                                  // d
      if (f == Fmt::Q4_1) std::memcpy(head + 2 * n + 2 * i, blk + 2, 2);  // m
    }
    out += n * bytes;
  }
}

// q -> q + 128 (as unsigned bytes: the sign bit flipped), n bytes.
void bias_bytes(uint8_t* p, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    v ^= 0x8080808080808080ull;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] ^= 0x80;
}

// Each 64-byte half of every quad of quantized x, from (block i, positions 4k..4k+3 at dword 4i + k) to dword
// 4k + i: chunk k (16 bytes) then holds positions 4k..4k+3 of the quad's four blocks, the order the packed
// registers' lanes take them in.
void transpose_halves(int8_t* qi, int64_t halves) {
  for (int64_t h = 0; h < halves; ++h) {
    int32_t t[16], u[16];
    std::memcpy(t, qi + 64 * h, 64);
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 4; ++i) u[4 * k + i] = t[4 * i + k];
    std::memcpy(qi + 64 * h, u, 64);
  }
}

// Each quad of quantized x from its halves (the first 16 bytes of blocks 4t..4t + 3, then their last 16) to its
// blocks in order, 32 bytes each: what AMX's tile unit loads 16 rows of at once (amx_group).
void plain_blocks(uint8_t* qi, int64_t quads) {
  for (int64_t t = 0; t < quads; ++t) {
    uint8_t u[QUAD];
    for (int i = 0; i < 4; ++i) {
      std::memcpy(u + 32 * i, qi + QUAD * t + 16 * i, 16);
      std::memcpy(u + 32 * i + 16, qi + QUAD * t + 64 + 16 * i, 16);
    }
    std::memcpy(qi + QUAD * t, u, QUAD);
  }
}

// Whether the AVX512-VNNI road's tiled products take AMX's tile unit: where the CPU has AMX-INT8 and Linux lets
// this process use its tiles (amx_tiles_here, NANOSERVE_AMX), unless turned off (int8_amx). The same bits either way.
std::atomic<int> amx_int8{-1};  // -1: not yet asked

bool amx_int8_here() {
#if defined(NANOSERVE_INT8_X86) && defined(__linux__)
  static const bool here = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)) && amx_tiles_here();  // AMX-INT8
  }();
  return here;
#else
  return false;
#endif
}

bool amx_int8_on() {
  int on = amx_int8.load(std::memory_order_relaxed);
  if (on < 0) amx_int8.store(on = amx_int8_here() ? 1 : 0);
  return on == 1;
}


// For the 256-bit roads' groups of eight blocks: each pair of transposed quads interleaved chunk by chunk (for each
// half, chunk k of the first quad, then chunk k of the second), so that a group's chunk k is one 32-byte load, lane
// i block i, where it took two loads and an insert for every weight row.
void pair_quads(int8_t* qi, int64_t pairs) {
  for (int64_t p = 0; p < pairs; ++p) {
    int8_t t[2 * QUAD];
    int8_t* q = qi + 2 * QUAD * p;
    std::memcpy(t, q, sizeof t);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k) {
        std::memcpy(q + 128 * h + 32 * k, t + 64 * h + 16 * k, 16);
        std::memcpy(q + 128 * h + 32 * k + 16, t + QUAD + 64 * h + 16 * k, 16);
      }
  }
}

// (row groups g0..g1 of four rows, of a packed weight of N rows, against all B rows of x whose quads are transposed)
using PackedFn = void (*)(Fmt, const uint8_t*, int64_t, int64_t, int64_t, const Acts&, int64_t, float*, int64_t);

enum class Layout { NONE, QUADS, ROWS };  // no packed layout, pack_group's, pack_row8's

struct Road {
  const char* name;
  RowsFn rows;
  QuantizeFn quantize;
  bool (*here)();
  PackedFn rows_packed;
  Layout layout;
};

bool always() { return true; }
#ifdef NANOSERVE_INT8_X86
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
bool has_avx_vnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
#endif

// Best first.
const Road ROADS[] = {
#ifdef NANOSERVE_INT8_X86
    {"avx512-vnni", avx512_vnni::rows, avx512_vnni::quantize_row, has_avx512_vnni, avx512_vnni::rows_packed,
     Layout::QUADS},
    {"avx-vnni", avx_vnni::rows, avx_vnni::quantize_row, has_avx_vnni, avx_vnni::rows_packed, Layout::ROWS},
    {"avx2", avx2::rows, avx2::quantize_row, has_avx2, avx2::rows_packed, Layout::ROWS},
#endif
    {"scalar", rows_scalar, quantize_row_scalar, always, nullptr, Layout::NONE},
};

const Road& pick(const std::string& name) {
  std::string known;
  for (const Road& road : ROADS) {
    if (name.empty() ? road.here() : name == road.name) {
      TORCH_CHECK(road.here(), "road: this CPU cannot run '", name, "'");
      return road;
    }
    known += std::string(known.empty() ? "" : ", ") + road.name;
  }
  TORCH_CHECK(false, "road: unknown '", name, "'; this build has ", known);
  return ROADS[0];
}

// x (B, K) float32, contiguous, quantized row by row by `road` into one buffer: qi, then d, ds, s. The buffer is
// the calling thread's, reused by its next call (a product's quantized x lives until the product returns): no
// allocation per product, which a decode step makes over a hundred of.
struct Quantized {
  uint8_t* buffer;
  Acts acts;
};

// x quantized for the tiled road: q + 128, the quads' halves transposed (otile) or the blocks in order (AMX's).
void tiled_x(Quantized& z, int64_t B) {
  z.acts.amx = amx_int8_on();
  if (z.acts.amx) plain_blocks(z.buffer, B * z.acts.kq / QUAD);
  else transpose_halves(reinterpret_cast<int8_t*>(z.buffer), B * z.acts.kq / 64);
  bias_bytes(z.buffer, B * z.acts.kq);
  z.acts.biased = true;
}


Quantized quantize(const float* xp, int64_t B, int64_t K, const Road& road) {
  const int64_t nb = K / QK, kq = (nb + 7) / 8 * 2 * QUAD, ld = (nb + GROUP - 1) / GROUP * GROUP;
  const size_t bytes = static_cast<size_t>(B * (kq + 3 * ld * 4));
  thread_local std::vector<uint8_t> kept;
  if (kept.size() < bytes + 64) kept.resize(bytes + 64);
  Quantized z;
  z.buffer = kept.data() + (64 - reinterpret_cast<uintptr_t>(kept.data()) % 64) % 64;  // 64-byte aligned
  int8_t* qi = reinterpret_cast<int8_t*>(z.buffer);
  float* d = reinterpret_cast<float*>(qi + B * kq);  // kq and ld * 4 are multiples of 64: every part aligned
  float* ds = d + B * ld;
  int32_t* s = reinterpret_cast<int32_t*>(ds + B * ld);
  z.acts = Acts{qi, d, ds, s, nb, kq, ld};
  at::parallel_for(0, B, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* q = qi + r * kq;
      if (nb % 8) {  // the last pair of quads' missing blocks
        for (int64_t b = nb; b % 8; ++b) {
          std::memset(q + lo_at(b), 0, 16);
          std::memset(q + lo_at(b) + 64, 0, 16);
        }
      }
      for (int64_t b = nb; b < ld; ++b) d[r * ld + b] = ds[r * ld + b] = 0.0f, s[r * ld + b] = 0;
      road.quantize(xp + r * K, nb, q, d + r * ld, s + r * ld, ds + r * ld);
    }
  });
  return z;
}

// x (B, K) quantized by `road`, then times the N weight rows at w: out (B, N). Threads split the weight rows; a
// task's rows stay in cache while every tile of x passes over them.
void product(const Road& road, Fmt f, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B, float* out,
             Team* team = nullptr) {
  const int64_t row_bytes = K / QK * (f == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES);
  const Quantized z = quantize(x, B, K, road);
  const uint8_t* w_end = w + N * row_bytes;
  parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += ROWS_PER_TASK)
      road.rows(f, w, row_bytes, o0, std::min(end, o0 + ROWS_PER_TASK), z.acts, B, out, N, w_end);
  });
}

int64_t checked_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x: expected a float32 CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "x: expected a contiguous tensor of at least one dim");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % QK == 0, "x: last dim ", K, " is not a multiple of the block size 32");
  return K == 0 ? 0 : x.numel() / K;
}

// The tiled road's tasks: TILE_ROWS weight rows (one tile) each, handed to whichever thread is free, so that a
// thread slowed by the machine's other work takes fewer of them: f(o0, o1).
struct NoScratch {};

template <class F>
void tiled_tasks(Team* team, int64_t N, const F& f) {
  const auto work = [&](int64_t task, NoScratch&) { f(task * TILE_ROWS, std::min(N, (task + 1) * TILE_ROWS)); };
  for_each_task<NoScratch>(team, (N + TILE_ROWS - 1) / TILE_ROWS, work);
}

// Q5_0, Q4_K, Q6_K on `road`: its quantizer, then the portable loop (the scalar road) or AVX2's integer sums (the
// x86 roads, which all have AVX2); on AVX512-VNNI, Q4_K and Q6_K take krows_few below KQUANT_TILED_ROWS rows of x (a
// decode step: AVX2's sums left those matrices compute-bound at a fraction of the read bandwidth), krows_tiled from it.
using GroupRowsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const Acts&, int64_t, float*, int64_t);

template <GFmt F>
GroupRowsFn group_rows_for(const Road& road) {
#ifdef NANOSERVE_INT8_X86
  if (std::string(road.name) != "scalar") return group_rows_avx2<F>;
#endif
  (void)road;
  return group_rows_scalar<F>;
}

// x's quantized rows as krows_few reads them: each super-block's eight blocks (Q5_0: each eight blocks, the last
// eight padded with zeros), 32 bytes each in position order, in the order its format's registers hold the groups
// (Q4_K: 0, 2, 1, 3, 4, 6, 5, 7: a byte's two nibbles are two groups; Q6_K, Q5_0: 0..7); and for Q6_K (Q5_0), 32
// (16) x each block half's sum, in the order khalves gives the halves (first halves, then second), which vpdpbusd's
// sums on q = qw + 32 (qw + 16) exceed qw's by.
void few_x(GFmt f, const Acts& a, int64_t B, int8_t* xk, int32_t* xh) {
  constexpr int64_t Q4_K_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  const int64_t supers = few_supers(a);
  const int32_t offset = f == GFmt::Q6_K ? 32 : 16;
  for (int64_t r = 0; r < B; ++r)
    for (int64_t u = 0; u < supers; ++u)
      for (int64_t t = 0; t < 8; ++t) {
        const int64_t g = 8 * u + (f == GFmt::Q4_K ? Q4_K_ORDER[t] : t);
        int8_t* to = xk + (r * supers + u) * 256 + 32 * t;
        int32_t h0 = 0, h1 = 0;
        if (g < a.nb) {
          const int8_t* lo = a.qi + r * a.kq + lo_at(g);
          std::memcpy(to, lo, 16);
          std::memcpy(to + 16, lo + 64, 16);
          for (int j = 0; j < 16; ++j) h0 += lo[j], h1 += lo[64 + j];
        } else {
          std::memset(to, 0, 32);
        }
        if (f == GFmt::Q4_K) continue;
        xh[(r * supers + u) * 16 + t] = offset * h0;
        xh[(r * supers + u) * 16 + 8 + t] = offset * h1;
      }
}

// x (B, K) quantized by `road`, then times N weight rows of Q5_0, Q4_K or Q6_K blocks at w: out (B, N). With a team,
// each of its threads quantizes x for itself and computes its share of the rows.
void group_product(const Road& road, GFmt f, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t B,
                   float* o, Team* team = nullptr) {
  const int64_t row_bytes = f == GFmt::Q5_0 ? K / QK * GroupFormat<GFmt::Q5_0>::BYTES
                            : f == GFmt::Q4_K ? K / 256 * GroupFormat<GFmt::Q4_K>::BYTES
                                              : K / 256 * GroupFormat<GFmt::Q6_K>::BYTES;
  Quantized z = quantize(x, B, K, road);
#ifdef NANOSERVE_INT8_X86
  if (road.layout == Layout::QUADS && B < KQUANT_TILED_ROWS) {  // a few rows: krows_few
    thread_local std::vector<int8_t> xk;
    thread_local std::vector<int32_t> xh;
    xk.resize(B * few_supers(z.acts) * 256);
    xh.resize(B * few_supers(z.acts) * 16);
    const int8_t* xkp = xk.data();  // this thread's buffers, read by every thread of torch's (each of a team has its own)
    const int32_t* xhp = xh.data();
    few_x(f, z.acts, B, xk.data(), xh.data());
    parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      if (f == GFmt::Q4_K) avx512_vnni::krows_few<GFmt::Q4_K>(w, row_bytes, begin, end, z.acts, B, xkp, xhp, o, N);
      else if (f == GFmt::Q6_K) avx512_vnni::krows_few<GFmt::Q6_K>(w, row_bytes, begin, end, z.acts, B, xkp, xhp, o, N);
      else avx512_vnni::krows_few<GFmt::Q5_0>(w, row_bytes, begin, end, z.acts, B, xkp, xhp, o, N);
    });
    return;
  }
  if (road.layout == Layout::QUADS && B >= KQUANT_TILED_ROWS && f != GFmt::Q5_0) {  // the K-quants' tiles
    tiled_x(z, B);
    tiled_tasks(team, N, [&](int64_t o0, int64_t o1) {
      if (f == GFmt::Q4_K) avx512_vnni::krows_tiled<GFmt::Q4_K>(w, row_bytes, o0, o1, z.acts, B, o, N);
      else avx512_vnni::krows_tiled<GFmt::Q6_K>(w, row_bytes, o0, o1, z.acts, B, o, N);
    });
    return;
  }
#endif
  const GroupRowsFn rows = f == GFmt::Q5_0 ? group_rows_for<GFmt::Q5_0>(road)
                           : f == GFmt::Q4_K ? group_rows_for<GFmt::Q4_K>(road) : group_rows_for<GFmt::Q6_K>(road);
  parallel_rows(team, N, ROWS_PER_TASK, [&](int64_t begin, int64_t end) { rows(w, row_bytes, begin, end, z.acts, B, o, N); });
}

torch::Tensor group_linear_int8(torch::Tensor x, torch::Tensor blocks, const std::string& fmt, const std::string& name) {
  const Road& road = pick(name);
  const int64_t B = checked_rows(x), K = x.size(-1);
  const GFmt f = fmt == "q5_0" ? GFmt::Q5_0 : fmt == "q4_k" ? GFmt::Q4_K : GFmt::Q6_K;
  const int64_t weights = f == GFmt::Q5_0 ? QK : 256;
  const int64_t bytes = f == GFmt::Q5_0 ? GroupFormat<GFmt::Q5_0>::BYTES
                        : f == GFmt::Q4_K ? GroupFormat<GFmt::Q4_K>::BYTES : GroupFormat<GFmt::Q6_K>::BYTES;
  TORCH_CHECK(K % weights == 0, "x: last dim ", K, " is not a multiple of the block size ", weights, " (", fmt, ")");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
              blocks.is_contiguous(), "blocks: expected a contiguous 2-dim uint8 CPU tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t N = blocks.size(0), row_bytes = K / weights * bytes;
  TORCH_CHECK(blocks.size(1) == row_bytes, "blocks: rows of ", blocks.size(1), " bytes, expected ", row_bytes, " (",
              K / weights, " ", fmt, " blocks of ", bytes, " bytes for ", K, " inputs)");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor out = torch::empty(shape, x.options());
  if (B == 0 || N == 0) return out;
  group_product(road, f, blocks.data_ptr<uint8_t>(), N, K, x.data_ptr<float>(), B, out.data_ptr<float>());
  return out;
}

}  // namespace int8q
}  // namespace

// x (..., K) float32 -> (q int8 (..., K), d float32 (..., K / 32), s int32 (..., K / 32)): the activations
// block_linear_int8 multiplies, as `road`'s quantizer makes them ("" for the best this CPU has).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations_int8(torch::Tensor x, std::string road) {
  using namespace int8q;
  const Road& chosen = pick(road);
  const int64_t B = checked_rows(x), K = x.size(-1), nb = K / QK;
  const Quantized z = quantize(x.data_ptr<float>(), B, K, chosen);
  torch::Tensor q = torch::empty({B, K}, x.options().dtype(torch::kInt8));
  torch::Tensor d = torch::empty({B, nb}, x.options());
  torch::Tensor s = torch::empty({B, nb}, x.options().dtype(torch::kInt32));
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* lo = z.acts.qi + r * z.acts.kq + lo_at(b);
      std::memcpy(q.data_ptr<int8_t>() + r * K + b * QK, lo, 16);
      std::memcpy(q.data_ptr<int8_t>() + r * K + b * QK + 16, lo + 64, 16);
      d.data_ptr<float>()[r * nb + b] = z.acts.d[r * z.acts.ld + b];
      s.data_ptr<int32_t>()[r * nb + b] = z.acts.s[r * z.acts.ld + b];
    }
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  q = q.view(shape);
  shape.back() = nb;
  return {q, d.view(shape), s.view(shape)};
}

// x (..., K) float32 times a weight of N rows held as blocks (N, K / 32 * block bytes; Q4_K, Q6_K: per 256) uint8
// -> (..., N), x quantized to int8 blocks first. road: "" for the best this CPU has, or one of int8_roads() by name.
torch::Tensor block_linear_int8(torch::Tensor x, torch::Tensor blocks, std::string fmt, std::string road) {
  using namespace int8q;
  if (fmt == "q5_0" || fmt == "q4_k" || fmt == "q6_k") return group_linear_int8(x, blocks, fmt, road);
  TORCH_CHECK(fmt == "q4_1" || fmt == "q8_0", "fmt: expected 'q4_1' or 'q8_0', got '", fmt, "'");
  const Fmt f = fmt == "q4_1" ? Fmt::Q4_1 : Fmt::Q8_0;
  const int64_t bytes = f == Fmt::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
  const Road& chosen = pick(road);
  const int64_t B = checked_rows(x), K = x.size(-1);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
              blocks.is_contiguous(), "blocks: expected a contiguous 2-dim uint8 CPU tensor, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t N = blocks.size(0), nb = K / QK, row_bytes = nb * bytes;
  TORCH_CHECK(blocks.size(1) == row_bytes, "blocks: rows of ", blocks.size(1), " bytes, expected ", row_bytes, " (",
              nb, " ", fmt, " blocks of ", bytes, " bytes for ", K, " inputs)");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor out = torch::empty(shape, x.options());
  if (B == 0 || N == 0) return out;
  int8q::product(chosen, f, blocks.data_ptr<uint8_t>(), N, K, x.data_ptr<float>(), B, out.data_ptr<float>());
  return out;
}

namespace {
namespace int8q {

const Road& best() {
  static const Road& road = pick("");
  return road;
}

bool packed_here() { return best().layout != Layout::NONE; }

// x (B, K) quantized, its quads transposed, then times a weight of N rows packed in `road`'s layout: out (B, N).
// Threads split the rows in groups of four; a task's 16 rows stay in cache while every tile of x passes over them.
// From TILED_ROWS rows of x (AVX512-VNNI) the tiled road's tasks of TILE_ROWS rows are taken instead (tiled_tasks).
// With a team, each of its threads quantizes x for itself and computes its share of the rows.
void product_packed(const Road& road, Fmt f, const uint8_t* packed, int64_t N, int64_t K, const float* x, int64_t B,
                    float* out, Team* team = nullptr) {
  TORCH_CHECK(road.layout != Layout::NONE, "road '", road.name, "' has no packed layout");
  TORCH_CHECK(road.layout == Layout::ROWS || !is_k8(f), "road '", road.name, "' has no packed layout for K-quants");
  const int64_t row_bytes = K / QK * fmt_bytes(f);
  Quantized z = quantize(x, B, K, road);
#ifdef NANOSERVE_INT8_X86
  if (road.layout == Layout::QUADS && B >= TILED_ROWS) {  // the tiled road reads q + 128
    tiled_x(z, B);
    tiled_tasks(team, N, [&](int64_t o0, int64_t o1) {
      if (f == Fmt::Q4_1) avx512_vnni::rows_tiled<Fmt::Q4_1>(packed, row_bytes, o0, o1, z.acts, B, out, N);
      else avx512_vnni::rows_tiled<Fmt::Q8_0>(packed, row_bytes, o0, o1, z.acts, B, out, N);
    });
    return;
  }
#endif
  transpose_halves(reinterpret_cast<int8_t*>(z.buffer), B * z.acts.kq / 64);  // qi, in place
  if (road.layout == Layout::ROWS) pair_quads(reinterpret_cast<int8_t*>(z.buffer), B * z.acts.kq / (2 * QUAD));
  parallel_rows(team, (N + 3) / 4, GROUPS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += GROUPS_PER_TASK)
      road.rows_packed(f, packed, row_bytes, g, std::min(end, g + GROUPS_PER_TASK), z.acts, B, out, N);
  });
}

Fmt checked_fmt(const std::string& fmt) {
  TORCH_CHECK(fmt == "q4_1" || fmt == "q8_0" || fmt == "q4_k8" || fmt == "q6_k8",
              "fmt: expected 'q4_1', 'q8_0', 'q4_k8' or 'q6_k8', got '", fmt, "'");
  return fmt == "q4_1" ? Fmt::Q4_1 : fmt == "q8_0" ? Fmt::Q8_0 : fmt == "q4_k8" ? Fmt::Q4_K8 : Fmt::Q6_K8;
}

const Road& packing_road(const std::string& name) {
  const Road& road = pick(name);
  TORCH_CHECK(road.layout != Layout::NONE, "road '", road.name, "' has no packed layout (the x86 roads have)");
  return road;
}

}  // namespace int8q
}  // namespace

// blocks (N, K / 32 * bytes) -> the same bytes in `road`'s packed layout ("" for the best this CPU has: pack_group
// for avx512-vnni, pack_row8 for avx-vnni and avx2), (N + 3) / 4 * 4 rows' worth and PACK_TAIL.
torch::Tensor pack_blocks_int8(torch::Tensor blocks, std::string fmt, std::string road) {
  using namespace int8q;
  const Fmt f = checked_fmt(fmt);
  const Road& chosen = packing_road(road);
  TORCH_CHECK(chosen.layout == Layout::ROWS || !is_k8(f), "road '", chosen.name, "' has no packed layout for ", fmt);
  const int64_t bytes = fmt_bytes(f);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
              blocks.is_contiguous() && blocks.size(1) % bytes == 0,
              "blocks: expected a contiguous uint8 CPU tensor (rows, n * ", bytes, ") of ", fmt, " blocks, got ",
              blocks.scalar_type(), " of shape ", blocks.sizes());
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1), nb = row_bytes / bytes;
  torch::Tensor out = torch::zeros({packed_bytes(N, row_bytes)}, blocks.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, (N + 3) / 4, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int rows = static_cast<int>(std::min<int64_t>(4, N - 4 * g));
      if (chosen.layout == Layout::QUADS) pack_group(f, w + 4 * g * row_bytes, row_bytes, nb, rows, o + 4 * g * row_bytes);
      else
        for (int j = 0; j < rows; ++j) pack_row8(f, w + (4 * g + j) * row_bytes, nb, o + (4 * g + j) * row_bytes);
    }
  });
  return out;
}

// x (..., K) float32 times a weight of N rows packed by `road` (pack_blocks_int8, the same road) -> (..., N):
// block_linear_int8's bits.
torch::Tensor block_linear_int8_packed(torch::Tensor x, torch::Tensor packed, std::string fmt, int64_t N,
                                       std::string road) {
  using namespace int8q;
  const Fmt f = checked_fmt(fmt);
  const Road& chosen = packing_road(road);
  const int64_t B = checked_rows(x), K = x.size(-1);
  const int64_t row_bytes = K / QK * fmt_bytes(f);
  TORCH_CHECK(N >= 0 && packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.dim() == 1 &&
              packed.is_contiguous() && packed.numel() == packed_bytes(N, row_bytes),
              "packed: expected the ", packed_bytes(N, row_bytes), " contiguous uint8 bytes of ", N, " rows of ", K,
              " inputs as ", fmt, " packed, got ", packed.scalar_type(), " of shape ", packed.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor out = torch::empty(shape, x.options());
  if (B > 0 && N > 0)
    product_packed(chosen, f, packed.data_ptr<uint8_t>(), N, K, x.data_ptr<float>(), B, out.data_ptr<float>());
  return out;
}

// x (B, K) times a weight of N rows held as blocks -> out (B, N), on the best road this CPU has: block_linear_int8
// on raw numbers, for callers that have checked the shapes (BlockModel, step.cpp).
void block_product_int8(const uint8_t* w, bool q4_1, int64_t N, int64_t K, const float* x, int64_t B, float* out,
                        Team* team) {
  if (B > 0 && N > 0)
    int8q::product(int8q::best(), q4_1 ? int8q::Fmt::Q4_1 : int8q::Fmt::Q8_0, w, N, K, x, B, out, team);
}

std::pair<const uint8_t*, int64_t> packed_share(const uint8_t* packed, bool q4_1, int64_t N, int64_t K,
                                                const Team& team) {
  const int64_t group_bytes = 4 * K / int8q::QK * (q4_1 ? int8q::Q4_1_BYTES : int8q::Q8_0_BYTES);
  const auto [begin, end] = team.share((N + 3) / 4, int8q::GROUPS_PER_TASK);  // product_packed's cut
  return {packed + begin * group_bytes, (end - begin) * group_bytes};
}

void block_product_int8_kquant(const uint8_t* w, int kfmt, int64_t N, int64_t K, const float* x, int64_t B, float* out,
                               Team* team) {
  using int8q::GFmt;
  if (B > 0 && N > 0)
    int8q::group_product(int8q::best(), kfmt == 1 ? GFmt::Q4_K : kfmt == 2 ? GFmt::Q6_K : GFmt::Q5_0, w, N, K, x, B, out,
                         team);
}

// Whether B rows of x meet a Q5_0 weight's own blocks (krows_few: 22 bytes a block read) rather than its packed Q8_0
// copy (34): on the AVX512-VNNI road, for one row of x, whose product is read-bound; from two rows the packed quads'
// multiplies, four rows of x a quad, are the faster.
bool int8_q5_0_blocks(int64_t B) { return int8q::best().layout == int8q::Layout::QUADS && B < 2; }

std::pair<const uint8_t*, int64_t> q5_0_share(const uint8_t* w, int64_t N, int64_t K, const Team& team) {
  const int64_t row_bytes = K / int8q::QK * int8q::GroupFormat<int8q::GFmt::Q5_0>::BYTES;
  const auto [begin, end] = team.share(N, int8q::ROWS_PER_TASK);  // group_product's cut
  return {w + begin * row_bytes, (end - begin) * row_bytes};
}

int64_t int8_packed_bytes(bool q4_1, int64_t N, int64_t K) {
  return int8q::packed_bytes(N, K / int8q::QK * (q4_1 ? int8q::Q4_1_BYTES : int8q::Q8_0_BYTES));
}

// Whether this CPU's int8 road has a packed layout (the x86 roads: BlockModel reads packed copies then).
bool int8_packed_here() { return int8q::packed_here(); }

bool int8_amx(int64_t on) {
  TORCH_CHECK(on >= -1 && on <= 1, "int8_amx: on is -1 (ask), 0 or 1, got ", on);
  TORCH_CHECK(on != 1 || int8q::amx_int8_here(), "int8_amx: this CPU (or process) has no AMX-INT8 tiles");
  if (on >= 0) int8q::amx_int8.store(static_cast<int>(on));
  return int8q::amx_int8_on();
}

void block_product_int8_packed(const uint8_t* packed, bool q4_1, int64_t N, int64_t K, const float* x, int64_t B,
                               float* out, Team* team) {
  if (B > 0 && N > 0)
    int8q::product_packed(int8q::best(), q4_1 ? int8q::Fmt::Q4_1 : int8q::Fmt::Q8_0, packed, N, K, x, B, out, team);
}

// The road block_linear_int8 takes by default on this CPU: "avx512-vnni", "avx-vnni", "avx2" or "scalar".
std::string int8_road() { return int8q::pick("").name; }

// From how many rows of x the AVX512-VNNI road multiplies tiles: (Q4_1, Q8_0 and Q5_0 as Q8_0; Q4_K and Q6_K).
std::pair<int64_t, int64_t> int8_tiled_rows() { return {int8q::TILED_ROWS, int8q::KQUANT_TILED_ROWS}; }

// Every road this CPU can run, best first (each gives the same bits).
std::vector<std::string> int8_roads() {
  std::vector<std::string> names;
  for (const int8q::Road& road : int8q::ROADS)
    if (road.here()) names.emplace_back(road.name);
  return names;
}

#else  // NANOSERVE_INT8_ROAD ---------------------------- one x86 road's loops, included once per road above

#define ROAD_FN __attribute__((target(INT8_TARGET))) inline

#if NANOSERVE_INT8_ROAD == 1  // ---- AVX512-VNNI: a quad of blocks to a register

// x_j * id rounded as roundf (quantize_row_scalar's steps, 16 at a time) and clamped to +-127
ROAD_FN __m512i round_away(__m512 v) {
  const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 one = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0f)),
      _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));  // copysign
  const __m512 r = _mm512_mask_add_ps(t, up, t, one);
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), r)));
}

ROAD_FN void quantize_row(const float* x, int64_t nb, int8_t* qi, float* d, int32_t* s, float* ds) {
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1), top = _mm512_set1_ps(FLT_MAX);
    int8_t* lo = qi + lo_at(b);
    if ((_mm512_cmp_ps_mask(a0, top, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, top, _CMP_LE_OQ)) != 0xffff) {
      quantize_bad(lo, d + b, s + b, ds + b);
      continue;
    }
    const float db = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) / 127.0f;
    const __m512 id = _mm512_set1_ps(db >= FLT_MIN ? 1.0f / db : 0.0f);
    const __m512i q0 = round_away(_mm512_mul_ps(v0, id)), q1 = round_away(_mm512_mul_ps(v1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 64), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = db;
    s[b] = sum;
    ds[b] = db * static_cast<float>(sum);
  }
}

ROAD_FN __mmask16 first16(int64_t c) { return c >= 16 ? 0xffff : c <= 0 ? 0 : static_cast<__mmask16>((1u << c) - 1); }
ROAD_FN __mmask32 first32(int64_t c) {
  return c >= 32 ? 0xffffffffu : c <= 0 ? 0 : static_cast<__mmask32>((1u << c) - 1);
}

// Four weight rows go together, a quad of blocks (4 blocks) of each at a time: lane 4j + i of a register holds
// row j's block i of the quad, so the 16 lanes are full whatever the row length, and the fp32 work of a quad of
// four rows is one vector op. Row j's 16 sums (lane b % 16) live in four registers acc[t] (t = quad % 4), at
// lanes 4j..4j+3: the tree then adds acc[0] + acc[2] and acc[1] + acc[3] as whole registers.
//
// Permute indices. Q4_1 (20 bytes = 5 dwords a block): block i's head (fp16 d, fp16 m) is the quad's dword 5i,
// its nibbles dwords 5i + 1..5i + 4. Q8_0 (34 bytes = 17 words a block): block i's fp16 d is word 17i, its
// weights words 17i + 1..17i + 16 (positions 16..31 read from 16 bytes on, at the same indices).
alignas(64) constexpr int32_t Q41_NIBBLES[16] = {1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19};
alignas(64) constexpr int32_t Q41_HEADS[2][16] = {  // rows 0, 1 (or 2, 3) from their first 64 bytes
    {0, 5, 10, 15, 16, 21, 26, 31},
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 10, 15, 16, 21, 26, 31}};
alignas(64) constexpr int16_t Q80_WEIGHTS[32] = {  // block i's positions 0..15 (words 17i + 1..17i + 8)
    1, 2, 3, 4, 5, 6, 7, 8, 18, 19, 20, 21, 22, 23, 24, 25, 35, 36, 37, 38, 39, 40, 41, 42, 52, 53, 54, 55, 56, 57, 58, 59};
alignas(64) constexpr int16_t Q80_HEADS[4][32] = {  // row j from its first 128 bytes, to words 4j..4j+3
    {0, 17, 34, 51},
    {0, 0, 0, 0, 0, 17, 34, 51},
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 34, 51},
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 34, 51}};

ROAD_FN __m512i idx(const void* p) { return _mm512_load_si512(p); }

// Quad t of four rows (row j's n real blocks at q[j]) -> each block's head in lane 4j + i (Q4_1: d | m << 16;
// Q8_0: d in 16-bit lane 4j + i), and each row's weights as unsigned bytes in the activations' quad layout
// (lo[j] = positions 0..15, hi[j] = 16..31). Masked loads read the n real blocks only; the rest are zero.
// Q8_0's signed weights are moved to w + 128 (vpdpbusd multiplies unsigned by signed); the 128 * s this adds to
// a block's sum is taken off after.
template <Fmt F>
ROAD_FN void load_quads(const uint8_t* const* q, int64_t n, __m512i& head, __m512i* lo, __m512i* hi) {
  if constexpr (F == Fmt::Q4_1) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i first[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      first[j] = _mm512_maskz_loadu_epi32(first16(5 * n), q[j]);
      const __m512i rest = _mm512_maskz_loadu_epi32(first16(5 * n - 16), q[j] + 64);
      const __m512i v = _mm512_permutex2var_epi32(first[j], idx(Q41_NIBBLES), rest);
      lo[j] = _mm512_and_si512(v, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
    }
    head = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(first[0], idx(Q41_HEADS[0]), first[1]),
                                   _mm512_permutex2var_epi32(first[2], idx(Q41_HEADS[1]), first[3]));
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    head = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int64_t words = 17 * n;  // the real blocks' 16-bit words
      const __m512i z0 = _mm512_maskz_loadu_epi16(first32(words), q[j]);
      const __m512i z1 = _mm512_maskz_loadu_epi16(first32(words - 32), q[j] + 64);
      const __m512i y0 = _mm512_maskz_loadu_epi16(first32(words - 8), q[j] + 16);  // the same 16 bytes on
      const __m512i y1 = _mm512_maskz_loadu_epi16(first32(words - 40), q[j] + 80);
      head = _mm512_mask_blend_epi16(0xfu << (4 * j), head, _mm512_permutex2var_epi16(z0, idx(Q80_HEADS[j]), z1));
      lo[j] = _mm512_xor_si512(_mm512_permutex2var_epi16(z0, idx(Q80_WEIGHTS), z1), flip);
      hi[j] = _mm512_xor_si512(_mm512_permutex2var_epi16(y0, idx(Q80_WEIGHTS), y1), flip);
    }
  }
}

// p_j: 128-bit lane i holds 4 partial sums of row j's block i -> the 16 sums, row j's block i in lane 4j + i.
ROAD_FN __m512i block_sums(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
  const __m512i b0 = _mm512_add_epi32(_mm512_unpacklo_epi64(p0, p1), _mm512_unpackhi_epi64(p0, p1));
  const __m512i b1 = _mm512_add_epi32(_mm512_unpacklo_epi64(p2, p3), _mm512_unpackhi_epi64(p2, p3));
  // lane i: (row 0, block i) and (row 1, block i) in b0, rows 2 and 3 in b1, two partial sums each
  const __m512 f0 = _mm512_castsi512_ps(b0), f1 = _mm512_castsi512_ps(b1);
  const __m512i c = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(f0, f1, _MM_SHUFFLE(2, 0, 2, 0))),
                                     _mm512_castps_si512(_mm512_shuffle_ps(f0, f1, _MM_SHUFFLE(3, 1, 3, 1))));
  // position 4i + j holds row j's block i
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), c);
}

// Quad t (n real blocks) of four weight rows (row j's blocks at row[j]) against R rows of x (from row r0): each
// row of x's acc[U] (U = t % 4) takes the products in the lanes of the real blocks.
template <Fmt F, int R, int U>
ROAD_FN void step(const uint8_t* const* row, int64_t t, int64_t n, const Acts& a, int64_t r0, __m512 (*acc)[4]) {
  const uint8_t* q[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    q[j] = row[j] + t * 4 * block_bytes<F>();
    for (int64_t ahead = PREFETCH; ahead < PREFETCH + 4 * block_bytes<F>(); ahead += 64)  // every line of the quad
      ROAD_PREFETCH(q[j] + ahead);
  }
  __m512i head, lo[4], hi[4];
  load_quads<F>(q, n, head, lo, hi);
  const __mmask16 real = static_cast<__mmask16>(0x1111u * ((1u << n) - 1));
  const __m512 dw = _mm512_cvtph_ps(F == Fmt::Q4_1 ? _mm512_cvtepi32_epi16(head) : _mm512_castsi512_si256(head));
  const __m512 mw = F == Fmt::Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))) : dw;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int8_t* qx = a.qi + (r0 + r) * a.kq + t * QUAD;
    const __m512i xlo = _mm512_loadu_si512(qx), xhi = _mm512_loadu_si512(qx + 64);
    __m512i p[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      p[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], xlo), hi[j], xhi);
    __m512i isum = block_sums(p[0], p[1], p[2], p[3]);
    const int64_t at = (r0 + r) * a.ld + 4 * t;  // this quad's 4 activation blocks, the same for every row j
    if constexpr (F == Fmt::Q8_0)  // the 128 * s
      isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(
                                        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.s + at))), 7));
    __m512 c = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_broadcast_f32x4(_mm_loadu_ps(a.d + at))), _mm512_cvtepi32_ps(isum));
    if constexpr (F == Fmt::Q4_1)
      c = _mm512_add_ps(c, _mm512_mul_ps(mw, _mm512_broadcast_f32x4(_mm_loadu_ps(a.ds + at))));
    acc[r][U] = _mm512_mask_add_ps(acc[r][U], real, acc[r][U], c);
  }
}

// Four weight rows (row j at w + min(j, rows - 1) * row_bytes: a missing row repeats the last, unstored) against
// R rows of x (from row r0): out[r * ldo + j].
template <Fmt F, int R>
ROAD_FN void tile(const uint8_t* w, int64_t row_bytes, int rows, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  const uint8_t* row[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) row[j] = w + std::min(j, rows - 1) * row_bytes;
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; 4 * (t + 4) <= a.nb; t += 4) {  // whole groups of 16 blocks
    step<F, R, 0>(row, t, 4, a, r0, acc);
    step<F, R, 1>(row, t + 1, 4, a, r0, acc);
    step<F, R, 2>(row, t + 2, 4, a, r0, acc);
    step<F, R, 3>(row, t + 3, 4, a, r0, acc);
  }
  const int64_t left = a.nb - 4 * t;  // 0..15 blocks: up to 4 quads, the last maybe part of one
  if (left > 0) step<F, R, 0>(row, t, std::min<int64_t>(4, left), a, r0, acc);
  if (left > 4) step<F, R, 1>(row, t + 1, std::min<int64_t>(4, left - 4), a, r0, acc);
  if (left > 8) step<F, R, 2>(row, t + 2, std::min<int64_t>(4, left - 8), a, r0, acc);
  if (left > 12) step<F, R, 3>(row, t + 3, left - 12, a, r0, acc);
  // the tree, four rows at once: lane 4j of v ends with row j's result
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 v = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][2]), _mm512_add_ps(acc[r][1], acc[r][3]));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(3, 2, 3, 2)));  // + 2 along
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(1, 1, 1, 1)));  // + 1 along
    alignas(64) float lanes[16];  // stored whole and picked: a compressing store is microcoded and slow on Zen 4
    _mm512_store_ps(lanes, v);
    for (int j = 0; j < rows; ++j) out[r * ldo + j] = lanes[4 * j];
  }
}

constexpr int TILE = 4;  // rows of x per quad of four weight rows read

// ---- the packed layout (pack_group): a quad's weights are whole registers, lane 4j + i for row j's block i,
// and the activations are read in the matching order, so the integer sums land in their lanes with no permute.

// A short quad of n < 4 blocks is stored compact; SHORT_QUAD[n] takes lane 4j + i from its lane j * n + i (lanes
// i >= n are masked off).
alignas(64) constexpr int32_t SHORT_QUAD[4][16] = {
    {}, {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {0, 1, 1, 1, 2, 3, 3, 3, 4, 5, 5, 5, 6, 7, 7, 7},
    {0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11}};

ROAD_FN __m512i chunk(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Quad t (n real blocks, FULL: n = 4) of a packed group at p -> its weights as unsigned bytes in place (w[k], lane
// 4j + i; Q4_1: 0..15, Q8_0: w + 128), d and m in their lanes (zero past a short quad's n blocks), and the mask of
// the real lanes.
template <Fmt F, bool FULL>
ROAD_FN __mmask16 punpack(const uint8_t* p, int64_t n, __m512i* w, __m512& dw, __m512& mw) {
  constexpr int REGS = F == Fmt::Q4_1 ? 4 : 8;
  const __mmask16 real = FULL ? 0xffff : static_cast<__mmask16>(0x1111u * ((1u << n) - 1));
  const int64_t reg = FULL ? 64 : 16 * n;
  // a short quad's lanes move into place by a plain load and a fixed permute: every row of the model's K = 576
  // ends in one, and an index built in memory per quad (narrow stores read back as one register stall the load)
  // with an expanding load made that quad cost more than a whole one
  const __m512i spread = FULL ? _mm512_setzero_si512() : idx(SHORT_QUAD[n]);
  const __mmask16 stored = first16(4 * n);  // a short quad's compact lanes
#pragma GCC unroll 8
  for (int k = 0; k < REGS; ++k)
    w[k] = FULL ? _mm512_loadu_si512(p + 64 * k)
                : _mm512_maskz_permutexvar_epi32(real, spread, _mm512_maskz_loadu_epi32(stored, p + reg * k));
  if constexpr (F == Fmt::Q4_1) {
    const __m512i low = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      w[4 + k] = _mm512_and_si512(_mm512_srli_epi32(w[k], 4), low);
      w[k] = _mm512_and_si512(w[k], low);
    }
  }
  const uint8_t* h = p + REGS * reg;
  if constexpr (FULL) {
    dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    mw = F == Fmt::Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32))) : dw;
  } else {  // compact lanes j * n + i -> lane 4j + i
    dw = _mm512_maskz_permutexvar_ps(real, spread, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(stored, h)));
    mw = F == Fmt::Q4_1 ? _mm512_maskz_permutexvar_ps(real, spread,
                                                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(stored, h + 8 * n)))
                        : dw;
  }
  return real;
}

// Quad t (n real blocks, FULL: n = 4) of a packed group at p against R rows of x, into acc[r][U].
template <Fmt F, int R, int U, bool FULL>
ROAD_FN void pstep(const uint8_t* p, int64_t t, int64_t n, const Acts& a, int64_t r0, __m512 (*acc)[4]) {
  // Q8_0 against one or two rows of x (a decode step's head: Gemma 3's is 178 MB) streams faster on an AMD CPU
  // with no asking at all, its hardware prefetchers left to it; more rows, or Q4_1, gain from the asking
  if (!(F == Fmt::Q8_0 && R <= 2 && AMD_CPU))
    for (int64_t ahead = PREFETCH; ahead < PREFETCH + 4 * n * block_bytes<F>(); ahead += 64)  // the quad's lines
      ROAD_PREFETCH(p + ahead);
  __m512i w[8];
  __m512 dw, mw;
  const __mmask16 real = punpack<F, FULL>(p, n, w, dw, mw);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int8_t* qx = a.qi + (r0 + r) * a.kq + t * QUAD;
    __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], chunk(qx));
    __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], chunk(qx + 64));
#pragma GCC unroll 3
    for (int k = 1; k < 4; ++k) {
      s0 = _mm512_dpbusd_epi32(s0, w[k], chunk(qx + 16 * k));
      s1 = _mm512_dpbusd_epi32(s1, w[4 + k], chunk(qx + 64 + 16 * k));
    }
    __m512i isum = _mm512_add_epi32(s0, s1);
    const int64_t at = (r0 + r) * a.ld + 4 * t;
    if constexpr (F == Fmt::Q8_0)  // the 128 * s
      isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(
                                        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.s + at))), 7));
    __m512 c = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_broadcast_f32x4(_mm_loadu_ps(a.d + at))), _mm512_cvtepi32_ps(isum));
    if constexpr (F == Fmt::Q4_1)
      c = _mm512_add_ps(c, _mm512_mul_ps(mw, _mm512_broadcast_f32x4(_mm_loadu_ps(a.ds + at))));
    acc[r][U] = FULL ? _mm512_add_ps(acc[r][U], c) : _mm512_mask_add_ps(acc[r][U], real, acc[r][U], c);
  }
}

template <Fmt F, int R, int U>
ROAD_FN const uint8_t* pquad(const uint8_t* p, int64_t t, int64_t n, const Acts& a, int64_t r0, __m512 (*acc)[4]) {
  if (n == 4) pstep<F, R, U, true>(p, t, 4, a, r0, acc);
  else pstep<F, R, U, false>(p, t, n, a, r0, acc);
  return p + 4 * n * block_bytes<F>();
}

// Each row's 16 sums (acc[r][0..3], row j at lanes 4j..4j+3) -> row j's result, tree16's adds as whole registers.
template <int R>
ROAD_FN void ptree(__m512 (*acc)[4], int rows, float* out, int64_t ldo) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 v = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][2]), _mm512_add_ps(acc[r][1], acc[r][3]));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(3, 2, 3, 2)));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(1, 1, 1, 1)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (int j = 0; j < rows; ++j) out[r * ldo + j] = lanes[4 * j];
  }
}

// A packed group of four weight rows (`rows` of them real) against R rows of x (from row r0): out[r * ldo + j].
template <Fmt F, int R>
ROAD_FN void ptile(const uint8_t* p, int rows, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
  constexpr int64_t QB = 16 * block_bytes<F>();
  int64_t t = 0;
  for (; 4 * (t + 4) <= a.nb; t += 4, p += 4 * QB) {
    pstep<F, R, 0, true>(p, t, 4, a, r0, acc);
    pstep<F, R, 1, true>(p + QB, t + 1, 4, a, r0, acc);
    pstep<F, R, 2, true>(p + 2 * QB, t + 2, 4, a, r0, acc);
    pstep<F, R, 3, true>(p + 3 * QB, t + 3, 4, a, r0, acc);
  }
  const int64_t left = a.nb - 4 * t;
  if (left > 0) p = pquad<F, R, 0>(p, t, std::min<int64_t>(4, left), a, r0, acc);
  if (left > 4) p = pquad<F, R, 1>(p, t + 1, std::min<int64_t>(4, left - 4), a, r0, acc);
  if (left > 8) p = pquad<F, R, 2>(p, t + 2, std::min<int64_t>(4, left - 8), a, r0, acc);
  if (left > 12) p = pquad<F, R, 3>(p, t + 3, left - 12, a, r0, acc);
  ptree<R>(acc, rows, out, ldo);
}

// ---- the tiled road (many rows of x): weight rows unpacked once into a tile, then every four rows of x multiplied
// by it. Each format's unpacker writes a group of four rows as quads of whole registers, nothing left to unpack
// (lane 4j + i: row j's block i of the quad): the weights as signed bytes (Q4_1's 0..15, Q8_0's own, a K-quant
// group's integers), each lane's scales a and b in fp32 (group_scales' a and b; Q4_1's d and m), and each lane's
// -128 * (sum of its first and second half's weights): x arrives as q + 128 (unsigned, as vpdpbusd's other side must
// be), and the sums start from these so that they end as the same integers. Four groups' quads are then turned into
// the tile (quads_to_rows). The fp32 steps are pstep's and group_c's, lane for lane: the same bits.
constexpr int64_t TILE_QUAD = 12 * 64;  // bytes of an unpacked quad: 8 weight registers, a, b, two starts

template <Fmt F, bool FULL>
ROAD_FN void tile_quad(const uint8_t* p, int64_t n, uint8_t* out) {
  __m512i w[8];
  __m512 dw, mw;
  punpack<F, FULL>(p, n, w, dw, mw);
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i sum0 = _mm512_setzero_si512(), sum1 = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    if constexpr (F == Fmt::Q8_0) w[k] = _mm512_xor_si512(w[k], flip);  // w + 128 -> w
    if (k < 4) sum0 = _mm512_dpbusd_epi32(sum0, ones, w[k]);
    else sum1 = _mm512_dpbusd_epi32(sum1, ones, w[k]);
    _mm512_store_si512(out + 64 * k, w[k]);
  }
  _mm512_store_ps(out + 512, dw);
  _mm512_store_ps(out + 576, mw);
  _mm512_store_si512(out + 640, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum0, 7)));
  _mm512_store_si512(out + 704, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum1, 7)));
}

// How a tile's lanes are scaled (group_c's steps): PLAIN c = (a * d) * isum (Q8_0, Q5_0); M, then c + b * ds (Q4_1,
// Q4_K); HALVES c = (a * d) * isum0, then c + (b * d) * isum1 (Q6_K: a scale each half).
enum TileMode { PLAIN, M, HALVES };

// The micro-kernel's tile: each group of four quads above (16 weight rows) turned so that a register's lane is a
// weight row: for block b, 8 registers (register k, lane o: row o's weights at positions 4k..4k+3), then a, b and the
// two starts, lane o row o's. A row of x then meets 16 weight rows in one vpdpbusd from four of its bytes broadcast
// from memory (no shuffle: the 128-bit broadcasts the quads take cost a shuffle each), and each lane's sums are one
// row's integers: the same integers, the same fp32 steps lane for lane.
constexpr int64_t TILE_BLOCK = TILE_QUAD;  // bytes of a block of 16 weight rows
constexpr int TILE_X = 4;                  // rows of x the micro-kernel takes at once

// Lane 4i + j <- lane 4j + i: a quad register's 4 x 4 (row, block) transposed.
alignas(64) constexpr int32_t TRANSPOSE4[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Quad t of four groups' quads (q[g]: group g's, lanes 4j + i) -> blocks 4t..4t + n - 1 of 16 rows (lane 4g + j).
ROAD_FN void quads_to_rows(const uint8_t* const q[4], int64_t n, uint8_t* out) {
  const __m512i turn = idx(TRANSPOSE4);
#pragma GCC unroll 12
  for (int v = 0; v < 12; ++v) {
    __m512i g[4];
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) g[h] = _mm512_permutexvar_epi32(turn, _mm512_load_si512(q[h] + 64 * v));
    const __m512i p0 = _mm512_shuffle_i32x4(g[0], g[1], 0x44), p1 = _mm512_shuffle_i32x4(g[2], g[3], 0x44);
    const __m512i p2 = _mm512_shuffle_i32x4(g[0], g[1], 0xee), p3 = _mm512_shuffle_i32x4(g[2], g[3], 0xee);
    const __m512i b[4] = {_mm512_shuffle_i32x4(p0, p1, 0x88), _mm512_shuffle_i32x4(p0, p1, 0xdd),
                          _mm512_shuffle_i32x4(p2, p3, 0x88), _mm512_shuffle_i32x4(p2, p3, 0xdd)};
    for (int64_t i = 0; i < n; ++i) _mm512_store_si512(out + i * TILE_BLOCK + 64 * v, b[i]);
  }
}

// Rows r0..r0 + R - 1 of x (q + 128, quads transposed) against NW groups of 16 weight rows (group n's blocks at
// tile + n * gstride): out[r * ldo + 16n + o] for the first `cols` of the 16 * NW rows. Block b's sums go to
// acc[b % 16]; the blocks of one acc are taken together (b = j, j + 16, ...), each acc is kept, and tree16's adds
// are then whole registers: lane o is row o's tree.
template <int MODE, int R, int NW>
ROAD_FN void otile(const uint8_t* tile, int64_t gstride, const Acts& a, int64_t r0, float* out, int64_t ldo,
                   int64_t cols) {
  alignas(64) float kept[GROUP][R][NW][16];
  const int8_t* x0 = a.qi + r0 * a.kq;
  for (int64_t j = 0; j < GROUP; ++j) {
    __m512 acc[R][NW];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int n = 0; n < NW; ++n) acc[r][n] = _mm512_setzero_ps();
    for (int64_t b = j; b < a.nb; b += GROUP) {
      const uint8_t* q = tile + b * TILE_BLOCK;
      const int8_t* xb = x0 + (b / 4) * QUAD + 4 * (b % 4);
      __m512i s[R][NW];
      __m512 c[R][NW];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // positions 0..15, then 16..31
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int n = 0; n < NW; ++n)
            if (MODE == HALVES || h == 0) s[r][n] = _mm512_load_si512(q + n * gstride + 640 + 64 * h);
#pragma GCC unroll 4
        for (int k = 4 * h; k < 4 * h + 4; ++k) {
          __m512i w[NW];
#pragma GCC unroll 4
          for (int n = 0; n < NW; ++n) w[n] = _mm512_load_si512(q + n * gstride + 64 * k);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i xk = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * a.kq + 64 * h + 16 * (k % 4)));
#pragma GCC unroll 4
            for (int n = 0; n < NW; ++n) s[r][n] = _mm512_dpbusd_epi32(s[r][n], xk, w[n]);
          }
        }
        if (MODE != HALVES && h == 0) continue;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 d = _mm512_set1_ps(a.d[(r0 + r) * a.ld + b]);
#pragma GCC unroll 4
          for (int n = 0; n < NW; ++n) {
            const uint8_t* qn = q + n * gstride;
            if (MODE == HALVES && h == 0) {
              c[r][n] = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(qn + 512), d), _mm512_cvtepi32_ps(s[r][n]));
              continue;
            }
            __m512 v;
            if constexpr (MODE == HALVES) {
              v = _mm512_add_ps(c[r][n], _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(qn + 576), d),
                                                       _mm512_cvtepi32_ps(s[r][n])));
            } else {
              v = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(qn + 512), d),
                                _mm512_cvtepi32_ps(_mm512_add_epi32(s[r][n], _mm512_load_si512(qn + 704))));
              if constexpr (MODE == M)
                v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_load_ps(qn + 576), _mm512_set1_ps(a.ds[(r0 + r) * a.ld + b])));
            }
            acc[r][n] = _mm512_add_ps(acc[r][n], v);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int n = 0; n < NW; ++n) _mm512_store_ps(kept[j][r][n], acc[r][n]);
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NW && 16 * n < cols; ++n) {
      __m512 t[8], u[4];
      for (int j = 0; j < 8; ++j) t[j] = _mm512_add_ps(_mm512_load_ps(kept[j][r][n]), _mm512_load_ps(kept[j + 8][r][n]));
      for (int j = 0; j < 4; ++j) u[j] = _mm512_add_ps(t[j], t[j + 4]);
      _mm512_mask_storeu_ps(out + r * ldo + 16 * n, first16(cols - 16 * n),
                            _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3])));
    }
}

#if NANOSERVE_INT8_ROAD == 1
// ---- the tiled road on AMX's tile unit (Intel's; int8_amx): the tile as the micro-kernel reads it is already what
// AMX's tdpbusd takes as its B operand (block b of 16 weight rows: 8 rows of 64 bytes, row k lane o = row o's weights
// at positions 4k..4k + 3), and 16 rows of x (q + 128, each block's 32 bytes in order: plain_blocks) are its A
// operand: one tdpbusd gives the 16 x 16 integer sums of a block that otile's 128 vpdpbusd give, the same integers.
// They are stored, and the fp32 steps are otile's, lane for lane, into the same 16 sums a row: the same bits.
#define AMX_FN __attribute__((target(INT8_TARGET ",amx-tile,amx-int8"))) inline

// Tiles for `rows` rows of x: 0 and 1 the sums. Whole blocks (PLAIN, M): two sets, each a block of x (32 bytes a
// row: tiles 2, 4) and a block of weights (8 x 64: 3, 5), so that one block's product runs while the last one's sums
// are scaled; HALVES: the halves of a block of x (16 bytes: 4, 5) and of weights (4 x 64: 6, 7).
AMX_FN void amx_config(int rows, bool halves) {
  AmxTiles c;
  const uint8_t r = static_cast<uint8_t>(rows);
  c.colsb[0] = c.colsb[1] = 64, c.rows[0] = c.rows[1] = r;
  if (halves) {
    c.colsb[4] = c.colsb[5] = 16, c.rows[4] = c.rows[5] = r;
    c.colsb[6] = c.colsb[7] = 64, c.rows[6] = c.rows[7] = 4;
  } else {
    c.colsb[2] = c.colsb[4] = 32, c.rows[2] = c.rows[4] = r;
    c.colsb[3] = c.colsb[5] = 64, c.rows[3] = c.rows[5] = 8;
  }
  load_tiles(c);
}

AMX_FN void amx_release() { _tile_release(); }

// Block b's integer sums into C tile T from the tiles A and W (a whole block: PLAIN, M).
#define AMX_BLOCK(T, A, W, b)                        \
  do {                                               \
    _tile_zero(T);                                   \
    _tile_loadd(A, x0 + 32 * (b), a.kq);             \
    _tile_loadd(W, q0 + (b) * TILE_BLOCK, 64);       \
    _tile_dpbusd(T, A, W);                           \
  } while (0)

// Rows r0..r0 + R - 1 of x (the tiles configured for R rows, R <= 16) against one group of 16 weight rows (its
// blocks at q0, TILE_BLOCK apart): out[r * ldo + o] for the first `cols` of the 16. Block b's sums go to acc[b % 16],
// the blocks of one acc taken in order (b = j, j + 16, ...), then tree16's adds, as otile's. Whole blocks are taken
// two tiles deep: the next block's product is asked for before this one's sums are scaled, so that the tile unit's
// latency hides behind the vector work.
template <int MODE>
AMX_FN void amx_group(const uint8_t* q0, const Acts& a, int64_t r0, int R, float* out, int64_t ldo, int64_t cols) {
  alignas(64) float kept[GROUP][16][16];
  alignas(64) int32_t c0[16][16], c1[16][16];
  const uint8_t* x0 = reinterpret_cast<const uint8_t*>(a.qi) + r0 * a.kq;
  const int64_t js = std::min<int64_t>(GROUP, a.nb);
  for (int64_t j = js; j < GROUP; ++j)  // no blocks: zero sums
    for (int r = 0; r < 16; ++r) _mm512_store_ps(kept[j][r], _mm512_setzero_ps());
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  // the blocks in the order their sums are taken: j = 0, 16, 32, ..., then 1, 17, ...; -1 after the last
  const auto after = [&](int64_t b) -> int64_t {
    if (b + GROUP < a.nb) return b + GROUP;
    return b % GROUP + 1 < js ? b % GROUP + 1 : -1;
  };
  int turn = 0;
  if constexpr (MODE != HALVES) AMX_BLOCK(0, 2, 3, 0);
  for (int64_t b = 0; b >= 0;) {
    const int64_t next = after(b);
    const uint8_t* q = q0 + b * TILE_BLOCK;
    if constexpr (MODE == HALVES) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(4, x0 + 32 * b, a.kq);
      _tile_loadd(6, q, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_loadd(5, x0 + 32 * b + 16, a.kq);
      _tile_loadd(7, q + 256, 64);
      _tile_dpbusd(1, 5, 7);
      _tile_stored(0, c0, 64);
      _tile_stored(1, c1, 64);
    } else if (turn == 0) {
      if (next >= 0) AMX_BLOCK(1, 4, 5, next);
      _tile_stored(0, c0, 64);
    } else {
      if (next >= 0) AMX_BLOCK(0, 2, 3, next);
      _tile_stored(1, c0, 64);
    }
    turn ^= 1;
    const __m512 wa = _mm512_load_ps(q + 512), wb = _mm512_load_ps(q + 576);
    const __m512i s0 = _mm512_load_si512(q + 640), s1 = _mm512_load_si512(q + 704);
    const __m512i both = _mm512_add_epi32(s0, s1);
    const float* d = a.d + r0 * a.ld + b;
    const float* ds = a.ds + r0 * a.ld + b;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (r >= R) break;
      const __m512 dr = _mm512_set1_ps(d[r * a.ld]);
      __m512 v;
      if constexpr (MODE == HALVES) {
        const __m512 c = _mm512_mul_ps(_mm512_mul_ps(wa, dr),
                                       _mm512_cvtepi32_ps(_mm512_add_epi32(s0, _mm512_load_si512(c0[r]))));
        v = _mm512_add_ps(c, _mm512_mul_ps(_mm512_mul_ps(wb, dr),
                                           _mm512_cvtepi32_ps(_mm512_add_epi32(s1, _mm512_load_si512(c1[r])))));
      } else {
        v = _mm512_mul_ps(_mm512_mul_ps(wa, dr), _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(c0[r]), both)));
        if constexpr (MODE == M) v = _mm512_add_ps(v, _mm512_mul_ps(wb, _mm512_set1_ps(ds[r * a.ld])));
      }
      acc[r] = _mm512_add_ps(acc[r], v);
    }
    if (next < 0 || next % GROUP != b % GROUP) {  // the last block of acc b % 16
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        _mm512_store_ps(kept[b % GROUP][r], acc[r]);
        acc[r] = _mm512_setzero_ps();
      }
    }
    b = next;
  }
  for (int r = 0; r < R; ++r) {
    __m512 t[8], u[4];
    for (int j = 0; j < 8; ++j) t[j] = _mm512_add_ps(_mm512_load_ps(kept[j][r]), _mm512_load_ps(kept[j + 8][r]));
    for (int j = 0; j < 4; ++j) u[j] = _mm512_add_ps(t[j], t[j + 4]);
    _mm512_mask_storeu_ps(out + r * ldo, first16(cols),
                          _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3])));
  }
}
#undef AMX_BLOCK
#endif

// Rows r0..r0 + xr - 1 of x (xr <= TILE_X) against the tile's first `groups` groups.
template <int MODE, int R = TILE_X>
ROAD_FN void orows(int xr, int groups, const uint8_t* tile, int64_t gstride, const Acts& a, int64_t r0, float* out,
                   int64_t ldo, int64_t cols) {
  if constexpr (R > 0) {
    if (xr != R) return orows<MODE, R - 1>(xr, groups, tile, gstride, a, r0, out, ldo, cols);
    constexpr int WIDE = MODE == HALVES ? 2 : 3;  // Q6_K's second scale takes registers: two groups at a time
    for (int n = 0; n < groups; n += WIDE) {
      const int here = std::min(WIDE, groups - n);
      const uint8_t* t = tile + n * gstride;
      float* o = out + 16 * n;
      if (here == 3) otile<MODE, R, 3>(t, gstride, a, r0, o, ldo, cols - 16 * n);
      else if (here == 2) otile<MODE, R, 2>(t, gstride, a, r0, o, ldo, cols - 16 * n);
      else otile<MODE, R, 1>(t, gstride, a, r0, o, ldo, cols - 16 * n);
    }
  }
}

// This thread's tile buffer, 64-byte aligned, of `bytes` (a tile, then its groups' quads as their unpacker writes them).
ROAD_FN uint8_t* tile_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> kept;
  if (kept.size() < static_cast<size_t>(bytes + 64)) kept.resize(bytes + 64);
  return kept.data() + (64 - reinterpret_cast<uintptr_t>(kept.data()) % 64) % 64;
}

// The real lanes of a last quad of `left` blocks (1..4).
ROAD_FN __mmask16 quad_lanes(int64_t left) { return static_cast<__mmask16>(0x1111u * ((1u << left) - 1)); }

// Weight rows o0..o1 (o0 a multiple of TILE_ROWS; o1 - o0 <= TILE_ROWS) against all B rows of x (q + 128, quads
// transposed): build(g, quads) unpacks the four rows 4g..4g + 3 into quads (its format's unpacker), which are turned
// into the tile once; then every TILE_X rows of x pass over it. out[r * N + o]. `next`: the next_bytes of weights the
// tasks after this one unpack, asked for into L2 a share before each pass, so that the multiplies hide their reads.
template <int MODE, class Build>
ROAD_FN void tiled_rows(int64_t o0, int64_t o1, const Acts& a, int64_t B, float* out, int64_t N, const Build& build,
                        const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  const int64_t quads = (a.nb + 3) / 4, gstride = a.nb * TILE_BLOCK, groups = (o1 - o0 + 15) / 16;
  uint8_t* tile = tile_buffer(TILE_ROWS / 16 * gstride + 4 * quads * TILE_QUAD);
  uint8_t* unpacked = tile + TILE_ROWS / 16 * gstride;
  for (int64_t n = 0; n < groups; ++n) {
    const uint8_t* q[4];
    for (int h = 0; h < 4; ++h) {
      const int64_t g = (o0 + 16 * n) / 4 + h;
      uint8_t* at = unpacked + h * quads * TILE_QUAD;
      if (4 * g < N) build(g, at);
      else std::memset(at, 0, quads * TILE_QUAD);
      q[h] = at;
    }
    for (int64_t t = 0; t < quads; ++t) {
      const uint8_t* qt[4] = {q[0] + t * TILE_QUAD, q[1] + t * TILE_QUAD, q[2] + t * TILE_QUAD, q[3] + t * TILE_QUAD};
      quads_to_rows(qt, std::min<int64_t>(4, a.nb - 4 * t), tile + n * gstride + 4 * t * TILE_BLOCK);
    }
  }
#if NANOSERVE_INT8_ROAD == 1
  if (a.amx) {  // 16 rows of x at a time on AMX's tile unit
    const int64_t passes = (B + 15) / 16, per_pass = (next_bytes / passes + 63) / 64 * 64;
    amx_config(16, MODE == HALVES);
    for (int64_t r0 = 0, ahead = 0; r0 < B; r0 += 16) {
      for (const int64_t e = std::min(next_bytes, ahead + per_pass); ahead < e; ahead += 64)
        _mm_prefetch(next + ahead, _MM_HINT_T1);
      const int rows = static_cast<int>(std::min<int64_t>(16, B - r0));
      if (rows < 16) amx_config(rows, MODE == HALVES);
      for (int64_t n = 0; n < groups; ++n)
        amx_group<MODE>(tile + n * gstride, a, r0, rows, out + r0 * N + o0 + 16 * n, N, o1 - o0 - 16 * n);
    }
    amx_release();
    return;
  }
#endif
  const int64_t passes = (B + TILE_X - 1) / TILE_X, per_pass = (next_bytes / passes + 63) / 64 * 64;
  for (int64_t r0 = 0, ahead = 0; r0 < B; r0 += TILE_X) {
    for (const int64_t e = std::min(next_bytes, ahead + per_pass); ahead < e; ahead += 64)
      _mm_prefetch(next + ahead, _MM_HINT_T1);
    orows<MODE>(static_cast<int>(std::min<int64_t>(TILE_X, B - r0)), static_cast<int>(groups), tile, gstride, a, r0,
                out + r0 * N + o0, N, o1 - o0);
  }
}

// Weight rows o0..o1 (a task: o0 a multiple of 16, at most TILE_ROWS) of a packed weight of N rows (Q4_1, Q8_0)
// against all B rows of x, each group of four rows unpacked from its quads: out[r * N + o].
template <Fmt F>
ROAD_FN void rows_tiled(const uint8_t* packed, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a, int64_t B,
                        float* out, int64_t N) {
  const int64_t quads = (a.nb + 3) / 4, left = a.nb - 4 * (quads - 1);  // the last quad's blocks, 1..4
  tiled_rows<F == Fmt::Q4_1 ? M : PLAIN>(o0, o1, a, B, out, N, [&](int64_t g, uint8_t* tile) {
    const uint8_t* p = packed + g * 4 * row_bytes;
    for (int64_t t = 0; t < quads; ++t, p += 16 * block_bytes<F>()) {
      if (t < quads - 1 || left == 4) tile_quad<F, true>(p, 4, tile + t * TILE_QUAD);
      else tile_quad<F, false>(p, left, tile + t * TILE_QUAD);
    }
  }, packed + o1 * row_bytes, (std::min(N, o1 + NEXT_TILES * TILE_ROWS) - std::min(N, o1)) * row_bytes);
}

// The K-quants' unpacker: weight rows o..o + 3 of Q4_K or Q6_K blocks (`rows` of them real; a missing row repeats
// the last, its results unstored), each group's integers (group_ints_avx2) and scales (group_scales8) laid out as a
// tile's quads, lane 4j + i row j's group 4t + i.
template <GFmt F>
ROAD_FN void ktile(const uint8_t* w, int64_t row_bytes, int rows, int64_t nb, uint8_t* tile) {
  using G = GroupFormat<F>;
  const int64_t quads = (nb + 3) / 4;
  thread_local std::vector<int8_t> ints;  // row j's group g at (j * nb + g) * 32
  thread_local std::vector<float> scales;  // a at j * nb + g, b at (4 + j) * nb + g
  ints.resize(4 * nb * 32);
  scales.resize(8 * nb);
  for (int j = 0; j < 4; ++j) {
    const uint8_t* row = w + std::min(j, rows - 1) * row_bytes;
    for (int64_t g = 0; g < nb; g += 8) {
      group_scales8<F>(row, g, scales.data() + j * nb + g, scales.data() + (4 + j) * nb + g);
      for (int64_t u = g; u < g + 8; ++u)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ints.data() + (j * nb + u) * 32),
                            group_ints_avx2<F>(row + u / G::GROUPS * G::BYTES, static_cast<int>(u % G::GROUPS)));
    }
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);  // i
  const __m512i row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // j
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t t = 0; t < quads; ++t) {
    const __mmask16 real = t == quads - 1 ? quad_lanes(nb - 4 * t) : static_cast<__mmask16>(0xffff);
    const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32(static_cast<int>(nb))),
                                        _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(4 * t))));
    const __m512i dwords = _mm512_slli_epi32(at, 3);  // each group's first dword
    uint8_t* out = tile + t * TILE_QUAD;
    __m512i sum0 = _mm512_setzero_si512(), sum1 = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real,
                                                    _mm512_add_epi32(dwords, _mm512_set1_epi32(k)), ints.data(), 4);
      if (k < 4) sum0 = _mm512_dpbusd_epi32(sum0, ones, v);
      else sum1 = _mm512_dpbusd_epi32(sum1, ones, v);
      _mm512_store_si512(out + 64 * k, v);
    }
    _mm512_store_ps(out + 512, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, at, scales.data(), 4));
    _mm512_store_ps(out + 576, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real,
                                                        _mm512_add_epi32(at, _mm512_set1_epi32(static_cast<int>(4 * nb))),
                                                        scales.data(), 4));
    _mm512_store_si512(out + 640, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum0, 7)));
    _mm512_store_si512(out + 704, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum1, 7)));
  }
}

// Weight rows o0..o1 (a task, as rows_tiled's) of K-quant blocks against all B rows of x, each group of four rows
// unpacked by ktile: out[r * N + o].
template <GFmt F>
ROAD_FN void krows_tiled(const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a, int64_t B,
                         float* out, int64_t N) {
  constexpr int MODE = F == GFmt::Q6_K ? HALVES : F == GFmt::Q4_K ? M : PLAIN;
  tiled_rows<MODE>(o0, o1, a, B, out, N, [&](int64_t g, uint8_t* tile) {
    ktile<F>(w + 4 * g * row_bytes, row_bytes, static_cast<int>(std::min<int64_t>(4, N - 4 * g)), a.nb, tile);
  }, w + o1 * row_bytes, (std::min(N, o1 + NEXT_TILES * TILE_ROWS) - std::min(N, o1)) * row_bytes);
}

// ---- The K-quants against a few rows of x (fewer than KQUANT_TILED_ROWS: a decode step). A super-block's eight groups are
// unpacked in four registers straight from its bytes, each register two groups' 64 weights (Q4_K: a byte's two
// nibbles are two groups), against x laid in the same order once per product (few_x); vpdpbusd's sums are reduced to
// each group's two halves, eight groups to a register; the fp32 steps are group_rows_avx2's, the scales group_scales8's
// floats decoded in registers. The same integers and steps: the same bits.

// Lane t (i0, lanes 0-7) and 8 + t (i1) of the reduced sums <- lane of h (khalves) holding group t's half.
alignas(64) constexpr int32_t KHALVES[2][16] = {{0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15},  // Q4_K
                                                {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15}};  // Q6_K
alignas(64) constexpr int32_t EVEN_ODD[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

// Super-block blk -> its integer weights as unsigned bytes (Q4_K: q, registers [g0 | g2], [g1 | g3], [g4 | g6],
// [g5 | g7]; Q6_K: q + 32, registers [g0 | g1] .. [g6 | g7]) and each group's scales a and b.
template <GFmt F>
ROAD_FN void kunpack(const uint8_t* blk, __m512i w[4], __m256& sa, __m256& sb) {
  const __m512i low = _mm512_set1_epi8(15);
  if constexpr (F == GFmt::Q4_K) {
    const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
    w[0] = _mm512_and_si512(q0, low);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low);
    w[2] = _mm512_and_si512(q1, low);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low);
    uint32_t u[3];  // group_scales8's 6-bit sc and m, four groups a word
    std::memcpy(u, blk + 4, 12);
    const uint64_t sc = (u[0] & 0x3f3f3f3fu) |
                        static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t m = (u[1] & 0x3f3f3f3fu) |
                       static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)) << 32;
    const auto floats = [](uint64_t bytes) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
    };
    sa = _mm256_mul_ps(_mm256_set1_ps(half_f16c(blk)), floats(sc));
    sb = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_f16c(blk + 2)), floats(m)), _mm256_set1_ps(-0.0f));
  } else {
    const __m512i three = _mm512_set1_epi8(3), top = _mm512_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {  // 128 weights: ql's 64 bytes, qh's 32 (its bits 2k, 2k + 1 for group 4c + k)
      const __m512i ql = _mm512_loadu_si512(blk + 64 * c);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * c));
      const __m512i qhx = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      w[2 * c] = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_slli_epi16(_mm512_and_si512(qhx, three), 4));
      w[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), _mm512_and_si512(qhx, top));
    }
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(half_f16c(blk + 208)), _mm512_cvtepi32_ps(sc));
    const __m512 e = _mm512_permutexvar_ps(idx(EVEN_ODD), s);  // each group's first half's scale, then its second's
    sa = _mm512_castps512_ps256(e);
    sb = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1));
  }
}

// Q5_0: n (1..8) blocks from blk -> their integers q = qw + 16 (0..31) as unsigned bytes, two blocks a register ([g0 |
// g1] .. [g6 | g7], each block's 32 in position order: qs's low nibbles, then its high ones, bit 4 from qh, whose bit
// j is position j's), zero past n; each block's d_w in sa's lanes.
ROAD_FN void q5_unpack(const uint8_t* blk, int64_t n, __m512i w[4], __m256& sa) {
  constexpr int64_t BYTES = GroupFormat<GFmt::Q5_0>::BYTES;
  const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
  const int64_t s = 0x0004000400040004;
  const __m512i shift = _mm512_set_epi64(s, s, 0, 0, s, s, 0, 0);  // a block's second 16 bytes: the high nibbles
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    if (2 * k >= n) {
      w[k] = _mm512_setzero_si512();
      continue;
    }
    const uint8_t *b0 = blk + 2 * k * BYTES, *b1 = b0 + BYTES;
    const bool two = 2 * k + 1 < n;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 6));
    const __m128i q1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + 6)) : _mm_setzero_si128();
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(q0)),
                                         _mm256_broadcastsi128_si256(q1), 1);
    uint32_t h0, h1 = 0;
    std::memcpy(&h0, b0 + 2, 4);
    if (two) std::memcpy(&h1, b1 + 2, 4);
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, shift), low);
    w[k] = _mm512_mask_add_epi8(q, static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32), q, sixteen);
  }
  // the d_w into a register word by word (eight narrow stores read back as one would stall the load)
  __m128i d = _mm_setzero_si128();
#pragma GCC unroll 8
  for (int g = 0; g < 8; ++g) {
    uint16_t h = 0;
    if (g < n) std::memcpy(&h, blk + g * BYTES, 2);
    d = _mm_insert_epi16(d, h, g);
  }
  sa = _mm256_cvtph_ps(d);
}

// Four registers of vpdpbusd's sums (lanes 4h..4h + 3 of a 128-bit quarter: a group's half) -> the eight groups'
// first halves (lanes 0-7) and second halves (8-15). Integer adds: exact in any order.
template <GFmt F>
ROAD_FN __m512i khalves(const __m512i* p) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
  const __m512i h = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  return _mm512_permutexvar_epi32(idx(KHALVES[F == GFmt::Q4_K ? 0 : 1]), h);
}

// Weight rows o0..o1 of Q4_K, Q6_K or Q5_0 blocks (Q5_0: eight at a time, as a super-block) against the B rows of
// x laid out by few_x (xk; xh: Q6_K's 32, Q5_0's 16 x each half's sum): out[r * N + o]. Group g's c goes to lane
// g % 16, as in every road.
template <GFmt F>
ROAD_FN void krows_few(const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a, int64_t B,
                       const int8_t* xk, const int32_t* xh, float* out, int64_t N) {
  const int64_t supers = few_supers(a), K = supers * 256;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w + o * row_bytes;
    for (int64_t r0 = 0; r0 < B; r0 += GTILE) {
      const int R = static_cast<int>(std::min<int64_t>(GTILE, B - r0));
      __m256 acc[GTILE][2];
      for (int r = 0; r < GTILE; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t u = 0; u < supers; ++u) {
        __m512i wv[4];
        __m256 sa, sb = _mm256_setzero_ps();
        const int64_t n = std::min<int64_t>(8, a.nb - 8 * u);  // groups in this super-block (Q5_0's last: fewer)
        if constexpr (F == GFmt::Q5_0) q5_unpack(row + 8 * u * GroupFormat<F>::BYTES, n, wv, sa);
        else kunpack<F>(row + u * GroupFormat<F>::BYTES, wv, sa, sb);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xk + (r0 + r) * K + u * 256;
          __m512i p[4];
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k)
            p[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[k], _mm512_loadu_si512(x + 64 * k));
          __m512i sums = khalves<F>(p);
          if constexpr (F != GFmt::Q4_K)
            sums = _mm512_sub_epi32(sums, _mm512_loadu_si512(xh + ((r0 + r) * supers + u) * 16));
          const __m256i i0 = _mm512_castsi512_si256(sums), i1 = _mm512_extracti64x4_epi64(sums, 1);
          const int64_t at = (r0 + r) * a.ld + 8 * u;
          const __mmask8 real = static_cast<__mmask8>((1u << n) - 1);
          const __m256 c = group_c8<F>(sa, sb, _mm256_maskz_loadu_ps(real, a.d + at), a.ds + at, i0, i1);
          acc[r][u % 2] = _mm256_mask_add_ps(acc[r][u % 2], real, acc[r][u % 2], c);
        }
      }
      alignas(32) float lanes[GROUP];
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(lanes, acc[r][0]);
        _mm256_store_ps(lanes + 8, acc[r][1]);
        out[(r0 + r) * N + o] = tree16(lanes);
      }
    }
  }
}

template <Fmt F, int R = 4>
ROAD_FN void prows_tile(int xr, const uint8_t* packed, int64_t row_bytes, int64_t g0, int64_t g1, int64_t N,
                        const Acts& a, int64_t r0, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (xr != R) return prows_tile<F, R - 1>(xr, packed, row_bytes, g0, g1, N, a, r0, out, ldo);
    for (int64_t g = g0; g < g1; ++g)
      ptile<F, R>(packed + g * 4 * row_bytes, static_cast<int>(std::min<int64_t>(4, N - 4 * g)), a, r0, out + 4 * g,
                  ldo);
  }
}

// Packed groups g0..g1 of a weight of N rows against all B rows of x (its quads transposed): out[r * N + o].
__attribute__((target(INT8_TARGET))) void rows_packed(Fmt f, const uint8_t* packed, int64_t row_bytes, int64_t g0,
                                                      int64_t g1, const Acts& a, int64_t B, float* out, int64_t N) {
  for (int64_t r0 = 0; r0 < B; r0 += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, B - r0));
    if (f == Fmt::Q4_1) prows_tile<Fmt::Q4_1>(n, packed, row_bytes, g0, g1, N, a, r0, out + r0 * N, N);
    else prows_tile<Fmt::Q8_0>(n, packed, row_bytes, g0, g1, N, a, r0, out + r0 * N, N);
  }
}



#else  // ---- AVX-VNNI and AVX2: a pair of blocks to a register

ROAD_FN __m256i round_away(__m256 v) {
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), sign = _mm256_set1_ps(-0.0f);
  const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, sign));  // copysign(1, v)
  const __m256 r = _mm256_add_ps(t, _mm256_and_ps(up, one));
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), r)));
}

ROAD_FN void quantize_row(const float* x, int64_t nb, int8_t* qi, float* d, int32_t* s, float* ds) {
  const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(FLT_MAX);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4], m = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
      const __m256 av = _mm256_andnot_ps(sign, v[i]);
      m = _mm256_max_ps(m, av);
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(av, top, _CMP_LE_OQ));
    }
    int8_t* lo = qi + lo_at(b);
    if (_mm256_movemask_ps(ok) != 0xff) {
      quantize_bad(lo, d + b, s + b, ds + b);
      continue;
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float db = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))) / 127.0f;
    const __m256 id = _mm256_set1_ps(db >= FLT_MIN ? 1.0f / db : 0.0f);
    __m256i q[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) q[i] = round_away(_mm256_mul_ps(v[i], id));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
    const __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(p));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 64), _mm256_extracti128_si256(p, 1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
    d[b] = db;
    s[b] = sum;
    ds[b] = db * static_cast<float>(sum);
  }
}

// The pair's weights as unsigned bytes (u) and the activations' matching signed bytes: sums of u * s, 8 int32
// (128-bit lane i: 4 partial sums of block i). Q4_1: nibbles times x. Q8_0 with VNNI: w + 128 times x, the
// 128 * s taken off after; with AVX2, |w| times x with w's sign (vpmaddubsw's int16 pairs would saturate on
// w + 128). No int16 sum can saturate: |u| <= 15 (Q4_1) or 128 (|w|), |x| <= 127.
#if NANOSERVE_INT8_ROAD == 2
ROAD_FN __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
constexpr bool FLIP = true;  // Q8_0 as w + 128
#else
ROAD_FN __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
constexpr bool FLIP = false;  // Q8_0 as |w| and sign
#endif

template <Fmt F>
ROAD_FN __m256i pair_bytes(const uint8_t* blk, int64_t off) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + block_bytes<F>() + off)), 1);
}

// blocks blk, blk + 1 against activations xlo (positions 0..15 of both) and xhi (16..31)
template <Fmt F>
ROAD_FN __m256i pair_sums(const uint8_t* blk, __m256i xlo, __m256i xhi) {
  if constexpr (F == Fmt::Q4_1) {
    const __m256i v = pair_bytes<F>(blk, 4), low = _mm256_set1_epi8(15);
    return dot(dot(_mm256_setzero_si256(), _mm256_and_si256(v, low), xlo),
               _mm256_and_si256(_mm256_srli_epi16(v, 4), low), xhi);
  } else if constexpr (FLIP) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    return dot(dot(_mm256_setzero_si256(), _mm256_xor_si256(pair_bytes<F>(blk, 2), flip), xlo),
               _mm256_xor_si256(pair_bytes<F>(blk, 18), flip), xhi);
  } else {
    const __m256i wlo = pair_bytes<F>(blk, 2), whi = pair_bytes<F>(blk, 18);
    return dot(dot(_mm256_setzero_si256(), _mm256_abs_epi8(wlo), _mm256_sign_epi8(xlo, wlo)), _mm256_abs_epi8(whi),
               _mm256_sign_epi8(xhi, whi));
  }
}

// y_k: 128-bit lane i holds 4 partial sums of block 2k + i -> the 8 blocks' sums, block b in lane b.
ROAD_FN __m256i block_sums(__m256i y0, __m256i y1, __m256i y2, __m256i y3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(y0, y1), _mm256_hadd_epi32(y2, y3));
  // lane 0: blocks 0, 2, 4, 6; lane 1: blocks 1, 3, 5, 7
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

ROAD_FN float tree16v(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(lo, hi);                                          // a[j] + a[j + 8]
  __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // + 4 along
  u = _mm_add_ps(u, _mm_movehl_ps(u, u));                                         // + 2 along
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));                        // + 1 along
}

ROAD_FN int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 halves at 16-bit offset `shift` of 8 dwords -> 8 floats
ROAD_FN __m256 halves(__m256i v, int shift) {
  const __m256i h = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xffff));
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // the 8 halves in the low 128 bits
  return _mm256_cvtph_ps(_mm256_castsi256_si128(p));
}

// One weight row's group of 16 blocks from block b0 (n real, NQ quads to read) against R rows of x; lanes 0..7
// of each row's sums in acc[2r], lanes 8..15 in acc[2r + 1]. Reads whole quads, and the heads of whole halves of
// 8 blocks: the caller makes sure they lie in the weight's memory (bytes past block n meet zero activations and
// masked lanes, so what they hold does not matter).
template <Fmt F, int R, int NQ>
ROAD_FN void group(const uint8_t* blk, int64_t n, const Acts& a, int64_t r0, int64_t b0, __m256* acc) {
  constexpr int64_t BYTES = block_bytes<F>();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  ROAD_PREFETCH(blk + PREFETCH);
  ROAD_PREFETCH(blk + PREFETCH + 64 * 4);
#pragma GCC unroll 2
  for (int h = 0; h < (NQ + 1) / 2; ++h) {  // blocks 8h .. 8h + 7: quads 2h, 2h + 1
    const uint8_t* hb = blk + 8 * h * BYTES;
    const __m256i head = _mm256_setr_epi32(load4(hb), load4(hb + BYTES), load4(hb + 2 * BYTES), load4(hb + 3 * BYTES),
                                           load4(hb + 4 * BYTES), load4(hb + 5 * BYTES), load4(hb + 6 * BYTES),
                                           load4(hb + 7 * BYTES));
    const __m256 dw = halves(head, 0), mw = F == Fmt::Q4_1 ? halves(head, 16) : dw;
    const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - 8 * h)), lane));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* qx = a.qi + (r0 + r) * a.kq + (b0 / 4 + 2 * h) * QUAD;
      __m256i y[4];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // pair p: blocks 8h + 2p, + 1: quad 2h + p / 2, its half p % 2
        if (2 * h + p / 2 < NQ) {
          const int8_t* xq = qx + (p / 2) * QUAD + (p % 2) * 32;
          y[p] = pair_sums<F>(hb + 2 * p * BYTES, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64)));
        } else {
          y[p] = _mm256_setzero_si256();
        }
      }
      __m256i isum = block_sums(y[0], y[1], y[2], y[3]);
      const int64_t at = (r0 + r) * a.ld + b0 + 8 * h;
      if constexpr (F == Fmt::Q8_0 && FLIP)
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.s + at)), 7));
      __m256 c = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(a.d + at)), _mm256_cvtepi32_ps(isum));
      if constexpr (F == Fmt::Q4_1) c = _mm256_add_ps(c, _mm256_mul_ps(mw, _mm256_loadu_ps(a.ds + at)));
      __m256& ac = acc[2 * r + h];
      ac = _mm256_blendv_ps(ac, _mm256_add_ps(ac, c), real);
    }
  }
}

// The last group's n blocks (fewer than 16) at src.
template <Fmt F, int R>
ROAD_FN void tail(const uint8_t* src, int64_t n, const Acts& a, int64_t r0, int64_t b0, __m256* acc) {
  switch ((n + 3) / 4) {
    case 1: group<F, R, 1>(src, n, a, r0, b0, acc); break;
    case 2: group<F, R, 2>(src, n, a, r0, b0, acc); break;
    case 3: group<F, R, 3>(src, n, a, r0, b0, acc); break;
    default: group<F, R, 4>(src, n, a, r0, b0, acc); break;
  }
}

// One weight row against R rows of x (from row r0): out[r * ldo]. A last group that would read past the weight's
// end (w_end) is read from a copy.
template <Fmt F, int R>
ROAD_FN void tile(const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t ldo, const uint8_t* w_end) {
  constexpr int64_t BYTES = block_bytes<F>();
  __m256 acc[2 * R];
#pragma GCC unroll 8
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + GROUP <= a.nb; b0 += GROUP) group<F, R, 4>(w + b0 * BYTES, GROUP, a, r0, b0, acc);
  const int64_t n = a.nb - b0;
  if (n > 0) {
    const uint8_t* src = w + b0 * BYTES;
    if (src + (n + 7) / 8 * 8 * BYTES <= w_end) {  // group reads 8 blocks' heads at a time
      tail<F, R>(src, n, a, r0, b0, acc);
    } else {
      uint8_t copy[GROUP * BYTES] = {};
      std::memcpy(copy, src, n * BYTES);
      tail<F, R>(copy, n, a, r0, b0, acc);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    out[r * ldo] = tree16v(acc[2 * r], acc[2 * r + 1]);
}

constexpr int TILE = 4;  // rows of x per pair of blocks read

// ---- the packed layout (pack_row8): a group of 8 blocks of one row, register k's lane i its block i, so eight
// dot products leave each block's integer sum in its lane, with no horizontal adds.

// The group of n blocks (FULL: 8) from block b of a packed row at p against R rows of x (from row r0), into
// acc[2r + H] (blocks b..b+7 are lanes 0..7 of the row's first or second eight sums: H = (b % 16) / 8).
template <Fmt F, int R, bool FULL, int H>
ROAD_FN void pgroup(const uint8_t* p, int64_t n, const Acts& a, int64_t r0, int64_t b, __m256* acc) {
  constexpr int REGS = F == Fmt::Q4_1 ? 4 : 8;
  constexpr bool K8 = is_k8(F);
  const int64_t reg = FULL ? 32 : 4 * n;
  for (int64_t ahead = PREFETCH; ahead < PREFETCH + n * block_bytes<F>(); ahead += 64)
    ROAD_PREFETCH(p + ahead);
  const __m256i live = FULL ? _mm256_set1_epi32(-1)
                            : _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i w[8];
#pragma GCC unroll 8
  for (int k = 0; k < REGS; ++k)
    w[k] = FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k))
                : _mm256_maskload_epi32(reinterpret_cast<const int*>(p + reg * k), live);
  if constexpr (F == Fmt::Q4_1) {
    const __m256i low = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      w[4 + k] = _mm256_and_si256(_mm256_srli_epi16(w[k], 4), low);
      w[k] = _mm256_and_si256(w[k], low);
    }
  }
  const uint8_t* h = p + REGS * reg;
  __m256 dw, mw;
  if constexpr (K8) {  // fp32 a, b: whole loads again, the lanes past n dropped
    dw = _mm256_loadu_ps(reinterpret_cast<const float*>(h));
    mw = _mm256_loadu_ps(reinterpret_cast<const float*>(h + (FULL ? 32 : 4 * n)));
  } else if constexpr (FULL) {
    dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    mw = F == Fmt::Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16))) : dw;
  } else {
    // whole loads (lanes past n are dropped with `live`; the packed bytes end in PACK_TAIL): the short group is
    // every row's last at the model's K = 576, and n heads copied into a register through memory stalled it
    dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    mw = F == Fmt::Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * n))) : dw;
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int8_t* qx = a.qi + (r0 + r) * a.kq + (b / 8) * 2 * QUAD;  // its pair of quads (pair_quads)
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    // AVX2 on Q4_1: vpmaddubsw's int16 pair sums (|15 * 127 * 2| = 3810) added four at a time stay exact in
    // int16 (15240), so the widening vpmaddwd runs once per half instead of once per chunk
    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32 * k));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 128 + 32 * k));
      if constexpr (F == Fmt::Q4_1 && !FLIP) {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[k], xl));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[4 + k], xh));
      } else if constexpr ((F == Fmt::Q8_0 && !FLIP) || K8) {  // K8: |w| and sign on every road (each half's sum
        // is kept: FLIP's correction is a whole block's)
        s0 = dot(s0, _mm256_abs_epi8(w[k]), _mm256_sign_epi8(xl, w[k]));
        s1 = dot(s1, _mm256_abs_epi8(w[4 + k]), _mm256_sign_epi8(xh, w[4 + k]));
      } else if constexpr (F == Fmt::Q8_0) {
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        s0 = dot(s0, _mm256_xor_si256(w[k], flip), xl);
        s1 = dot(s1, _mm256_xor_si256(w[4 + k], flip), xh);
      } else {
        s0 = dot(s0, w[k], xl);
        s1 = dot(s1, w[4 + k], xh);
      }
    }
    if constexpr (F == Fmt::Q4_1 && !FLIP) {
      s0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(1));
      s1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(1));
    }
    __m256i isum = _mm256_add_epi32(s0, s1);
    const int64_t at = (r0 + r) * a.ld + b;
    if constexpr (F == Fmt::Q8_0 && FLIP)
      isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.s + at)), 7));
    const __m256 d = _mm256_loadu_ps(a.d + at);
    __m256 c;
    if constexpr (F == Fmt::Q6_K8) {  // group_c's: (a * d) * i0, then + (b * d) * i1
      c = _mm256_mul_ps(_mm256_mul_ps(dw, d), _mm256_cvtepi32_ps(s0));
      c = _mm256_add_ps(c, _mm256_mul_ps(_mm256_mul_ps(mw, d), _mm256_cvtepi32_ps(s1)));
    } else {
      c = _mm256_mul_ps(_mm256_mul_ps(dw, d), _mm256_cvtepi32_ps(isum));
    }
    if constexpr (F == Fmt::Q4_1 || F == Fmt::Q4_K8) c = _mm256_add_ps(c, _mm256_mul_ps(mw, _mm256_loadu_ps(a.ds + at)));
    __m256& ac = acc[2 * r + H];
    ac = FULL ? _mm256_add_ps(ac, c) : _mm256_blendv_ps(ac, _mm256_add_ps(ac, c), _mm256_castsi256_ps(live));
  }
}

// One packed row at p against R rows of x (from row r0): out[r * ldo].
template <Fmt F, int R>
ROAD_FN void ptile(const uint8_t* p, const Acts& a, int64_t r0, float* out, int64_t ldo) {
  constexpr int64_t GB = 8 * block_bytes<F>();
  __m256 acc[2 * R];
#pragma GCC unroll 8
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 16 <= a.nb; b += 16, p += 2 * GB) {
    pgroup<F, R, true, 0>(p, 8, a, r0, b, acc);
    pgroup<F, R, true, 1>(p + GB, 8, a, r0, b + 8, acc);
  }
  const int64_t left = a.nb - b;
  if (left >= 8) {
    pgroup<F, R, true, 0>(p, 8, a, r0, b, acc);
    if (left > 8) pgroup<F, R, false, 1>(p + GB, left - 8, a, r0, b + 8, acc);
  } else if (left > 0) {
    pgroup<F, R, false, 0>(p, left, a, r0, b, acc);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r * ldo] = tree16v(acc[2 * r], acc[2 * r + 1]);
}

template <Fmt F, int R = TILE>
ROAD_FN void prows_tile(int xr, const uint8_t* packed, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a,
                        int64_t r0, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (xr != R) return prows_tile<F, R - 1>(xr, packed, row_bytes, o0, o1, a, r0, out, ldo);
    for (int64_t o = o0; o < o1; ++o) ptile<F, R>(packed + o * row_bytes, a, r0, out + o, ldo);
  }
}

// Rows 4 g0 .. 4 g1 (up to N) of a packed weight against all B rows of x (its quads transposed): out[r * N + o].
__attribute__((target(INT8_TARGET))) void rows_packed(Fmt f, const uint8_t* packed, int64_t row_bytes, int64_t g0,
                                                      int64_t g1, const Acts& a, int64_t B, float* out, int64_t N) {
  const int64_t o0 = 4 * g0, o1 = std::min(4 * g1, N);
  for (int64_t r0 = 0; r0 < B; r0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, B - r0));
    if (f == Fmt::Q4_1) prows_tile<Fmt::Q4_1>(n, packed, row_bytes, o0, o1, a, r0, out + r0 * N, N);
    else if (f == Fmt::Q8_0) prows_tile<Fmt::Q8_0>(n, packed, row_bytes, o0, o1, a, r0, out + r0 * N, N);
    else if (f == Fmt::Q4_K8) prows_tile<Fmt::Q4_K8>(n, packed, row_bytes, o0, o1, a, r0, out + r0 * N, N);
    else prows_tile<Fmt::Q6_K8>(n, packed, row_bytes, o0, o1, a, r0, out + r0 * N, N);
  }
}

#endif

template <Fmt F, int R = TILE>
ROAD_FN void rows_tile(int rows, const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, const Acts& a,
                       int64_t r0, float* out, int64_t ldo, const uint8_t* w_end) {
  if constexpr (R > 0) {
    if (rows != R) return rows_tile<F, R - 1>(rows, w, row_bytes, o0, o1, a, r0, out, ldo, w_end);
#if NANOSERVE_INT8_ROAD == 1
    for (int64_t o = o0; o < o1; o += 4)
      tile<F, R>(w + o * row_bytes, row_bytes, static_cast<int>(std::min<int64_t>(4, o1 - o)), a, r0, out + o, ldo);
#else
    for (int64_t o = o0; o < o1; ++o) tile<F, R>(w + o * row_bytes, a, r0, out + o, ldo, w_end);
#endif
  }
}

// Weight rows o0..o1 against all B rows of x, TILE rows of x at a time: out[r * N + o].
__attribute__((target(INT8_TARGET))) void rows(Fmt f, const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1,
                                               const Acts& a, int64_t B, float* out, int64_t N, const uint8_t* w_end) {
  for (int64_t r0 = 0; r0 < B; r0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, B - r0));
    if (f == Fmt::Q4_1) rows_tile<Fmt::Q4_1>(n, w, row_bytes, o0, o1, a, r0, out + r0 * N, N, w_end);
    else rows_tile<Fmt::Q8_0>(n, w, row_bytes, o0, o1, a, r0, out + r0 * N, N, w_end);
  }
}

#undef ROAD_FN
#endif
