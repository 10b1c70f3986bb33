// The products of a few activation rows with a packed weight matrix (decode steps).
//
// Float path: each weight group is widened to float in registers and dotted with up to 8 rows at
// once, so the weights are read once per step; the result equals dequantize-then-matmul up to
// float rounding.
// Integer path (ggml's q8 dot products): each row is rounded to 8-bit codes with one scale per 32
// elements, and weight codes meet them in maddubs/madd integer dot products, about half the
// instructions per weight of the float path. 4-, 5- and 6-bit codes stay unsigned (their stored
// bits), which maddubs takes as they are, and a row's offsets and mins meet the activation sums
// once per row; the scale products of a row are formed 8 at a time before its blocks. It changes
// the numerics the way llama.cpp's CPU backend does (activations carry about 2-3 significant
// digits).
#include "kernels.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <utility>

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
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6, 8 or 32");
  TORCH_CHECK(scales.is_contiguous() && (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "scales must be contiguous float16 or float32");
  TORCH_CHECK(bits == 8   ? group % 16 == 0
              : bits == 6 ? (group == 16 || group == 32)
                          : group == 32,
              "unsupported group size ", group, " for ", bits, "-bit codes");
  p.group = group;
  p.groups = scales.size(1);
  p.N = scales.size(0);
  p.K = p.groups * group;
  TORCH_CHECK(p.K % 32 == 0 || bits == 8, "rows of ", bits, "-bit codes are whole blocks of 32");
  TORCH_CHECK(qs.size(1) == p.row_bytes(), "qs and scales disagree on the row length");
  p.qs = qs.data_ptr<uint8_t>();
  p.half = scales.scalar_type() == at::kHalf;
  p.scales = scales.data_ptr();
  if (mins.defined() && mins.numel() > 0) {
    TORCH_CHECK(mins.is_contiguous() && mins.sizes() == scales.sizes() && mins.scalar_type() == scales.scalar_type(),
                "mins must match scales");
    p.mins = mins.data_ptr();
  }
  return p;
}

namespace {

// the 32 values at p (into v) and their 8-bit scale: amax / 127
inline float q8_block(const float* p, __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(p + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h) / 127.f;
}

}  // namespace

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
  // the mins meet the rounded values too, so every path sees the same numbers
  if (with_sums) sums.resize(m * (k / 16));
  // ggml's quantize_row_q8_0 in AVX2: scale by 127 / amax, round to nearest even, pack to bytes
  at::parallel_for(0, m * (k / 32), 64, [&](int64_t b0, int64_t b1) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = b0; b < b1; ++b) {
      __m256 v[4];
      const float d = q8_block(rows + b * 32, v);
      d8[b] = d;
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      // words, then bytes; both packs interleave 128-bit lanes, which the permute undoes
      const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8.data() + b * 32), bytes);
      if (with_sums) {  // the codes are within +-127, so the int32 sums are exact
        alignas(32) int32_t s[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(s), _mm256_add_epi32(q[0], q[1]));
        const int32_t lo = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
        _mm256_store_si256(reinterpret_cast<__m256i*>(s), _mm256_add_epi32(q[2], q[3]));
        const int32_t hi = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
        sums[2 * b] = d * (float)lo;
        sums[2 * b + 1] = d * (float)hi;
      }
    }
  });
}

void round_rows_q8(const float* x, float* out, int64_t blocks) {
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      __m256 v[4];
      const float d = q8_block(x + b * 32, v);
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f), dv = _mm256_set1_ps(d);
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(out + b * 32 + 8 * i,
                         _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), dv));
    }
  });
}

bool int8_path(const Packed& w) { return w.bits != 32 && w.K % 32 == 0; }

bool unsigned_offset(const Packed& w) { return w.bits == 5 || w.bits == 6; }

namespace {

// [M, groups]: the sums of each activation row over each group of w, for its mins
std::vector<float> group_sums(const Packed& w, const Activations& a) {
  const int64_t per = w.group / 16, ng = w.groups;
  std::vector<float> gsum(a.M * ng, 0.f);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t i = 0; i < per; ++i) gsum[m * ng + g] += a.sums[m * (a.K / 16) + g * per + i];
  return gsum;
}

