// The kernels' C++ entry points, one extension built from kernels.cpp (the layer's small calls and the paged
// attention), attention_bf16.cpp (a prompt's attention with bf16 products), matmul_bf16.cpp (a bf16 matrix's
// product, on AVX512_BF16 or widened to fp32), matmul_fp32.cpp (an fp32 matrix's, one order for any rows), quant.cpp
// (the product on GGUF blocks), step.cpp (a model on blocks stepped by one call), peak.cpp (the compute peaks
// bench.roofline measures) and module.cpp (the Python bindings).
#pragma once
#include <ATen/Parallel.h>
#include <torch/types.h>  // torch::Tensor and its factories; the bindings alone need torch/extension.h

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

class Team;

// bf16 held as uint16_t (a float's top half): widened to float exactly, and a float narrowed to the nearest bf16
// (ties to even, a NaN kept a NaN), as torch's .to(torch.bfloat16) rounds.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }
inline uint16_t narrow_bf16(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps, bool h_bf16);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, bool round_bf16);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale, int64_t split_keys, int64_t window);
void paged_attention_rows(const float* q, const void* k_pool, const void* v_pool, bool bf16, int64_t N, int64_t H,
                          int64_t D, int64_t NB, int64_t BS, int64_t K, const int64_t* query_start_loc,
                          const int64_t* seq_lens, const int64_t* block_tables, int64_t R, int64_t W, double scale,
                          int64_t split_keys, float* out, Team* team = nullptr, int64_t window = 0,
                          const std::vector<bool>* skip = nullptr);
torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, std::string fmt, std::string road);
torch::Tensor block_dequantize(torch::Tensor blocks, int64_t K, std::string fmt, std::string road);
std::vector<std::tuple<std::string, std::string, int64_t, int64_t>> block_kernels();
torch::Tensor argmax_rows(torch::Tensor logits);
std::vector<torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor tokens, int64_t k);
void apply_bitmask_(torch::Tensor logits, torch::Tensor bitmask);
// The first largest value of a range and where it is (`nan`: the range holds a NaN, `at` the first one).
struct RangeMax {
  float value;
  int64_t at;
  bool nan;
};
RangeMax argmax_range(const float* x, int64_t begin, int64_t end);
// torch.argmax's answer over consecutive ranges from their RangeMax in order: the first NaN, else the first largest.
int64_t first_largest(const RangeMax* parts, int64_t n);
// The block product on int8 activations (int8.cpp).
torch::Tensor block_linear_int8(torch::Tensor x, torch::Tensor blocks, std::string fmt, std::string road);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations_int8(torch::Tensor x, std::string road);
std::string int8_road();
torch::Tensor pack_blocks_int8(torch::Tensor blocks, std::string fmt, std::string road);
torch::Tensor block_linear_int8_packed(torch::Tensor x, torch::Tensor packed, std::string fmt, int64_t N,
                                       std::string road);
