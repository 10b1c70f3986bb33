// The packed weight view, the 8-bit rounding of activation rows and the float path of the products
// (see kernels.h for the operation sequence every product keeps).
//
// The float path dequantizes the weight a tile of rows at a time into a per-thread buffer that
// stays in the core's L2 cache (a float32 weight is read where it is), and every chunk of up to 4
// activation rows passes over it in register tiles: 1 activation row against 8 weight rows (eight
// independent chains hide the fma's latency), 2 against 4, 3 or 4 against 3 (12 accumulators).
// One code for decode steps and prompts: a token's row comes out the same in either.
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
  if (bits == 32 || bits == 16) {
    TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == (bits == 32 ? at::kFloat : at::kHalf),
                "float weights must be float32 (bits=32) or float16 (bits=16) [N, K]");
    p.qs = static_cast<const uint8_t*>(qs.data_ptr());
    p.N = qs.size(0);
    p.K = qs.size(1);
    return p;
  }
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6, 8, 16 or 32");
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

void Activations::prepare(const float* rows, int64_t m, int64_t k) {
  TORCH_CHECK(k % 32 == 0, "8-bit activation rows are whole blocks of 32");
  x = rows;
  M = m;
  K = k;
  q8.resize(m * k);
  d8.resize(m * (k / 32));
  sums.resize(m * (k / 16));
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
      // the codes are within +-127, so the int32 sums are exact
      alignas(32) int32_t s[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s), _mm256_add_epi32(q[0], q[1]));
      const int32_t lo = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s), _mm256_add_epi32(q[2], q[3]));
      const int32_t hi = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
      sums[2 * b] = d * (float)lo;
      sums[2 * b + 1] = d * (float)hi;
    }
  });
}

bool int8_path(const Packed& w) { return !w.is_float() && w.K % 32 == 0; }

void product_rows(const Packed& w, const float* x, int64_t M, bool int8, const float* bias, float* out,
                  Activations& a) {
  if (int8 && int8_path(w)) {
    a.prepare(x, M, w.K);
    int8_product(w, a, bias, out);
  } else {
    float_product(w, x, M, bias, out);
  }
}

namespace {

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
    __m256 v[4];
    widen_block(w.bits, q + b * 4 * w.bits, v);
    for (int i = 0; i < 4; ++i) {
      const int64_t g = (b * 32 + i * 8) / G;
      const __m256 d = _mm256_set1_ps(to_float(sc[g])), m = _mm256_set1_ps(mn ? to_float(mn[g]) : 0.f);
      _mm256_storeu_ps(dst + b * 32 + i * 8, _mm256_fmadd_ps(v[i], d, m));
    }
  }
}

// MR activation rows (x, row stride K) against NR weight rows (float32, or float16 widened exactly
// to float32 as they are loaded: wr[n]) over all of K, into out (row stride N): the float path's
// operation sequence (kernels.h) for each output
template <int MR, int NR, typename W>
void dot_tile(const float* x, int64_t K, const W* const* wr, const float* bias, float* out, int64_t N) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t K8 = K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load8(wr[n] + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(wv[n], xv, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t k = K8; k < K; ++k) s = std::fma(to_float(wr[n][k]), x[m * K + k], s);
      out[m * N + n] = bias ? s + bias[n] : s;
    }
}

