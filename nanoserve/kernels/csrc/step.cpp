// A model held on GGUF blocks, on tiles (fp32 or bf16) or on bf16 panels, stepped by one call
// (nanoserve/model/compiled.py says when it runs and why): the embedding rows, every layer of the Python forward
// (model/llama.py, Block.forward; model/gemma3.py, Gemma3Block.forward), then the LM head at each request's last
// token. It runs the loops the Python forward reaches, in the same order, on the same rows, so its logits are that
// forward's bit for bit; what it saves is the Python and the tensor bookkeeping between.
#include "nanoserve.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <tuple>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

int64_t block_bytes(const std::string& fmt, const char* what, int64_t i) {
  TORCH_CHECK(fmt == "q4_1" || fmt == "q8_0", what, " ", i, ": fmt '", fmt,
              "' is not q4_1, q8_0, f32, bf16 or bf16-panels");
  return fmt == "q4_1" ? 20 : 34;
}

constexpr int64_t TILE = 16;  // outputs per tile of pack_fp32 and pack_bf16

void check_i64(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && (n < 0 || t.numel() == n), name,
              ": expected ", n < 0 ? std::string("") : std::to_string(n) + " ", "contiguous int64");
}

}  // namespace

// embed: the token table's blocks (V rows); norms: attn_norm and mlp_norm of each layer, then the final norm;
// blocks/fmts: wqkv, wo, w_gate_up, w_down of each layer, then the head; int8: which of them take int8 activations;
// packed: each one's pack_blocks_int8 copy, read instead of its blocks (an empty tensor: none); kv_bf16: the K/V
// cache holds bf16. Every shape is checked here, once.
// windows (Gemma 3's layer, one per layer): norms are then attn_norm, post_attn_norm, mlp_norm, post_mlp_norm (the
// hidden size each), q_norm and k_norm (head_dim each) of each layer, every one the (1 + w) the norm multiplies by;
// the embedding rows are scaled by embed_scale; the MLP is GeGLU.
BlockModel::BlockModel(torch::Tensor embed, std::string embed_fmt, std::vector<torch::Tensor> norms,
                       std::vector<torch::Tensor> blocks, std::vector<std::string> fmts, std::vector<bool> int8,
                       std::vector<torch::Tensor> packed, int64_t n_heads, int64_t n_kv_heads, double eps,
                       bool kv_bf16, std::vector<int64_t> windows, double embed_scale)
    : H_(n_heads), K_(n_kv_heads), eps_(static_cast<float>(eps)), kv_bf16_(kv_bf16), gemma_(!windows.empty()),
      windows_(windows), embed_scale_(static_cast<float>(embed_scale)) {
  const size_t per = gemma_ ? 6 : 2;  // norms a layer
  TORCH_CHECK(blocks.size() % 4 == 1 && fmts.size() == blocks.size() && int8.size() == blocks.size() &&
              packed.size() == blocks.size() &&
              norms.size() == blocks.size() / 4 * per + 1 && (!gemma_ || windows.size() == blocks.size() / 4),
              "expected 4 matrices and ", per, " norms per layer", gemma_ ? " and a window each" : "",
              ", then the head and the final norm; got ", blocks.size(), " matrices, ", fmts.size(), " formats, ",
              int8.size(), " activation flags, ", packed.size(), " packed copies, ", norms.size(), " norms and ",
              windows.size(), " windows");
  TORCH_CHECK(!gemma_ || !kv_bf16, "a Gemma layer's compiled step takes an fp32 K/V pool");
  L_ = static_cast<int64_t>(blocks.size() / 4);
  TORCH_CHECK(norms[0].dim() == 1, "norms: expected vectors");
  C_ = norms[0].numel();
  auto matrix = [&](const torch::Tensor& t, const std::string& fmt, int64_t cols, const char* what, int64_t i) {
    if (fmt == "f32") {
      TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 3 && t.is_contiguous() && t.size(1) == cols &&
                      t.size(2) == TILE,
                  what, " ", i, ": expected the contiguous float32 tiles (outputs / 16, ", cols, ", 16) of pack_fp32, "
                  "got ", t.scalar_type(), " ", t.sizes());
      keep_.push_back(t);
      Matrix m{nullptr, false, t.size(0) * TILE, cols, false, nullptr};
      m.tiles = t.data_ptr<float>();
      return m;
    }
    if (fmt == "bf16") {
      TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.dim() == 4 && t.is_contiguous() && cols % 2 == 0 &&
                      t.size(1) == cols / 2 && t.size(2) == TILE && t.size(3) == 2,
                  what, " ", i, ": expected the contiguous bf16 tiles (outputs / 16, ", cols / 2, ", 16, 2) of "
                  "pack_bf16 (an even number of inputs), got ", t.scalar_type(), " ", t.sizes());
      TORCH_CHECK(prompt_attention_bf16_here(), what, " ", i, ": bf16 tiles need a CPU with AVX512_BF16");
      keep_.push_back(t);
      Matrix m{nullptr, false, t.size(0) * TILE, cols, false, nullptr};
      m.bf16_tiles = static_cast<const uint16_t*>(t.data_ptr());
      bf16_ = true;
      return m;
    }
    if (fmt == "bf16-panels") {
      TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.dim() == 3 && t.is_contiguous() && t.size(1) == cols &&
                      t.size(2) == TILE,
                  what, " ", i, ": expected the contiguous bf16 panels (outputs / 16, ", cols, ", 16) of "
                  "pack_bf16_panels, got ", t.scalar_type(), " ", t.sizes());
      keep_.push_back(t);
      Matrix m{nullptr, false, t.size(0) * TILE, cols, false, nullptr};
      m.bf16_panels = static_cast<const uint16_t*>(t.data_ptr());
      bf16_ = true;
      return m;
    }
    if (fmt == "q5_0" || fmt == "q4_k" || fmt == "q6_k") {  // int8 activations only (checked below)
      const bool k = fmt != "q5_0";
      const int64_t weights = k ? 256 : 32, bytes = fmt == "q5_0" ? 22 : fmt == "q4_k" ? 144 : 210;
      TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.dim() == 2 && t.is_contiguous() && cols % weights == 0 &&
                      t.size(1) == cols / weights * bytes,
                  what, " ", i, ": expected contiguous uint8 rows of ", cols / weights * bytes, " bytes (", cols,
                  " inputs as ", fmt, "), got ", t.scalar_type(), " ", t.sizes());
      keep_.push_back(t);
      Matrix m{t.data_ptr<uint8_t>(), false, t.size(0), cols, false, nullptr};
      m.kquant = fmt == "q4_k" ? 1 : fmt == "q6_k" ? 2 : -1;  // -1: Q5_0, its packed copy read from the tiles' rows
      return m;
    }
    const int64_t bytes = block_bytes(fmt, what, i);
    TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.dim() == 2 && t.is_contiguous() && cols % 32 == 0 &&
                    t.size(1) == cols / 32 * bytes,
                what, " ", i, ": expected contiguous uint8 rows of ", cols / 32 * bytes, " bytes (", cols,
                " inputs as ", fmt, "), got ", t.scalar_type(), " ", t.sizes());
    keep_.push_back(t);
    return Matrix{t.data_ptr<uint8_t>(), fmt == "q4_1", t.size(0), cols, false, nullptr};
  };
  if (embed_fmt == "f32" || embed_fmt == "bf16") {
    embed_bf16_ = embed_fmt == "bf16";
    const auto type = embed_bf16_ ? torch::kBFloat16 : torch::kFloat32;
    TORCH_CHECK(embed.scalar_type() == type && embed.dim() == 2 && embed.size(1) == C_, "embed: expected a ", type,
                " (vocabulary, ", C_, ") table, got ", embed.scalar_type(), " ", embed.sizes());
    keep_.push_back(embed);
    embed_ = Matrix{nullptr, false, embed.size(0), C_, false, nullptr};
    embed_table_ = embed.data_ptr();
    embed_rs_ = embed.stride(0);
    embed_cs_ = embed.stride(1);
  } else {
    embed_ = matrix(embed, embed_fmt, C_, "embed", 0);
  }
  for (size_t i = 0; i < norms.size(); ++i) {
    const auto& w = norms[i];
    const bool qk = gemma_ && i + 1 < norms.size() && i % 6 >= 4;  // q_norm, k_norm: head_dim numbers (below)
    TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && (qk || w.numel() == C_),
                "norms: expected contiguous float32 weights of ", C_, " numbers");
    keep_.push_back(w);
    norms_.push_back(w.data_ptr<float>());
  }
  for (int64_t layer = 0; layer < L_; ++layer) {
    const Matrix qkv = matrix(blocks[4 * layer], fmts[4 * layer], C_, "blocks", 4 * layer);
    TORCH_CHECK(H_ > 0 && K_ > 0 && H_ % K_ == 0 && qkv.rows % (H_ + 2 * K_) == 0, "layer ", layer, ": ", qkv.rows,
                " q/k/v rows do not split into ", H_, " + 2 x ", K_, " heads");
    const int64_t D = qkv.rows / (H_ + 2 * K_);
    TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim ", D, ": expected an even number up to 512");
    TORCH_CHECK(!gemma_ || (norms[6 * layer + 4].numel() == D && norms[6 * layer + 5].numel() == D &&
                            windows_[layer] >= 0),
                "layer ", layer, ": expected q_norm and k_norm of ", D, " numbers and a window >= 0");
    const Matrix wo = matrix(blocks[4 * layer + 1], fmts[4 * layer + 1], H_ * D, "blocks", 4 * layer + 1);
    const Matrix gate_up = matrix(blocks[4 * layer + 2], fmts[4 * layer + 2], C_, "blocks", 4 * layer + 2);
    const Matrix down = matrix(blocks[4 * layer + 3], fmts[4 * layer + 3], gate_up.rows / 2, "blocks", 4 * layer + 3);
    TORCH_CHECK(wo.rows == C_ && down.rows == C_ && gate_up.rows % 2 == 0 && (layer == 0 || gate_up.rows == 2 * I_),
                "layer ", layer, ": matrix shapes do not fit the hidden size ", C_);
    I_ = gate_up.rows / 2;
    mats_.insert(mats_.end(), {qkv, wo, gate_up, down});
  }
  mats_.push_back(matrix(blocks[4 * L_], fmts[4 * L_], C_, "blocks", 4 * L_));
  for (size_t i = 0; i < mats_.size(); ++i)
    TORCH_CHECK(!bf16_ || mats_[i].bf16_tiles || mats_[i].bf16_panels, "blocks ", i,
                ": a bf16 model's matrices are all bf16 tiles or panels");
  for (size_t i = 0; i < mats_.size(); ++i) {
    TORCH_CHECK(!int8[i] || mats_[i].blocks, "int8 ", i, ": int8 activations are for a matrix of blocks, not tiles");
    TORCH_CHECK(int8[i] || mats_[i].kquant == 0, "blocks ", i, ": ", fmts[i], " is multiplied on int8 activations");
    TORCH_CHECK(mats_[i].kquant != -1 || packed[i].numel() > 0, "blocks ", i, ": q5_0 is read from its packed copy");
    mats_[i].int8 = int8[i];
    if (packed[i].numel() == 0) continue;
    const Matrix& m = mats_[i];
    const int64_t bytes = int8_packed_bytes(m.q4_1, m.rows, m.cols);
    TORCH_CHECK(int8[i] && int8_packed_here() && m.blocks && m.kquant <= 0, "packed ", i, ": a packed layout is "
                "read by an x86 int8 road, for a matrix of q4_1, q8_0 or q5_0 blocks on int8 activations");
    TORCH_CHECK(packed[i].scalar_type() == torch::kUInt8 && packed[i].dim() == 1 && packed[i].is_contiguous() &&
                packed[i].numel() == bytes, "packed ", i, ": expected the ", bytes, " bytes pack_blocks_int8 makes");
    keep_.push_back(packed[i]);
    mats_[i].packed = packed[i].data_ptr<uint8_t>();
  }
}

