// Matrix products with block-quantized weights on x86 CPUs (AVX2 + FMA), float32 activations.
//
// Two packed formats, both "w = q * scale + min" per group of consecutive elements of a row:
//   bits=4: qs [N, K/2] uint8, groups of 32; in group g of a row, byte j holds element j in its
//           low nibble and element j+16 in its high nibble (ggml's Q4_0/Q4_1 layout);
//   bits=8: qs [N, K] int8, groups of `group` (a multiple of 16).
// scales and mins are [N, K/group] float32; mins may be empty (w = q * scale).
//
// A few activation rows (decode) run a direct kernel that keeps the weights packed: each group is
// widened to float in registers and dotted with up to 8 rows at once, so weights are read once per
// step. Many rows (prefill) dequantize a tile of weight rows into a cache-sized buffer and hand it
// to the BLAS matmul, which is faster than the direct kernel once the tile is reused enough.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kMaxDirectRows = 8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline void widen_q4(const uint8_t* p, __m256 w[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline void widen_q8x16(const int8_t* p, __m256 w[2]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

struct Packed {
  const uint8_t* qs;
  const float* scales;
  const float* mins;  // nullptr: no offsets
  int64_t bits, group, K, groups;
  int64_t row_bytes() const { return bits == 4 ? K / 2 : K; }
};

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for n in [n0, n1), MR rows of x
template <int MR>
void direct_rows(const Packed& w, const float* x, const float* xsum, const float* bias,
                 float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = w.group, ng = w.groups;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MR];
    float off[MR];
    for (int m = 0; m < MR; ++m) { acc[m] = _mm256_setzero_ps(); off[m] = 0.f; }
    const uint8_t* q = w.qs + n * w.row_bytes();
    const float* sc = w.scales + n * ng;
    const float* mn = w.mins ? w.mins + n * ng : nullptr;
    for (int64_t g = 0; g < ng; ++g) {
      const __m256 d = _mm256_set1_ps(sc[g]);
      if (w.bits == 4) {
        __m256 v[4];
        widen_q4(q + g * 16, v);
        for (int m = 0; m < MR; ++m) {
          const float* xp = x + m * K + g * 32;
          __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xp));
          t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp + 8), t);
          t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xp + 16), t);
          t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xp + 24), t);
          acc[m] = _mm256_fmadd_ps(d, t, acc[m]);
        }
      } else {
        __m256 t[MR];
        for (int m = 0; m < MR; ++m) t[m] = _mm256_setzero_ps();
        for (int64_t c = 0; c < G; c += 16) {
          __m256 v[2];
          widen_q8x16(reinterpret_cast<const int8_t*>(q) + g * G + c, v);
          for (int m = 0; m < MR; ++m) {
            const float* xp = x + m * K + g * G + c;
            t[m] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xp), t[m]);
            t[m] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp + 8), t[m]);
          }
        }
        for (int m = 0; m < MR; ++m) acc[m] = _mm256_fmadd_ps(d, t[m], acc[m]);
      }
      if (mn) {
        for (int m = 0; m < MR; ++m) off[m] += mn[g] * xsum[m * ng + g];
      }
    }
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MR; ++m) out[m * N + n] = hsum(acc[m]) + off[m] + b;
  }
}

using DirectFn = void (*)(const Packed&, const float*, const float*, const float*, float*, int64_t,
                          int64_t, int64_t);
constexpr DirectFn kDirect[kMaxDirectRows] = {
    direct_rows<1>, direct_rows<2>, direct_rows<3>, direct_rows<4>,
    direct_rows<5>, direct_rows<6>, direct_rows<7>, direct_rows<8>};