// MR activation rows against NR packed weight rows (n..n+NR-1), each block of codes dequantized in
// registers: the values dequant_row gives and the chain dot_tile runs on them, without the buffer
// (a decode step's few rows would pay more for the buffer's stores and loads than they save)
template <int BITS, int MR, int NR, typename S>
void dequant_dot_tile(const Packed& w, int64_t n, const float* x, const float* bias, float* out) {
  const int64_t K = w.K, G = w.group, N = w.N;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const auto step = [&](int r, int64_t k, __m256 v, int64_t g) __attribute__((always_inline)) {
    const S* mn = w.mins_of<S>(n + r);
    const __m256 wv = _mm256_fmadd_ps(v, _mm256_set1_ps(to_float(w.scales_of<S>(n + r)[g])),
                                      _mm256_set1_ps(mn ? to_float(mn[g]) : 0.f));
    for (int m = 0; m < MR; ++m) acc[m][r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m][r]);
  };
  if constexpr (BITS == 8) {
    for (int64_t k = 0; k < K; k += 16)
      for (int r = 0; r < NR; ++r) {
        __m256 v[2];
        widen_q8x16(reinterpret_cast<const int8_t*>(w.qs + (n + r) * w.row_bytes()) + k, v);
        step(r, k, v[0], k / G);
        step(r, k + 8, v[1], k / G);
      }
  } else {
    for (int64_t b = 0; b < K / 32; ++b)
      for (int r = 0; r < NR; ++r) {
        const __m256i q = codes32<BITS>(w.qs + (n + r) * w.row_bytes() + b * 4 * BITS);
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        step(r, b * 32, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), (b * 32) / G);
        step(r, b * 32 + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), (b * 32 + 8) / G);
        step(r, b * 32 + 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), (b * 32 + 16) / G);
        step(r, b * 32 + 24, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), (b * 32 + 24) / G);
      }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const float s = hsum(acc[m][r]);
      out[m * N + n + r] = bias ? s + bias[n + r] : s;
    }
}

// a few activation rows (MR <= 4) against weight rows n0..n1, NR at a time (NR * MR chains)
template <int BITS, int MR, typename S>
void dequant_rows(const Packed& w, int64_t n0, int64_t n1, const float* x, const float* bias, float* out) {
  constexpr int NR = MR == 1 ? 8 : MR == 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) dequant_dot_tile<BITS, MR, NR, S>(w, n, x, bias, out);
  for (; n < n1; ++n) dequant_dot_tile<BITS, MR, 1, S>(w, n, x, bias, out);
}

template <int BITS, typename S>
void dequant_rows_of(const Packed& w, int64_t n0, int64_t n1, const float* x, int64_t M, const float* bias,
                     float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* xm = x + m0 * w.K;
    float* om = out + m0 * w.N;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: dequant_rows<BITS, 1, S>(w, n0, n1, xm, bias, om); break;
      case 2: dequant_rows<BITS, 2, S>(w, n0, n1, xm, bias, om); break;
      case 3: dequant_rows<BITS, 3, S>(w, n0, n1, xm, bias, om); break;
      default: dequant_rows<BITS, 4, S>(w, n0, n1, xm, bias, om);
    }
  }
}

template <typename S>
void dequant_rows_as(const Packed& w, int64_t n0, int64_t n1, const float* x, int64_t M, const float* bias,
                     float* out) {
  switch (w.bits) {
    case 4: return dequant_rows_of<4, S>(w, n0, n1, x, M, bias, out);
    case 5: return dequant_rows_of<5, S>(w, n0, n1, x, M, bias, out);
    case 6: return dequant_rows_of<6, S>(w, n0, n1, x, M, bias, out);
    default: return dequant_rows_of<8, S>(w, n0, n1, x, M, bias, out);
  }
}

template <typename W>
using DotFn = void (*)(const float*, int64_t, const W* const*, const float*, float*, int64_t);
constexpr int kMaxTileRows = 4;            // activation rows per register tile
constexpr int kTileCols[5] = {0, 8, 4, 3, 3};  // weight rows per register tile, by activation rows

template <int MR, typename W, int... NR>
constexpr std::array<DotFn<W>, 8> dot_row(std::integer_sequence<int, NR...>) { return {dot_tile<MR, NR + 1, W>...}; }

template <typename W>
const DotFn<W>* dot_tiles(int mr) {
  constexpr auto cols = std::make_integer_sequence<int, 8>{};
  static constexpr std::array<DotFn<W>, 8> k1 = dot_row<1, W>(cols), k2 = dot_row<2, W>(cols),
                                           k3 = dot_row<3, W>(cols), k4 = dot_row<4, W>(cols);
  return mr == 1 ? k1.data() : mr == 2 ? k2.data() : mr == 3 ? k3.data() : k4.data();
}