// One step: ids/positions (n,) the step's real tokens; cos/sin tables (P, D) covering their positions; the K/V
// pool (L, blocks, block_size, K, D) and the step's metadata (attention/metadata.py). Returns the logits (R, V)
// at rows last_rows (R,), and each one's argmax (R,) as argmax_rows gives it: the sampler's greedy rows then need
// no pass of their own over the logits, which the step's threads have just written and still hold.
// On a pool of several KV cache groups (kv/storage.py): group_slots and group_tables, each group's slot mapping and
// block tables (slot_mapping and block_tables are then group 0's), layer l in slot layer_slot[l] of the pool under
// group layer_group[l]'s tables. cos_local/sin_local: a Gemma model's sliding layers' rope tables.
std::tuple<torch::Tensor, torch::Tensor> BlockModel::step(
    torch::Tensor ids, torch::Tensor positions, torch::Tensor cos_table, torch::Tensor sin_table,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor query_start_loc,
    torch::Tensor seq_lens, torch::Tensor block_tables, torch::Tensor last_rows, double scale, int64_t split_keys,
    std::vector<torch::Tensor> group_slots, std::vector<torch::Tensor> group_tables, std::vector<int64_t> layer_group,
    std::vector<int64_t> layer_slot, c10::optional<torch::Tensor> cos_local, c10::optional<torch::Tensor> sin_local) {
  const int64_t n = ids.numel(), H = H_, K = K_, C = C_, I = I_, HT = H + 2 * K, D = mats_[0].rows / HT;
  check_i64(ids, -1, "ids");
  check_i64(positions, n, "positions");
  check_i64(slot_mapping, n, "slot_mapping");
  check_i64(last_rows, -1, "last_rows");
  const auto kv_type = kv_bf16_ ? torch::kBFloat16 : torch::kFloat32;
  const bool grouped = !group_slots.empty();
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 5 && (grouped || k_cache.size(0) == L_) &&
              k_cache.size(3) == K && k_cache.size(4) == D && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == kv_type && v_cache.scalar_type() == kv_type,
              "k_cache/v_cache: expected contiguous ", kv_type, " (", L_, ", blocks, block_size, ", K, ", ", D,
              ") of one shape");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == D && sin_table.sizes() == cos_table.sizes() &&
              cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.scalar_type() == torch::kFloat32 &&
              sin_table.scalar_type() == torch::kFloat32, "cos/sin tables: expected contiguous float32 (P, ", D, ")");
  TORCH_CHECK(!gemma_ || (cos_local && sin_local && cos_local->sizes() == cos_table.sizes() &&
                          sin_local->sizes() == cos_table.sizes() && cos_local->is_contiguous() &&
                          sin_local->is_contiguous() && cos_local->scalar_type() == torch::kFloat32 &&
                          sin_local->scalar_type() == torch::kFloat32),
              "cos_local/sin_local: a Gemma step expects its sliding layers' tables, shaped as cos/sin tables");
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t* last = last_rows.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(1) * k_cache.size(2), width = K * D, R = last_rows.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < embed_.rows, "ids: row ", i, " token ", id[i], " outside the vocabulary of ",
                embed_.rows);
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_table.size(0), "positions: row ", i, " position ", pos[i],
                " outside the rope tables of ", cos_table.size(0));
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "slot_mapping: row ", i, " slot ", slot[i], " outside the pool of ",
                slots, " slots");
  }
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(last[r] >= 0 && last[r] < n, "last_rows: ", last[r], " is not a row of the step's ", n);
  // the attention metadata's tensors, checked once; each request's lengths and blocks are checked where read
  const int64_t R_req = seq_lens.numel();
  check_i64(seq_lens, -1, "seq_lens");
  check_i64(query_start_loc, R_req + 1, "query_start_loc");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 &&
              block_tables.size(0) == R_req && block_tables.is_contiguous(),
              "block_tables: expected contiguous int64 (", R_req, ", W)");
  const int64_t *qsl = query_start_loc.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  // each layer's slots, tables (and their width) and place in the pool: group 0's and its own index, ungrouped
  std::vector<const int64_t*> slot_of(L_, slot), table_of(L_, block_tables.data_ptr<int64_t>());
  std::vector<int64_t> width_of(L_, block_tables.size(1)), pool_of(L_);
  for (int64_t l = 0; l < L_; ++l) pool_of[l] = l;
  if (grouped) {
    const int64_t G = static_cast<int64_t>(group_slots.size());
    TORCH_CHECK(static_cast<int64_t>(group_tables.size()) == G && static_cast<int64_t>(layer_group.size()) == L_ &&
                static_cast<int64_t>(layer_slot.size()) == L_, "groups: expected ", G, " block tables and a group and "
                "slot for each of ", L_, " layers");
    for (int64_t g = 0; g < G; ++g) {
      check_i64(group_slots[g], n, "group_slots");
      const torch::Tensor& t = group_tables[g];
      TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 2 && t.size(0) == R_req && t.is_contiguous(),
                  "group_tables: expected contiguous int64 (", R_req, ", W)");
      for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK(group_slots[g].data_ptr<int64_t>()[i] >= 0 && group_slots[g].data_ptr<int64_t>()[i] < slots,
                    "group_slots: group ", g, " row ", i, " outside the pool of ", slots, " slots");
    }
    for (int64_t l = 0; l < L_; ++l) {
      TORCH_CHECK(layer_group[l] >= 0 && layer_group[l] < G && layer_slot[l] >= 0 && layer_slot[l] < k_cache.size(0),
                  "layer ", l, ": group ", layer_group[l], " or pool slot ", layer_slot[l], " out of range");
      slot_of[l] = group_slots[layer_group[l]].data_ptr<int64_t>();
      table_of[l] = group_tables[layer_group[l]].data_ptr<int64_t>();
      width_of[l] = group_tables[layer_group[l]].size(1);
      pool_of[l] = layer_slot[l];
    }
  }
  // On a bf16 pool a whole prompt (more than one row, nothing cached before it) takes the kernel with bf16 products,
  // as the Python forward's paged backend gives it (attention/paged.py, compiled_attend), where this CPU has it
  std::vector<bool> prompt;  // (none asked for on an fp32 pool: a decode step allocates nothing for it)
  bool prompts = false;
  if (kv_bf16_ && prompt_attention_bf16_here() && (D == 64 || D == 128)) {
    prompt.assign(R_req, false);
    for (int64_t r = 0; r < R_req; ++r) {
      const int64_t T = qsl[r + 1] - qsl[r];
      prompt[r] = T > 1 && T == lens[r] && qsl[r + 1] <= n;
      prompts = prompts || prompt[r];
    }
  }

  // A decode step runs in one parallel region (Team): its threads meet after each product instead of being
  // forked and joined for each. Each thread keeps its own copy of the rows between products (the residual
  // stream, the norms' outputs, q after RoPE), computed by the same loops from the same numbers; the products'
  // and attention's outputs are shared, each thread writing its own share of them. The bits are the same.
