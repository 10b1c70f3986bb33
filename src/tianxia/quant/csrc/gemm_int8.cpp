// The integer GEMM for more than a few activation rows (batched decode steps, prompts): rows of
// 8-bit codes with one scale per 32 (Activations) times a weight of 4-, 5-, 6- or 8-bit codes.
//
// Each thread widens a tile of weight rows once to byte codes that maddubs (u8 x s8) takes as its
// unsigned operand: 5- and 6-bit codes keep their +16 / +32 offset, so every code is 0..63 and
// needs neither ggml's sign trick nor can it saturate (2 * 63 * 127 < 2^15). 8-bit codes (Q8_0,
// int8) stay signed and take the sign trick, one more op per product, and widen each product to
// 32 bits before the fold; that is still 1.2-1.6x BLAS on the rounded rows, and 1.6x the direct
// kernel at 16 rows (a batched decode step's output head). Four weight rows and four activation rows
// then meet in a register tile: per block of 32, four maddubs dot products are folded by a
// 4x4 transpose-add into one vector (lanes: the four weight rows' low and high 16 elements),
// which takes one convert and one multiply-add with the block's scales. Offsets and mins take one more multiply-add with the activations' sums:
//   sum_k x_k (s (u_k - off) + min) = s d_x (u . q_x) + (min - off s) sum_k x_k   per half block.
#include "kernels.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace tianxia {

namespace {

// A tile of weight rows, widened: per group of 4 rows ("quad") and block of 32, 4 x 32 code bytes,
// then the 8 scales and the 8 correction factors (min - off * scale) that one folded vector meets
// (low lane: the 4 rows' values for elements 0..15, high lane: for 16..31).
struct WeightTile {
  std::vector<uint8_t> codes;
  std::vector<float> factors;
  int64_t rows = 0;
};

template <int BITS, typename S>
void widen_tile(const Packed& w, int64_t n0, int64_t rows, WeightTile& t) {
  const int64_t nb = w.K / 32, G = w.group, quads = (rows + 3) / 4;
  const float off = kCodeOffset<BITS>;
  t.rows = rows;
  t.codes.resize(quads * nb * 128);
  t.factors.resize(quads * nb * 16);
  for (int64_t q = 0; q < quads; ++q) {
    for (int j = 0; j < 4; ++j) {
      const int64_t r = 4 * q + j;
      uint8_t* c = t.codes.data() + q * nb * 128 + j * 32;
      float* f = t.factors.data() + q * nb * 16 + j;
      if (r >= rows) {  // padding of the last quad: zero codes, zero scales
        for (int64_t b = 0; b < nb; ++b) {
          std::memset(c + b * 128, 0, 32);
          f[b * 16] = f[b * 16 + 4] = f[b * 16 + 8] = f[b * 16 + 12] = 0.f;
        }
        continue;
      }
      const int64_t n = n0 + r;
      const uint8_t* p = w.qs + n * w.row_bytes();
      const S* sc = w.scales_of<S>(n);
      const S* mn = w.mins_of<S>(n);
      for (int64_t b = 0; b < nb; ++b) {
        if constexpr (BITS == 8) {
          std::memcpy(c + b * 128, p + b * 32, 32);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + b * 128), codes32<BITS, true>(p + b * 4 * BITS));
        }
        for (int half = 0; half < 2; ++half) {
          const int64_t g = BITS == 8 ? b * 32 / G : G == 32 ? b : 2 * b + half;
          const float s = to_float(sc[g]);
          f[b * 16 + 4 * half] = s;
          f[b * 16 + 8 + 4 * half] = (mn ? to_float(mn[g]) : 0.f) - off * s;
        }
      }
    }
  }
}

// Activation rows m0..m0+MR as one panel that the register tile walks with a single pointer (with
// a pointer and a scale per row, the loop ran out of registers): per block, the MR rows' 32 codes,
// their MR scales, then per row the sums of the block's two halves as the folded vectors meet
// them (the first half's sum in the low lane, the second's in the high lane).
template <int MR>
constexpr int64_t kPanelBlock = MR * 32 + MR * 4 + MR * 32;

template <int MR>
void pack_panel(const Activations& a, int64_t m0, uint8_t* panel) {
  const int64_t K = a.K, nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* p = panel + b * kPanelBlock<MR>;
    float* d = reinterpret_cast<float*>(p + MR * 32);
    float* s = d + MR;
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      std::memcpy(p + m * 32, a.q8.data() + row * K + b * 32, 32);
      d[m] = a.d8[row * nb + b];
      const float* hs = a.sums.data() + row * (K / 16) + 2 * b;
      _mm256_storeu_ps(s + m * 8, _mm256_set_m128(_mm_set1_ps(hs[1]), _mm_set1_ps(hs[0])));
    }
  }
}

