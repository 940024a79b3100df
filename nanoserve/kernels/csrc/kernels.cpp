// The glue of a decoder layer and its paged attention, as four loops (nanoserve/kernels/__init__.py says why).
//
// Each loop computes one row (or one row's kv head) from that row's numbers only, in the same
// order whatever the batch, so a row's result never depends on the rows beside it. Loops over a
// row's C or D numbers keep LANES partial sums, added in a fixed order at the end: the compiler
// turns them into vector instructions without being allowed to reorder anything itself.
#include "nanoserve.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int LANES = 16;
constexpr int64_t HEADS_AT_ONCE = 16;  // query heads whose softmax rows are made ready together
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
#if defined(__clang__)
#define SWAP_LANES(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define PICK_LANES(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SWAP_LANES(v, ...) __builtin_shuffle(v, (ivec){__VA_ARGS__})
#define PICK_LANES(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

// `vec`: LANES floats as one value, + and * lane by lane, so lane j's arithmetic is the same whatever the vector
// unit. With AVX-512 it is one register. AVX2 has no register for 16 floats: GCC would keep such a value in
// memory and send every add through the stack, so there `vec` is two 8-float halves, a register each, and each
// operation acts half by half (the same lanes, the same bits). `wvec`: WIDE floats, one register, for loops whose
// answer does not depend on the lane count (comparisons, bit conversions). aligned(4): loads from any float.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define NANOSERVE_SPLIT_VEC 1
constexpr int WIDE = 8;
typedef float wvec __attribute__((vector_size(WIDE * sizeof(float)), aligned(4)));
typedef int32_t wivec __attribute__((vector_size(WIDE * sizeof(int32_t))));
struct vec {
  wvec lo, hi;
  float operator[](int j) const { return j < WIDE ? lo[j] : hi[j - WIDE]; }
  vec& operator+=(const vec& b) {
    lo += b.lo;
    hi += b.hi;
    return *this;
  }
  vec& operator*=(float s) {
    lo *= s;
    hi *= s;
    return *this;
  }
};
inline vec operator*(const vec& a, const vec& b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline vec operator*(float s, const vec& a) { return {s * a.lo, s * a.hi}; }
inline vec operator*(const vec& a, float s) { return {a.lo * s, a.hi * s}; }
inline vec load_lanes(const float* p) {
  return {*reinterpret_cast<const wvec*>(p), *reinterpret_cast<const wvec*>(p + WIDE)};
}
inline void store_lanes(float* p, const vec& v) {
  *reinterpret_cast<wvec*>(p) = v.lo;
  *reinterpret_cast<wvec*>(p + WIDE) = v.hi;
}
#if defined(__clang__)
#define PICK_HALF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK_HALF(a, b, ...) __builtin_shuffle(a, b, (wivec){__VA_ARGS__})
#endif
#else
constexpr int WIDE = LANES;
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef vec wvec;
typedef ivec wivec;
inline vec load_lanes(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store_lanes(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }
#endif

// The sum of v's lanes as a fixed tree: halves, quarters, eighths, pairs. A few vector instructions, and
// the same bits on any CPU.
inline float hsum(vec v) {
#ifdef NANOSERVE_SPLIT_VEC
  wvec h = v.lo + v.hi;  // the halves' sum: lanes 0..7 of the tree's first stage
  h += PICK_HALF(h, h, 4, 5, 6, 7, 0, 1, 2, 3);
  h += PICK_HALF(h, h, 2, 3, 0, 1, 6, 7, 4, 5);
  h += PICK_HALF(h, h, 1, 0, 3, 2, 5, 4, 7, 6);
  return h[0];
#else
  v += SWAP_LANES(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += SWAP_LANES(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += SWAP_LANES(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += SWAP_LANES(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
#endif
}

// a . b as LANES running sums (lane j takes elements j, j + LANES, ...), summed by hsum, then the tail.
inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load_lanes(a + i) * load_lanes(b + i);
  float s = hsum(acc);
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

// The largest of x[0..n) (n >= 1), WIDE at a time: exact, so any order gives the same number.
inline float max_of(const float* x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= WIDE) {
    wvec acc = *reinterpret_cast<const wvec*>(x);
    for (i = WIDE; i + WIDE <= n; i += WIDE) {
      const wvec y = *reinterpret_cast<const wvec*>(x + i);
      acc = acc > y ? acc : y;
    }
    for (int j = 0; j < WIDE; ++j) m = std::max(m, acc[j]);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// The sum of x[0..n) as LANES running sums added in a fixed order, then the tail: the same bits on any CPU.
inline float sum_of(const float* x, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load_lanes(x + i);
  float s = 0.f;
  for (int j = 0; j < LANES; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i];
  return s;
}

// A K/V pool holds float or bf16 numbers (bf16: the top half of a float's bits, stored as uint16_t). Reading
// one widens it to float exactly: a shift, which vectorizes; every sum after it is the fp32 loop's.
typedef uint16_t hvec __attribute__((vector_size(WIDE * sizeof(uint16_t)), aligned(2)));
typedef uint32_t uvec __attribute__((vector_size(WIDE * sizeof(uint32_t)), aligned(4)));  // (loads: any float)
inline wvec widen_lanes(const uint16_t* p) {
  return reinterpret_cast<wvec>(__builtin_convertvector(*reinterpret_cast<const hvec*>(p), uvec) << 16);
}
#ifdef NANOSERVE_SPLIT_VEC
inline vec load_lanes(const uint16_t* p) { return {widen_lanes(p), widen_lanes(p + WIDE)}; }
#else
inline vec load_lanes(const uint16_t* p) { return widen_lanes(p); }
#endif

// a . b for a float a and a pool's b: dot's sums in dot's order.
inline float dot(const float* a, const uint16_t* b, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load_lanes(a + i) * load_lanes(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

// out[h][0 .. 4 * LANES) = inv[h] * sum over keys l, in order, of p[h][l] * v_l, for NH heads of one kv head whose
// value numbers for key l start at v + at[l]. Key by key: 4 * LANES numbers of a value slot read once, in one
// contiguous run, for all NH heads; the next keys' numbers asked for ahead of their turn.
template <int NH, class T>
inline void value_run(const float* const* p, int64_t n, const T* v, const int64_t* at, const float* inv,
                      float* out, int64_t D) {
  vec acc[NH][4] = {};
  for (int64_t l = 0; l < n; ++l) {
    const T* vl = v + at[l];
    const T* ahead = v + at[std::min<int64_t>(l + 8, n - 1)];
    for (int c = 0; c < 4; ++c) __builtin_prefetch(ahead + c * LANES);
    const vec v0 = load_lanes(vl), v1 = load_lanes(vl + LANES), v2 = load_lanes(vl + 2 * LANES),
              v3 = load_lanes(vl + 3 * LANES);
    for (int h = 0; h < NH; ++h) {
      const float ph = p[h][l];
      acc[h][0] += ph * v0;
      acc[h][1] += ph * v1;
      acc[h][2] += ph * v2;
      acc[h][3] += ph * v3;
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 4; ++c) {
      store_lanes(out + h * D + c * LANES, acc[h][c] * inv[h]);
    }
}

// The second half of attention for `heads` query heads of one query, whose scores over its n keys are rows
// of `scores` (row h at scores + h * stride): each row's softmax in place, then out (head h at out + h * D)
// = sum over keys l, in order, of p[h][l] * value row l of the head's kv head ((h_first + h) / rep), by
// `value_run`: key l's value slot starts at vd + at[l], and one read of a kv head's numbers in it serves
// the heads that share it. With m_out/l_out (a piece of a split row) each head's max and sum of e^(s - max)
// go there and out keeps the sums unnormalised: the online softmax's state (m, l, acc) of Day 22.
template <class T>
void value_sums(float* scores, int64_t stride, int64_t n, int64_t heads, int64_t h_first, int64_t rep, int64_t D,
                const T* vd, const int64_t* at, float* out, float* m_out = nullptr, float* l_out = nullptr) {
  float inv[HEADS_AT_ONCE];
  const float* p[HEADS_AT_ONCE];
  for (int64_t h0 = 0; h0 < heads; h0 += HEADS_AT_ONCE) {
    const int64_t hn = std::min<int64_t>(HEADS_AT_ONCE, heads - h0);
    int64_t kv[HEADS_AT_ONCE];
    for (int64_t h = 0; h < hn; ++h) {
      float* row = scores + (h0 + h) * stride;
      const float mx = max_of(row, n);
      for (int64_t l = 0; l < n; ++l) row[l] = fast_exp(row[l] - mx);
      const float sum = sum_of(row, n);
      inv[h] = m_out ? 1.0f : 1.0f / sum;
      if (m_out) {
        m_out[h0 + h] = mx;
        l_out[h0 + h] = sum;
      }
      p[h] = row;
      kv[h] = ((h_first + h0 + h) / rep) * D;
    }
    for (int64_t a = 0; a < hn;) {  // runs of up to 4 heads that share a kv head
      int64_t b = a + 1;
      while (b < hn && b - a < 4 && kv[b] == kv[a]) ++b;
      int64_t d0 = 0;
      for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) {
        float* o = out + (h0 + a) * D + d0;
        switch (b - a) {
          case 1: value_run<1>(p + a, n, vd + kv[a] + d0, at, inv + a, o, D); break;
          case 2: value_run<2>(p + a, n, vd + kv[a] + d0, at, inv + a, o, D); break;
          case 3: value_run<3>(p + a, n, vd + kv[a] + d0, at, inv + a, o, D); break;
          default: value_run<4>(p + a, n, vd + kv[a] + d0, at, inv + a, o, D);
        }
      }
      for (; d0 < D; d0 += LANES) {  // a head_dim that is not a multiple of 4 * LANES: the rest, head by head
        const int64_t dn = std::min<int64_t>(LANES, D - d0);
        for (int64_t h = a; h < b; ++h) {
          float acc[LANES] = {0.f};
          for (int64_t l = 0; l < n; ++l)
            for (int64_t j = 0; j < dn; ++j) acc[j] += p[h][l] * widen(vd[at[l] + kv[h] + d0 + j]);
          for (int64_t j = 0; j < dn; ++j) out[(h0 + h) * D + d0 + j] = acc[j] * inv[h];
        }
      }
      a = b;
    }
  }
}

// tree16's stages: a's and b's lanes added in hsum's pairs (8 apart, then 4, 2, 1), both at once; a's sums
// stay in the lower half of each group of lanes, b's in the upper. (PICK_LANES: lanes 0..15 are a's, 16..31 b's.)
#ifdef NANOSERVE_SPLIT_VEC
// Two halves: the first stage adds a's halves and b's; each later stage is the same pick within each half.
inline vec halves(const vec& a, const vec& b) { return {a.lo + a.hi, b.hi + b.lo}; }
inline vec quarters(const vec& a, const vec& b) {
  auto f = [](wvec x, wvec y) {
    return PICK_HALF(x, y, 0, 1, 2, 3, 12, 13, 14, 15) + PICK_HALF(x, y, 4, 5, 6, 7, 8, 9, 10, 11);
  };
  return {f(a.lo, b.lo), f(a.hi, b.hi)};
}
inline vec eighths(const vec& a, const vec& b) {
  auto f = [](wvec x, wvec y) {
    return PICK_HALF(x, y, 0, 1, 10, 11, 4, 5, 14, 15) + PICK_HALF(x, y, 2, 3, 8, 9, 6, 7, 12, 13);
  };
  return {f(a.lo, b.lo), f(a.hi, b.hi)};
}
inline vec pairs(const vec& a, const vec& b) {
  auto f = [](wvec x, wvec y) {
    return PICK_HALF(x, y, 0, 9, 2, 11, 4, 13, 6, 15) + PICK_HALF(x, y, 1, 8, 3, 10, 5, 12, 7, 14);
  };
  return {f(a.lo, b.lo), f(a.hi, b.hi)};
}
#else
inline vec halves(vec a, vec b) {
  return PICK_LANES(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31) +
         PICK_LANES(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
}
inline vec quarters(vec a, vec b) {
  return PICK_LANES(a, b, 0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31) +
         PICK_LANES(a, b, 4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
}
inline vec eighths(vec a, vec b) {
  return PICK_LANES(a, b, 0, 1, 18, 19, 4, 5, 22, 23, 8, 9, 26, 27, 12, 13, 30, 31) +
         PICK_LANES(a, b, 2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29);
}
inline vec pairs(vec a, vec b) {
  return PICK_LANES(a, b, 0, 17, 2, 19, 4, 21, 6, 23, 8, 25, 10, 27, 12, 29, 14, 31) +
         PICK_LANES(a, b, 1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
}
#endif
// hsum of sixteen vectors at once: lane j of the result is hsum(a[j]), bit for bit, since every stage adds the
// pairs hsum adds, in its order. One add serves two vectors, so the four stages take 15 adds where sixteen
// hsums take 64. The stages leave input k in lane REV[k]; fed in REV's order (a bit reversal is its own
// inverse), key j comes out in lane j.
constexpr int REV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
__attribute__((always_inline)) inline vec tree16(const vec* a) {
  vec t[8], u[4];
  for (int m = 0; m < 8; ++m) t[m] = halves(a[REV[2 * m]], a[REV[2 * m + 1]]);
  for (int m = 0; m < 4; ++m) u[m] = quarters(t[2 * m], t[2 * m + 1]);
  return pairs(eighths(u[0], u[1]), eighths(u[2], u[3]));
}

// Scores of `heads` query heads of one query (row at qrow, head h at qrow + h * D) over n keys whose slots
// start at kd + at[l]: scores[h * n + l] = dot(q_h, k_l) * scale. Key by key, each slot read once for every
// head; with D a multiple of LANES, each score's running sums are kept (dot's, lane for lane) and every LANES
// keys reduced together (tree16), a shared tree in place of a horizontal sum per score. A decode step's keys
// come from memory, not cache (the weights streamed since their layer last ran), so with `fetch` each key's
// numbers are asked for AHEAD keys before their turn, and its values (read once the scores are done, at vd +
// at[l]) now; the later rows of a prompt's tile find them in cache and skip the asking.
// The most registers a key's numbers may take in decode_scores (head_dim / LANES): with AVX-512's 32 registers a
// head of 256 (Gemma 3's) fits in 16 beside the sums; the 256-bit build's vectors are pairs of registers.
#ifdef __AVX512F__
constexpr int KEY_REGS = 16;
#else
constexpr int KEY_REGS = 8;
#endif

template <class T>
void decode_scores(const float* qrow, const T* kd, const T* vd, const int64_t* at, int64_t n, int64_t heads,
                   int64_t h_first, int64_t rep, int64_t D, float scale, float* scores, bool fetch = true) {
  constexpr int64_t AHEAD = 16;
  const int64_t g0 = h_first / rep, g1 = (h_first + heads - 1) / rep + 1;  // the kv heads read
  const int64_t DV = D % LANES == 0 && D <= KEY_REGS * LANES ? D / LANES : 0;  // a key's registers (0: none)
  const int64_t tiled = DV ? n / LANES * LANES : 0;  // keys reduced LANES at a time; the rest one by one (dot)
  thread_local std::vector<vec> sums;  // (head, key of the tile): running sums
  if (static_cast<int64_t>(sums.size()) < heads * LANES) sums.resize(heads * LANES);
  // a key's numbers for the kv heads read: `lines` cache lines from kd + at[l] + g0 * D (its values' likewise)
  const int64_t lines = ((g1 - g0) * D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const char* const k_from = reinterpret_cast<const char*>(kd + g0 * D);
  const char* const v_from = reinterpret_cast<const char*>(vd + g0 * D);
  if (fetch)
    for (int64_t l = 0; l < std::min<int64_t>(AHEAD, n); ++l)
      for (int64_t i = 0; i < lines; ++i) __builtin_prefetch(k_from + at[l] * static_cast<int64_t>(sizeof(T)) + 64 * i);
  // one key's running sums for every head: its kv heads' numbers loaded once each (DV registers), then each
  // query head that shares one multiplies them, in dot's order (lane j: q_j k_j + q_{j+LANES} k_{j+LANES} + ...)
  const auto key_sums = [&](auto dv, int64_t l) {
    constexpr int DV = decltype(dv)::value;
    for (int64_t g = g0; g < g1; ++g) {
      const T* k = kd + at[l] + g * D;
      vec kr[DV];
      for (int i = 0; i < DV; ++i) kr[i] = load_lanes(k + i * LANES);
      for (int64_t h = std::max(g * rep, h_first); h < std::min((g + 1) * rep, h_first + heads); ++h) {
        const float* q = qrow + (h - h_first) * D;
        vec acc = {};
        for (int i = 0; i < DV; ++i) acc += load_lanes(q + i * LANES) * kr[i];
        sums[(h - h_first) * LANES + l % LANES] = acc;
      }
    }
  };
  const auto keys = [&](auto dv) {
    // the asking loop's bounds and bases as locals: read through the lambda's references, they were loaded
    // again on every turn of it, a visible part of a decode row's time
    const int64_t* const slots = at;
    const char* const kb = k_from;
    const char* const vb = v_from;
    const int64_t last = n - 1, span = lines;
    for (int64_t l = 0; l < n; ++l) {
      if (fetch) {
        const char* ka = kb + slots[std::min<int64_t>(l + AHEAD, last)] * static_cast<int64_t>(sizeof(T));
        const char* va = vb + slots[l] * static_cast<int64_t>(sizeof(T));
        for (int64_t i = 0; i < span; ++i) {
          __builtin_prefetch(ka + 64 * i);
          __builtin_prefetch(va + 64 * i, 0, 2);
        }
      }
      if (l >= tiled) {
        for (int64_t h = 0; h < heads; ++h)
          scores[h * n + l] = dot(qrow + h * D, kd + at[l] + ((h_first + h) / rep) * D, D) * scale;
        continue;
      }
      if constexpr (decltype(dv)::value > 0) key_sums(dv, l);
      if (l % LANES == LANES - 1)
        for (int64_t h = 0; h < heads; ++h) {
          store_lanes(scores + h * n + l - (LANES - 1), tree16(sums.data() + h * LANES) * scale);
        }
    }
  };
  if (DV) with_rows<KEY_REGS>(DV, keys);
  else keys(std::integral_constant<int, 0>{});  // every key by dot (the same bits: tree16 adds as hsum does)
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, ": expected a float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// A row of bf16 (uint16_t) widened into floats, and floats narrowed into bf16, WIDE at a time (the narrowing's
// NaN test as a lane select, so the loop stays vector code).
void widen_row(const uint16_t* x, int64_t n, float* out) {
  int64_t c = 0;
  for (; c + WIDE <= n; c += WIDE) *reinterpret_cast<wvec*>(out + c) = widen_lanes(x + c);
  for (; c < n; ++c) out[c] = widen(x[c]);
}

// WIDE floats' bits -> each one's bf16 (narrow_bf16, lane by lane) in the low half of its lane.
inline uvec narrow_lanes(uvec u) {
  const uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
}

void narrow_row(const float* x, int64_t n, uint16_t* out) {
  int64_t c = 0;
  for (; c + WIDE <= n; c += WIDE)
    *reinterpret_cast<hvec*>(out + c) = __builtin_convertvector(narrow_lanes(*reinterpret_cast<const uvec*>(x + c)),
                                                                hvec);
  for (; c < n; ++c) out[c] = narrow_bf16(x[c]);
}

// Rows i < n of (x + residual, rms_norm(x + residual) * weight), C numbers each, into out and h; with residual
// null, out is not written (x is the stream as it is). A bf16 model's residual (its product's output) is widened
// and its h (its next product's input) narrowed once, a row at a time through `row`'s floats.
template <class R, class H>
void add_rms_norm_rows_t(const float* x, const R* residual, const float* weight, int64_t n, int64_t C, float eps,
                         float* out, H* h) {
  std::vector<float> row(std::is_same_v<R, float> && std::is_same_v<H, float> ? 0 : C);
  for (int64_t i = 0; i < n; ++i) {
    const float* o = x + i * C;
    if (residual) {
      float* oi = out + i * C;
      const float* b;
      if constexpr (std::is_same_v<R, float>) b = residual + i * C;
      else widen_row(residual + i * C, C, row.data()), b = row.data();
      for (int64_t c = 0; c < C; ++c) oi[c] = o[c] + b[c];
      o = oi;
    }
    const float inv = 1.0f / std::sqrt(dot(o, o, C) / static_cast<float>(C) + eps);
    float* hi;
    if constexpr (std::is_same_v<H, float>) hi = h + i * C;
    else hi = row.data();
    for (int64_t c = 0; c < C; ++c) hi[c] = (o[c] * inv) * weight[c];
    if constexpr (!std::is_same_v<H, float>) narrow_row(hi, C, h + i * C);
  }
}

}  // namespace

void add_rms_norm_rows(const float* x, const float* residual, const float* weight, int64_t n, int64_t C, float eps,
                       float* out, float* h) {
  add_rms_norm_rows_t(x, residual, weight, n, C, eps, out, h);
}

// A bf16 model's: residual (if any) a bf16 product's output, h its next product's bf16 input.
void add_rms_norm_rows_bf16(const float* x, const uint16_t* residual, const float* weight, int64_t n, int64_t C,
                            float eps, float* out, uint16_t* h) {
  add_rms_norm_rows_t(x, residual, weight, n, C, eps, out, h);
}

void widen_bf16_row(const uint16_t* x, int64_t n, float* out) { widen_row(x, n, out); }
void narrow_bf16_row(const float* x, int64_t n, uint16_t* out) { narrow_row(x, n, out); }

// (x + residual, rms_norm(x + residual) * weight) over the last dim; residual may be None (then x as is). x is
// fp32; residual fp32 or bf16; h comes back in h_bf16 ? bf16 : fp32.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps, bool h_bf16) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  const int64_t C = x.size(-1), N = x.numel() / C;
  TORCH_CHECK(weight.numel() == C, "weight: expected ", C, " numbers, got ", weight.numel());
  torch::Tensor out = x;
  const bool r_bf16 = residual.has_value() && residual->scalar_type() == torch::kBFloat16;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && (r_bf16 || residual->scalar_type() == torch::kFloat32),
                "residual: expected a contiguous float32 or bfloat16 tensor, got ", residual->scalar_type());
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual: shape ", residual->sizes(), " is not x's ", x.sizes());
    out = torch::empty_like(x);
  }
  auto h = torch::empty(x.sizes(), x.options().dtype(h_bf16 ? torch::kBFloat16 : torch::kFloat32));
  const void* r = residual.has_value() ? residual->data_ptr() : nullptr;
  auto rows = [&](auto* hp) {
    if (r_bf16)
      add_rms_norm_rows_t(x.data_ptr<float>(), static_cast<const uint16_t*>(r), weight.data_ptr<float>(), N, C,
                          static_cast<float>(eps), out.data_ptr<float>(), hp);
    else
      add_rms_norm_rows_t(x.data_ptr<float>(), static_cast<const float*>(r), weight.data_ptr<float>(), N, C,
                          static_cast<float>(eps), out.data_ptr<float>(), hp);
  };
  if (h_bf16)
    rows(reinterpret_cast<uint16_t*>(h.data_ptr()));
  else
    rows(h.data_ptr<float>());
  return {out, h};
}

// Rotate the first `heads` of the HT heads of each of n rows of qkv (n, HT, D) in place by each row's cos/sin
// (n, D): the pairs (x_i, x_{i+D/2}), as apply_rope does. D even, at most 512.
void rope_rows(float* qkv, const float* cos, const float* sin, int64_t n, int64_t HT, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  float rotated[512];
  for (int64_t i = 0; i < n; ++i) {
    const float* c = cos + i * D;
    const float* s = sin + i * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = qkv + (i * HT + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        rotated[d] = x[d] * c[d] - x[d + half] * s[d];
        rotated[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
      }
      std::copy(rotated, rotated + D, x);
    }
  }
}

// Each of x's n floats rounded to the nearest bf16 and kept as a float (narrow_bf16, then widened exactly): what
// .to(torch.bfloat16).to(torch.float32) gives, in place, in one pass.
void round_bf16_(float* x, int64_t n) {
  int64_t c = 0;
  for (; c + WIDE <= n; c += WIDE) {  // (memcpy: x may be unaligned)
    uvec u;
    std::memcpy(&u, x + c, sizeof u);
    u = narrow_lanes(u) << 16;
    std::memcpy(x + c, &u, sizeof u);
  }
  for (; c < n; ++c) x[c] = widen(narrow_bf16(x[c]));
}

// Rotate the first `heads` heads of qkv (N, heads_total, D) in place by each token's cos/sin (N, D); with
// round_bf16, then round every head (q, k and v) to bf16, as a model whose K/V cache is bf16 sees them.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, bool round_bf16) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t D = qkv.size(-1), HT = qkv.size(-2), N = qkv.numel() / (HT * D);
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim ", D, ": expected an even number up to 512");
  TORCH_CHECK(0 <= heads && heads <= HT, "heads ", heads, " out of 0..", HT);
  TORCH_CHECK(cos.numel() == N * D && sin.numel() == N * D, "cos/sin: expected ", N, " x ", D, " numbers");
  rope_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), N, HT, heads, D);
  if (round_bf16) round_bf16_(qkv.data_ptr<float>(), qkv.numel());
}

namespace {

// A gated MLP's middle for rows begin..end-1: gate_up (n, 2I) -> act(gate) * up (n, I). SwiGLU's act is
// silu(x) = x / (1 + e^-x); GeGLU's (Gemma) gelu's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715
// x^3), which is x / (1 + e^(-2u)): the same loop with another exponent.
template <bool GELU = false>
void silu_mul_range(const float* gate_up, int64_t begin, int64_t end, int64_t I, float* out) {
  for (int64_t i = begin; i < end; ++i) {
    const float* gi = gate_up + i * 2 * I;
    const float* ui = gi + I;
    float* oi = out + i * I;
    for (int64_t c = 0; c < I; ++c) {
      const float x = gi[c];
      if constexpr (GELU) {
        const float u2 = 1.5957691216f * (x + 0.044715f * (x * x * x));  // 2u
        oi[c] = x / (1.0f + fast_exp(-u2)) * ui[c];
      } else {
        oi[c] = x / (1.0f + fast_exp(-x)) * ui[c];
      }
    }
  }
}

int64_t silu_grain(int64_t I) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)); }

}  // namespace

void silu_mul_rows(const float* gate_up, int64_t n, int64_t I, float* out) {
  at::parallel_for(0, n, silu_grain(I), [&](int64_t begin, int64_t end) { silu_mul_range(gate_up, begin, end, I, out); });
}

// GeGLU's middle on raw rows (BlockModel's Gemma layer): gelu_tanh_mul's loops.
void gelu_tanh_mul_rows(const float* gate_up, int64_t n, int64_t I, float* out) {
  at::parallel_for(0, n, silu_grain(I), [&](int64_t begin, int64_t end) {
    silu_mul_range<true>(gate_up, begin, end, I, out);
  });
}

// The same for a bf16 model, whose gate_up product returns bf16 and whose down product takes bf16: each row
// widened, computed by the float loop, narrowed once.
void silu_mul_rows_bf16(const uint16_t* gate_up, int64_t n, int64_t I, uint16_t* out) {
  at::parallel_for(0, n, silu_grain(I), [&](int64_t begin, int64_t end) {
    std::vector<float> in(2 * I), row(I);
    for (int64_t i = begin; i < end; ++i) {
      widen_row(gate_up + i * 2 * I, 2 * I, in.data());
      silu_mul_range(in.data(), 0, 1, I, row.data());
      narrow_row(row.data(), I, out + i * I);
    }
  });
}

// GeGLU's middle: gate_up (..., 2I) float32 -> gelu_tanh(gate) * up (..., I).
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, N = gate_up.numel() / std::max<int64_t>(I2, 1);
  TORCH_CHECK(I2 % 2 == 0, "gate_up: last dim ", I2, " is not even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, silu_grain(I), [&](int64_t begin, int64_t end) { silu_mul_range<true>(g, begin, end, I, o); });
  return out;
}

// SwiGLU's middle: gate_up (..., 2I) -> silu(gate) * up (..., I), in gate_up's dtype (float32 or bfloat16).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  const bool bf16 = gate_up.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous() && (bf16 || gate_up.scalar_type() == torch::kFloat32),
              "gate_up: expected a contiguous float32 or bfloat16 CPU tensor, got ", gate_up.scalar_type());
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, N = gate_up.numel() / I2;
  TORCH_CHECK(I2 % 2 == 0, "gate_up: last dim ", I2, " is not even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  if (bf16)
    silu_mul_rows_bf16(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), N, I,
                       reinterpret_cast<uint16_t*>(out.data_ptr()));
  else
    silu_mul_rows(gate_up.data_ptr<float>(), N, I, out.data_ptr<float>());
  return out;
}

// The first largest of x[begin, end) (end > begin), a NaN counting as largest: torch.argmax's answer on that
// range. Comparisons only, one pass: WIDE running maxima, each with the first index it was seen at (a larger
// value replaces it, an equal one does not), then the lanes compared; a range holding a NaN is searched for its
// first NaN instead.
RangeMax argmax_range(const float* x, int64_t begin, int64_t end) {
  float m = x[begin];
  int64_t best = begin, i = begin;
  bool nan = false;
  if (end - begin >= WIDE) {
    wvec acc = *reinterpret_cast<const wvec*>(x + begin);
    wivec at, seen = acc != acc;
    for (int j = 0; j < WIDE; ++j) at[j] = j;
    wivec now = at;
    for (i = begin + WIDE; i + WIDE <= end; i += WIDE) {
      const wvec y = *reinterpret_cast<const wvec*>(x + i);
      now += WIDE;
      const wivec larger = y > acc;
      acc = larger ? y : acc;
      at = larger ? now : at;
      seen |= y != y;
    }
    m = acc[0];
    best = begin + at[0];
    for (int j = 1; j < WIDE; ++j) {
      nan = nan || seen[j];
      if (acc[j] > m || (acc[j] == m && begin + at[j] < best)) m = acc[j], best = begin + at[j];
    }
    nan = nan || seen[0];
  }
  for (; i < end; ++i) {
    nan = nan || x[i] != x[i];
    if (x[i] > m) m = x[i], best = i;
  }
  if (nan) {  // the first NaN
    best = begin;
    while (x[best] == x[best]) ++best;
  }
  return {m, best, nan};
}

int64_t first_largest(const RangeMax* parts, int64_t n) {
  RangeMax got = parts[0];
  for (int64_t p = 1; p < n && !got.nan; ++p)
    if (parts[p].nan || parts[p].value > got.value) got = parts[p];
  return got.at;
}

// Each row's argmax: logits (B, V) -> (B,) int64, the first index of the row's largest value, a NaN counting
// as largest, as torch.argmax answers.
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits: expected (rows, vocab) with vocab > 0");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V < (int64_t(1) << 31), "logits: rows of ", V, " are too long");
  auto out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_range(lp + r * V, 0, V).at;
  });
  return out;
}

