// A whole decode step of a Llama-style decoder in one call: every layer's norms, projections
// (packed or float32 weights), RoPE, K/V cache write, paged attention and MLP run here on
// preallocated buffers, so Python dispatches one call per step instead of a dozen per layer.
//
// It covers what models/llama.py's module path computes for the families it supports (q/k/v
// bias, q/k norms, sandwich norms, Gemma's offset norms, SiLU or tanh-GELU gating, partial and
// interleaved RoPE, sliding windows, attention soft-capping), for steps of single-token
// decodes with a float32, float16 or Q8_0/Q4_0 cache; anything else takes the module path.
//
// LoRA adapters (layers/lora.py) are registered by slot; a step's rows come in runs of one slot,
// and after each projection every run adds its adapter's parts, (x A^T) B^T on its rows, with the
// float kernel the module path's dense_linear uses, so both paths give the same bits (for float32
// adapters and for the float16 ones held over packed models alike).
#include <torch/extension.h>

#include <array>
#include <cstring>
#include <unordered_map>

#include "kernels.h"
#include "kv_blocks.h"

namespace tianxia {
namespace {

// a packed (or float32) weight; the tensors are held so the pointers in w stay valid
struct Part {
  at::Tensor qs, scales, mins;
  std::vector<uint8_t> quad_scales;  // the integer path's scales and mins, laid out once (w.quad_scales)
  Packed w;
};

// a projection: one part, or blocks of output rows in different encodings side by side (a fused
// q/k/v whose v came in another GGUF type), each multiplied by its own kernel
struct Linear {
  std::vector<Part> parts;
  at::Tensor bias;
  const float* b = nullptr;
  int64_t N = 0;
};

// one targeted part of a projection: its delta is added to output rows [row0, row0 + b.N)
struct LoraPart {
  at::Tensor a_t, b_t;
  Packed a, b;  // [r, K], [rows, r] float32, or float16 over a packed model (bits=16)
  int64_t row0 = 0;
};

// an adapter: per layer, per projection (qkv, o, gate_up, down), its parts
using Lora = std::vector<std::array<std::vector<LoraPart>, 4>>;

enum Norm { kInput, kPostAttention, kPreFeedforward, kPostFeedforward, kQ, kK, kNumNorms };

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor norms[kNumNorms];  // undefined where the model has none
  at::Tensor k_cache, v_cache;   // [blocks, block_size, Hk, D] float32 or float16
  int64_t rope = 0, window = 0;
};

}  // namespace

class Decoder {
 public:
  Decoder(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
          double eps, double norm_offset, double scale, double softcap, bool sandwich, bool gelu,
          bool interleaved, bool int8, at::Tensor final_norm)
      : H_(hidden), Hq_(num_heads), Hk_(num_kv_heads), D_(head_dim), I_(intermediate), eps_((float)eps),
        offset_((float)norm_offset), scale_((float)scale), softcap_((float)softcap), sandwich_(sandwich),
        gelu_(gelu), interleaved_(interleaved), int8_(int8), final_norm_(final_norm.contiguous()) {
    TORCH_CHECK(final_norm_.scalar_type() == at::kFloat && final_norm_.numel() == H_, "bad final norm");
  }

