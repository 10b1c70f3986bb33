// The torch-facing CPU ops: products with packed or float32 weights (kernels.cpp, gemm_int8.cpp),
// the fused float32 ops of a step (fused_ops.cpp), the whole-step decoder (decoder.cpp), and the
// sampler's draw (sampling.cpp).
//
// Every product, of any number of rows, runs one kernel per path (8-bit activations: the integer
// register tile; float32: the float one) whose result for a row does not depend on the other rows
// (kernels.h), so prompts, chunks of prompts and decode steps of any batch agree bit for bit.
#include <torch/extension.h>

#include "kernels.h"
#include "kv_blocks.h"

using namespace tianxia;

void bind_decoder(pybind11::module& m);
torch::Tensor race_draw(torch::Tensor x, torch::Tensor floor, torch::Tensor keys, torch::Tensor top_p,
                        torch::Tensor min_p, int64_t bins, double span);
torch::Tensor nucleus_floor(torch::Tensor x, torch::Tensor top_p, int64_t bins, double span);
torch::Tensor top_k_floor(torch::Tensor x, torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p);

namespace {

torch::Tensor product(torch::Tensor x, const Packed& w, c10::optional<torch::Tensor> bias, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.scalar_type() == torch::kFloat32,
              "x must be float32 [M, ", w.K, "]");
  x = x.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_t;
  if (bias.has_value() && bias->defined()) {
    bias_t = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias_t.numel() == w.N, "bias has ", bias_t.numel(), " values, the weight ", w.N, " rows");
    b = bias_t.data_ptr<float>();
  }
  auto out = torch::empty({x.size(0), w.N}, x.options());
  Activations a;
  product_rows(w, x.data_ptr<float>(), x.size(0), int8, b, out.data_ptr<float>(), a);
  return out;
}

}  // namespace

// y = x @ w.T + bias, x [M, K] float32; int8: x rounded to 8 bits per 32 values (see kernels.cpp)
// table: the weight's quad_scale_table (empty: none), which single-row products read their factors
// from instead of gathering them per call (the same results)
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, torch::Tensor mins,
                            c10::optional<torch::Tensor> bias, int64_t bits, int64_t group, bool int8,
                            c10::optional<torch::Tensor> table) {
  Packed w = unpack(qs, scales, mins, bits, group);
  if (table.has_value() && table->defined() && table->numel() > 0) {
    TORCH_CHECK(table->scalar_type() == torch::kUInt8 && table->is_contiguous() &&
                    table->numel() == (int64_t)quad_scale_table_bytes(w), "not this weight's quad_scale_table");
    w.quad_scales = table->data_ptr<uint8_t>();
  }
  return product(x, w, bias, int8);
}

// the weight's scales and mins laid out per quad of rows (kernels.h), as a uint8 tensor (empty
// where its products take the float path)
torch::Tensor packed_scale_table(torch::Tensor qs, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                                 int64_t group) {
  const std::vector<uint8_t> t = quad_scale_table(unpack(qs, scales, mins, bits, group));
  auto out = torch::empty({(int64_t)t.size()}, torch::TensorOptions().dtype(torch::kUInt8));
  std::memcpy(out.data_ptr<uint8_t>(), t.data(), t.size());
  return out;
}

// y = x @ w.T + bias for a float32 weight [N, K], row by row as the float path computes it
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kHalf),
              "the weight must be float32 or float16 [N, K]");
  weight = weight.contiguous();
  const int64_t bits = weight.scalar_type() == torch::kFloat32 ? 32 : 16;
  return product(x, unpack(weight, torch::Tensor(), torch::Tensor(), bits, 0), bias, false);
}

// rows idx of w, dequantized: [len(idx), K] float32 (embedding lookups)
torch::Tensor packed_rows(torch::Tensor idx, torch::Tensor qs, torch::Tensor scales, torch::Tensor mins,
                          int64_t bits, int64_t group) {
  const Packed w = unpack(qs, scales, mins, bits, group);
  idx = idx.to(torch::kInt64).contiguous();
  const int64_t R = idx.numel(), N = w.N;
  auto out = torch::empty({R, w.K}, torch::TensorOptions().dtype(torch::kFloat32));
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "row index out of range");
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(w, ip[r], op + r * w.K);
  });
  return out;
}