// acc[m]: rows m of the panel against one quad of weight rows, over all blocks. The four maddubs
// products are folded (a 4x4 transpose-add in each lane: lane j of h sums p_j's values there)
// while still 16-bit where that cannot overflow: a pair sum is at most 2 * 127 * code, so four
// fit for codes up to 31 (4- and 5-bit: 31496 < 2^15) and two for 6-bit codes. Unpacking
// 32-bit units keeps each row's pair sums side by side, so one madd with ones finishes the fold
// (two for 6-bit codes) where each product took its own: 3-12% faster than four madds.
template <int BITS, int MR>
inline void quad_rows(const uint8_t* codes, const float* factors, const uint8_t* panel, int64_t nb, __m256 acc[MR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, codes += 128, factors += 16, panel += kPanelBlock<MR>) {
    const __m256i* c = reinterpret_cast<const __m256i*>(codes);
    const __m256i w0 = _mm256_loadu_si256(c), w1 = _mm256_loadu_si256(c + 1), w2 = _mm256_loadu_si256(c + 2),
                  w3 = _mm256_loadu_si256(c + 3);
    const __m256 sv = _mm256_loadu_ps(factors), cv = _mm256_loadu_ps(factors + 8);
    const float* d = reinterpret_cast<const float*>(panel + MR * 32);
    if constexpr (BITS == 8) {
      // signed codes: ggml's sign trick (|w| times x with w's sign), once per weight row and
      // activation row; a pair sum reaches 2 * 127 * 127, so each product is widened to 32 bits
      // before the fold
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1), a2 = _mm256_abs_epi8(w2),
                    a3 = _mm256_abs_epi8(w3);
      for (int m = 0; m < MR; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + m * 32));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones);
        const __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(a2, _mm256_sign_epi8(x, w2)), ones);
        const __m256i p3 = _mm256_madd_epi16(_mm256_maddubs_epi16(a3, _mm256_sign_epi8(x, w3)), ones);
        const __m256i e = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
        const __m256i o = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
        const __m256i h = _mm256_add_epi32(_mm256_unpacklo_epi64(e, o), _mm256_unpackhi_epi64(e, o));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sv, _mm256_set1_ps(d[m])), acc[m]);
      }
      continue;
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + m * 32));
      const __m256i p0 = _mm256_maddubs_epi16(w0, x), p1 = _mm256_maddubs_epi16(w1, x);
      const __m256i p2 = _mm256_maddubs_epi16(w2, x), p3 = _mm256_maddubs_epi16(w3, x);
      __m256i e = _mm256_add_epi16(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
      __m256i o = _mm256_add_epi16(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
      __m256i h;
      if constexpr (BITS <= 5) {
        h = _mm256_madd_epi16(_mm256_add_epi16(_mm256_unpacklo_epi64(e, o), _mm256_unpackhi_epi64(e, o)), ones);
      } else {
        e = _mm256_madd_epi16(e, ones);
        o = _mm256_madd_epi16(o, ones);
        h = _mm256_add_epi32(_mm256_unpacklo_epi64(e, o), _mm256_unpackhi_epi64(e, o));
      }
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sv, _mm256_set1_ps(d[m])), acc[m]);
      acc[m] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(d + MR + 8 * m), acc[m]);
    }
  }
}

constexpr int kTileRows = 4;  // activation rows per register tile

template <int BITS, int MR>
void tile_outputs(const WeightTile& t, const uint8_t* panel, int64_t nb, int64_t m0, int64_t n0, const float* bias,
                  float* out, int64_t N) {
  for (int64_t q = 0; q < (t.rows + 3) / 4; ++q) {
    __m256 acc[MR];
    quad_rows<BITS, MR>(t.codes.data() + q * nb * 128, t.factors.data() + q * nb * 16, panel, nb, acc);
    const int64_t n = n0 + 4 * q;
    const __m128 bv = bias && t.rows - 4 * q >= 4 ? _mm_loadu_ps(bias + n) : _mm_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m128 v = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1)), bv);
      if (t.rows - 4 * q >= 4) {
        _mm_storeu_ps(out + (m0 + m) * N + n, v);
      } else {
        alignas(16) float r[4];
        _mm_store_ps(r, v);
        for (int j = 0; 4 * q + j < t.rows; ++j) out[(m0 + m) * N + n + j] = r[j] + (bias ? bias[n + j] : 0.f);
      }
    }
  }
}

