// The products of a few activation rows with a packed weight matrix (decode steps).
//
// Float path: each weight group is widened to float in registers and dotted with up to 8 rows at
// once, so the weights are read once per step; the result equals dequantize-then-matmul up to
// float rounding.
// Integer path (ggml's q8 dot products): each row is rounded to 8-bit codes with one scale per 32
// elements, and weight codes meet them in maddubs/madd integer dot products, about half the
// instructions per weight of the float path. It changes the numerics the way llama.cpp's CPU
// backend does (activations carry about 2-3 significant digits).
#include "kernels.h"

#include <c10/util/Exception.h>

namespace tianxia {

Packed unpack(const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
              int64_t group) {
  TORCH_CHECK(qs.is_contiguous(), "packed weight tensors must be contiguous");
  Packed p;
  p.bits = bits;
  if (bits == 32) {
    TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kFloat, "float weights must be float32 [N, K]");
    p.qs = reinterpret_cast<const uint8_t*>(qs.data_ptr<float>());
    p.N = qs.size(0);
    p.K = qs.size(1);
    return p;
  }
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4, 8 or 32");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat, "scales must be contiguous float32");
  TORCH_CHECK(bits == 8 ? group % 16 == 0 : group == 32, "unsupported group size ", group);
  p.group = group;
  p.groups = scales.size(1);
  p.N = scales.size(0);
  p.K = p.groups * group;
  TORCH_CHECK(qs.size(1) == (bits == 4 ? p.K / 2 : p.K), "qs and scales disagree on the row length");
  p.qs = qs.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<float>();
  if (mins.defined() && mins.numel() > 0) {
    TORCH_CHECK(mins.is_contiguous() && mins.sizes() == scales.sizes(), "mins must match scales");
    p.mins = mins.data_ptr<float>();
  }
  return p;
}

void Activations::prepare(const float* rows, int64_t m, int64_t k, bool with_sums, bool int8) {
  x = rows;
  M = m;
  K = k;
  quantized = int8 && k % 32 == 0;
  if (with_sums && k % 16 == 0 && !quantized) {
    sums.resize(m * (k / 16));
    for (int64_t i = 0; i < m * (k / 16); ++i) {
      const float* p = rows + i * 16;
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += p[j];
      sums[i] = s;
    }
  }
  if (!quantized) return;
  q8.resize(m * k);
  d8.resize(m * (k / 32));
  // ggml's quantize_row_q8_0 in AVX2: scale by 127 / amax, round to nearest even, pack to bytes
  at::parallel_for(0, m * (k / 32), 64, [&](int64_t b0, int64_t b1) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = b0; b < b1; ++b) {
      const float* p = rows + b * 32;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float d = amax / 127.f;
      d8[b] = d;
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      // words, then bytes; both packs interleave 128-bit lanes, which the permute undoes
      const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8.data() + b * 32), bytes);
    }
  });
  if (with_sums) {  // the mins meet the rounded values too, so every path sees the same numbers
    sums.resize(m * (k / 16));
    for (int64_t i = 0; i < m * (k / 16); ++i) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += q8[i * 16 + j];
      sums[i] = d8[i / 2] * (float)s;
    }
  }
}

void Activations::dequantized(float* out) const {
  for (int64_t i = 0; i < M * K; ++i) out[i] = d8[i / 32] * (float)q8[i];
}

bool int8_path(const Packed& w) { return (w.bits == 4 || w.bits == 8) && w.K % 32 == 0; }

namespace {

template <int MR>
void float_rows(const Packed& w, const Activations& a, const float* gsum, int64_t m0, const float* bias,
                float* out, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = w.group, ng = w.groups, N = w.N;
  const float* x = a.x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MR];
    float off[MR];
    for (int m = 0; m < MR; ++m) { acc[m] = _mm256_setzero_ps(); off[m] = 0.f; }
    const uint8_t* q = w.qs + n * w.row_bytes();
    if (w.bits == 32) {
      const float* wr = reinterpret_cast<const float*>(q);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(wr + k);
        for (int m = 0; m < MR; ++m) acc[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * K + k), acc[m]);
      }
      for (; k < K; ++k)
        for (int m = 0; m < MR; ++m) off[m] += wr[k] * x[m * K + k];
    } else {
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
      }
      if (mn)
        for (int m = 0; m < MR; ++m) off[m] += dot(mn, gsum + (m0 + m) * ng, ng);
    }
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MR; ++m) out[(m0 + m) * N + n] = hsum(acc[m]) + off[m] + b;
  }
}