// dequantize row n of w into dst[K]
inline void dequant_row(const Packed& w, int64_t n, float* dst) {
  const uint8_t* q = w.qs + n * w.row_bytes();
  const float* sc = w.scales + n * w.groups;
  const float* mn = w.mins ? w.mins + n * w.groups : nullptr;
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m256 d = _mm256_set1_ps(sc[g]);
    const __m256 m = _mm256_set1_ps(mn ? mn[g] : 0.f);
    if (w.bits == 4) {
      __m256 v[4];
      widen_q4(q + g * 16, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + g * 32 + i * 8, _mm256_fmadd_ps(v[i], d, m));
    } else {
      for (int64_t c = 0; c < w.group; c += 16) {
        __m256 v[2];
        widen_q8x16(reinterpret_cast<const int8_t*>(q) + g * w.group + c, v);
        for (int i = 0; i < 2; ++i)
          _mm256_storeu_ps(dst + g * w.group + c + i * 8, _mm256_fmadd_ps(v[i], d, m));
      }
    }
  }
}

Packed unpack(const torch::Tensor& qs, const torch::Tensor& scales, const torch::Tensor& mins,
              int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qs.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32,
              "packed weight tensors must be contiguous, scales float32");
  TORCH_CHECK(bits == 8 ? group % 16 == 0 : group == 32, "unsupported group size ", group);
  const int64_t K = scales.size(1) * group;
  TORCH_CHECK(qs.size(1) == (bits == 4 ? K / 2 : K), "qs and scales disagree on the row length");
  const bool has_mins = mins.numel() > 0;
  if (has_mins) TORCH_CHECK(mins.is_contiguous() && mins.sizes() == scales.sizes(), "bad mins");
  return Packed{qs.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                has_mins ? mins.data_ptr<float>() : nullptr, bits, group, K, scales.size(1)};
}

}  // namespace

// y = x @ w.T + bias, x [M, K] float32
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, torch::Tensor mins,
                            c10::optional<torch::Tensor> bias, int64_t bits, int64_t group) {
  const Packed w = unpack(qs, scales, mins, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.scalar_type() == torch::kFloat32,
              "x must be float32 [M, ", w.K, "]");
  x = x.contiguous();
  const int64_t M = x.size(0), N = scales.size(0);
  const float* b = nullptr;
  torch::Tensor bias_t;
  if (bias.has_value() && bias->defined()) {
    bias_t = bias->contiguous();
    b = bias_t.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  if (M <= kMaxDirectRows) {
    torch::Tensor xsum;
    if (w.mins) xsum = x.view({M, w.groups, group}).sum(-1).contiguous();
    const float* xs = w.mins ? xsum.data_ptr<float>() : nullptr;
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const DirectFn fn = kDirect[M - 1];
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { fn(w, xp, xs, b, op, N, n0, n1); });
    return out;
  }
  // tiles of weight rows of about 512 KiB as float32: big enough for an efficient BLAS call,
  // small enough to stay in the L2 cache between the dequantization and the product
  const int64_t tile = std::max<int64_t>(16, ((int64_t)(512 << 10) / (w.K * 4)) / 16 * 16);
  auto buf = torch::empty({std::min(tile, N), w.K}, x.options());
  float* bp = buf.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nt = std::min(tile, N - n0);
    at::parallel_for(0, nt, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequant_row(w, n0 + r, bp + r * w.K);
    });
    auto part = torch::mm(x, buf.narrow(0, 0, nt).t());
    out.narrow(1, n0, nt).copy_(part);
  }
  if (b) out.add_(bias_t);
  return out;
}

// rows idx of w, dequantized: [len(idx), K] float32 (embedding lookups)
torch::Tensor packed_rows(torch::Tensor idx, torch::Tensor qs, torch::Tensor scales, torch::Tensor mins,
                          int64_t bits, int64_t group) {
  const Packed w = unpack(qs, scales, mins, bits, group);
  idx = idx.to(torch::kInt64).contiguous();
  const int64_t R = idx.numel(), N = scales.size(0);
  auto out = torch::empty({R, w.K}, torch::TensorOptions().dtype(torch::kFloat32));
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "row index out of range");
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(w, ip[r], op + r * w.K);
  });
  return out;
}


// ---- fused per-layer ops of the decode step (float32): one call instead of several torch ops ----