// A NaN above every number (as torch.topk orders them), else the numbers' own order.
inline bool above(float a, float b) { return (a > b) | ((a != a) & (b == b)); }

// The k largest seen so far, largest first; of equal ones the first seen stays ahead.
struct TopK {
  int64_t k, n;
  float* value;
  int64_t* at;
  void offer(float x, int64_t i) {
    if (n == k && !above(x, value[k - 1])) return;
    int64_t p = n < k ? n++ : k - 1;
    for (; p > 0 && above(x, value[p - 1]); --p) value[p] = value[p - 1], at[p] = at[p - 1];
    value[p] = x, at[p] = i;
  }
};

// What log-probabilities read of each row, in three reads of it (after the first the row is in L2): logits (R, V),
// tokens (R,) -> (log-sum-exp (R,), the token's logit (R,), its rank (R,): 1 + how many logits are above it, the
// row's k largest (R, k) and their indices (R, k)). The log-sum-exp is m + log(sum of e^(x - m)), m the row's
// largest, the sum fast_exp's in LANES running sums added in a fixed order: torch.logsumexp's number to a few ulp,
// the same bits on any CPU; a row holding a NaN gives NaN, one of only -inf gives -inf, one holding +inf gives
// +inf, as torch answers. The top k are torch.topk's, a NaN counting as largest; of equal logits the first index
// comes first.
std::vector<torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor tokens, int64_t k) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits: expected (rows, vocab) with vocab > 0");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous() && tokens.dim() == 1 &&
                  tokens.size(0) == R, "tokens: expected contiguous int64 (", R, ",)");
  TORCH_CHECK(k >= 1 && k <= V, "k: expected 1 <= k <= ", V, ", got ", k);
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "tokens[", r, "] = ", tp[r], " is not in [0, ", V, ")");
  auto lse = torch::empty({R}, logits.options()), chosen = torch::empty({R}, logits.options());
  auto rank = torch::empty({R}, tokens.options()), value = torch::empty({R, k}, logits.options());
  auto at = torch::empty({R, k}, tokens.options());
  const float* lp = logits.data_ptr<float>();
  float *lsp = lse.data_ptr<float>(), *cp = chosen.data_ptr<float>(), *vp = value.data_ptr<float>();
  int64_t *rp = rank.data_ptr<int64_t>(), *ap = at.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float e[LANES];
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      const float c = x[tp[r]], m = max_of(x, V);
      vec acc = {};  // the sum of e^(x - m): a loop of fast_exp alone, so that it vectorizes
      int64_t i = 0;
      for (; i + LANES <= V; i += LANES) {
        for (int j = 0; j < LANES; ++j) e[j] = fast_exp(x[i + j] - m);  // NaN stays NaN through fast_exp
        acc += load_lanes(e);
      }
      float sum = 0.f;
      for (int j = 0; j < LANES; ++j) sum += acc[j];
      for (; i < V; ++i) sum += fast_exp(x[i] - m);
      if (!std::isfinite(m)) {  // -inf or +inf is the row's largest: the answer is m, unless a NaN is there
        bool nan = false;
        for (int64_t l = 0; l < V; ++l) nan = nan || x[l] != x[l];
        lsp[r] = nan ? NAN : m;
      } else {
        lsp[r] = m + std::log(sum);
      }
      // the logits above c, and the top k: WIDE at a time, a run offered one by one only where a logit in it
      // could enter (comparisons only, so the counts and picks are exact in any order)
      TopK top{k, 0, vp + r * k, ap + r * k};
      wivec above_c = {};
      for (i = 0; i + WIDE <= V; i += WIDE) {
        const wvec y = *reinterpret_cast<const wvec*>(x + i);
        above_c -= y > c;  // a true lane is -1
        if (top.n == k) {
          const wivec in = (y > top.value[k - 1]) | (y != y);
          bool any = false;
          for (int j = 0; j < WIDE; ++j) any = any || in[j];
          if (!any) continue;
        }
        for (int j = 0; j < WIDE; ++j) top.offer(x[i + j], i + j);
      }
      int64_t n_above = 0;
      for (int j = 0; j < WIDE; ++j) n_above += above_c[j];
      for (; i < V; ++i) {
        n_above += x[i] > c;
        top.offer(x[i], i);
      }
      cp[r] = c;
      rp[r] = n_above + 1;
    }
  });
  return {lse, chosen, rank, value, at};
}

