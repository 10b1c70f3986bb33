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
      // the sum of squares in two vectors of partial sums: a single float sum is a chain of
      // dependent adds, 4 cycles an element (SmolLM2's 61 norms of a 16-row step: 0.46 -> 0.20 ms;
      // a prompt step of 2,048 rows, three alternating pairs: 887-989 against 950-1,191 ms)
      float ss = 0.f;
      int64_t i = 0;
      if (H >= 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (; i + 16 <= H; i += 16) {
          const __m256 x0 = _mm256_loadu_ps(h + i), x1 = _mm256_loadu_ps(h + i + 8);
          a0 = _mm256_fmadd_ps(x0, x0, a0);
          a1 = _mm256_fmadd_ps(x1, x1, a1);
        }
        ss = hsum(_mm256_add_ps(a0, a1));
      }
      for (; i < H; ++i) ss += h[i] * h[i];
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
    // 0.5 g (1 + tanh(z)) = g / (1 + e^{-2z}), z = sqrt(2/pi) (g + 0.044715 g^3): a quotient, where
    // g - g / (1 + e^{2z}) lost the small results of negative g (about -4) to cancellation
    const __m256 z2 = _mm256_mul_ps(_mm256_set1_ps(-2.f * 0.7978845608028654f),
                                    _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
    return _mm256_div_ps(g, _mm256_add_ps(one, exp8(z2)));
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

// the scores of query qr against keys [t0, t1) (t0 a multiple of 8 from the first key; whole blocks
// of 8 keys take one reduction for their 8 dot products, the keys past the last whole block of
// the query's n one dot product each), scaled, into sr
template <typename T>
inline void score_keys(const float* qr, const T* const* k, int64_t t0, int64_t t1, int64_t n, int64_t D, float scale,
                       float* sr) {
  int64_t t = t0;
  const int64_t whole = D % 8 == 0 ? n / 8 * 8 : 0;
  for (; t + 8 <= std::min(t1, whole); t += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qc = _mm256_loadu_ps(qr + c);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(kv_load8(k[t + i], c), qc, acc[i]);
    }
    _mm256_storeu_ps(sr + t, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
  }
  for (t = std::max(t, whole); t < t1; ++t) sr[t] = kv_dot(k[t], qr, D) * scale;
}

// scores of n keys into probabilities (exp(s - max), unnormalised); returns 1 / their sum
inline float softmax_scores(float* sr, int64_t n, float softcap) {
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
  return 1.f / sum;
}

// acc[c] += p_t v_t[8c..8c+7] for keys [t0, t1), in key order
template <int ND, typename T>
inline void weigh_values(const float* sr, const T* const* v, int64_t t0, int64_t t1, float* accum) {
  __m256 acc[ND];
  for (int c = 0; c < ND; ++c) acc[c] = _mm256_loadu_ps(accum + 8 * c);
  for (int64_t t2 = t0; t2 < t1; ++t2) {
    const __m256 p = _mm256_set1_ps(sr[t2]);
    for (int c = 0; c < ND; ++c) acc[c] = _mm256_fmadd_ps(p, kv_load8(v[t2], 8 * c), acc[c]);
  }
  for (int c = 0; c < ND; ++c) _mm256_storeu_ps(accum + 8 * c, acc[c]);
}

// One KV head of a group of G query rows over the same cached tokens (one sequence: a decode, or
// the rows of a speculative verification or of a prompt chunk, each with its own length n[g]):
// the G x rep query heads, rep per row at q + g * sq (outputs at out + g * so), over the keys
// and values k[t], v[t] (float32, float16 or Q8_0/Q4_0 block rows, widened in registers:
// kv_blocks.h). The keys and values are read a block at a time for every query head, while the
// block is in L1, instead of once per query head; each query head's scores, softmax and weighted
// sum take the same operations, in the same order, as when it is alone, so a row's output does
// not depend on its group. ND = D / 8 when the head size is 64 or 128 (the accumulators then stay
// in registers), 0 for any other size.
template <int ND, typename T>
void attend_kv_group(const float* q, int64_t sq, float* out, int64_t so, const int64_t* n, int64_t G,
                     const T* const* k, const T* const* v, int64_t rep, int64_t D, float scale, float softcap,
                     std::vector<float>& scores) {
  int64_t most = 0;
  for (int64_t g = 0; g < G; ++g) most = std::max(most, n[g]);
  // keys per block: 8-32 KiB of float32 K or V rows of 64-128 values for a group; one row reads all
  // its keys per query head in one pass (SmolLM2's 16 decodes at 800 keys: 8-15% faster than in
  // blocks, which the other heads read again from L2 instead of L1)
  const int64_t block = G > 1 ? 32 : std::max<int64_t>(most, 1), stride = (most + 7) / 8 * 8;
  // one buffer for the scores, the weighted sums' accumulators and the 1 / sum of each query head
  scores.resize(G * rep * stride + G * rep * std::max<int64_t>(ND, 1) * 8 + G * rep);
  float* const accum = scores.data() + G * rep * stride;
  float* const inv = accum + G * rep * std::max<int64_t>(ND, 1) * 8;
  for (int64_t t0 = 0; t0 < most; t0 += block)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < rep; ++r)
        if (t0 < n[g])
          score_keys(q + g * sq + r * D, k, t0, std::min(t0 + block, n[g]), n[g], D, scale,
                     scores.data() + (g * rep + r) * stride);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < rep; ++r) inv[g * rep + r] = softmax_scores(scores.data() + (g * rep + r) * stride, n[g], softcap);
  if constexpr (ND > 0) {
    std::fill(accum, accum + G * rep * ND * 8, 0.f);
    for (int64_t t0 = 0; t0 < most; t0 += block)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < rep; ++r)
          if (t0 < n[g])
            weigh_values<ND>(scores.data() + (g * rep + r) * stride, v, t0, std::min(t0 + block, n[g]),
                             accum + (g * rep + r) * ND * 8);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < rep; ++r) {
        float* o = out + g * so + r * D;
        const float* a = accum + (g * rep + r) * ND * 8;
        for (int c = 0; c < ND; ++c)
          _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), _mm256_set1_ps(inv[g * rep + r])));
      }
  } else {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < rep; ++r) {
        const float* sr = scores.data() + (g * rep + r) * stride;
        float* o = out + g * so + r * D;
        std::fill(o, o + D, 0.f);
        for (int64_t t2 = 0; t2 < n[g]; ++t2)
          for (int64_t d = 0; d < D; ++d) o[d] += sr[t2] * kv_elem(v[t2], d);
        for (int64_t d = 0; d < D; ++d) o[d] *= inv[g * rep + r];
      }
  }
}

}  // namespace

