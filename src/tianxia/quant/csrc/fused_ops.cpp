// The float32 ops of a decode step on raw rows: residual add + RMSNorm, RoPE, the gated MLP
// activation and paged one-token attention. The torch-facing ops (bindings.cpp) and the fused decode step (decoder.cpp) share them.
#include "kernels.h"

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
  at::parallel_for(0, T * I, 2048, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t t = j / I, i = j % I;
      const float g = x[t * 2 * I + i];
      const float act = gelu ? 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                             : g / (1.0f + std::exp(-g));
      out[j] = act * x[t * 2 * I + I + i];
    }
  });
}

void paged_decode_rows(const float* q, int64_t sq, float* out, int64_t so, const float* k_cache,
                       const float* v_cache, const int64_t* block_tables, int64_t max_blocks,
                       const int64_t* seq_lens, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                       int64_t block_size, float scale, int64_t window, float softcap) {
  const int64_t rep = Hq / Hk, bs = block_size;
  at::parallel_for(0, B * Hk, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> scores, acc(rep * D), denom(rep);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t b = j / Hk, hk = j % Hk, len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
      const int64_t* bt = block_tables + b * max_blocks;
      scores.assign(rep * n, 0.f);
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = bt[t / bs] * bs + t % bs;
        const float* kr = k_cache + (slot * Hk + hk) * D;
        for (int64_t r = 0; r < rep; ++r) {
          float s = dot(q + b * sq + (hk * rep + r) * D, kr, D) * scale;
          if (softcap > 0) s = std::tanh(s / softcap) * softcap;
          scores[r * n + t - start] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sr[i] = std::exp(sr[i] - mx); sum += sr[i]; }
        denom[r] = sum;
      }
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = bt[t / bs] * bs + t % bs;
        const float* vr = v_cache + (slot * Hk + hk) * D;
        for (int64_t r = 0; r < rep; ++r) {
          const __m256 p = _mm256_set1_ps(scores[r * n + t - start]);
          float* a = acc.data() + r * D;
          int64_t d = 0;
          for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(a + d)));
          for (; d < D; ++d) a[d] += scores[r * n + t - start] * vr[d];
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        float* o = out + b * so + (hk * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] / denom[r];
      }
    }
  });
}

}  // namespace tianxia