// out = rmsnorm(x + residual) * (offset + weight); returns (out, x + residual)
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                    double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32);
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / H;
  const bool has_res = residual.numel() > 0;
  auto out = torch::empty_like(x);
  torch::Tensor sum = has_res ? torch::empty_like(x) : x;
  if (has_res) residual = residual.contiguous();
  rms_norm_rows(x.data_ptr<float>(), has_res ? residual.data_ptr<float>() : nullptr, sum.data_ptr<float>(),
                out.data_ptr<float>(), weight.data_ptr<float>(), T, H, (float)eps, (float)offset);
  return {out, sum};
}

// in-place RoPE of q [T, Hq, D] and k [T, Hk, D] (innermost stride 1) from a [L, rd] cos|sin
// table; false (nothing changed) when a position is past the table
bool rope(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos_sin,
          bool interleaved) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2));
  TORCH_CHECK(cos_sin.is_contiguous());
  positions = positions.to(torch::kInt64).contiguous();
  const int64_t T = q.size(0), L = cos_sin.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    if (pp[t] < 0 || pp[t] >= L) return false;
  rope_rows(q.data_ptr<float>(), q.stride(0), q.size(1), k.data_ptr<float>(), k.stride(0), k.size(1), q.size(2),
            pp, T, cos_sin.data_ptr<float>(), cos_sin.size(1), interleaved);
  return true;
}

// act(x[:, :I]) * x[:, I:], act SiLU or (gelu) tanh-GELU
torch::Tensor gated_act(torch::Tensor x, bool gelu) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32);
  x = x.contiguous();
  const int64_t I = x.size(-1) / 2, T = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  gated_act_rows(x.data_ptr<float>(), out.data_ptr<float>(), T, I, gelu);
  return out;
}

// attention of query tokens over their paged K/V (float32 or float16 caches [blocks, bs, Hk, D]):
// seq_lens[b] is query b's context length (its position + 1) and seq_of[b] its row of
// block_tables (empty: row b); the decodes of a step and every token of its prompts, one call
// a uint8 cache holds Q8_0 or Q4_0 block rows (kv_blocks.h), told apart by their size
char kv_block_format(const torch::Tensor& cache, int64_t D) {
  if (cache.scalar_type() != torch::kUInt8) return 0;
  TORCH_CHECK(D % 32 == 0, "Q8_0/Q4_0 KV caches need a head size that is a multiple of 32");
  const int64_t rb = cache.size(-1);
  TORCH_CHECK(rb == kv_row_stride<KvQ8_0>(D) || rb == kv_row_stride<KvQ4_0>(D),
              "a uint8 KV cache must hold Q8_0 or Q4_0 rows of the head size");
  return rb == kv_row_stride<KvQ8_0>(D) ? 8 : 4;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           int64_t window, double softcap, torch::Tensor seq_of) {
  const auto type = k_cache.scalar_type();
  TORCH_CHECK((type == torch::kHalf || type == torch::kFloat32 || type == torch::kUInt8) &&
                  v_cache.scalar_type() == type && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_decode needs contiguous float32, float16 or Q8_0/Q4_0 (uint8) caches");
  const char blocks = kv_block_format(k_cache, q.size(2));
  q = q.to(torch::kFloat32).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t rows = seq_of.numel() > 0 ? block_tables.size(0) : B;
  TORCH_CHECK(seq_lens.numel() == B && (seq_of.numel() == 0 || seq_of.numel() == B) && block_tables.size(0) >= rows,
              "paged_decode: one length (and sequence) per query");
  if (seq_of.numel() > 0) {
    seq_of = seq_of.to(torch::kInt64).contiguous();
    const int64_t* s = seq_of.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(s[b] >= 0 && s[b] < rows, "paged_decode: sequence index out of range");
  }
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_tables.size(1) * k_cache.size(1), "paged_decode: bad length");
  auto out = torch::empty_like(q);
  auto run = [&](auto* kc, auto* vc) {
    paged_decode_rows(q.data_ptr<float>(), Hq * D, out.data_ptr<float>(), Hq * D, kc, vc,
                      block_tables.data_ptr<int64_t>(), block_tables.size(1), lens,
                      seq_of.numel() > 0 ? seq_of.data_ptr<int64_t>() : nullptr, B, Hq, k_cache.size(2), D,
                      k_cache.size(1), (float)scale, window, (float)softcap);
  };
  if (blocks == 8) {
    run(reinterpret_cast<const KvQ8_0*>(k_cache.data_ptr<uint8_t>()),
        reinterpret_cast<const KvQ8_0*>(v_cache.data_ptr<uint8_t>()));
  } else if (blocks == 4) {
    run(reinterpret_cast<const KvQ4_0*>(k_cache.data_ptr<uint8_t>()),
        reinterpret_cast<const KvQ4_0*>(v_cache.data_ptr<uint8_t>()));
  } else if (type == torch::kHalf) {
    run(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::Half>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::Half>()));
  } else {
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return out;
}