template <int BITS, typename S>
void gemm_as(const Packed& w, const Activations& a, const float* bias, float* out) {
  const int64_t N = w.N, K = w.K, M = a.M, nb = K / 32;
  // the activation panels, once per call: rows 4c..4c+3 at c * nb * kPanelBlock<4>, then the
  // last 1-3 rows
  constexpr int R = kTileRows;
  const int64_t full = M / R, rest = M % R, span = nb * kPanelBlock<R>;
  thread_local std::vector<uint8_t> buffer;  // (a lambda would see its own thread's: use the pointer)
  buffer.resize(full * span + nb * kPanelBlock<R - 1>);
  uint8_t* const panels = buffer.data();
  at::parallel_for(0, full + (rest > 0), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      uint8_t* p = panels + c * span;
      if (c < full) pack_panel<R>(a, R * c, p);
      else if (rest == 3) pack_panel<3>(a, R * c, p);
      else if (rest == 2) pack_panel<2>(a, R * c, p);
      else pack_panel<1>(a, R * c, p);
    }
  });
  // a tile's codes (rows x K bytes) stay in L2 while every activation row passes over them; the
  // tiles, about kTileBytes and at least 8 per thread, go in turn to whichever thread is free (a
  // core slowed down by another process takes fewer, and the last tile keeps the other waiting
  // only briefly)
  constexpr int64_t kTileBytes = 96 << 10;
  const int64_t threads = at::get_num_threads();
  int64_t tiles = std::max<int64_t>(8 * threads, (N * K + kTileBytes - 1) / kTileBytes);
  const int64_t tile = std::max<int64_t>(4, ((N + tiles - 1) / tiles + 3) / 4 * 4);
  tiles = (N + tile - 1) / tile;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local WeightTile t;
    for (int64_t i; (i = next.fetch_add(1)) < tiles;) {
      const int64_t n0 = i * tile, rows = std::min(tile, N - n0);
      widen_tile<BITS, S>(w, n0, rows, t);
      for (int64_t c = 0; c < full; ++c) tile_outputs<BITS, R>(t, panels + c * span, nb, R * c, n0, bias, out, N);
      const uint8_t* p = panels + full * span;
      if (rest == 3) tile_outputs<BITS, 3>(t, p, nb, R * full, n0, bias, out, N);
      else if (rest == 2) tile_outputs<BITS, 2>(t, p, nb, R * full, n0, bias, out, N);
      else if (rest == 1) tile_outputs<BITS, 1>(t, p, nb, R * full, n0, bias, out, N);
    }
  });
}

}  // namespace

bool int8_gemm_path(const Packed& w) {
  return ((w.bits == 4 || w.bits == 5 || w.bits == 6) || (w.bits == 8 && w.group % 32 == 0 && !w.mins)) &&
         w.K % 32 == 0;
}

bool product_rows_takes(const Packed& w, int64_t M, bool int8) {
  return (int8 && int8_gemm_path(w)) || M <= (int8 && int8_path(w) ? 2 * kMaxDirectRows : kMaxDirectRows);
}

void product_rows(const Packed& w, const float* x, int64_t M, bool int8, const float* bias, float* out,
                  Activations& a) {
  // from 9 rows on, the tiles beat the direct kernel (1.3-1.6x at 16 rows), below it the widening
  // of the weight does not pay
  const bool gemm = int8 && int8_gemm_path(w) && M > kMaxDirectRows;
  a.prepare(x, M, w.K, gemm || w.mins != nullptr || (int8 && unsigned_offset(w)), int8 && int8_path(w));
  if (gemm) {
    int8_gemm(w, a, bias, out);
  } else {
    small_matmul(w, a, bias, out);
  }
}

void int8_gemm(const Packed& w, const Activations& a, const float* bias, float* out) {
  TORCH_CHECK(a.quantized && a.K == w.K && int8_gemm_path(w), "int8_gemm: 8-bit activation rows and 4-, 5- or 6-bit codes");
  TORCH_CHECK(!a.sums.empty(), "int8_gemm needs the activation sums");
  if (w.half) {
    if (w.bits == 4) gemm_as<4, uint16_t>(w, a, bias, out);
    else if (w.bits == 5) gemm_as<5, uint16_t>(w, a, bias, out);
    else if (w.bits == 6) gemm_as<6, uint16_t>(w, a, bias, out);
    else gemm_as<8, uint16_t>(w, a, bias, out);
  } else {
    if (w.bits == 4) gemm_as<4, float>(w, a, bias, out);
    else if (w.bits == 5) gemm_as<5, float>(w, a, bias, out);
    else if (w.bits == 6) gemm_as<6, float>(w, a, bias, out);
    else gemm_as<8, float>(w, a, bias, out);
  }
}

}  // namespace tianxia
