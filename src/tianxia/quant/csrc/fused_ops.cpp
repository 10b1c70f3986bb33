// The float32 ops of a step on raw rows: residual add + RMSNorm, RoPE, the gated MLP activation
// and paged attention, one query token at a time. The torch-facing ops (bindings.cpp) and the fused
// decode step (decoder.cpp) share them, and each row's result depends on that row alone (a
// query's attention: on its position and the cached K/V), so prompts and decode steps agree.
#include "kernels.h"
#include "kv_blocks.h"

#include <atomic>

namespace tianxia {

void rms_norm_rows(const float* x, const float* res, float* sum_out, float* out, const float* w,
                   int64_t T, int64_t H, float eps, float offset) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* h = x + t * H;
      if (res) {
        float* s = sum_out + t * H;
        const float* r = res + t * H;
        for (int64_t i = 0; i < H; ++i) s[i] = h[i] + r[i];
        h = s;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
      const float inv = 1.0f / std::sqrt(ss / (float)H + eps);
      float* o = out + t * H;
      for (int64_t i = 0; i < H; ++i) o[i] = (h[i] * inv) * (offset + w[i]);
    }
  });
}

void rope_rows(float* q, int64_t sq, int64_t Hq, float* k, int64_t sk, int64_t Hk, int64_t D,
               const int64_t* pos, int64_t T, const float* cos_sin, int64_t rd, bool interleaved) {
  const int64_t half = rd / 2;
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
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos_sin + pos[t] * rd;
      const float* s = c + half;
      for (int64_t h = 0; h < Hq; ++h) rotate(q + t * sq + h * D, c, s);
      for (int64_t h = 0; h < Hk; ++h) rotate(k + t * sk + h * D, c, s);
    }
  });
}

void gated_act_rows(const float* x, float* out, int64_t T, int64_t I, bool gelu) {
  const auto act = [gelu](__m256 g) {
    const __m256 one = _mm256_set1_ps(1.f);
    if (!gelu) return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    // 0.5 g (1 + tanh(z)) = g - g / (1 + e^{2z}), z = sqrt(2/pi) (g + 0.044715 g^3)
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f),
                                   _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
    return _mm256_sub_ps(g, _mm256_div_ps(g, _mm256_add_ps(one, exp8(z))));
  };
  at::parallel_for(0, T * I, 2048, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b;) {
      const int64_t t = j / I, i0 = j % I, run = std::min(b - j, I - i0);
      const float* g = x + t * 2 * I + i0;
      const float* u = g + I;
      float* o = out + j;
      int64_t i = 0;
      for (; i + 8 <= run; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(act(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
      if (i < run) {  // the row's last few values, through a zero-padded vector
        alignas(32) float gt[8] = {0}, r[8];
        std::copy(g + i, g + run, gt);
        _mm256_store_ps(r, act(_mm256_load_ps(gt)));
        for (int64_t k = i; k < run; ++k) o[k] = r[k - i] * u[k];
      }
      j += run;
    }
  });
}

