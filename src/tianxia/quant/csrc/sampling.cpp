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
#include <cmath>
#include <functional>
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

// the noise's 32-bit hash of (key, token id)
inline __m256i hash8(__m256i index, __m256i lo, __m256i hi) {
  return mix8(_mm256_xor_si256(mix8(_mm256_xor_si256(index, lo)), hi));
}

// -log(-log u) for u = (top 24 bits of the hash + 1/2) / 2^24, in (0, 1)
inline __m256 gumbel8(__m256i h) {
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.f / 16777216.f));
  const __m256 e = _mm256_sub_ps(_mm256_setzero_ps(), log8(u));
  return _mm256_sub_ps(_mm256_setzero_ps(), log8(e));
}

// an upper bound of gumbel8(h) without a logarithm: with n = 2^24 - (h >> 8) >= 1,
// -log u >= 1 - u = (n - 1/2) / 2^24 >= n / 2^25, so the noise is at most
// ln 2 (25 - floor(log2 n)), and floor(log2 n) is the exponent of n as a float (plus a margin
// far above log8's rounding)
inline __m256 gumbel_bound8(__m256i h) {
  const __m256i n = _mm256_sub_epi32(_mm256_set1_epi32(1 << 24), _mm256_srli_epi32(h, 8));
  const __m256i biased = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(n)), 23);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_set1_epi32(127 + 25), biased)),
                         _mm256_set1_ps(0.693147181f), _mm256_set1_ps(1e-2f));
}

inline float gumbel1(uint32_t index, uint32_t lo, uint32_t hi) {
  const uint32_t h = mix1(mix1(index ^ lo) ^ hi);
  const float u = (static_cast<float>(h >> 8) + 0.5f) * (1.f / 16777216.f);
  return -std::log(-std::log(u));
}

// above every noise gumbel8 gives: -log(-log u) for the largest u, 1 - 2^-25, is 17.33
constexpr float kGumbelMax = 18.f;