bool int8_packed_here();
std::vector<std::string> int8_roads();
std::pair<int64_t, int64_t> int8_tiled_rows();
// A whole prompt's causal attention with bf16 products (attention_bf16.cpp), and whether this CPU can run it.
torch::Tensor prompt_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale);
bool prompt_attention_bf16_here();
// x @ w.T for a bf16 matrix stored [in, out] (matmul_bf16.cpp).
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w);
// The same from its panels, packed once at load (matmul_bf16.cpp).
torch::Tensor pack_bf16_panels(torch::Tensor w);
torch::Tensor bf16_panels_linear(torch::Tensor x, torch::Tensor panels);
// x @ w.T for a bf16 matrix from its tiled copy, on AVX512_BF16's pair products (matmul_bf16.cpp).
torch::Tensor pack_bf16(torch::Tensor w);
torch::Tensor bf16_tiles_linear(torch::Tensor x, torch::Tensor tiles, int64_t N, std::string unit);
// Which units multiply the tiles here, AMX's tile unit ("amx") then AVX512_BF16's pair products ("avx512-bf16"): each
// gives a row its bits for any rows, its own bits (matmul_bf16.cpp); the first is taken.
std::vector<std::string> bf16_tiles_units();
// Whether this process may use AMX's tiles (a CPU with them, Linux's permission, NANOSERVE_AMX not 0).
bool amx_tiles_here();
// AMX's tile configuration, palette 1: each tile's bytes a row and rows, the rest zero (ldtilecfg's 64 bytes).
struct alignas(64) AmxTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#if defined(__x86_64__)
#include <immintrin.h>
// Configure this thread's tiles (zeroing them). The asm tells GCC the stores are read: GCC 12 dropped them.
__attribute__((target("amx-tile"))) inline void load_tiles(const AmxTiles& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}
#endif
// Whether the int8 tiled products take AMX's tile unit (the same bits as without): on = -1 asks, 0 or 1 sets.
bool int8_amx(int64_t on);
// x @ w.T for an fp32 matrix from its tiled copy, the same bits for any row count (matmul_fp32.cpp).
torch::Tensor pack_fp32(torch::Tensor w);
torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor tiles, int64_t N);
// The compute peaks per number format (peak.cpp): the (format, road) loops this CPU can run, and one run of one.
std::vector<std::tuple<std::string, std::string>> peak_roads();
double peak_ops(std::string format, std::string road, int64_t iters);
// The same loops on raw numbers, for callers that have checked the shapes (step.cpp).
void fp32_product(const float* tiles, int64_t nt, int64_t K, const float* x, int64_t M, float* out,
                  Team* team = nullptr);
void bf16_tiles_product(const uint16_t* tiles, int64_t nt, int64_t P, const uint16_t* x, int64_t M, uint16_t* out,
                        Team* team = nullptr, const std::string& unit = "");
// bf16_panels_linear on raw numbers: x (M, K) bf16 times the panels of N outputs -> out (M, N) bf16.
void bf16_panels_product(const uint16_t* panels, int64_t N, int64_t K, const uint16_t* x, int64_t M, uint16_t* out,
                         Team* team = nullptr);
void add_rms_norm_rows_bf16(const float* x, const uint16_t* residual, const float* weight, int64_t n, int64_t C,
                            float eps, float* out, uint16_t* h);
void silu_mul_rows_bf16(const uint16_t* gate_up, int64_t n, int64_t I, uint16_t* out);
void widen_bf16_row(const uint16_t* x, int64_t n, float* out);   // exact
void narrow_bf16_row(const float* x, int64_t n, uint16_t* out);  // each to the nearest bf16
void add_rms_norm_rows(const float* x, const float* residual, const float* weight, int64_t n, int64_t C, float eps,
                       float* out, float* h);
void rope_rows(float* qkv, const float* cos, const float* sin, int64_t n, int64_t HT, int64_t heads, int64_t D);
void round_bf16_(float* x, int64_t n);
void silu_mul_rows(const float* gate_up, int64_t n, int64_t I, float* out);
void gelu_tanh_mul_rows(const float* gate_up, int64_t n, int64_t I, float* out);
void block_product(const uint8_t* w, bool q4_1, int64_t N, int64_t K, const float* x, int64_t B, float* out,
                   Team* team = nullptr);
void block_product_int8(const uint8_t* w, bool q4_1, int64_t N, int64_t K, const float* x, int64_t B, float* out,
                        Team* team = nullptr);
void block_product_int8_packed(const uint8_t* packed, bool q4_1, int64_t N, int64_t K, const float* x, int64_t B,
                               float* out, Team* team = nullptr);
// Q4_K (kfmt 1), Q6_K (kfmt 2) or Q5_0 (kfmt -1) blocks on int8 activations: block_linear_int8's product on raw numbers.
void block_product_int8_kquant(const uint8_t* w, int kfmt, int64_t N, int64_t K, const float* x, int64_t B, float* out,
                               Team* team = nullptr);