#ifdef _OPENMP
  const int64_t T = n <= TEAM_ROWS && !at::in_parallel_region() ? at::get_num_threads() : 1;
#else
  const int64_t T = 1;
#endif

  // the step's numbers, each buffer reused by every layer, in one block kept between steps: a decode step's
  // arithmetic is small enough that a dozen fresh allocations would be a visible part of it
  const auto f32 = cos_table.options();
  std::lock_guard<std::mutex> turn(scratch_mutex_);  // steps of one model take turns on its scratch
  int64_t need = 0;
  const auto r16 = [](int64_t count) { return (count + 15) / 16 * 16; };  // 64 bytes
  auto carve = [&](int64_t count) { const int64_t at = need; need += r16(count); return at; };
  // each thread's own: the residual stream xs, x2, a norm's output h, q, the MLP's activation, the head's rows,
  // (in a team) its copy of qkv for RoPE, (bf16) a product's input; shared: the products' outputs, attention's
  const int64_t hb_n = bf16_ ? (std::max(R * C, n * std::max({C, I, H * D})) + 1) / 2 : 0;  // never both at once
  const int64_t own = 3 * r16(n * C) + r16(n * H * D) + r16(n * I) + r16(R * C) + (T > 1 ? r16(n * HT * D) : 0) +
                      r16(hb_n);
  const int64_t at_own = carve(T * own), at_qkv = carve(n * HT * D), at_o = carve(n * C), at_gu = carve(n * 2 * I),
                at_cs = carve(2 * n * D), at_cl = carve(gemma_ ? 2 * n * D : 0), at_attn = carve(n * H * D),
                at_ob = carve(bf16_ ? (n * std::max(HT * D, C) + 1) / 2 : 0),  // bf16: qkv's and wo's outputs,
                at_ob2 = carve(bf16_ ? n * I : 0), at_ob3 = carve(bf16_ ? (n * C + 1) / 2 : 0);  // gate_up's, down's
  torch::Tensor scratch = scratch_;
  if (scratch.numel() < need) {
    scratch = torch::empty({need}, f32);  // kept unless it is a long prompt chunk's
    if (need * static_cast<int64_t>(sizeof(float)) <= KEPT_SCRATCH_BYTES) scratch_ = scratch;
  }
  float* const base = scratch.data_ptr<float>();
  float *qkvp = base + at_qkv, *op = base + at_o, *gup = base + at_gu, *cp = base + at_cs, *sp = cp + n * D;
  float *clp = base + at_cl, *slp = clp + n * D;  // (gemma_) the sliding layers'
  float* attnp = base + at_attn;
  const auto u16 = [base](int64_t at) { return reinterpret_cast<uint16_t*>(base + at); };
  uint16_t *ob = u16(at_ob), *ob2 = u16(at_ob2), *ob3 = u16(at_ob3);
  for (int64_t i = 0; i < n; ++i) {  // each token's rotations, as `DecoderLM.rope` looks them up
    std::memcpy(cp + i * D, cos_table.data_ptr<float>() + pos[i] * D, D * sizeof(float));
    std::memcpy(sp + i * D, sin_table.data_ptr<float>() + pos[i] * D, D * sizeof(float));
    if (!gemma_) continue;
    std::memcpy(clp + i * D, cos_local->data_ptr<float>() + pos[i] * D, D * sizeof(float));
    std::memcpy(slp + i * D, sin_local->data_ptr<float>() + pos[i] * D, D * sizeof(float));
  }
  float* const xs0 = base + at_own;  // thread 0's residual stream, where the embedding goes
  if (embed_table_) {  // each token's row of the table, as `embedding` copies it (bf16: widened, exactly)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t at = id[i] * embed_rs_ + c * embed_cs_;
        xs0[i * C + c] = embed_bf16_ ? widen(static_cast<const uint16_t*>(embed_table_)[at])
                                     : static_cast<const float*>(embed_table_)[at];
      }
  } else {
    dequantize_rows(embed_.blocks, embed_.q4_1, C, id, n, xs0);
  }
  if (gemma_)  // Gemma's embedding rows times sqrt(hidden), as Gemma3.hidden_states scales them
    for (int64_t j = 0; j < n * C; ++j) xs0[j] = xs0[j] * embed_scale_;
  const int64_t V = mats_[4 * L_].rows;
  torch::Tensor logits = torch::empty({R, V}, f32);
  torch::Tensor head = bf16_ ? torch::empty({R * V}, f32.dtype(torch::kBFloat16)) : logits;
  // each thread's share of each row's vocabulary: its largest (a share no thread had, or an empty one, never wins)
  std::vector<RangeMax> parts(T * R, RangeMax{-INFINITY, -1, false});
  const auto largest = [&](int64_t r, int64_t v0, int64_t v1, RangeMax& part) {  // of row r's logits [v0, v1)
    float* row = logits.data_ptr<float>() + r * V;
    if (bf16_) widen_bf16_row(static_cast<const uint16_t*>(head.data_ptr()) + r * V + v0, v1 - v0, row + v0);
    if (v0 < v1) part = argmax_range(row, v0, v1);
  };
  auto bf16_product = [](const Matrix& w, const uint16_t* x, int64_t rows, uint16_t* out, Team* team) {
    if (w.bf16_panels) bf16_panels_product(w.bf16_panels, w.rows, w.cols, x, rows, out, team);
    else bf16_tiles_product(w.bf16_tiles, w.rows / TILE, w.cols / 2, x, rows, out, team);
  };
  auto product = [](const Matrix& w, const float* x, int64_t rows, float* out, Team* team) {
    if (w.tiles) fp32_product(w.tiles, w.rows / TILE, w.cols, x, rows, out, team);
    else if (w.kquant > 0 || (w.kquant < 0 && int8_q5_0_blocks(rows)))  // Q5_0: its own blocks where they pay
      block_product_int8_kquant(w.blocks, w.kquant, w.rows, w.cols, x, rows, out, team);
    else if (w.packed) block_product_int8_packed(w.packed, w.q4_1, w.rows, w.cols, x, rows, out, team);
    else if (w.int8) block_product_int8(w.blocks, w.q4_1, w.rows, w.cols, x, rows, out, team);
    else block_product(w.blocks, w.q4_1, w.rows, w.cols, x, rows, out, team);
  };
  // The layers and the head, on one thread's part of the work: the whole of it without a team.
  const auto run = [&](Team* team) {
    const int64_t t = team ? team->tid : 0;
    // f(i0, i1) over the rows 0..n of the work between products: without a team (a step of many rows) on torch's
    // threads, so that one thread does not do it while the others wait; in a team each thread does all of it on
    // its own copy. Each row's loops are the same however the rows are cut: the same bits.
    const auto rows = [team, n](const auto& f) {
      if (team == nullptr && n >= 2 * ROW_GRAIN) at::parallel_for(0, n, ROW_GRAIN, f);
      else f(0, n);
    };
    const auto sync = [team, n](const Matrix& next) {  // the team's threads meet; each asks for its next packed bytes
      if (!team) return;
      if (next.kquant < 0 && int8_q5_0_blocks(n)) {  // a Q5_0 weight read from its own blocks
        const auto [at, bytes] = q5_0_share(next.blocks, next.rows, next.cols, *team);
        return team->sync(at, bytes);
      }
      if (!next.packed) return team->sync();
      const auto [at, bytes] = packed_share(next.packed, next.q4_1, next.rows, next.cols, *team);
      team->sync(at, bytes);
    };
    float* p = base + at_own + t * own;
    const auto take = [&](int64_t count) { float* at = p; p += r16(count); return at; };
    float *xs = take(n * C), *x2 = take(n * C), *hp = take(n * C), *qp = take(n * H * D), *ap = take(n * I);
    float *rowsp = take(R * C), *qkv = team ? take(n * HT * D) : qkvp;
    uint16_t* hb = reinterpret_cast<uint16_t*>(take(hb_n));
    if (t > 0) std::memcpy(xs, xs0, n * C * sizeof(float));
    for (int64_t layer = 0; layer < L_; ++layer) {
      const Matrix* w = &mats_[4 * layer];
      // attention: x + wo(attend(rope(q), rope(k), v)), with this step's k/v written into their slots first
      if (bf16_) {  // a bf16 model's product: its input narrowed to bf16 (by the norm), its bf16 output widened
        rows([&](int64_t i0, int64_t i1) {
          add_rms_norm_rows_bf16(xs + i0 * C, nullptr, norms_[2 * layer], i1 - i0, C, eps_, nullptr, hb + i0 * C);
        });
        bf16_product(w[0], hb, n, ob, team);
        sync(w[1]);
        rows([&](int64_t i0, int64_t i1) { widen_bf16_row(ob + i0 * HT * D, (i1 - i0) * HT * D, qkv + i0 * HT * D); });
      } else {
        rows([&](int64_t i0, int64_t i1) {
          add_rms_norm_rows(xs + i0 * C, nullptr, norms_[(gemma_ ? 6 : 2) * layer], i1 - i0, C, eps_, nullptr,
                            hp + i0 * C);
        });
        product(w[0], hp, n, qkvp, team);
        if (team) {  // each thread ropes its own copy
          sync(w[1]);
          std::memcpy(qkv, qkvp, n * HT * D * sizeof(float));
        }
      }
      const bool local = gemma_ && windows_[layer] > 0;  // a sliding layer: its own rotation speeds
      const int64_t* slot = slot_of[layer];
      const int64_t layer_bytes = pool_of[layer] * k_cache.stride(0) * k_cache.element_size();
      void* kp = static_cast<char*>(k_cache.data_ptr()) + layer_bytes;
      void* vp = static_cast<char*>(v_cache.data_ptr()) + layer_bytes;
      rows([&](int64_t i0, int64_t i1) {
        if (gemma_)  // QK-norm: each token's q heads, then its k heads, normed as rows of D in place
          for (int64_t i = i0; i < i1; ++i) {
            float* row = qkv + i * HT * D;
            add_rms_norm_rows(row, nullptr, norms_[6 * layer + 4], H, D, eps_, nullptr, row);
            add_rms_norm_rows(row + H * D, nullptr, norms_[6 * layer + 5], K, D, eps_, nullptr, row + H * D);
          }
        rope_rows(qkv + i0 * HT * D, (local ? clp : cp) + i0 * D, (local ? slp : sp) + i0 * D, i1 - i0, HT, H + K, D);
        if (kv_bf16_)  // q, k and v as a bf16 cache holds them (rope_qk's round_to)
          round_bf16_(qkv + i0 * HT * D, (i1 - i0) * HT * D);
        for (int64_t i = i0; i < i1; ++i) {  // row i of qkv: H q heads, then K k heads, then K v heads
          const float* row = qkv + i * HT * D;
          std::memcpy(qp + i * H * D, row, H * D * sizeof(float));
          if (t > 0) continue;  // thread 0 writes the step's k/v
          if (kv_bf16_) {  // already bf16 numbers: narrowing keeps them exactly
            for (int64_t j = 0; j < width; ++j) {
              static_cast<uint16_t*>(kp)[slot[i] * width + j] = narrow_bf16(row[H * D + j]);
              static_cast<uint16_t*>(vp)[slot[i] * width + j] = narrow_bf16(row[(H + K) * D + j]);
            }
          } else {
            std::memcpy(static_cast<float*>(kp) + slot[i] * width, row + H * D, width * sizeof(float));
            std::memcpy(static_cast<float*>(vp) + slot[i] * width, row + (H + K) * D, width * sizeof(float));
          }
        }
      });
      sync(w[1]);
      if (prompts && (team == nullptr || team->tid == 0)) {  // q, k, v of each whole prompt as rows of qkv
        const auto view = [&](int64_t r, int64_t col, int64_t heads) {
          return torch::from_blob(qkv + qsl[r] * HT * D + col, {qsl[r + 1] - qsl[r], heads, D}, {HT * D, D, 1}, f32);
        };
        for (int64_t r = 0; r < R_req; ++r) {
          if (!prompt[r]) continue;
          const torch::Tensor o = prompt_attention_bf16(view(r, 0, H), view(r, H * D, K), view(r, (H + K) * D, K),
                                                        scale);
          std::memcpy(attnp + qsl[r] * H * D, o.data_ptr<float>(), o.numel() * sizeof(float));
        }
      }
      paged_attention_rows(qp, kp, vp, kv_bf16_, n, H, D, k_cache.size(1), k_cache.size(2), K, qsl, lens,
                           table_of[layer], R_req, width_of[layer], scale, split_keys, attnp, team,
                           gemma_ ? windows_[layer] : 0, prompts ? &prompt : nullptr);
      sync(w[1]);
      const float* mlp_out = op;
      if (bf16_) {  // the same, each product's bf16 output where the fp32 road has its float one
        rows([&](int64_t i0, int64_t i1) { narrow_bf16_row(attnp + i0 * H * D, (i1 - i0) * H * D, hb + i0 * H * D); });
        bf16_product(w[1], hb, n, ob, team);
        sync(w[2]);
        rows([&](int64_t i0, int64_t i1) {
          add_rms_norm_rows_bf16(xs + i0 * C, ob + i0 * C, norms_[2 * layer + 1], i1 - i0, C, eps_, x2 + i0 * C,
                                 hb + i0 * C);
        });
        bf16_product(w[2], hb, n, ob2, team);
        sync(w[3]);
        silu_mul_rows_bf16(ob2, n, I, hb);
        bf16_product(w[3], hb, n, ob3, team);  // not ob: the next layer's qkv goes there while this is read
        sync(w[4]);
        rows([&](int64_t i0, int64_t i1) { widen_bf16_row(ob3 + i0 * C, (i1 - i0) * C, hp + i0 * C); });  // (each thread its own)
        mlp_out = hp;
      } else {  // (Gemma3Block.forward: each sublayer's output normed before its residual add; GeGLU)
        product(w[1], attnp, n, op, team);
        sync(w[2]);
        rows([&](int64_t i0, int64_t i1) {
          const int64_t m = i1 - i0, at = i0 * C;
          if (gemma_) add_rms_norm_rows(op + at, nullptr, norms_[6 * layer + 1], m, C, eps_, nullptr, hp + at);
          add_rms_norm_rows(xs + at, (gemma_ ? hp : op) + at, norms_[gemma_ ? 6 * layer + 2 : 2 * layer + 1], m, C,
                            eps_, x2 + at, hp + at);
        });
        // the MLP: x + w_down(silu(gate) * up)
        product(w[2], hp, n, gup, team);
        sync(w[3]);
        if (gemma_) gelu_tanh_mul_rows(gup, n, I, ap);
        else silu_mul_rows(gup, n, I, ap);
        product(w[3], ap, n, op, team);
        sync(w[4]);
        if (gemma_) {
          rows([&](int64_t i0, int64_t i1) {
            add_rms_norm_rows(op + i0 * C, nullptr, norms_[6 * layer + 3], i1 - i0, C, eps_, nullptr, hp + i0 * C);
          });
          mlp_out = hp;
        }
      }
      rows([&](int64_t i0, int64_t i1) {
        for (int64_t j = i0 * C; j < i1 * C; ++j) xs[j] = x2[j] + mlp_out[j];
      });
    }
    add_rms_norm_rows(xs, nullptr, norms_[(gemma_ ? 6 : 2) * L_], n, C, eps_, nullptr, hp);
    for (int64_t r = 0; r < R; ++r) std::memcpy(rowsp + r * C, hp + last[r] * C, C * sizeof(float));
    if (bf16_) {
      narrow_bf16_row(rowsp, R * C, hb);
      bf16_product(mats_[4 * L_], hb, R, static_cast<uint16_t*>(head.data_ptr()), team);
    } else {
      product(mats_[4 * L_], rowsp, R, logits.data_ptr<float>(), team);
    }
    if (!team) return;
    // once every share of the logits is written: this thread's share of each row (a bf16 model's widened), and
    // the largest in it
    team->sync();
    const auto [v0, v1] = team->share(V, 1024);
    for (int64_t r = 0; r < R; ++r) largest(r, v0, v1, parts[t * R + r]);
  };
  const auto argmax = [&] {
    torch::Tensor best = torch::empty({R}, f32.dtype(torch::kInt64));
    std::vector<RangeMax> row(T);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t t = 0; t < T; ++t) row[t] = parts[t * R + r];
      best.data_ptr<int64_t>()[r] = first_largest(row.data(), T);
    }
    return std::make_tuple(logits, best);
  };
  if (T == 1) {  // (a step of many rows) the rows' largest on torch's threads
    run(nullptr);
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) largest(r, 0, V, parts[r]);
    });
    return argmax();
  }