// M rows of x against float weight rows [n0, n0 + nt) (rows[r]: row n0 + r), register tile by tile
template <typename W>
void dot_rows(const float* x, int64_t M, int64_t K, const W* const* rows, int64_t n0, int64_t nt, const float* bias,
              float* out, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
    const int mr = (int)std::min<int64_t>(kMaxTileRows, M - m0);
    const DotFn<W>* fns = dot_tiles<W>(mr);
    for (int64_t r = 0; r < nt; r += kTileCols[mr]) {
      const int nr = (int)std::min<int64_t>(kTileCols[mr], nt - r);
      fns[nr - 1](x + m0 * K, K, rows + r, bias ? bias + n0 + r : nullptr, out + m0 * N + n0 + r, N);
    }
  }
}

}  // namespace

void dequant_row(const Packed& w, int64_t n, float* dst) {
  if (w.bits == 32) {
    std::memcpy(dst, w.qs + n * w.row_bytes(), sizeof(float) * w.K);
  } else if (w.bits == 16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(w.qs + n * w.row_bytes());
    for (int64_t k = 0; k < w.K; ++k) dst[k] = to_float(src[k]);
  } else if (w.half) {
    dequant_row_as<uint16_t>(w, n, dst);
  } else {
    dequant_row_as<float>(w, n, dst);
  }
}

// up to this many activation rows, packed weights are dequantized in registers (decode steps)
constexpr int64_t kFewFloatRows = 4;

void float_product(const Packed& w, const float* x, int64_t M, const float* bias, float* out) {
  const int64_t N = w.N, K = w.K;
  const bool dense = w.is_float();  // read in place (float16 widened in registers)
  if (!dense && M <= kFewFloatRows) {
    // about 8 shares of weight rows per thread, from an atomic counter
    const int64_t threads = at::get_num_threads();
    const int64_t share = std::max<int64_t>(1, N / (8 * threads * 16)) * 16, shares = (N + share - 1) / share;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < shares;) {
        const int64_t n0 = i * share, n1 = std::min(N, n0 + share);
        if (w.half) dequant_rows_as<uint16_t>(w, n0, n1, x, M, bias, out);
        else dequant_rows_as<float>(w, n0, n1, x, M, bias, out);
      }
    });
    return;
  }
  // tiles of weight rows (about 128 KiB of float32) from an atomic counter: a core slowed down by
  // another process takes fewer, and neither waits long for the other at the end
  const int64_t threads = at::get_num_threads();
  int64_t tile = std::max<int64_t>(8, (128 << 10) / (4 * K) / 8 * 8);
  tile = std::min(tile, std::max<int64_t>(8, (N + 4 * threads - 1) / (4 * threads) + 7) / 8 * 8);
  const int64_t tiles = (N + tile - 1) / tile;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> buffer;
    if (!dense) buffer.resize(tile * K);
    std::vector<const float*> rows(w.bits == 16 ? 0 : tile);
    std::vector<const uint16_t*> half_rows(w.bits == 16 ? tile : 0);
    for (int64_t i; (i = next.fetch_add(1)) < tiles;) {
      const int64_t n0 = i * tile, nt = std::min(tile, N - n0);
      if (w.bits == 16) {
        for (int64_t r = 0; r < nt; ++r) half_rows[r] = reinterpret_cast<const uint16_t*>(w.qs) + (n0 + r) * K;
        dot_rows(x, M, K, half_rows.data(), n0, nt, bias, out, N);
        continue;
      }
      for (int64_t r = 0; r < nt; ++r) {
        if (dense) {
          rows[r] = reinterpret_cast<const float*>(w.qs) + (n0 + r) * K;
        } else {
          dequant_row(w, n0 + r, buffer.data() + r * K);
          rows[r] = buffer.data() + r * K;
        }
      }
      dot_rows(x, M, K, rows.data(), n0, nt, bias, out, N);
    }
  });
}

}  // namespace tianxia
