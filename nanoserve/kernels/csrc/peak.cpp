// The machine's compute peaks per number format (bench.roofline): loops of one multiply-add instruction on
// registers alone, no memory touched, several independent accumulators so that each unit's latency is hidden, run
// on each of torch's threads at once. What a product kernel can reach at best on this CPU, per format.
//
//   fp32   FMA (vfmadd231ps): 2 FLOPs a lane, 16 lanes with AVX-512, 8 with AVX2
//   int8   a u8 x s8 multiply-add into int32: AVX512-VNNI's 512-bit vpdpbusd (64 products), AVX-VNNI's 256-bit one
//          (32), AVX2's vpmaddubsw + vpmaddwd + vpaddd (32 products in three instructions); 2 ops a product
//   bf16   AVX512_BF16's vdpbf16ps: 32 pair products into 16 fp32 sums, 2 FLOPs a product
//   amx    Intel's tile unit (AMX), where the CPU has it and Linux lets the process use it: tdpbusd (int8) and
//          tdpbf16ps (bf16) on whole tiles, four independent 16 x 16 sums, 16 x 16 x 64 int8 (32 bf16 pair) products
//          each, the tiles' registers only
//
// An empty asm statement marks each input as changed after its use, so the compiler keeps every instruction in
// the loop instead of hoisting one whose inputs do not change; it emits nothing.
#include "nanoserve.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define NANOSERVE_PEAK_X86 1
#endif

namespace {

constexpr int CHAINS = 12;  // independent accumulators: a unit's latency (4-5 cycles) times its throughput (2) and more

#ifdef NANOSERVE_PEAK_X86
#define TOUCH(v) asm volatile("" : "+x"(v))

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
bool has_avx512_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }
bool has_avx_vnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

// Each loop returns the operations it did; the sum of its accumulators goes to a volatile sink so none is dead.
volatile float sink_f;
volatile int sink_i;

__attribute__((target("avx512f"))) double fp32_avx512(int64_t iters) {
  __m512 acc[CHAINS], a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : acc) v = _mm512_fmadd_ps(a, b, v);
  __m512 s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
  sink_f = _mm512_reduce_add_ps(s);
  return 2.0 * 16 * CHAINS * static_cast<double>(iters);
}

__attribute__((target("avx2,fma"))) double fp32_avx2(int64_t iters) {
  __m256 acc[CHAINS], a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : acc) v = _mm256_fmadd_ps(a, b, v);
  __m256 s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm256_add_ps(s, acc[c]);
  float out[8];
  _mm256_storeu_ps(out, s);
  sink_f = out[0];
  return 2.0 * 8 * CHAINS * static_cast<double>(iters);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double int8_avx512_vnni(int64_t iters) {
  __m512i acc[CHAINS], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : acc) v = _mm512_dpbusd_epi32(v, a, b);
  __m512i s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm512_add_epi32(s, acc[c]);
  sink_i = _mm512_reduce_add_epi32(s);
  return 2.0 * 64 * CHAINS * static_cast<double>(iters);
}

__attribute__((target("avx2,avxvnni"))) double int8_avx_vnni(int64_t iters) {
  __m256i acc[CHAINS], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5);
  for (auto& v : acc) v = _mm256_setzero_si256();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : acc) v = _mm256_dpbusd_avx_epi32(v, a, b);
  __m256i s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm256_add_epi32(s, acc[c]);
  sink_i = _mm256_extract_epi32(s, 0);
  return 2.0 * 32 * CHAINS * static_cast<double>(iters);
}

__attribute__((target("avx2"))) double int8_avx2(int64_t iters) {
  constexpr int N = 8;  // 8 accumulators, 4 inputs, the ones and a temporary: AVX2's 16 registers
  __m256i acc[N], a[4], b = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
  for (int k = 0; k < 4; ++k) a[k] = _mm256_set1_epi8(static_cast<char>(3 + k));
  for (auto& v : acc) v = _mm256_setzero_si256();
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < N; ++c) {
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a[c % 4], b), ones));
      TOUCH(a[c % 4]);
    }
  __m256i s = acc[0];
  for (int c = 1; c < N; ++c) s = _mm256_add_epi32(s, acc[c]);
  sink_i = _mm256_extract_epi32(s, 0);
  return 2.0 * 32 * N * static_cast<double>(iters);
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_avx512(int64_t iters) {
  __m512 acc[CHAINS];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0 each
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : acc) v = _mm512_dpbf16_ps(v, a, b);
  __m512 s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
  sink_f = _mm512_reduce_add_ps(s);
  return 2.0 * 32 * CHAINS * static_cast<double>(iters);
}

bool has_amx_int8() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)) && amx_tiles_here();
}
bool has_amx_bf16() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && amx_tiles_here();
}

__attribute__((target("amx-tile"))) void whole_tiles() {
  AmxTiles c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  load_tiles(c);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

__attribute__((target("amx-tile,amx-int8"))) double int8_amx(int64_t iters) {
  whole_tiles();
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  alignas(64) int32_t c[16][16];
  _tile_stored(0, c, 64);
  sink_i = c[0][0];
  _tile_release();
  return 2.0 * 16 * 16 * 64 * 4 * static_cast<double>(iters);
}

__attribute__((target("amx-tile,amx-bf16"))) double bf16_amx(int64_t iters) {
  whole_tiles();
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[16][16];
  _tile_stored(0, c, 64);
  sink_f = c[0][0];
  _tile_release();
  return 2.0 * 16 * 16 * 32 * 2 * 4 * static_cast<double>(iters);
}
#endif

struct Peak {
  const char* format;
  const char* road;
  bool (*here)();
  double (*loop)(int64_t);
};

#ifdef NANOSERVE_PEAK_X86
// Best road first, per format.
const Peak PEAKS[] = {
    {"fp32", "avx512", has_avx512, fp32_avx512},         {"fp32", "avx2", has_avx2, fp32_avx2},
    {"int8", "amx", has_amx_int8, int8_amx},
    {"int8", "avx512-vnni", has_avx512_vnni, int8_avx512_vnni}, {"int8", "avx-vnni", has_avx_vnni, int8_avx_vnni},
    {"int8", "avx2", has_avx2, int8_avx2},               {"bf16", "amx", has_amx_bf16, bf16_amx},
    {"bf16", "avx512-bf16", has_avx512_bf16, bf16_avx512},
};
#endif

}  // namespace

std::vector<std::tuple<std::string, std::string>> peak_roads() {
  std::vector<std::tuple<std::string, std::string>> out;
#ifdef NANOSERVE_PEAK_X86
  for (const Peak& p : PEAKS)
    if (p.here()) out.emplace_back(p.format, p.road);
#endif
  return out;
}

// Every one of torch's threads runs `iters` rounds of the road's loop at once; the operations done by them all.
double peak_ops(std::string format, std::string road, int64_t iters) {
  TORCH_CHECK(iters > 0, "iters: expected a positive count, got ", iters);
#ifdef NANOSERVE_PEAK_X86
  for (const Peak& p : PEAKS) {
    if (format != p.format || road != p.road) continue;
    TORCH_CHECK(p.here(), "this CPU cannot take the ", road, " road for ", format);
    const int64_t threads = at::get_num_threads();
    std::vector<double> ops(threads, 0.0);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) ops[t] = p.loop(iters);
    });
    double total = 0.0;
    for (double v : ops) total += v;
    return total;
  }
#endif
  TORCH_CHECK(false, "no peak loop for format '", format, "' on road '", road, "' (peak_roads() lists them)");
}