template <int MR, typename S>
void float_rows(const Packed& w, const Activations& a, const float* gsum, int64_t m0, const float* bias,
                float* out, int64_t n0, int64_t n1, float*) {
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
    } else if (w.bits == 8) {
      const S* sc = w.scales_of<S>(n);
      for (int64_t g = 0; g < ng; ++g) {
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
        const __m256 d = _mm256_set1_ps(to_float(sc[g]));
        for (int m = 0; m < MR; ++m) acc[m] = _mm256_fmadd_ps(d, t[m], acc[m]);
      }
    } else {  // blocks of 32 codes, one or two scales each
      const S* sc = w.scales_of<S>(n);
      const int64_t block_bytes = 4 * w.bits;
      for (int64_t b = 0; b < K / 32; ++b) {
        __m256 v[4];
        const uint8_t* p = q + b * block_bytes;
        widen_block(w.bits, p, v);
        const __m256 d0 = _mm256_set1_ps(to_float(sc[G == 32 ? b : 2 * b]));
        const __m256 d1 = G == 32 ? d0 : _mm256_set1_ps(to_float(sc[2 * b + 1]));
        for (int m = 0; m < MR; ++m) {
          const float* xp = x + m * K + b * 32;
          const __m256 t0 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp + 8), _mm256_mul_ps(v[0], _mm256_loadu_ps(xp)));
          const __m256 t1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(v[2], _mm256_loadu_ps(xp + 16)));
          if (G == 32) {
            acc[m] = _mm256_fmadd_ps(d0, _mm256_add_ps(t0, t1), acc[m]);
          } else {
            acc[m] = _mm256_fmadd_ps(d1, t1, _mm256_fmadd_ps(d0, t0, acc[m]));
          }
        }
      }
    }
    if (const S* mn = w.mins_of<S>(n))
      for (int m = 0; m < MR; ++m) off[m] += dot_mixed(mn, gsum + (m0 + m) * ng, ng);
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MR; ++m) out[(m0 + m) * N + n] = hsum(acc[m]) + off[m] + b;
  }
}

// Per weight row, before its blocks: for each of the MR activation rows, the weight scale times the
// activation scale of every scale unit (a block of 32, or a half block for groups of 16), so that
// a block's product takes one broadcast where it took a float16 conversion and a multiply:
// sd[m * units + u]; and, with `offset`, sum_g (min_g - off * scale_g) * gsum[m, g] (gsum: the
// row's sums over each group), the weight's mins and the offset of unsigned 5- and 6-bit codes.
// One pass, 8 units at a time, then 4: a scalar float16 tail cost as much as the vector part.
template <int MR, typename S, bool WEIGHT_ONLY = false>
void row_prologue(const S* sc, const S* mn, int64_t G, float off, bool offset, const float* xd, const float* gsum,
                  int64_t nb, float* sd, float offs[MR]) {
  for (int m = 0; m < MR; ++m) offs[m] = 0.f;
  if (G > 32) {  // one scale for several blocks (a scale per row, say): few rows take this path
    for (int m = 0; m < MR; ++m)
      for (int64_t b = 0; b < nb; ++b) sd[m * nb + b] = to_float(sc[b * 32 / G]) * xd[m * nb + b];
    const int64_t ng = nb * 32 / G;
    if (offset)
      for (int64_t g = 0; g < ng; ++g) {
        const float c = (mn ? to_float(mn[g]) : 0.f) - off * to_float(sc[g]);
        for (int m = 0; m < MR; ++m) offs[m] += c * gsum[m * ng + g];
      }
    return;
  }
  const int64_t units = G == 16 ? 2 * nb : nb;  // = the groups
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256 ov = _mm256_set1_ps(off);
  int64_t u = 0;
  for (; u + 8 <= units; u += 8) {
    const __m256 s = load8(sc + u);
    const __m256 c = offset ? _mm256_fnmadd_ps(ov, s, mn ? load8(mn + u) : _mm256_setzero_ps()) : s;
    if (WEIGHT_ONLY) _mm256_storeu_ps(sd + u, s);
    for (int m = 0; m < MR; ++m) {
      if (!WEIGHT_ONLY) {
        const __m256 d = G == 16 ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xd + m * nb + u / 2)), pairs)
                                 : _mm256_loadu_ps(xd + m * nb + u);
        _mm256_storeu_ps(sd + m * units + u, _mm256_mul_ps(s, d));
      }
      if (offset) acc[m] = _mm256_fmadd_ps(c, _mm256_loadu_ps(gsum + m * units + u), acc[m]);
    }
  }
  __m128 acc4[MR];
  for (int m = 0; m < MR; ++m) acc4[m] = _mm_setzero_ps();
  if (u + 4 <= units) {
    const __m128 s = load4(sc + u);
    const __m128 c = offset ? _mm_fnmadd_ps(_mm_set1_ps(off), s, mn ? load4(mn + u) : _mm_setzero_ps()) : s;
    if (WEIGHT_ONLY) _mm_storeu_ps(sd + u, s);
    for (int m = 0; m < MR; ++m) {
      const float* x = xd + m * nb;
      const __m128 d = G == 16 ? _mm_setr_ps(x[u / 2], x[u / 2], x[u / 2 + 1], x[u / 2 + 1]) : _mm_loadu_ps(x + u);
      if (!WEIGHT_ONLY) _mm_storeu_ps(sd + m * units + u, _mm_mul_ps(s, d));
      if (offset) acc4[m] = _mm_fmadd_ps(c, _mm_loadu_ps(gsum + m * units + u), acc4[m]);
    }
    u += 4;
  }
  for (int m = 0; m < MR; ++m) {
    const __m128 s4 = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1)), acc4[m]);
    __m128 t = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    offs[m] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  for (; u < units; ++u) {
    const float s = to_float(sc[u]);
    const float c = (mn ? to_float(mn[u]) : 0.f) - off * s;
    if (WEIGHT_ONLY) sd[u] = s;
    for (int m = 0; m < MR; ++m) {
      if (!WEIGHT_ONLY) sd[m * units + u] = s * xd[m * nb + (G == 16 ? u / 2 : u)];
      if (offset) offs[m] += c * gsum[m * units + u];
    }
  }
}