int64_t race_row(const float* x, int64_t V, float floor, uint32_t lo, uint32_t hi) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m256 best = _mm256_set1_ps(neg_inf);
  __m256i best_at = _mm256_setzero_si256();
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8), vlo = _mm256_set1_epi32(static_cast<int32_t>(lo)),
                vhi = _mm256_set1_epi32(static_cast<int32_t>(hi));
  const __m256 vfloor = _mm256_set1_ps(floor), vneg = _mm256_set1_ps(neg_inf);
  const __m256 vgmax = _mm256_set1_ps(kGumbelMax);
  // the best score so far over all lanes: a logit that even the largest noise cannot lift above
  // it cannot win (a later index loses a tie), so its noise is never computed
  __m256 lead = vneg;
  int64_t i = 0;
  for (; i + 8 <= V; i += 8, index = _mm256_add_epi32(index, step)) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 kept = _mm256_cmp_ps(v, vfloor, _CMP_GE_OQ);
    // a truncated row skips most of its noise, and so does the tail of any row
    const __m256 reach = _mm256_cmp_ps(_mm256_add_ps(v, vgmax), lead, _CMP_GT_OQ);
    if (_mm256_movemask_ps(_mm256_and_ps(kept, reach)) == 0) continue;
    // and most logits near the top are passed on their hash alone: the logarithms are for the
    // few whose noise may lift them above the lead
    const __m256i h = hash8(index, vlo, vhi);
    const __m256 open = _mm256_and_ps(kept, _mm256_cmp_ps(_mm256_add_ps(v, gumbel_bound8(h)), lead, _CMP_GT_OQ));
    if (_mm256_movemask_ps(open) == 0) continue;
    const __m256 score = _mm256_blendv_ps(vneg, _mm256_add_ps(v, gumbel8(h)), open);
    const __m256 better = _mm256_cmp_ps(score, best, _CMP_GT_OQ);  // strictly: the first index wins ties
    if (_mm256_movemask_ps(better) == 0) continue;
    best = _mm256_blendv_ps(best, score, better);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(index), better));
    __m256 m = _mm256_max_ps(best, _mm256_permute2f128_ps(best, best, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    lead = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
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

// a row's largest logit (NaN ignored)
inline float row_max(const float* x, int64_t V) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  __m256 vmax = _mm256_set1_ps(top);
  for (; i + 8 <= V; i += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(x + i), vmax);  // NaN lanes keep vmax
  float lane[8];
  _mm256_storeu_ps(lane, vmax);
  for (float v : lane) top = std::max(top, v);
  for (; i < V; ++i) top = std::max(top, x[i]);
  return top;
}

// e^x by exp8's arithmetic, for the few weights taken one at a time: a token's weight is one number
inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

// the lowest logit a row weighs: its min-p floor, max + ln(min_p) (min_p: 0 for none), and never
// -inf, so that one compare, x >= low, leaves out -inf and NaN too
inline float weighed_low(float top, float min_p) {
  const float low = min_p > 0.f ? top + std::log(min_p) : -std::numeric_limits<float>::infinity();
  return std::max(low, std::numeric_limits<float>::lowest());
}

// the weights e^(x - top) of 8 logits; those below low (-inf and NaN among them) weigh nothing
inline __m256 weight8(__m256 x, __m256 vtop, __m256 vlow) {
  return _mm256_and_ps(_mm256_cmp_ps(x, vlow, _CMP_GE_OQ), exp8(_mm256_sub_ps(x, vtop)));
}

// the smallest logit of a row's top-p nucleus over its distribution (see nucleus_floor), the
// logits below `low` (weighed_low) left out, `top` the row's largest (row_max): one vectorized
// pass takes each logit's weight and bin, and only the scatter into the bins is scalar
float row_floor(const float* x, int64_t V, double p, float top, float low, int bins, float span,
                std::vector<double>& hist, std::vector<std::pair<float, int64_t>>& in_bin) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (!(top > neg_inf)) return top;
  int64_t i;
  hist.assign(bins, 0.0);
  const float scale = bins / span, last = static_cast<float>(bins - 1);
  // one float arithmetic for every pass below, so a logit's bin is one number; min's second
  // operand is taken for a NaN difference: such lanes land in the last bin
  auto bin_of = [&](float v) { return static_cast<int>(std::min(last, (top - v) * scale)); };
  const __m256 vtop = _mm256_set1_ps(top), vscale = _mm256_set1_ps(scale), vlast = _mm256_set1_ps(last),
               vlow = _mm256_set1_ps(low);
  auto bin8 = [&](__m256 v) {
    return _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(vtop, v), vscale), vlast));
  };
  alignas(32) float w[8];
  alignas(32) int32_t at[8];
  for (i = 0; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_store_ps(w, weight8(v, vtop, vlow));
    _mm256_store_si256(reinterpret_cast<__m256i*>(at), bin8(v));
    for (int j = 0; j < 8; ++j) hist[at[j]] += w[j];
  }
  for (; i < V; ++i)
    if (x[i] >= low) hist[bin_of(x[i])] += exp1(x[i] - top);
  double total = 0;
  for (int b = 0; b < bins; ++b) total += hist[b];
  const double want = p * total;
  double before = 0;
  int b = 0;
  for (; b < bins - 1 && before + hist[b] < want; ++b) before += hist[b];
  // the bin holding the token where the mass before reaches p: its logits, largest first
  in_bin.clear();
  const __m256i vb = _mm256_set1_epi32(b);
  for (i = 0; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    int hits = _mm256_movemask_ps(_mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bin8(v), vb)),
                                                _mm256_cmp_ps(v, vlow, _CMP_GE_OQ)));
    for (; hits; hits &= hits - 1) {
      const int64_t k = i + __builtin_ctz(hits);
      in_bin.emplace_back(x[k], k);
    }
  }
  for (; i < V; ++i)
    if (x[i] >= low && bin_of(x[i]) == b) in_bin.emplace_back(x[i], i);
  if (in_bin.empty()) return neg_inf;
  std::sort(in_bin.begin(), in_bin.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
  float floor = in_bin[0].first;  // the bin holds the crossing token: its largest logit stays
  for (const auto& [v, k] : in_bin) {
    if (before >= want) break;
    floor = v;
    before += exp1(v - top);
  }
  return floor;
}

