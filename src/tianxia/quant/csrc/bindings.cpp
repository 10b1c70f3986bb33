// The torch-facing CPU ops: matmuls with packed weights (kernels.cpp, gemm_int8.cpp), the fused
// float32 ops of a decode step (fused_ops.cpp), and the whole-step decoder (decoder.cpp).
//
// A few activation rows (decode) run the direct kernels, which keep the weights packed; with 8-bit
// activations, more rows take the integer GEMM (4-, 5-, 6- and 8-bit codes). The rest (float32
// activations; 8-bit codes in groups of 16) dequantize tiles of weight rows into cache-sized buffers for
// single-threaded BLAS calls, and from kWideRows on (a batch of prompts) whole chunks of the
// weight for multi-threaded ones: BLAS is faster than the direct kernel once a dequantized weight
// is reused enough.
#include <torch/extension.h>

#include "kernels.h"

using namespace tianxia;

void bind_decoder(pybind11::module& m);

namespace {

// from this many activation rows on, products dequantize whole chunks of the weight for BLAS
constexpr int64_t kWideRows = 512;

// a float32 buffer of at least n values, kept per thread and slot between calls: a fresh large
// allocation comes from mmap and pays a page fault per 4 KiB on first touch, every call
float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& b = buffers[slot];
  if ((int64_t)b.size() < n) b.resize(n);
  return b.data();
}

// dequantize row n of w into dst[K]
template <typename S>
void dequant_row_as(const Packed& w, int64_t n, float* dst) {
  const uint8_t* q = w.qs + n * w.row_bytes();
  const S* sc = w.scales_of<S>(n);
  const S* mn = w.mins_of<S>(n);
  const int64_t G = w.group;
  if (w.bits == 8) {
    for (int64_t g = 0; g < w.groups; ++g) {
      const __m256 d = _mm256_set1_ps(to_float(sc[g])), m = _mm256_set1_ps(mn ? to_float(mn[g]) : 0.f);
      for (int64_t c = 0; c < G; c += 16) {
        __m256 v[2];
        widen_q8x16(reinterpret_cast<const int8_t*>(q) + g * G + c, v);
        for (int i = 0; i < 2; ++i) _mm256_storeu_ps(dst + g * G + c + i * 8, _mm256_fmadd_ps(v[i], d, m));
      }
    }
    return;
  }
  for (int64_t b = 0; b < w.K / 32; ++b) {  // blocks of 32 codes, in one or two groups
    const uint8_t* p = q + b * 4 * w.bits;
    __m256 v[4];
    widen_block(w.bits, p, v);
    for (int i = 0; i < 4; ++i) {
      const int64_t g = (b * 32 + i * 8) / G;
      const __m256 d = _mm256_set1_ps(to_float(sc[g])), m = _mm256_set1_ps(mn ? to_float(mn[g]) : 0.f);
      _mm256_storeu_ps(dst + b * 32 + i * 8, _mm256_fmadd_ps(v[i], d, m));
    }
  }
}

inline void dequant_row(const Packed& w, int64_t n, float* dst) {
  if (w.half) {
    dequant_row_as<uint16_t>(w, n, dst);
  } else {
    dequant_row_as<float>(w, n, dst);
  }
}

}  // namespace