// One weight row against MR activation rows over all blocks: 4-, 5- and 6-bit codes stay unsigned
// (maddubs is u8 x s8; the offsets of 5- and 6-bit codes meet the activation sums afterwards), 8-bit
// ones take ggml's sign trick.
// LATE (more than 2 rows): sd holds the weight's scales alone, and each row's block multiplies
// them by its activation scale: the products of every row cost the prologue more than they saved
// (0.81x for Q6_K at 8 rows, whose two halves' products took two broadcasts and an insert). At 8
// rows the pairs of blocks still cost registers: 0.94-0.97x for Q4_K/Q6_K, 1.02-1.05x for Q5_0.
template <int MR, int BITS, bool HALVES, bool LATE = false>
inline void int8_row(const uint8_t* q, const int8_t* xq, const float* xd, const float* sd, int64_t K, int64_t nb,
                     __m256 acc[MR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t units = HALVES ? 2 * nb : nb;
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  auto codes = [&](int64_t b, __m256i& wv, __m256i& sw) __attribute__((always_inline)) {
    if constexpr (BITS == 8) {
      sw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
      wv = _mm256_sign_epi8(sw, sw);
    } else {
      wv = codes32<BITS, true>(q + b * 4 * BITS);
    }
  };
  auto weight_scale = [&](int64_t b) __attribute__((always_inline)) {
    return HALVES ? _mm256_set_m128(_mm_broadcast_ss(sd + 2 * b + 1), _mm_broadcast_ss(sd + 2 * b))
                  : _mm256_broadcast_ss(sd + b);
  };
  // block b's dot product for row m, as floats times its scale product (still to be multiplied)
  auto product = [&](int64_t b, int m, __m256i wv, __m256i sw, __m256 wscale, __m256& p, __m256& scale)
      __attribute__((always_inline)) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
    if constexpr (BITS == 8) xv = _mm256_sign_epi8(xv, sw);
    p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
    const float* s = sd + m * units;
    if constexpr (LATE) scale = _mm256_mul_ps(wscale, _mm256_broadcast_ss(xd + m * nb + b));
    else if constexpr (HALVES) scale = _mm256_set_m128(_mm_broadcast_ss(s + 2 * b + 1), _mm_broadcast_ss(s + 2 * b));
    else scale = _mm256_broadcast_ss(s + b);
  };
  // Two blocks at a time, added to the row's sum together: one chain of multiply-adds per block
  // would wait out the FMA's latency at every block when there are few activation rows. Every
  // row count sums in this order, so a row's result does not depend on the rows beside it.
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m256i w0, s0, w1, s1;
    codes(b, w0, s0);
    codes(b + 1, w1, s1);
    __m256 ws0, ws1;
    if constexpr (LATE) {
      ws0 = weight_scale(b);
      ws1 = weight_scale(b + 1);
    }
    for (int m = 0; m < MR; ++m) {
      __m256 p0, c0, p1, c1;
      product(b, m, w0, s0, ws0, p0, c0);
      product(b + 1, m, w1, s1, ws1, p1, c1);
      acc[m] = _mm256_add_ps(acc[m], _mm256_fmadd_ps(p1, c1, _mm256_mul_ps(p0, c0)));
    }
  }
  if (b < nb) {
    __m256i w, sw;
    codes(b, w, sw);
    __m256 ws;
    if constexpr (LATE) ws = weight_scale(b);
    for (int m = 0; m < MR; ++m) {
      __m256 p, c;
      product(b, m, w, sw, ws, p, c);
      acc[m] = _mm256_fmadd_ps(p, c, acc[m]);
    }
  }
}