// Whether B rows of x multiply a Q5_0 weight from its own blocks (block_product_int8_kquant, kfmt -1) rather than its
// packed Q8_0 copy, and this thread's share of a weight's rows' bytes in that product (team.sync's `ahead`).
bool int8_q5_0_blocks(int64_t B);
std::pair<const uint8_t*, int64_t> q5_0_share(const uint8_t* w, int64_t N, int64_t K, const Team& team);
// The bytes of a weight of N rows of K inputs in pack_blocks_int8's layout.
int64_t int8_packed_bytes(bool q4_1, int64_t N, int64_t K);
// The packed bytes a team thread's share of that product reads (where it starts, how many).
std::pair<const uint8_t*, int64_t> packed_share(const uint8_t* packed, bool q4_1, int64_t N, int64_t K,
                                                const Team& team);
void dequantize_rows(const uint8_t* w, bool q4_1, int64_t K, const int64_t* ids, int64_t n, float* out);

// A model on blocks or tiles, stepped by one call (step.cpp): its weights checked and held once, each step's
// inputs passed to `step`. A matrix of fmt "q4_1" or "q8_0" is GGUF blocks; of fmt "f32" or "bf16", the tiles of
// an fp32 or bf16 matrix (pack_fp32, pack_bf16: every matrix then bf16), as the token table of embed_fmt "f32" or
// "bf16" is an fp32 or bf16 (V, C) table. int8[i]: matrix i multiplies int8-quantized activations
// (block_linear_int8's product), from packed[i] (pack_blocks_int8) where that is not empty; on int8 activations
// "q5_0" (read from its packed copy, Q8_0's layout), "q4_k" and "q6_k" too. kv_bf16: its K/V cache holds bf16.
// windows (one per layer, or none): Gemma 3's layer (model/gemma3.py), each layer's sliding window (0: none).
class BlockModel {
 public:
  BlockModel(torch::Tensor embed, std::string embed_fmt, std::vector<torch::Tensor> norms,
             std::vector<torch::Tensor> blocks, std::vector<std::string> fmts, std::vector<bool> int8,
             std::vector<torch::Tensor> packed, int64_t n_heads, int64_t n_kv_heads, double eps, bool kv_bf16,
             std::vector<int64_t> windows = {}, double embed_scale = 1.0);
  std::tuple<torch::Tensor, torch::Tensor> step(torch::Tensor ids, torch::Tensor positions, torch::Tensor cos_table,
                                                torch::Tensor sin_table, torch::Tensor k_cache, torch::Tensor v_cache,
                                                torch::Tensor slot_mapping, torch::Tensor query_start_loc,
                                                torch::Tensor seq_lens, torch::Tensor block_tables,
                                                torch::Tensor last_rows, double scale, int64_t split_keys,
                                                std::vector<torch::Tensor> group_slots = {},
                                                std::vector<torch::Tensor> group_tables = {},
                                                std::vector<int64_t> layer_group = {},
                                                std::vector<int64_t> layer_slot = {},
                                                c10::optional<torch::Tensor> cos_local = c10::nullopt,
                                                c10::optional<torch::Tensor> sin_local = c10::nullopt);
  std::tuple<torch::Tensor, torch::Tensor> decode(int64_t steps, torch::Tensor ids, torch::Tensor positions,
                                                  torch::Tensor cos_table, torch::Tensor sin_table,
                                                  torch::Tensor k_cache, torch::Tensor v_cache,
                                                  torch::Tensor block_tables, torch::Tensor stop_ids, double scale,
                                                  int64_t split_keys);