// whether a row's top-p nucleus keeps logit v: the mass of the logits above it is below p (the
// sort's rule, with ties kept, as row_floor's; the same weights, summed in double, those below
// `low` left out)
bool in_nucleus(const float* x, int64_t V, float v, double p, float top, float low) {
  if (!(v < top)) return true;  // the largest logit always stays
  const __m256 vtop = _mm256_set1_ps(top), vv = _mm256_set1_ps(v), vlow = _mm256_set1_ps(low);
  __m256d total = _mm256_setzero_pd(), above = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x8 = _mm256_loadu_ps(x + i);
    const __m256 w = weight8(x8, vtop, vlow);
    const __m256 wa = _mm256_and_ps(_mm256_cmp_ps(x8, vv, _CMP_GT_OQ), w);
    total = _mm256_add_pd(total, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1))));
    above = _mm256_add_pd(above, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(wa)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(wa, 1))));
  }
  double lanes[4], lanes_above[4];
  _mm256_storeu_pd(lanes, total);
  _mm256_storeu_pd(lanes_above, above);
  double sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  double sum_above = lanes_above[0] + lanes_above[1] + lanes_above[2] + lanes_above[3];
  for (; i < V; ++i) {
    if (!(x[i] >= low)) continue;
    const double w = exp1(x[i] - top);
    sum += w;
    if (x[i] > v) sum_above += w;
  }
  return sum_above < p * sum;
}

// the smallest logit a row keeps under top-k `k` (0 < k < V) and then top-p `p` over the
// distribution renormalized to the k (as vLLM), among its logits at or above `low` (weighed_low:
// min-p comes first, as in vLLM): the k largest logits collected in one pass, a logit taken only
// above the k-th largest among those collected so far, the collection cut back to k (nth_element)
// whenever it doubles
float row_top_k_floor(const float* x, int64_t V, int64_t k, double p, float low, std::vector<float>& kept) {
  kept.clear();
  // x > bar is x >= low until the first cut (-inf and NaN never enter)
  float bar = std::nextafter(low, -std::numeric_limits<float>::infinity());
  auto cut = [&]() {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<float>());
    kept.resize(k);
    bar = *std::min_element(kept.begin(), kept.end());
  };
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(bar), _CMP_GT_OQ));
    for (; above; above &= above - 1) kept.push_back(x[i + __builtin_ctz(above)]);
    if (static_cast<int64_t>(kept.size()) >= 2 * k) cut();
  }
  for (; i < V; ++i)
    if (x[i] > bar) kept.push_back(x[i]);
  if (kept.empty()) return -std::numeric_limits<float>::infinity();
  if (static_cast<int64_t>(kept.size()) > k) cut();
  std::sort(kept.begin(), kept.end(), std::greater<float>());
  if (!(p < 1.0)) return kept.back();
  double total = 0;
  for (float v : kept) total += exp1(v - kept[0]);
  // a logit stays while the mass before it is below p; the largest always does
  double before = 0;
  float floor = kept[0];
  for (float v : kept) {
    if (before >= p * total) break;
    floor = v;
    before += exp1(v - kept[0]);
  }
  return floor;
}

}  // namespace