// y = x @ w.T + bias, x [M, K] float32; int8: x rounded to 8 bits per 32 values first (see
// kernels.cpp), for any number of rows, so decode and prefill see the same numbers
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, torch::Tensor mins,
                            c10::optional<torch::Tensor> bias, int64_t bits, int64_t group, bool int8) {
  const Packed w = unpack(qs, scales, mins, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.scalar_type() == torch::kFloat32,
              "x must be float32 [M, ", w.K, "]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.N;
  const float* b = nullptr;
  torch::Tensor bias_t;
  if (bias.has_value() && bias->defined()) {
    bias_t = bias->contiguous();
    b = bias_t.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  if (product_rows_takes(w, M, int8)) {
    Activations a;
    product_rows(w, x.data_ptr<float>(), M, int8, b, out.data_ptr<float>(), a);
    return out;
  }
  if (int8 && w.K % 32 == 0) {
    float* xr = scratch(0, M * w.K);
    round_rows_q8(x.data_ptr<float>(), xr, M * w.K / 32);
    x = torch::from_blob(xr, {M, w.K}, x.options());
  }
  if (M >= kWideRows) {
    // Many rows (a batch of prompts): the weight is dequantized in chunks of up to 16 MiB of
    // float32, each multiplied by one multi-threaded BLAS call, which blocks for that many rows
    // better than per-thread tiles do (1.0-2.5x at 2048 rows) and bounds the extra memory.
    const int64_t chunk = std::min(N, std::max<int64_t>(16, (16 << 20) / (4 * w.K) / 16 * 16));
    float* bp = scratch(1, chunk * w.K);
    auto buf = torch::from_blob(bp, {chunk, w.K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t nt = std::min(chunk, N - n0);
      at::parallel_for(0, nt, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) dequant_row(w, n0 + r, bp + r * w.K);
      });
      out.narrow(1, n0, nt).copy_(torch::mm(x, buf.narrow(0, 0, nt).t()));
    }
    if (b) out.add_(bias_t);
    return out;
  }
  // Each thread takes whole tiles of weight rows: it dequantizes one into its own buffer (about
  // 256 KiB of float32, so it stays in that core's L2 cache) and multiplies it with a
  // single-threaded BLAS call. No barrier between tiles, and no tile crosses cores.
  // (as many tiles per thread for every thread, so that none waits for the last one)
  const int64_t threads = at::get_num_threads(), budget = 256 << 10;
  int64_t num_tiles = std::max<int64_t>(1, (N * w.K * 4 + budget - 1) / budget);
  num_tiles = (num_tiles + threads - 1) / threads * threads;
  const int64_t tile = ((N + num_tiles - 1) / num_tiles + 15) / 16 * 16;
  num_tiles = (N + tile - 1) / tile;
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);  // thread-local: the caller's mode, so `out` may be written
    auto buf = torch::empty({std::min(tile, N), w.K}, x.options());
    float* bp = buf.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, nt = std::min(tile, N - n0);
      for (int64_t r = 0; r < nt; ++r) dequant_row(w, n0 + r, bp + r * w.K);
      out.narrow(1, n0, nt).copy_(torch::mm(x, buf.narrow(0, 0, nt).t()));
    }
  });
  if (b) out.add_(bias_t);
  return out;
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

// silu(x[:, :I]) * x[:, I:]
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32);
  x = x.contiguous();
  const int64_t I = x.size(-1) / 2, T = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  gated_act_rows(x.data_ptr<float>(), out.data_ptr<float>(), T, I, false);
  return out;
}

// attention of one query token per sequence over its paged K/V (float32 or float16 caches
// [blocks, bs, Hk, D]): the decode half of a step, as one call for the whole batch
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           int64_t window, double softcap) {
  const bool half = k_cache.scalar_type() == torch::kHalf;
  TORCH_CHECK((half || k_cache.scalar_type() == torch::kFloat32) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode needs contiguous float32 or float16 caches");
  q = q.to(torch::kFloat32).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  auto out = torch::empty_like(q);
  auto run = [&](auto* kc, auto* vc) {
    paged_decode_rows(q.data_ptr<float>(), Hq * D, out.data_ptr<float>(), Hq * D, kc, vc,
                      block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(), B, Hq,
                      k_cache.size(2), D, k_cache.size(1), (float)scale, window, (float)softcap);
  };
  if (half) {
    run(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::Half>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::Half>()));
  } else {
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: the GIL is released while they run, so the server's event
  // loop (streaming the previous step's tokens) is not held up by a whole engine step.
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("packed_linear", &packed_linear, release, "x @ dequant(w).T + bias with block-quantized w");
  m.def("packed_rows", &packed_rows, release, "rows of a block-quantized matrix, dequantized");
  m.def("rms_norm", &rms_norm, release, "fused residual add + RMSNorm");
  m.def("rope", &rope, release, "in-place rotary embedding of q and k");
  m.def("silu_and_mul", &silu_and_mul, release, "silu(gate) * up");
  m.def("paged_decode", &paged_decode, release, "one-token attention over paged float32 K/V");
  bind_decoder(m);
}