  // linears: per projection (qkv, o, gate_up, down) its bias (an empty tensor for "none"), then
  // (qs, scales, mins) of each of its parts; formats: per projection the number of parts, then
  // (bits, group) of each; norms: input, post-attention, pre- and post-feedforward, q, k
  void add_layer(std::vector<at::Tensor> linears, std::vector<int64_t> formats, std::vector<at::Tensor> norms,
                 at::Tensor kv_cache, int64_t rope, int64_t window) {
    TORCH_CHECK(norms.size() == kNumNorms, "bad layer");
    const auto type = kv_cache.scalar_type();
    const int64_t row = type == at::kByte ? kv_cache.size(4) : D_;  // Q8_0/Q4_0 rows: their bytes
    TORCH_CHECK((type == at::kFloat || type == at::kHalf ||
                 (type == at::kByte && D_ % 32 == 0 &&
                  (row == kv_row_stride<KvQ8_0>(D_) || row == kv_row_stride<KvQ4_0>(D_)))) &&
                    kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(3) == Hk_ &&
                    kv_cache.size(4) == row,
                "the fused decoder needs a float32, float16 or Q8_0/Q4_0 cache [2, blocks, block_size, Hk, row]");
    Layer l;
    Linear* lin[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    const int64_t shapes[4][2] = {{(Hq_ + 2 * Hk_) * D_, H_}, {H_, Hq_ * D_}, {2 * I_, H_}, {H_, I_}};
    size_t t = 0, f = 0;
    for (int i = 0; i < 4; ++i) {
      Linear& x = *lin[i];
      TORCH_CHECK(t < linears.size() && f < formats.size() && formats[f] >= 1, "bad layer");
      const at::Tensor bias = linears[t++];
      for (int64_t k = formats[f++]; k > 0; --k) {
        TORCH_CHECK(t + 3 <= linears.size() && f + 2 <= formats.size(), "bad layer");
        Part p;
        p.qs = linears[t].contiguous();
        p.scales = linears[t + 1].contiguous();
        p.mins = linears[t + 2].contiguous();
        p.w = unpack(p.qs, p.scales, p.mins, formats[f], formats[f + 1]);
        // Every step multiplies this weight: its scales and mins are laid out per quad here once,
        // not gathered at each product, where a decode step's one row waited on them (the weights
        // stream from memory: gathered per product, the one-row products ran at a third of their
        // speed). The table holds them as stored (float16 stays float16), so a step reads no more
        // bytes of them than the weight holds: float32 factors made ahead read 4x the scales of
        // a Q5_0 or Q8_0 weight (1.13x generation for Qwen2.5-Coder without them)
        if (int8_) {
          p.quad_scales = quad_scale_table(p.w);
          if (!p.quad_scales.empty()) p.w.quad_scales = p.quad_scales.data();
        }
        TORCH_CHECK(p.w.K == shapes[i][1], "projection ", i, " has ", p.w.K, " inputs, expected ", shapes[i][1]);
        x.N += p.w.N;
        x.parts.push_back(std::move(p));
        t += 3;
        f += 2;
      }
      TORCH_CHECK(x.N == shapes[i][0], "projection ", i, " has ", x.N, " outputs, expected ", shapes[i][0]);
      if (bias.numel() > 0) {
        x.bias = bias.to(at::kFloat).contiguous();
        TORCH_CHECK(x.bias.numel() == x.N, "bias of projection ", i, " has the wrong size");
        x.b = x.bias.data_ptr<float>();
      }
    }
    TORCH_CHECK(t == linears.size() && f == formats.size(), "bad layer");
    for (int i = 0; i < kNumNorms; ++i) {
      if (norms[i].numel() == 0) continue;
      l.norms[i] = norms[i].to(at::kFloat).contiguous();
      TORCH_CHECK(l.norms[i].numel() == (i >= kQ ? D_ : H_), "norm ", i, " has the wrong size");
    }
    TORCH_CHECK(l.norms[kInput].defined() && l.norms[kPostAttention].defined(), "layer norms are missing");
    TORCH_CHECK(!sandwich_ || (l.norms[kPreFeedforward].defined() && l.norms[kPostFeedforward].defined()),
                "sandwich norms are missing");
    l.k_cache = kv_cache[0];
    l.v_cache = kv_cache[1];
    l.rope = rope;
    l.window = window;
    layers_.push_back(std::move(l));
  }

  // an adapter in `slot` (replacing what was there): tensors (a, b) per part, index (layer,
  // projection, first output row) per part
  void set_lora(int64_t slot, std::vector<at::Tensor> tensors, std::vector<int64_t> index) {
    TORCH_CHECK(tensors.size() * 3 == index.size() * 2, "bad adapter");
    const int64_t in[4] = {H_, Hq_ * D_, H_, I_}, out[4] = {(Hq_ + 2 * Hk_) * D_, H_, 2 * I_, H_};
    Lora lora(layers_.size());
    for (size_t i = 0; i < tensors.size() / 2; ++i) {
      const int64_t layer = index[3 * i], proj = index[3 * i + 1];
      TORCH_CHECK(layer >= 0 && layer < (int64_t)layers_.size() && proj >= 0 && proj < 4, "bad adapter part");
      LoraPart p;
      p.a_t = tensors[2 * i].contiguous();
      p.b_t = tensors[2 * i + 1].contiguous();
      const auto type = p.a_t.scalar_type();
      TORCH_CHECK((type == at::kFloat || type == at::kHalf) && p.b_t.scalar_type() == type,
                  "an adapter part's matrices are both float32 or both float16");
      const int64_t bits = type == at::kFloat ? 32 : 16;
      p.a = unpack(p.a_t, at::Tensor(), at::Tensor(), bits, 0);
      p.b = unpack(p.b_t, at::Tensor(), at::Tensor(), bits, 0);
      p.row0 = index[3 * i + 2];
      TORCH_CHECK(p.a.K == in[proj] && p.b.K == p.a.N && p.row0 >= 0 && p.row0 + p.b.N <= out[proj],
                  "adapter part of layer ", layer, " projection ", proj, " has the wrong shape");
      lora[layer][proj].push_back(std::move(p));
    }
    lora_[slot] = std::move(lora);
  }

  void drop_lora(int64_t slot) { lora_.erase(slot); }

  // hidden: [M, H] embedded tokens, one per sequence; returns the final-normed hidden states.
  // lora_runs: [G, 3] (slot, first row, end row) of the rows with an adapter (may be empty)
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                     at::Tensor seq_lens, std::vector<at::Tensor> rope_tables, at::Tensor lora_runs) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == H_ && hidden.scalar_type() == at::kFloat, "bad hidden");
    hidden = hidden.contiguous();
    positions = positions.to(at::kLong).contiguous();
    slots = slots.to(at::kLong).contiguous();
    block_tables = block_tables.to(at::kLong).contiguous();
    seq_lens = seq_lens.to(at::kLong).contiguous();
    const int64_t M = hidden.size(0), Qs = Hq_ * D_, KVs = Hk_ * D_, QKV = Qs + 2 * KVs;
    TORCH_CHECK(positions.numel() == M && slots.numel() == M && seq_lens.numel() == M &&
                    block_tables.size(0) == M, "one token per sequence");
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (const at::Tensor& t : rope_tables) {
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "bad RoPE table");
      for (int64_t i = 0; i < M; ++i)
        TORCH_CHECK(pos[i] >= 0 && pos[i] < t.size(0), "position ", pos[i], " is past the RoPE table");
    }
    h_.assign(hidden.data_ptr<float>(), hidden.data_ptr<float>() + M * H_);
    res_.resize(M * H_);
    n_.resize(M * H_);
    qkv_.resize(M * QKV);
    attn_.resize(M * Qs);
    gu_.resize(M * 2 * I_);
    act_.resize(M * I_);
    const int64_t* slot = slots.data_ptr<int64_t>();
    runs_.clear();
    if (lora_runs.numel() > 0) {
      lora_runs = lora_runs.to(at::kLong).contiguous();
      TORCH_CHECK(lora_runs.dim() == 2 && lora_runs.size(1) == 3, "bad LoRA runs");
      const int64_t* g = lora_runs.data_ptr<int64_t>();
      for (int64_t i = 0; i < lora_runs.size(0); ++i, g += 3) {
        auto it = lora_.find(g[0]);
        TORCH_CHECK(it != lora_.end(), "no LoRA adapter in slot ", g[0]);
        TORCH_CHECK(0 <= g[1] && g[1] < g[2] && g[2] <= M, "bad LoRA run");
        runs_.push_back({&it->second, g[1], g[2]});
      }
    }
    float* h = h_.data();
    float* r = res_.data();
    float* n = n_.data();
    for (size_t li = 0; li < layers_.size(); ++li) {
      Layer& L = layers_[li];
      if (li == 0) {
        std::memcpy(r, h, sizeof(float) * M * H_);
        rms_norm_rows(h, nullptr, nullptr, n, L.norms[kInput].data_ptr<float>(), M, H_, eps_, offset_);
      } else {
        rms_norm_rows(h, r, r, n, L.norms[kInput].data_ptr<float>(), M, H_, eps_, offset_);
      }
      linear(L.qkv, n, M, qkv_.data());
      add_lora(li, 0, n, H_, qkv_.data(), QKV);
      if (L.norms[kQ].defined()) {
        for (int64_t t = 0; t < M; ++t) {
          float* row = qkv_.data() + t * QKV;
          rms_norm_rows(row, nullptr, nullptr, row, L.norms[kQ].data_ptr<float>(), Hq_, D_, eps_, offset_);
          rms_norm_rows(row + Qs, nullptr, nullptr, row + Qs, L.norms[kK].data_ptr<float>(), Hk_, D_, eps_,
                        offset_);
        }
      }
      const at::Tensor& table = rope_tables.at(L.rope);
      rope_rows(qkv_.data(), QKV, Hq_, qkv_.data() + Qs, QKV, Hk_, D_, pos, M, table.data_ptr<float>(),
                table.size(1), interleaved_);
      if (L.k_cache.scalar_type() == at::kByte && L.k_cache.size(3) == kv_row_stride<KvQ8_0>(D_)) {
        cache_and_attend(reinterpret_cast<KvQ8_0*>(L.k_cache.data_ptr<uint8_t>()),
                         reinterpret_cast<KvQ8_0*>(L.v_cache.data_ptr<uint8_t>()), L, slot, block_tables, seq_lens, M);
      } else if (L.k_cache.scalar_type() == at::kByte) {
        cache_and_attend(reinterpret_cast<KvQ4_0*>(L.k_cache.data_ptr<uint8_t>()),
                         reinterpret_cast<KvQ4_0*>(L.v_cache.data_ptr<uint8_t>()), L, slot, block_tables, seq_lens, M);
      } else if (L.k_cache.scalar_type() == at::kHalf) {
        cache_and_attend(reinterpret_cast<uint16_t*>(L.k_cache.data_ptr<at::Half>()),
                         reinterpret_cast<uint16_t*>(L.v_cache.data_ptr<at::Half>()), L, slot, block_tables,
                         seq_lens, M);
      } else {
        cache_and_attend(L.k_cache.data_ptr<float>(), L.v_cache.data_ptr<float>(), L, slot, block_tables, seq_lens,
                         M);
      }
      linear(L.o, attn_.data(), M, h);
      add_lora(li, 1, attn_.data(), Qs, h, H_);
      if (!sandwich_) {
        rms_norm_rows(h, r, r, n, L.norms[kPostAttention].data_ptr<float>(), M, H_, eps_, offset_);
      } else {
        rms_norm_rows(h, nullptr, nullptr, n, L.norms[kPostAttention].data_ptr<float>(), M, H_, eps_, offset_);
        rms_norm_rows(n, r, r, n, L.norms[kPreFeedforward].data_ptr<float>(), M, H_, eps_, offset_);
      }
      linear(L.gate_up, n, M, gu_.data());
      add_lora(li, 2, n, H_, gu_.data(), 2 * I_);
      gated_act_rows(gu_.data(), act_.data(), M, I_, gelu_);
      linear(L.down, act_.data(), M, h);
      add_lora(li, 3, act_.data(), I_, h, H_);
      if (sandwich_)
        rms_norm_rows(h, nullptr, nullptr, h, L.norms[kPostFeedforward].data_ptr<float>(), M, H_, eps_, offset_);
    }
    at::Tensor out = at::empty({M, H_}, hidden.options());
    rms_norm_rows(h, r, r, out.data_ptr<float>(), final_norm_.data_ptr<float>(), M, H_, eps_, offset_);
    return out;
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

 private:
  // the step's K/V rows (in qkv_) into the layer's cache, then attention over it into attn_
  template <typename T>
  void cache_and_attend(T* kc, T* vc, const Layer& L, const int64_t* slot, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t M) {
    const int64_t Qs = Hq_ * D_, KVs = Hk_ * D_, QKV = Qs + 2 * KVs, row = Hk_ * kv_row_stride<T>(D_);
    // a token's Hk head rows at once: blocks of 32 never straddle two heads (D % 32 == 0), so the
    // bytes are those of quantize_kv on each head's row
    for (int64_t t = 0; t < M; ++t) {
      kv_store_row(qkv_.data() + t * QKV + Qs, kc + slot[t] * row, KVs);
      kv_store_row(qkv_.data() + t * QKV + Qs + KVs, vc + slot[t] * row, KVs);
    }
    paged_decode_rows(qkv_.data(), QKV, attn_.data(), Qs, kc, vc, block_tables.data_ptr<int64_t>(),
                      block_tables.size(1), seq_lens.data_ptr<int64_t>(), nullptr, M, Hq_, Hk_, D_, L.k_cache.size(1), scale_,
                      L.window, softcap_);
  }

  void linear(const Linear& l, const float* x, int64_t M, float* out) {
    if (l.parts.size() == 1) return product_rows(l.parts[0].w, x, M, int8_, l.b, out, a_);
    int64_t n0 = 0;
    for (const Part& p : l.parts) {
      const int64_t n = p.w.N;
      part_.resize(M * n);
      product_rows(p.w, x, M, int8_, l.b ? l.b + n0 : nullptr, part_.data(), a_);
      for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * l.N + n0, part_.data() + m * n, sizeof(float) * n);
      n0 += n;
    }
  }

  // each run's adapter parts of projection `proj` of layer `li`: out[rows] += (x A^T) B^T, x and
  // out of K and N columns
  void add_lora(size_t li, int proj, const float* x, int64_t K, float* out, int64_t N) {
    for (const Run& run : runs_) {
      const int64_t m = run.end - run.start;
      for (const LoraPart& p : (*run.lora)[li][proj]) {
        xa_.resize(m * p.a.N);
        delta_.resize(m * p.b.N);
        product_rows(p.a, x + run.start * K, m, false, nullptr, xa_.data(), a_);
        product_rows(p.b, xa_.data(), m, false, nullptr, delta_.data(), a_);
        for (int64_t i = 0; i < m; ++i) {
          float* o = out + (run.start + i) * N + p.row0;
          const float* d = delta_.data() + i * p.b.N;
          for (int64_t j = 0; j < p.b.N; ++j) o[j] += d[j];
        }
      }
    }
  }

  struct Run {
    const Lora* lora;
    int64_t start, end;
  };

  int64_t H_, Hq_, Hk_, D_, I_;
  float eps_, offset_, scale_, softcap_;
  bool sandwich_, gelu_, interleaved_, int8_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> h_, res_, n_, qkv_, attn_, gu_, act_, part_, xa_, delta_;
  std::unordered_map<int64_t, Lora> lora_;  // by slot
  std::vector<Run> runs_;  // this step's
  Activations a_;
};

}  // namespace tianxia

void bind_decoder(pybind11::module& m) {
  pybind11::class_<tianxia::Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, double, bool, bool,
                          bool, bool, at::Tensor>())
      .def("add_layer", &tianxia::Decoder::add_layer)
      .def("set_lora", &tianxia::Decoder::set_lora)
      .def("drop_lora", &tianxia::Decoder::drop_lora)
      .def("forward", &tianxia::Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("num_layers", &tianxia::Decoder::num_layers);
}