// out = rmsnorm(x + residual) * (offset + weight); returns (out, x + residual)
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                    double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32);
  x = x.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / H;
  const bool has_res = residual.numel() > 0;
  auto out = torch::empty_like(x);
  torch::Tensor sum = has_res ? torch::empty_like(x) : x;
  if (has_res) residual = residual.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* rp = has_res ? residual.data_ptr<float>() : nullptr;
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* w = weight.contiguous().data_ptr<float>();
  const float off = (float)offset;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* h = xp + t * H;
      if (rp) {
        float* s = sp + t * H;
        const float* r = rp + t * H;
        for (int64_t i = 0; i < H; ++i) s[i] = h[i] + r[i];
        h = s;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
      const float inv = 1.0f / std::sqrt(ss / (float)H + (float)eps);
      float* o = op + t * H;
      for (int64_t i = 0; i < H; ++i) o[i] = (h[i] * inv) * (off + w[i]);
    }
  });
  return {out, sum};
}

// in-place RoPE of q [T, Hq, D] and k [T, Hk, D] (innermost stride 1) from a [L, rd] cos|sin
// table; false (nothing changed) when a position is past the table
bool rope(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos_sin,
          bool interleaved) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos_sin.is_contiguous());
  positions = positions.to(torch::kInt64).contiguous();
  const int64_t T = q.size(0), L = cos_sin.size(0), rd = cos_sin.size(1), half = rd / 2;
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    if (pp[t] < 0 || pp[t] >= L) return false;
  const float* cs = cos_sin.data_ptr<float>();
  auto rotate = [&](float* x, const float* c, const float* s) {
    if (interleaved) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[2 * i], x2 = x[2 * i + 1];
        x[2 * i] = x1 * c[i] - x2 * s[i];
        x[2 * i + 1] = x2 * c[i] + x1 * s[i];
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  };
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cs + pp[t] * rd;
      const float* s = c + half;
      for (int64_t h = 0; h < q.size(1); ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s);
      for (int64_t h = 0; h < k.size(1); ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s);
    }
  });
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
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * I, 2048, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / I, i = j % I;
      const float g = xp[t * 2 * I + i];
      op[j] = g / (1.0f + std::exp(-g)) * xp[t * 2 * I + I + i];
    }
  });
  return out;
}

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t i = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

// attention of one query token per sequence over its paged K/V (float32 caches [blocks, bs, Hk, D]):
// the decode half of a step, as one call for the whole batch
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           int64_t window, double softcap) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous());
  q = q.to(torch::kFloat32).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), rep = Hq / Hk;
  const int64_t maxb = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> scores, acc(rep * D);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t b = j / Hk, hk = j % Hk, len = sl[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
      scores.assign(rep * n, 0.f);
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = bt[b * maxb + t / bs] * bs + t % bs;
        const float* kr = kc + (slot * Hk + hk) * D;
        for (int64_t r = 0; r < rep; ++r) {
          float s = dot(qp + (b * Hq + hk * rep + r) * D, kr, D) * (float)scale;
          if (softcap > 0) s = std::tanh(s / (float)softcap) * (float)softcap;
          scores[r * n + t - start] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(rep);
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sr[i] = std::exp(sr[i] - mx); sum += sr[i]; }
        denom[r] = sum;
      }
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = bt[b * maxb + t / bs] * bs + t % bs;
        const float* vr = vc + (slot * Hk + hk) * D;
        for (int64_t r = 0; r < rep; ++r) {
          const float p = scores[r * n + t - start];
          float* a = acc.data() + r * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        float* o = op + (b * Hq + hk * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] / denom[r];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ dequant(w).T + bias with block-quantized w");
  m.def("packed_rows", &packed_rows, "rows of a block-quantized matrix, dequantized");
  m.def("rms_norm", &rms_norm, "fused residual add + RMSNorm");
  m.def("rope", &rope, "in-place rotary embedding of q and k");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("paged_decode", &paged_decode, "one-token attention over paged float32 K/V");
}