#ifdef _OPENMP
  Team::Shared shared;
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(T)
  {
    Team team(shared, omp_get_thread_num(), omp_get_num_threads());
    try {
      run(&team);
    } catch (const Team::Abandoned&) {  // another thread's error ends the step: it is the one reported
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      shared.failed = true;
    }
  }
  if (error) std::rethrow_exception(error);
#endif
  return argmax();
}

// Up to `steps` decode steps of R requests, one token each, each step's input the argmax of the step before: what
// that many `step` calls in a row compute, bit for bit, without the host's work between them (the scheduler, the
// sampler, the bookkeeping: after a step has streamed every weight through the caches, that work runs on cold
// caches). ids, positions (R,): the first step's tokens and their positions; block_tables (R, W) already holding
// a slot for every position through positions + steps - 1; stop_ids (R, S): each request's stop tokens (-1 pads).
// The steps end early once every request has chosen one of its stop tokens. Returns the tokens (steps run, R) and
// the last step's logits.
std::tuple<torch::Tensor, torch::Tensor> BlockModel::decode(
    int64_t steps, torch::Tensor ids, torch::Tensor positions, torch::Tensor cos_table, torch::Tensor sin_table,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor stop_ids, double scale,
    int64_t split_keys) {
  const int64_t R = ids.numel();
  TORCH_CHECK(!gemma_, "decode: a Gemma model's steps run one `step` call each");
  TORCH_CHECK(steps >= 1, "steps: expected at least 1, got ", steps);
  check_i64(ids, -1, "ids");
  check_i64(positions, R, "positions");
  TORCH_CHECK(k_cache.dim() == 5, "k_cache: expected (layers, blocks, block_size, kv heads, head_dim)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.size(0) == R &&
              block_tables.is_contiguous(), "block_tables: expected contiguous int64 (", R, ", W)");
  TORCH_CHECK(stop_ids.scalar_type() == torch::kInt64 && stop_ids.dim() == 2 && stop_ids.size(0) == R &&
              stop_ids.is_contiguous(), "stop_ids: expected contiguous int64 (", R, ", S)");
  const int64_t bs = k_cache.size(2), W = block_tables.size(1), S = stop_ids.size(1);
  const int64_t* stops = stop_ids.data_ptr<int64_t>();
  std::vector<bool> stopped(R, false);
  const int64_t *table = block_tables.data_ptr<int64_t>(), *first = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)  // refused before any step runs
    TORCH_CHECK(first[r] >= 0 && (first[r] + steps - 1) / bs < W, "block_tables: request ", r,
                " has no block for position ", first[r] + steps - 1);
  const auto i64 = ids.options();
  torch::Tensor tokens = torch::empty({steps, R}, i64), logits;
  torch::Tensor starts = torch::arange(R + 1, i64), last = torch::arange(R, i64);
  torch::Tensor cur = ids;
  for (int64_t s = 0; s < steps; ++s) {
    torch::Tensor pos = torch::empty({R}, i64), slot = torch::empty({R}, i64), lens = torch::empty({R}, i64);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t p = first[r] + s;
      pos.data_ptr<int64_t>()[r] = p;
      slot.data_ptr<int64_t>()[r] = table[r * W + p / bs] * bs + p % bs;
      lens.data_ptr<int64_t>()[r] = p + 1;
    }
    torch::Tensor best;
    std::tie(logits, best) = step(cur, pos, cos_table, sin_table, k_cache, v_cache, slot, starts, lens, block_tables,
                                  last, scale, split_keys);
    tokens[s].copy_(best);
    cur = best;
    bool all = true;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < S && !stopped[r]; ++j) stopped[r] = stops[r * S + j] == best.data_ptr<int64_t>()[r];
      all = all && stopped[r];
    }
    if (all) return std::make_tuple(tokens.narrow(0, 0, s + 1), logits);
  }
  return std::make_tuple(tokens, logits);
}