// [R] the smallest logit each row keeps under its min-p (min_p: [R] float32, 0 for none), then
// its top-k (top_k: [R] int64, 0 or >= V for none: -inf) and then its top-p (top_p: [R] float32)
// over the distribution renormalized to those k, in one pass over the row (two with a min-p)
// instead of a sort or a topk. Ties with the last kept logit are kept too.
torch::Tensor top_k_floor(torch::Tensor x, torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [R, V]");
  x = x.contiguous();
  top_k = top_k.to(torch::kInt64).contiguous();
  top_p = top_p.to(torch::kFloat32).contiguous();
  min_p = min_p.to(torch::kFloat32).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(top_k.numel() == R && top_p.numel() == R && min_p.numel() == R,
              "top_k [R], top_p [R] and min_p [R] for ", R, " rows");
  auto out = torch::empty({R}, x.options());
  const float* px = x.data_ptr<float>();
  const int64_t* pk = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* pm = min_p.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> kept;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = px + r * V;
      const float low = weighed_low(pm[r] > 0.f ? row_max(row, V) : 0.f, pm[r]);
      po[r] = pk[r] > 0 && pk[r] < V ? row_top_k_floor(row, V, pk[r], pp[r], low, kept)
                                     : -std::numeric_limits<float>::infinity();
    }
  });
  return out;
}

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
    std::vector<double> hist;
    std::vector<std::pair<float, int64_t>> in_bin;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = px + r * V;
      po[r] = row_floor(row, V, pp[r], row_max(row, V), weighed_low(0.f, 0.f), static_cast<int>(bins),
                        static_cast<float>(span), hist, in_bin);
    }
  });
  return out;
}

// One token per row of x [R, V] (float32 logits, temperature applied, -inf where excluded): the
// race over the logits at or above floor[r] ([R] float32) and at or above the row's min-p floor
// (min_p: [R] float32, 0 for none; max + ln(min_p)), and within the row's top-p nucleus (top_p:
// [R] float32, 1 for none; the nucleus of the distribution above the min-p floor, found as
// nucleus_floor finds it, with `bins` and `span`), noise keyed by keys[r] ([R, 2] int64: the two
// 32-bit halves of the row's 64-bit key). Returns [R] int64.
//
// A top-p row races first and asks afterwards: the winner of the race over the whole row is the
// winner over any set that holds it, and it is in the nucleus when the mass above its logit is
// below p, one pass over the row. Only a row whose winner fell in the tail (1 - p of the time)
// finds its floor and races again, with the same noise.
torch::Tensor race_draw(torch::Tensor x, torch::Tensor floor, torch::Tensor keys, torch::Tensor top_p,
                        torch::Tensor min_p, int64_t bins, double span) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [R, V]");
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "a vocabulary of 2^31 tokens or more");
  x = x.contiguous();
  floor = floor.to(torch::kFloat32).contiguous();
  keys = keys.to(torch::kInt64).contiguous();
  top_p = top_p.to(torch::kFloat32).contiguous();
  min_p = min_p.to(torch::kFloat32).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(floor.numel() == R && keys.numel() == 2 * R && top_p.numel() == R && min_p.numel() == R,
              "floor [R], keys [R, 2], top_p [R] and min_p [R] for ", R, " rows");
  auto out = torch::empty({R}, x.options().dtype(torch::kInt64));
  const float* px = x.data_ptr<float>();
  const float* pf = floor.data_ptr<float>();
  const int64_t* pk = keys.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* pm = min_p.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> hist;
    std::vector<std::pair<float, int64_t>> in_bin;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = px + r * V;
      const auto lo = static_cast<uint32_t>(pk[2 * r]), hi = static_cast<uint32_t>(pk[2 * r + 1]);
      const float top = pm[r] > 0.f || pp[r] < 1.f ? row_max(row, V) : 0.f;
      const float low = weighed_low(top, pm[r]);
      const float kept = std::max(pf[r], low);  // -inf logits, which never win a race, left out
      int64_t at = race_row(row, V, kept, lo, hi);
      if (pp[r] < 1.f && !in_nucleus(row, V, row[at], pp[r], top, low)) {
        const float nucleus =
            row_floor(row, V, pp[r], top, low, static_cast<int>(bins), static_cast<float>(span), hist, in_bin);
        at = race_row(row, V, std::max(kept, nucleus), lo, hi);
      }
      po[r] = at;
    }
  });
  return out;
}