// rows per group at most: a prompt chunk's rows (one sequence) split into groups that the threads share
constexpr int64_t kMaxGroup = 8;

template <typename T>
void paged_decode_rows(const float* q, int64_t sq, float* out, int64_t so, const T* k_cache, const T* v_cache,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens, const int64_t* seq_of,
                       int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, float scale, int64_t window,
                       float softcap) {
  const int64_t rep = Hq / Hk, bs = block_size, stride = kv_row_stride<T>(D);
  const auto attend = D == 64 ? attend_kv_group<8, T> : D == 128 ? attend_kv_group<16, T> : attend_kv_group<0, T>;
  auto table_of = [&](int64_t b) { return block_tables + (seq_of ? seq_of[b] : b) * max_blocks; };
  auto start_of = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : int64_t(0); };
  // Groups of consecutive rows that read the same cached tokens from their first (the same block
  // table, no window cut): a sequence's rows in a verification step or a prompt chunk
  std::vector<int64_t> first;  // each group's first row, then B
  for (int64_t b = 0; b < B; ++b) {
    const bool joins = b > 0 && b - first.back() < kMaxGroup && start_of(b) == 0 && start_of(b - 1) == 0 &&
                       (table_of(b) == table_of(b - 1) ||
                        std::memcmp(table_of(b), table_of(b - 1), sizeof(int64_t) * max_blocks) == 0);
    if (!joins) first.push_back(b);
  }
  const int64_t groups = (int64_t)first.size(), items = groups * Hk;
  first.push_back(B);
  // (group, KV head) pairs from an atomic counter, a few at a time: the queries of a prompt cost
  // in proportion to their positions, and a static split would give one thread the long ones.
  // Where there are groups enough for every thread, a take is whole groups, all their KV heads:
  // a block of the cache holds every head's rows of its tokens side by side, and the lines the
  // first head brings in then serve the others from this core's cache (a decode step of 16
  // SmolLM2 sequences of 228 tokens whose caches stream from memory: 344-365 against 383-417 us
  // a layer, in three alternating runs). A few groups (a single decode) share out their heads.
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = groups >= 4 * threads ? std::max<int64_t>(1, groups / (16 * threads)) * Hk
                                              : std::max<int64_t>(1, items / (16 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    std::vector<const T*> k, v;
    std::vector<int64_t> n;
    for (int64_t j0; (j0 = next.fetch_add(chunk)) < items;) {
      for (int64_t j = j0; j < std::min(items, j0 + chunk); ++j) {
        const int64_t gi = j / Hk, hk = j % Hk, b0 = first[gi], G = first[gi + 1] - b0;
        const int64_t start = start_of(b0);
        int64_t len = 0;
        n.resize(G);
        for (int64_t g = 0; g < G; ++g) {
          n[g] = seq_lens[b0 + g] - start;
          len = std::max(len, seq_lens[b0 + g]);
        }
        const int64_t* bt = table_of(b0);
        k.resize(len - start);
        v.resize(len - start);
        // the rows of the paged cache, in token order, a block at a time: a division per token
        // took 4-8% of a decode step's attention (16 SmolLM2 sequences of 228 tokens, in cache)
        for (int64_t t = start; t < len;) {
          // token t of block b is row (bt[b] * bs + t - b * bs) * Hk + hk
          const int64_t b = t / bs, end = std::min(len, (b + 1) * bs), at = ((bt[b] - b) * bs * Hk + hk) * stride;
          for (; t < end; ++t) {
            k[t - start] = k_cache + at + t * Hk * stride;
            v[t - start] = v_cache + at + t * Hk * stride;
          }
        }
        attend(q + b0 * sq + hk * rep * D, sq, out + b0 * so + hk * rep * D, so, n.data(), G, k.data(), v.data(), rep,
               D, scale, softcap, scores);
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