// A grammar's token masks applied in place: logits (R, V) fp32, bitmask (R, ceil(V / 32)) int32, bit j of word w
// allowing token 32 w + j; every token not allowed becomes -inf, as masked_fill_ writes it. One pass over a row,
// a word at a time: a word that allows all 32 is skipped, one that allows none fills 32 at once.
void apply_bitmask_(torch::Tensor logits, torch::Tensor bitmask) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits: expected (rows, vocab)");
  const int64_t R = logits.size(0), V = logits.size(1), W = (V + 31) / 32;
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() && bitmask.dim() == 2 &&
                  bitmask.size(0) == R && bitmask.size(1) == W,
              "bitmask: expected contiguous int32 (", R, ", ", W, "), got ", bitmask.scalar_type(), " ",
              bitmask.sizes());
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t bits = mp[r * W + w];
        if (bits == 0xffffffffu) continue;
        float* x = lp + r * V + w * 32;
        const int64_t n = std::min<int64_t>(32, V - w * 32);
        if (bits == 0) {
          std::fill(x, x + n, -INFINITY);
          continue;
        }
        for (int64_t j = 0; j < n; ++j)
          if (!((bits >> j) & 1u)) x[j] = -INFINITY;
      }
  });
}

namespace {

// at[j] = where key l0 + j's slot starts in the pool (j < n), block by block: no division per key.
inline void key_slots(const int64_t* table, int64_t l0, int64_t n, int64_t BS, int64_t slot, int64_t* at) {
  for (int64_t j = 0, l = l0; j < n;) {
    const int64_t end = std::min(n, j + BS - l % BS);
    for (int64_t base = (table[l / BS] * BS + l % BS) * slot; j < end; ++j, ++l, base += slot) at[j] = base;
  }
}

// Split-K for rows of more than P keys (flash-decoding): the keys of a row (request r's query at q row `row`,
// over `keys` keys; rows = {r, row, keys}) are cut into pieces of P keys,
// and each piece is a task that leaves, for every query head, the piece's online-softmax state: max m, sum l
// of e^(s - m), and the unnormalised value sum acc (each key slot read once). Then each (row, head) merges its
// pieces in order: M = the largest m, out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M). The pieces
// depend on the row's own length only, never on the batch or the thread count, and so do its bits.
template <class T>
void split_decode(const std::vector<std::array<int64_t, 3>>& rows, const float* qd, const T* kd, const T* vd,
                  float* od, const int64_t* tables, int64_t W, int64_t BS, int64_t H, int64_t K, int64_t D,
                  float scale, int64_t P, Team* team) {
  const int64_t R = static_cast<int64_t>(rows.size()), rep = H / K;  // rep query heads share each kv head
  std::vector<int64_t> first(R + 1, 0);  // row s's pieces are first[s] .. first[s+1]-1
  for (int64_t s = 0; s < R; ++s) first[s + 1] = first[s] + (rows[s][2] + P - 1) / P;
  const int64_t pieces = first[R];
  std::vector<float> own;  // (piece, head, ...): acc, then m, then l; a team's threads share theirs
  if (team == nullptr) own.resize(pieces * H * (D + 2));
  float* const acc = team ? team->buffer(pieces * H * (D + 2)) : own.data();
  float *const m = acc + pieces * H * D, *const l = m + pieces * H;
  struct Scratch {
    std::vector<float> scores;
    std::vector<int64_t> at;
  };
  // a task: one piece of up to 16 consecutive rows of one request (the same keys, read while in cache)
  std::vector<std::array<int64_t, 3>> jobs;  // (first row, end row, piece)
  for (int64_t s = 0; s < R;) {
    int64_t e = s + 1;
    while (e < R && e - s < 16 && rows[e][0] == rows[s][0] && rows[e][1] == rows[e - 1][1] + 1) ++e;
    for (int64_t p = 0; p < first[e] - first[e - 1]; ++p) jobs.push_back({s, e, p});  // the last row has the most
    s = e;
  }
  const auto run_piece = [&](int64_t job, Scratch& sc) {
    const auto [s0, s1, p] = jobs[job];
    const int64_t r = rows[s0][0], l0 = p * P, most = std::min(P, rows[s1 - 1][2] - l0);
    sc.scores.resize(H * most);
    sc.at.resize(most);
    key_slots(tables + r * W, l0, most, BS, K * D, sc.at.data());
    for (int64_t s = s0, fetched = 0; s < s1; ++s) {
      if (rows[s][2] <= l0) continue;  // this row's keys end before the piece
      const int64_t n = std::min(P, rows[s][2] - l0), piece = first[s] + p;
      decode_scores(qd + rows[s][1] * H * D, kd, vd, sc.at.data(), n, H, 0, rep, D, scale, sc.scores.data(),
                    !fetched++);
      value_sums(sc.scores.data(), n, n, H, 0, rep, D, vd, sc.at.data(), acc + piece * H * D, m + piece * H,
                 l + piece * H);
    }
  };
  const auto merge = [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / H, h = task % H;
      float M = m[first[s] * H + h], L = 0.f;
      for (int64_t p = first[s] + 1; p < first[s + 1]; ++p) M = std::max(M, m[p * H + h]);
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t p = first[s]; p < first[s + 1]; ++p) {  // in order: the same sums whatever ran where
        const float c = fast_exp(m[p * H + h] - M);
        L += l[p * H + h] * c;
        const float* a = acc + (p * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a[d] * c;
      }
      const float inv = 1.0f / L;
      float* dst = od + (rows[s][1] * H + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
    }
  };
  for_each_task<Scratch>(team, static_cast<int64_t>(jobs.size()), run_piece);
  if (team) team->sync();  // every piece in place before any row merges its own
  parallel_rows(team, R * H, 1, merge);
}

}  // namespace

