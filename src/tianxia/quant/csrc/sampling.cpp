// The sampler's draw on the CPU (layers/sampler.py): the exponential race over each row's kept
// logits in one pass, with noise hashed from the row's key and the token id, as the GPU's Triton
// draw does (layers/triton_sampling.py), so that no generator fills a noise tensor the size of
// the logits (at 16 rows of a 49k vocabulary that took longer than everything else the sampler
// does).
//
// The token of row r is argmax over i with x[r, i] >= floor[r] of x[r, i] - log(E_i), where
// E_i = -log(u_i) is Exp(1) and u_i uniform on (0, 1): the Gumbel-max trick, a categorical draw
// from softmax(x) restricted to the kept logits. u_i is a hash of (key, i): a row's draw depends
// on its logits and key alone, never on the other rows or on how the threads split the work.
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"

using namespace tianxia;

namespace {

// ln x for 8 positive normal floats: Cephes' logf (x = m 2^e with m in [sqrt(1/2), sqrt(2)), a
// degree-8 polynomial in m - 1; about 1 ulp)
inline __m256 log8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  // the mantissa as a float in [0.5, 1)
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                 _mm256_set1_epi32(0x3f000000)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(one, small));
  m = _mm256_add_ps(_mm256_sub_ps(m, one), _mm256_and_ps(m, small));  // 2m - 1 where m < sqrt(1/2)
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

// a 32-bit mix with low bias (Wellons' lowbias32), twice: once with each half of the row's key
inline __m256i mix8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7feb352d));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

inline uint32_t mix1(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  return h ^ (h >> 16);
}

// -log(-log u) for u = (top 24 bits of the hash + 1/2) / 2^24, in (0, 1)
inline __m256 gumbel8(__m256i index, __m256i lo, __m256i hi) {
  const __m256i h = mix8(_mm256_xor_si256(mix8(_mm256_xor_si256(index, lo)), hi));
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.f / 16777216.f));
  const __m256 e = _mm256_sub_ps(_mm256_setzero_ps(), log8(u));
  return _mm256_sub_ps(_mm256_setzero_ps(), log8(e));
}

inline float gumbel1(uint32_t index, uint32_t lo, uint32_t hi) {
  const uint32_t h = mix1(mix1(index ^ lo) ^ hi);
  const float u = (static_cast<float>(h >> 8) + 0.5f) * (1.f / 16777216.f);
  return -std::log(-std::log(u));
}

int64_t race_row(const float* x, int64_t V, float floor, uint32_t lo, uint32_t hi) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m256 best = _mm256_set1_ps(neg_inf);
  __m256i best_at = _mm256_setzero_si256();
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8), vlo = _mm256_set1_epi32(static_cast<int32_t>(lo)),
                vhi = _mm256_set1_epi32(static_cast<int32_t>(hi));
  const __m256 vfloor = _mm256_set1_ps(floor), vneg = _mm256_set1_ps(neg_inf);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8, index = _mm256_add_epi32(index, step)) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 kept = _mm256_cmp_ps(v, vfloor, _CMP_GE_OQ);
    if (_mm256_movemask_ps(kept) == 0) continue;  // a truncated row skips most of its noise
    const __m256 score = _mm256_blendv_ps(vneg, _mm256_add_ps(v, gumbel8(index, vlo, vhi)), kept);
    const __m256 better = _mm256_cmp_ps(score, best, _CMP_GT_OQ);  // strictly: the first index wins ties
    best = _mm256_blendv_ps(best, score, better);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(index), better));
  }
  float lane[8];
  int32_t lane_at[8];
  _mm256_storeu_ps(lane, best);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_at), best_at);
  float top = neg_inf;
  int64_t at = -1;
  for (int j = 0; j < 8; ++j) {
    if (lane[j] > top || (lane[j] == top && lane[j] > neg_inf && lane_at[j] < at)) {
      top = lane[j];
      at = lane_at[j];
    }
  }
  for (; i < V; ++i) {
    if (!(x[i] >= floor)) continue;
    const float score = x[i] + gumbel1(static_cast<uint32_t>(i), lo, hi);
    if (score > top) {
      top = score;
      at = i;
    }
  }
  return at < 0 ? 0 : at;  // no kept logit (the caller drops such rows): any token
}