namespace {

// the sums of 8 vectors, as one vector
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// one (sequence, KV head): its rep query heads over n cached tokens (float32, float16 or Q8_0/Q4_0
// block rows T, widened in registers: kv_blocks.h);
// ND = D / 8 when the head size is 64 or 128 (the accumulators then stay in registers), 0 for any
// other size
template <int ND, typename T>
void attend_kv_head(const float* q, float* out, const T* const* k, const T* const* v, int64_t n, int64_t rep,
                    int64_t D, float scale, float softcap, std::vector<float>& scores) {
  scores.resize(rep * n);
  for (int64_t r = 0; r < rep; ++r) {
    const float* qr = q + r * D;
    float* sr = scores.data() + r * n;
    int64_t t = 0;
    if (D % 8 == 0) {
      for (; t + 8 <= n; t += 8) {  // 8 keys at a time: one reduction for 8 dot products
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
          const __m256 qc = _mm256_loadu_ps(qr + c);
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(kv_load8(k[t + i], c), qc, acc[i]);
        }
        _mm256_storeu_ps(sr + t, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
      }
    }
    for (; t < n; ++t) sr[t] = kv_dot(k[t], qr, D) * scale;
    if (softcap > 0)
      for (int64_t i = 0; i < n; ++i) sr[i] = std::tanh(sr[i] / softcap) * softcap;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
    const __m256 m = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + i), m));
      _mm256_storeu_ps(sr + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; i < n; ++i) { sr[i] = std::exp(sr[i] - mx); sum += sr[i]; }
    const float inv = 1.f / sum;
    float* o = out + r * D;
    if constexpr (ND > 0) {
      __m256 acc[ND];
      for (int c = 0; c < ND; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t t2 = 0; t2 < n; ++t2) {
        const __m256 p = _mm256_set1_ps(sr[t2]);
        for (int c = 0; c < ND; ++c) acc[c] = _mm256_fmadd_ps(p, kv_load8(v[t2], 8 * c), acc[c]);
      }
      for (int c = 0; c < ND; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
    } else {
      std::fill(o, o + D, 0.f);
      for (int64_t t2 = 0; t2 < n; ++t2)
        for (int64_t d = 0; d < D; ++d) o[d] += sr[t2] * kv_elem(v[t2], d);
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

}  // namespace

template <typename T>
void paged_decode_rows(const float* q, int64_t sq, float* out, int64_t so, const T* k_cache, const T* v_cache,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens, const int64_t* seq_of,
                       int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, float scale, int64_t window,
                       float softcap) {
  const int64_t rep = Hq / Hk, bs = block_size, items = B * Hk, stride = kv_row_stride<T>(D);
  const auto attend = D == 64 ? attend_kv_head<8, T> : D == 128 ? attend_kv_head<16, T> : attend_kv_head<0, T>;
  // (query, KV head) pairs from an atomic counter, a few at a time: the queries of a prompt cost
  // in proportion to their positions, and a static split would give one thread the long ones
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, items / (16 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    std::vector<const T*> k, v;
    for (int64_t j0; (j0 = next.fetch_add(chunk)) < items;) {
      for (int64_t j = j0; j < std::min(items, j0 + chunk); ++j) {
        const int64_t b = j / Hk, hk = j % Hk, len = seq_lens[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
        const int64_t* bt = block_tables + (seq_of ? seq_of[b] : b) * max_blocks;
        k.resize(n);
        v.resize(n);
        for (int64_t t = start; t < len; ++t) {  // the rows of the paged cache, in token order
          const int64_t row = (bt[t / bs] * bs + t % bs) * Hk + hk;
          k[t - start] = k_cache + row * stride;
          v[t - start] = v_cache + row * stride;
        }
        attend(q + b * sq + hk * rep * D, out + b * so + hk * rep * D, k.data(), v.data(), n, rep, D, scale, softcap,
               scores);
      }
    }
  });
}

template void paged_decode_rows<float>(const float*, int64_t, float*, int64_t, const float*, const float*,
                                       const int64_t*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
                                       int64_t, int64_t, int64_t, float, int64_t, float);
template void paged_decode_rows<uint16_t>(const float*, int64_t, float*, int64_t, const uint16_t*, const uint16_t*,
                                          const int64_t*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
                                          int64_t, int64_t, int64_t, float, int64_t, float);

template void paged_decode_rows<KvQ8_0>(const float*, int64_t, float*, int64_t, const KvQ8_0*, const KvQ8_0*,
                                        const int64_t*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
                                        int64_t, int64_t, int64_t, float, int64_t, float);
template void paged_decode_rows<KvQ4_0>(const float*, int64_t, float*, int64_t, const KvQ4_0*, const KvQ4_0*,
                                        const int64_t*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
                                        int64_t, int64_t, int64_t, float, int64_t, float);

}  // namespace tianxia