 private:
  struct Matrix {
    const uint8_t* blocks;
    bool q4_1;
    int64_t rows, cols;  // the weight's (out, in)
    bool int8;           // x quantized to int8 blocks first (kernels/int8.py)
    const uint8_t* packed = nullptr;  // int8 on an x86 road: the same blocks packed (pack_blocks_int8)
    const float* tiles = nullptr;     // fmt "f32": the fp32 matrix's tiles (rows / 16 of them), not blocks
    const uint16_t* bf16_tiles = nullptr;  // fmt "bf16": a bf16 matrix's tiles of pairs (pack_bf16)
    const uint16_t* bf16_panels = nullptr;  // fmt "bf16-panels": its panels (pack_bf16_panels), any x86 CPU
    int kquant = 0;                         // fmt "q4_k" (1) or "q6_k" (2): blocks of 256 weights
  };
  std::vector<torch::Tensor> keep_;  // the tensors whose memory the pointers below read
  Matrix embed_;
  const void* embed_table_ = nullptr;  // embed_fmt "f32" or "bf16": row v, column c at [v * rs + c * cs]
  bool embed_bf16_ = false;
  int64_t embed_rs_ = 0, embed_cs_ = 0;
  bool bf16_ = false;  // the matrices are bf16 (Llama.cast_matrices): each product takes bf16 and gives bf16
  std::vector<const float*> norms_;  // attn_norm and mlp_norm of each layer, then the final norm
  std::vector<Matrix> mats_;         // wqkv, wo, w_gate_up, w_down of each layer, then the head
  int64_t L_, H_, K_, C_, I_;
  float eps_;
  bool kv_bf16_;  // q, k, v rounded to bf16 after RoPE, and the K/V pools bf16 (Block.kv_dtype)
  bool gemma_ = false;           // Gemma 3's layer: four norms a layer and QK-norm, GeGLU, windows
  std::vector<int64_t> windows_;  // (gemma_) each layer's sliding window, 0 for none
  float embed_scale_ = 1.0f;     // (gemma_) the embedding rows' scale, sqrt(hidden)
  static constexpr int64_t TEAM_ROWS = 32;  // a step of at most this many rows runs as one Team (decode steps)
  static constexpr int64_t ROW_GRAIN = 8;  // rows a thread takes at least of the work between products, without a team
  static constexpr int64_t KEPT_SCRATCH_BYTES = 8 << 20;  // a step's buffers up to this size stay for the next
  torch::Tensor scratch_ = torch::empty({0});
  std::mutex scratch_mutex_;
};

// Tasks 0..n-1 handed out one at a time to whichever of torch's threads is free, each thread calling
// work(task, scratch) with a scratch of its own: tasks of unequal size (a row's pieces and its short last piece,
// requests of different lengths) then end together, where fixed runs of tasks would leave one thread the long
// ones. Which thread computes a task never changes its numbers.
template <class Scratch, class Work>
void for_each_task(int64_t n, const Work& work) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t task = next++; task < n; task = next++) work(task, scratch);
  });
}

// The threads of one parallel region that a whole decode step runs in (step.cpp), thread `tid` of `size`. A
// decode step's products are small: forking the threads for each and joining them after costs several trips of
// a cache line between cores, a visible part of the step. A team forks once per step; its threads meet at
// sync() where a product's output must be whole, and share tasks through for_each_task.
class Team {
 public:
  struct Shared {
    std::atomic<int64_t> arrived{0};
    std::atomic<uint64_t> tickets{0};  // (round << 32) | next task of that round
    std::atomic<bool> failed{false};
    std::vector<float> buffer;
  };
  struct Abandoned {};  // thrown at sync() when another thread of the team failed

  Team(Shared& shared, int64_t tid, int64_t size)
      : tid(tid), size(size), shared_(shared),
        spin_(size > static_cast<int64_t>(std::thread::hardware_concurrency()) ? 1 << 8 : 1 << 18) {}
  const int64_t tid, size;