// Attention of a step's query tokens over their requests' keys, read where they lie in the paged pool:
// no gather, no mask. A step is a flat list of N query rows from R requests; request r owns rows
// query_start_loc[r] .. query_start_loc[r+1]-1, the last T_r of its seq_lens[r] tokens (a whole prompt,
// a chunk after cached context, or one decode token). Its query i sits at position seq_lens[r] - T_r + i
// and attends over keys 0..that position, key l in block block_tables[r][l / block_size]. Rows past
// query_start_loc[R] are padding and come out zero.
// Every query row is computed as a decode row, over its own keys: a row of more than split_keys keys (split_keys >
// 0) is split-K (flash-decoding): its keys are cut into pieces of split_keys, and the pieces' softmax states
// merged in order. A row's bits so depend on its query and its keys alone: never on the other rows of the step,
// on how its prompt was cut into chunks, or on the thread count.
// With window > 0 (a sliding layer's), the query at position p sees keys max(0, p - window + 1) .. p only, read the
// same way; blocks wholly before a request's first query's window are not read (they may be freed: -1). A window
// wider than split_keys is refused (its rows would need split-K from an offset).
// q (N, H, D); k_pool/v_pool (blocks, block_size, K, D), float32 or bf16; query_start_loc (R+1,), seq_lens (R,),
// block_tables (R, W): int64. Returns (N, H*D).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale, int64_t split_keys, int64_t window) {
  check_f32(q, "q");
  TORCH_CHECK(k_pool.device().is_cpu() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == torch::kFloat32 || k_pool.scalar_type() == torch::kBFloat16),
              "k_pool/v_pool: expected contiguous float32 or bfloat16 CPU pools of one dtype, got ",
              k_pool.scalar_type(), " and ", v_pool.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
              "expected q (N, H, D) and k/v pools (blocks, block_size, K, D) of one shape");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_pool.size(0), BS = k_pool.size(1), K = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && K > 0 && H % K == 0, "pool heads/dims (", K, ", ", k_pool.size(3),
              ") do not fit q's (", H, ", ", D, ")");
  const int64_t R = seq_lens.numel();
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(), "seq_lens: expected contiguous int64");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt64 && query_start_loc.numel() == R + 1 &&
                  query_start_loc.is_contiguous(), "query_start_loc: expected ", R + 1, " contiguous int64");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.size(0) == R &&
                  block_tables.is_contiguous(), "block_tables: expected contiguous int64 (", R, ", W)");
  auto out = torch::empty({N, H * D}, q.options());
  paged_attention_rows(q.data_ptr<float>(), k_pool.data_ptr(), v_pool.data_ptr(),
                       k_pool.scalar_type() == torch::kBFloat16, N, H, D, NB, BS, K,
                       query_start_loc.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                       block_tables.data_ptr<int64_t>(), R, block_tables.size(1), scale, split_keys,
                       out.data_ptr<float>(), nullptr, window);
  return out;
}