template <int MR, int BITS>
void int8_rows(const Packed& w, const Activations& a, const float* gsum, int64_t m0, const float* bias,
               float* out, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = w.group, ng = w.groups, N = w.N, nb = K / 32;
  const int8_t* xq = a.q8.data() + m0 * K;
  const float* xd = a.d8.data() + m0 * nb;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MR];
    float off[MR];
    for (int m = 0; m < MR; ++m) { acc[m] = _mm256_setzero_ps(); off[m] = 0.f; }
    const uint8_t* q = w.qs + n * w.row_bytes();
    const float* sc = w.scales + n * ng;
    const float* mn = w.mins ? w.mins + n * ng : nullptr;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i wv, sw;
      __m256 scale;
      if (BITS == 4) {  // unsigned codes 0..15: maddubs takes them as they are
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
        wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
        scale = _mm256_set1_ps(sc[b]);
      } else {  // signed codes: |w| times x with w's sign (ggml's trick, maddubs is u8 x s8)
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
        wv = _mm256_sign_epi8(raw, raw);
        sw = raw;
        scale = G >= 32 ? _mm256_set1_ps(sc[b * 32 / G])
                        : _mm256_set_m128(_mm_set1_ps(sc[2 * b + 1]), _mm_set1_ps(sc[2 * b]));
      }
      for (int m = 0; m < MR; ++m) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
        if (BITS == 8) xv = _mm256_sign_epi8(xv, sw);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(scale, _mm256_set1_ps(xd[m * nb + b])),
                                 acc[m]);
      }
    }
    if (mn)  // sum_g min_g * (sum of the row over group g), one vector dot per row
      for (int m = 0; m < MR; ++m) off[m] = dot(mn, gsum + (m0 + m) * ng, ng);
    const float bv = bias ? bias[n] : 0.f;
    for (int m = 0; m < MR; ++m) out[(m0 + m) * N + n] = hsum(acc[m]) + off[m] + bv;
  }
}

using RowsFn = void (*)(const Packed&, const Activations&, const float*, int64_t, const float*, float*, int64_t,
                        int64_t);
constexpr RowsFn kFloat[kMaxDirectRows] = {float_rows<1>, float_rows<2>, float_rows<3>, float_rows<4>,
                                           float_rows<5>, float_rows<6>, float_rows<7>, float_rows<8>};
constexpr RowsFn kInt4x8[kMaxDirectRows] = {int8_rows<1, 4>, int8_rows<2, 4>, int8_rows<3, 4>, int8_rows<4, 4>,
                                            int8_rows<5, 4>, int8_rows<6, 4>, int8_rows<7, 4>, int8_rows<8, 4>};
constexpr RowsFn kInt8x8[kMaxDirectRows] = {int8_rows<1, 8>, int8_rows<2, 8>, int8_rows<3, 8>, int8_rows<4, 8>,
                                            int8_rows<5, 8>, int8_rows<6, 8>, int8_rows<7, 8>, int8_rows<8, 8>};

}  // namespace

void small_matmul(const Packed& w, const Activations& a, const float* bias, float* out) {
  TORCH_CHECK(a.K == w.K, "activation rows have ", a.K, " elements, the weight expects ", w.K);
  TORCH_CHECK(!w.mins || !a.sums.empty(), "weights with mins need the activation sums");
  const RowsFn* table = !(a.quantized && int8_path(w)) ? kFloat : w.bits == 4 ? kInt4x8 : kInt8x8;
  // the activations' sums over each weight group, for the mins
  std::vector<float> gsum;
  if (w.mins) {
    const int64_t per = w.group / 16, ng = w.groups;
    gsum.assign(a.M * ng, 0.f);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t i = 0; i < per; ++i) gsum[m * ng + g] += a.sums[m * (a.K / 16) + g * per + i];
  }
  const float* gs = gsum.empty() ? nullptr : gsum.data();
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxDirectRows) {
      const int64_t mr = std::min<int64_t>(kMaxDirectRows, a.M - m0);
      table[mr - 1](w, a, gs, m0, bias, out, n0, n1);
    }
  });
}

}  // namespace tianxia