  // Wait until every thread has arrived: what each wrote before is then seen by all. A thread that waits asks
  // meanwhile for the first bytes of what it reads next (`ahead`, into L2), so that the wait is not all lost.
  // A long wait gives the core away, since the thread waited for may be waiting for a core: soon where the team
  // has more threads than the machine has cores, after a millisecond or so where other work shares them.
  void sync(const uint8_t* ahead = nullptr, int64_t bytes = 0) {
    const int64_t goal = ++passed_ * size;
    shared_.arrived.fetch_add(1, std::memory_order_acq_rel);
    bytes = std::min<int64_t>(bytes, 64 << 10);
    for (int64_t turn = 0; shared_.arrived.load(std::memory_order_acquire) < goal; ++turn) {
      if (shared_.failed.load(std::memory_order_relaxed)) throw Abandoned{};
      if (64 * turn < bytes) __builtin_prefetch(ahead + 64 * turn, 0, 2);
      else if (turn > spin_) std::this_thread::yield();
    }
  }
  // Tasks 0..n-1 to whichever thread asks first, as for_each_task hands them out; every thread of the team calls
  // this with the same n, in the same order as its other calls.
  template <class Scratch, class Work>
  void for_each_task(int64_t n, const Work& work) {
    const uint64_t round = ++rounds_;
    Scratch scratch;
    for (int64_t task = take(round, n); task >= 0; task = take(round, n)) work(task, scratch);
  }
  // This thread's share (begin, end) of 0..n-1, cut as at::parallel_for(0, n, grain, f) cuts it.
  std::pair<int64_t, int64_t> share(int64_t n, int64_t grain = 1) const {
    const int64_t threads = std::max<int64_t>(1, std::min(size, (n + grain - 1) / grain));
    const int64_t chunk = (n + threads - 1) / threads, begin = std::min(n, tid * chunk);
    return {begin, std::min(n, begin + chunk)};
  }
  // A buffer of at least `count` floats that every thread of the team sees (it syncs twice).
  float* buffer(int64_t count) {
    sync();
    if (tid == 0 && static_cast<int64_t>(shared_.buffer.size()) < count) shared_.buffer.resize(count);
    sync();
    return shared_.buffer.data();
  }

 private:
  int64_t take(uint64_t round, int64_t n) {  // the next task of `round`, or -1 once they are all taken
    uint64_t v = shared_.tickets.load(std::memory_order_relaxed);
    for (;;) {
      if ((v >> 32) > round) return -1;  // another thread has begun a later round: this one's are all taken
      const int64_t task = (v >> 32) < round ? 0 : static_cast<int64_t>(v & 0xffffffffu);
      if (task >= n) return -1;
      if (shared_.tickets.compare_exchange_weak(v, (round << 32) | static_cast<uint64_t>(task + 1),
                                                std::memory_order_acq_rel))
        return task;
    }
  }
  Shared& shared_;
  const int64_t spin_;  // turns of waiting before each turn yields
  int64_t passed_ = 0;
  uint64_t rounds_ = 0;
};

// at::parallel_for(0, n, grain, f) on torch's threads, or on a team this thread's share of the same cut.
template <class F>
void parallel_rows(Team* team, int64_t n, int64_t grain, const F& f) {
  if (team == nullptr) {
    at::parallel_for(0, n, grain, f);
    return;
  }
  const auto [begin, end] = team->share(n, grain);
  if (begin < end) f(begin, end);
}

// for_each_task(n, work) on torch's threads, or on a team.
template <class Scratch, class Work>
void for_each_task(Team* team, int64_t n, const Work& work) {
  if (team) team->for_each_task<Scratch>(n, work);
  else for_each_task<Scratch>(n, work);
}

// f(std::integral_constant<int, m>{}) for a row count m in 1..MAX known only at run time: a register tile's rows are
// a template argument (matmul_fp32.cpp's and matmul_bf16.cpp's tiles).
template <int MAX, typename F>
void with_rows(int64_t m, const F& f) {
  if constexpr (MAX > 0) {
    if (m == MAX) f(std::integral_constant<int, MAX>{});
    else with_rows<MAX - 1>(m, f);
  }
}