// float32 rows [R, D] as Q8_0 (bits 8) or Q4_0 (bits 4) block rows [R, bytes], each row on its own
torch::Tensor quantize_kv(torch::Tensor x, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 && (bits == 8 || bits == 4),
              "quantize_kv: x [R, D] with D a multiple of 32, bits 8 (Q8_0) or 4 (Q4_0)");
  x = x.to(torch::kFloat32).contiguous();
  const int64_t R = x.size(0), D = x.size(1);
  const int64_t rb = bits == 8 ? kv_row_stride<KvQ8_0>(D) : kv_row_stride<KvQ4_0>(D);
  auto out = torch::empty({R, rb}, x.options().dtype(torch::kUInt8));
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bits == 8) kv_store_row(src + r * D, reinterpret_cast<KvQ8_0*>(dst + r * rb), D);
      else kv_store_row(src + r * D, reinterpret_cast<KvQ4_0*>(dst + r * rb), D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: the GIL is released while they run, so the server's event
  // loop (streaming the previous step's tokens) is not held up by a whole engine step.
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  namespace py = pybind11;
  m.def("packed_linear", &packed_linear, release, "x @ dequant(w).T + bias with block-quantized w", py::arg("x"),
        py::arg("qs"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("bits"), py::arg("group"),
        py::arg("int8"), py::arg("table") = py::none());
  m.def("packed_scale_table", &packed_scale_table, release, "a packed weight's scales per quad of rows");
  m.def("dense_linear", &dense_linear, release, "x @ w.T + bias with a float32 or float16 w, row-invariant");
  m.def("packed_rows", &packed_rows, release, "rows of a block-quantized matrix, dequantized");
  m.def("rms_norm", &rms_norm, release, "fused residual add + RMSNorm");
  m.def("rope", &rope, release, "in-place rotary embedding of q and k");
  m.def("gated_act", &gated_act, release, "silu(gate) * up, or gelu_tanh(gate) * up");
  m.def("paged_decode", &paged_decode, release, "attention of query tokens over paged K/V, one position each");
  m.def("nucleus_floor", &nucleus_floor, release, "the smallest logit of each row's top-p nucleus, without a sort");
  m.def("top_k_floor", &top_k_floor, release, "the smallest logit each row keeps under its min-p, top-k and top-p");
  m.def("race_draw", &race_draw, release,
        "the sampler's draw: a token per row among its logits at or above a floor and its min-p floor, in its "
        "top-p nucleus");
  m.def("best_cpu_isa", &best_cpu_isa, "the best kernel variant this CPU runs: 0 AVX2, 1 AVX-512 VNNI, 2 AMX-INT8");
  m.def("set_cpu_isa", &set_cpu_isa, "use variant isa (clamped to the CPU's best): AVX-512 for products of at "
        "least min_rows rows, AMX for at least amx_min_rows (< 0: unchanged); returns the variant in use",
        py::arg("isa"), py::arg("min_rows"), py::arg("amx_min_rows") = -1);
  m.def("cpu_isa", &cpu_isa, "the kernel variant in use");
  m.def("avx512_min_rows", &avx512_min_rows, "the fewest rows that take the AVX-512 variant");
  m.def("amx_min_rows", &amx_min_rows, "the fewest rows that take the AMX variant");
  m.def("quantize_kv", &quantize_kv, release, "float32 rows as Q8_0 or Q4_0 KV cache rows");
  bind_decoder(m);
}