template <int MR, int BITS, typename S>
void int8_rows(const Packed& w, const Activations& a, const float* gsum, int64_t m0, const float* bias,
               float* out, int64_t n0, int64_t n1, float* sd) {
  const int64_t K = w.K, G = w.group, ng = w.groups, N = w.N, nb = K / 32;
  const int8_t* xq = a.q8.data() + m0 * K;
  const float* xd = a.d8.data() + m0 * nb;
  const float off = kCodeOffset<BITS>;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MR];
    float offs[MR];
    const uint8_t* q = w.qs + n * w.row_bytes();
    const S* sc = w.scales_of<S>(n);
    const S* mn = w.mins_of<S>(n);
    const float* gs = gsum ? gsum + m0 * ng : nullptr;
    if (MR > 2 && G <= 32) {
      row_prologue<MR, S, true>(sc, mn, G, off, mn || off != 0.f, xd, gs, nb, sd, offs);
      if (G == 16) int8_row<MR, BITS, true, true>(q, xq, xd, sd, K, nb, acc);
      else int8_row<MR, BITS, false, true>(q, xq, xd, sd, K, nb, acc);
    } else {
      row_prologue<MR, S>(sc, mn, G, off, mn || off != 0.f, xd, gs, nb, sd, offs);
      if (G == 16) int8_row<MR, BITS, true>(q, xq, xd, sd, K, nb, acc);
      else int8_row<MR, BITS, false>(q, xq, xd, sd, K, nb, acc);
    }
    const float bv = bias ? bias[n] : 0.f;
    for (int m = 0; m < MR; ++m) out[(m0 + m) * N + n] = hsum(acc[m]) + offs[m] + bv;
  }
}

// (..., n0, n1, scratch): scratch holds kMaxDirectRows * K / 16 floats
using RowsFn = void (*)(const Packed&, const Activations&, const float*, int64_t, const float*, float*, int64_t,
                        int64_t, float*);
using RowsTable = std::array<RowsFn, kMaxDirectRows>;

template <typename S, int... M>
constexpr RowsTable float_table(std::integer_sequence<int, M...>) { return {float_rows<M + 1, S>...}; }
template <int BITS, typename S, int... M>
constexpr RowsTable int8_table(std::integer_sequence<int, M...>) { return {int8_rows<M + 1, BITS, S>...}; }

template <typename S>
const RowsTable& rows_table(const Packed& w, bool integer) {
  constexpr auto rows = std::make_integer_sequence<int, kMaxDirectRows>{};
  static constexpr RowsTable kFloat = float_table<S>(rows), kInt4 = int8_table<4, S>(rows),
                             kInt5 = int8_table<5, S>(rows), kInt6 = int8_table<6, S>(rows),
                             kInt8 = int8_table<8, S>(rows);
  if (!integer) return kFloat;
  return w.bits == 4 ? kInt4 : w.bits == 5 ? kInt5 : w.bits == 6 ? kInt6 : kInt8;
}

}  // namespace

constexpr int64_t kWeightTile = 16;

void small_matmul(const Packed& w, const Activations& a, const float* bias, float* out) {
  TORCH_CHECK(a.K == w.K, "activation rows have ", a.K, " elements, the weight expects ", w.K);
  const bool integer = a.quantized && int8_path(w);
  const bool with_sums = w.mins || (integer && unsigned_offset(w));
  TORCH_CHECK(!with_sums || !a.sums.empty(), "weights with mins or offset codes need the activation sums");
  const RowsTable& table = w.half ? rows_table<uint16_t>(w, integer) : rows_table<float>(w, integer);
  std::vector<float> gsum;
  if (with_sums) gsum = group_sums(w, a);
  const float* gs = gsum.empty() ? nullptr : gsum.data();
  // a tile of weight rows stays in L1 while every chunk of activation rows passes it; the tiles go
  // in turn to whichever thread is free, so a core slowed down by another process takes fewer
  // and neither waits long for the other at the end (about 8 shares per thread)
  const int64_t threads = at::get_num_threads();
  const int64_t share = std::max<int64_t>(1, w.N / (8 * threads * kWeightTile)) * kWeightTile;
  const int64_t shares = (w.N + share - 1) / share;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(kMaxDirectRows * (w.K / 16 + 1));
    for (int64_t i; (i = next.fetch_add(1)) < shares;) {
      const int64_t n1 = std::min(w.N, (i + 1) * share);
      for (int64_t t0 = i * share; t0 < n1; t0 += kWeightTile) {
        const int64_t t1 = std::min(n1, t0 + kWeightTile);
        for (int64_t m0 = 0; m0 < a.M; m0 += kMaxDirectRows) {
          const int64_t mr = std::min<int64_t>(kMaxDirectRows, a.M - m0);
          table[mr - 1](w, a, gs, m0, bias, out, t0, t1, scratch.data());
        }
      }
    }
  });
}

}  // namespace tianxia