// paged_attention on raw pointers, for a caller that has checked the tensors (step.cpp): q (N, H, D), the pools
// (NB, BS, K, D) of float, or of bf16 if `bf16`, the step's metadata, and out (N, H * D). Each request's lengths
// and block ids are checked here. A request marked in `skip` is left alone: its rows of out are the caller's.
void paged_attention_rows(const float* qd, const void* k_pool, const void* v_pool, bool bf16, int64_t N, int64_t H,
                          int64_t D, int64_t NB, int64_t BS, int64_t K, const int64_t* qsl, const int64_t* lens,
                          const int64_t* tables, int64_t R, int64_t W, double scale, int64_t split_keys,
                          float* od, Team* team, int64_t window, const std::vector<bool>* skip) {
  const int64_t rep = H / K;
  TORCH_CHECK(qsl[0] == 0 && qsl[R] <= N, "query_start_loc: expected to start at 0 and end by row ", N);
  TORCH_CHECK(split_keys >= 0, "split_keys: expected 0 (never split) or a piece size, got ", split_keys);
  TORCH_CHECK(window >= 0 && (window == 0 || split_keys == 0 || window <= split_keys), "window: expected 0 (none) or ",
              "1..", split_keys, " (split_keys) positions, got ", window);
  // the first key query i of request r sees (its position lens[r] - T + i, less the window)
  const auto low = [&](int64_t r, int64_t i) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, lens[r] - (qsl[r + 1] - qsl[r]) + i - window + 1) : 0;
  };
  constexpr int64_t TILE = 16;  // queries of one request handled by one task (they share its keys in cache)
  std::vector<std::array<int64_t, 3>> tiles;  // (request, first query, end query): rows of at most split_keys keys
  std::vector<std::array<int64_t, 3>> split;  // rows of more, their keys read in pieces: (request, q row, keys)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t T = qsl[r + 1] - qsl[r];
    TORCH_CHECK(T >= 1, "request ", r, ": no query rows (query_start_loc must increase)");
    TORCH_CHECK(lens[r] >= T && lens[r] <= W * BS, "request ", r, ": sequence length ", lens[r], " outside ", T,
                "..", W * BS, " (its ", T, T == 1 ? " query" : " queries", "; its table's ", W, " blocks of ", BS, ")");
    for (int64_t b = low(r, 0) / BS; b < (lens[r] + BS - 1) / BS; ++b)
      TORCH_CHECK(tables[r * W + b] >= 0 && tables[r * W + b] < NB, "request ", r, ": block ", tables[r * W + b],
                  " is not in the pool of ", NB);
    // query i sees lens[r] - T + i + 1 keys: the first `whole` see at most split_keys (all, with split_keys 0)
    // (with a window, every query sees at most window <= split_keys keys)
    if (skip != nullptr && (*skip)[r]) continue;  // its rows computed by the caller
    const int64_t whole = split_keys > 0 && window == 0 ? std::clamp<int64_t>(split_keys - (lens[r] - T), 0, T) : T;
    for (int64_t i = 0; i < whole; i += TILE) tiles.push_back({r, i, std::min(whole, i + TILE)});
    for (int64_t i = whole; i < T; ++i) split.push_back({r, qsl[r] + i, lens[r] - T + i + 1});
  }
  // Tasks go to whichever thread is free (for_each_task), heaviest first: a tile's work grows with its keys.
  std::sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) {
    return lens[a[0]] - (qsl[a[0] + 1] - qsl[a[0]]) + a[2] > lens[b[0]] - (qsl[b[0] + 1] - qsl[b[0]]) + b[2];
  });
  if (team == nullptr || team->tid == 0)
    std::memset(od + qsl[R] * H * D, 0, (N - qsl[R]) * H * D * sizeof(float));  // padding rows
  const float fscale = static_cast<float>(scale);
  // A task is a tile and all its kv heads (each key slot holds every kv head's numbers side by side: read
  // once), unless there are too few tiles to keep every thread busy: then a tile and one kv head. Either
  // way every (query, head) row is computed by the same loops in the same order: a decode row's.
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const bool per_head = n_tiles < 4 * (team ? team->size : at::get_num_threads());
  struct Scratch {
    std::vector<float> scores;
    std::vector<int64_t> at;  // where key l's slot starts in the pool (every kv head's numbers, side by side)
  };
  const auto attend = [&](const auto* kd, const auto* vd) {  // float or bf16 pools: the same loops
    const auto tile_task = [&](int64_t task, Scratch& sc) {
      const auto& tile = tiles[per_head ? task / K : task];
      const int64_t r = tile[0], i0 = tile[1], i1 = tile[2];
      const int64_t g0 = per_head ? task % K : 0, heads = (per_head ? 1 : K) * rep, h_first = g0 * rep;
      const int64_t* table = tables + r * W;
      const int64_t first = lens[r] - (qsl[r + 1] - qsl[r]);  // keys before the request's first query
      const int64_t l0 = low(r, i0);                           // the first key the tile's first query sees
      sc.at.resize(first + i1 - l0);                           // to the last key its last query sees
      key_slots(table, l0, first + i1 - l0, BS, K * D, sc.at.data());
      sc.scores.resize(heads * (first + i1 - l0));
      for (int64_t i = i0; i < i1; ++i) {  // each query over its own keys, key by key, each slot read once
        const int64_t row = qsl[r] + i, lo = low(r, i), n = first + i + 1 - lo;
        const int64_t* at = sc.at.data() + (lo - l0);
        decode_scores(qd + (row * H + h_first) * D, kd, vd, at, n, heads, h_first, rep, D, fscale,
                      sc.scores.data(), i == i0);
        value_sums(sc.scores.data(), n, n, heads, h_first, rep, D, vd, at, od + (row * H + h_first) * D);
      }
    };
    for_each_task<Scratch>(team, per_head ? n_tiles * K : n_tiles, tile_task);
    if (!split.empty()) split_decode(split, qd, kd, vd, od, tables, W, BS, H, K, D, fscale, split_keys, team);
  };
  if (bf16)
    attend(static_cast<const uint16_t*>(k_pool), static_cast<const uint16_t*>(v_pool));
  else
    attend(static_cast<const float*>(k_pool), static_cast<const float*>(v_pool));
}