// the smallest logit of a row's top-p nucleus over its whole distribution (see nucleus_floor)
float row_floor(const float* x, int64_t V, double p, int bins, float span, std::vector<float>& e,
                std::vector<double>& hist) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) top = std::max(top, x[i]);
  if (!(top > -std::numeric_limits<float>::infinity())) return top;
  e.resize(V);
  double total = 0;
  int64_t i = 0;
  const __m256 vtop = _mm256_set1_ps(top);
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(&e[i], exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vtop)));
  for (; i < V; ++i) e[i] = std::exp(x[i] - top);
  hist.assign(bins, 0.0);
  const float scale = bins / span;
  auto bin_of = [&](float v) { return static_cast<int>(std::min(static_cast<float>(bins - 1), (top - v) * scale)); };
  for (i = 0; i < V; ++i) {
    if (!(x[i] > -std::numeric_limits<float>::infinity())) continue;  // no mass
    hist[bin_of(x[i])] += e[i];
    total += e[i];
  }
  const double want = p * total;
  double before = 0;
  int b = 0;
  for (; b < bins - 1 && before + hist[b] < want; ++b) before += hist[b];
  // the bin holding the token where the mass before reaches p: its logits, largest first
  std::vector<std::pair<float, int64_t>> in_bin;
  for (i = 0; i < V; ++i)
    if (x[i] > -std::numeric_limits<float>::infinity() && bin_of(x[i]) == b) in_bin.emplace_back(x[i], i);
  if (in_bin.empty()) return -std::numeric_limits<float>::infinity();
  std::sort(in_bin.begin(), in_bin.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
  float floor = in_bin[0].first;  // the bin holds the crossing token: its largest logit stays
  for (const auto& [v, at] : in_bin) {
    if (before >= want) break;
    floor = v;
    before += e[at];
  }
  return floor;
}

}  // namespace

// [R] the smallest logit each row's top-p nucleus keeps (top_p: [R] float32), over the row's whole
// distribution, the sort's rule (a token is kept while the mass before it is below p) without a
// sort: the row's mass (double) binned by logit (`bins` bins over the `span` below its largest,
// lower logits in the last), the bin where the running mass reaches p found, and only its logits
// sorted. Ties with the last kept logit are kept too.
torch::Tensor nucleus_floor(torch::Tensor x, torch::Tensor top_p, int64_t bins, double span) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [R, V]");
  x = x.contiguous();
  top_p = top_p.to(torch::kFloat32).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(top_p.numel() == R, "top_p [R] for ", R, " rows");
  auto out = torch::empty({R}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e;
    std::vector<double> hist;
    for (int64_t r = r0; r < r1; ++r)
      po[r] = row_floor(px + r * V, V, pp[r], static_cast<int>(bins), static_cast<float>(span), e, hist);
  });
  return out;
}

// One token per row of x [R, V] (float32 logits, temperature applied, -inf where excluded): the
// race over the logits at or above floor[r] ([R] float32), noise keyed by keys[r] ([R, 2] int64:
// the two 32-bit halves of the row's 64-bit key). Returns [R] int64.
torch::Tensor race_draw(torch::Tensor x, torch::Tensor floor, torch::Tensor keys) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [R, V]");
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "a vocabulary of 2^31 tokens or more");
  x = x.contiguous();
  floor = floor.to(torch::kFloat32).contiguous();
  keys = keys.to(torch::kInt64).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(floor.numel() == R && keys.numel() == 2 * R, "floor [R] and keys [R, 2] for ", R, " rows");
  auto out = torch::empty({R}, x.options().dtype(torch::kInt64));
  const float* px = x.data_ptr<float>();
  const float* pf = floor.data_ptr<float>();
  const int64_t* pk = keys.data_ptr<int64_t>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      po[r] = race_row(px + r * V, V, pf[r], static_cast<uint32_t>(pk[2 * r]), static_cast<uint32_t>(pk[2 * r + 1]));
  });
  return out;
}
