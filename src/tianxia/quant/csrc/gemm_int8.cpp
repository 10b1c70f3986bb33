// The integer path of the products, for any number of activation rows (decode steps and prompts
// alike): rows of 8-bit codes with one scale per 32 (Activations) times a weight of 4-, 5-, 6- or
// 8-bit codes, by one register tile whose operation sequence per output is the same for every
// row count (kernels.h), so that a token's row does not depend on its batch or its prompt's
// chunking.
//
// Each thread widens 4 weight rows at a time ("a quad") to byte codes that maddubs (u8 x s8) takes
// as its unsigned operand: 5- and 6-bit codes keep their +16 / +32 offset, so every code is 0..63
// and needs neither ggml's sign trick nor can it saturate (2 * 63 * 127 < 2^15). 8-bit codes (Q8_0,
// Q3_K, Q2_K, int8) stay signed and take the sign trick, one more op per product, and widen each
// product to 32 bits before the fold. With a quad's codes come its factors per block: the 4 rows'
// scales and (min - off * scale) for the block's two halves. Four weight rows and up to four
// activation rows then meet in a register tile: per block of 32, four maddubs dot products are
// folded by a 4x4 transpose-add into one vector (lanes: the four weight rows' low and high 16
// elements), which takes one convert and one multiply-add with the block's scales, and one more
// multiply-add with the activations' half-block sums for the offsets and mins:
//   sum_k x_k (s (u_k - off) + min) = s d_x (u . q_x) + (min - off s) sum_k x_k   per half block.
// Many rows (prompts, batched steps) widen tiles of about 96 KiB that stay in L2 while every
// activation row passes over them; a few rows (decode) widen one quad at a time, used at once.
#include "kernels.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <new>

namespace tianxia {

namespace {

// A tile of weight rows, widened: per quad and block of 32, 4 x 32 code bytes (codes), then 16
// factors (factors): the 4 rows' scales of the block's low half's group, of its high half's
// group, then the same for min - off * scale.
struct WeightTile {
  std::vector<uint8_t> codes;
  std::vector<float> factors;
  int64_t rows = 0;
};

// 4 x 8 floats (rows r, groups g..g+7) into u[i] = [group g+i of rows 0-3 | group g+4+i of rows 0-3]
inline void transpose4x8(const __m256 r[4], __m256 u[4]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  u[0] = _mm256_shuffle_ps(t0, t2, 0x44);
  u[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  u[2] = _mm256_shuffle_ps(t1, t3, 0x44);
  u[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

// the factors of one quad (rows n0..n0+rows-1 of w, rows <= 4; missing rows get zeros)
template <int BITS, typename S>
void quad_factors(const Packed& w, int64_t n0, int64_t rows, float* f) {
  const int64_t nb = w.K / 32, G = w.group;
  const float off = kCodeOffset<BITS>;
  const S* sc[4];
  const S* mn[4];
  for (int r = 0; r < 4; ++r) {
    sc[r] = r < rows ? w.scales_of<S>(n0 + r) : nullptr;
    mn[r] = r < rows ? w.mins_of<S>(n0 + r) : nullptr;
  }
  int64_t b = 0;
  if (G == 32 || G == 16) {
    // 8 groups of each row at a time (8 blocks, or 4 of two groups), transposed into the lanes
    const __m256 ov = _mm256_set1_ps(off);
    const int64_t per = 32 / G;  // groups per block
    for (; (b + 8 / per) <= nb; b += 8 / per) {
      const int64_t g = b * per;
      __m256 s[4], c[4], us[4], uc[4];
      for (int r = 0; r < 4; ++r) {
        if (!sc[r]) {
          s[r] = c[r] = _mm256_setzero_ps();
          continue;
        }
        s[r] = load8(sc[r] + g);
        c[r] = _mm256_fnmadd_ps(ov, s[r], mn[r] ? load8(mn[r] + g) : _mm256_setzero_ps());
      }
      transpose4x8(s, us);
      transpose4x8(c, uc);
      float* fb = f + b * 16;
      if (per == 1) {  // block b+i: u[i] low lane, block b+4+i: high lane, for both halves
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(fb + i * 16, _mm256_permute2f128_ps(us[i], us[i], 0x00));
          _mm256_storeu_ps(fb + i * 16 + 8, _mm256_permute2f128_ps(uc[i], uc[i], 0x00));
          _mm256_storeu_ps(fb + (i + 4) * 16, _mm256_permute2f128_ps(us[i], us[i], 0x11));
          _mm256_storeu_ps(fb + (i + 4) * 16 + 8, _mm256_permute2f128_ps(uc[i], uc[i], 0x11));
        }
      } else {  // groups 2b+j: block b (u0 | u1 low lanes), b+1 (u2 | u3), b+2, b+3 (high lanes)
        for (int i = 0; i < 2; ++i) {
          _mm256_storeu_ps(fb + i * 16, _mm256_permute2f128_ps(us[2 * i], us[2 * i + 1], 0x20));
          _mm256_storeu_ps(fb + i * 16 + 8, _mm256_permute2f128_ps(uc[2 * i], uc[2 * i + 1], 0x20));
          _mm256_storeu_ps(fb + (i + 2) * 16, _mm256_permute2f128_ps(us[2 * i], us[2 * i + 1], 0x31));
          _mm256_storeu_ps(fb + (i + 2) * 16 + 8, _mm256_permute2f128_ps(uc[2 * i], uc[2 * i + 1], 0x31));
        }
      }
    }
  }
  for (; b < nb; ++b)  // the rest one value at a time: the same values (fnmadd = fma(-off, s, min))
    for (int r = 0; r < 4; ++r)
      for (int half = 0; half < 2; ++half) {
        const int64_t g = G == 16 ? 2 * b + half : b * 32 / G;
        const float s = sc[r] ? to_float(sc[r][g]) : 0.f;
        const float m = mn[r] ? to_float(mn[r][g]) : 0.f;
        f[b * 16 + 4 * half + r] = s;
        f[b * 16 + 8 + 4 * half + r] = sc[r] ? std::fma(-off, s, m) : 0.f;
      }
}

// Prefetches of what a later step of a product of a few rows reads: per block, its share of up to
// three contiguous regions (the next quads' code rows, which follow these in memory, and their
// quad_scale_table entries; or later weight rows' codes, scales and mins: rows()), so that the
// short rows of such products (28 blocks at K = 896) do not wait on memory at the start of each
// step. Loads of no register: the results do not change.
struct Ahead {
  const char* p[3] = {nullptr, nullptr, nullptr};
  int64_t step[3] = {0, 0, 0};  // bytes per block
  inline void at(int64_t b) const {
    for (int i = 0; i < 3; ++i) {
      if (!p[i]) continue;
      const char* s = p[i] + b * step[i];
      const uintptr_t first = reinterpret_cast<uintptr_t>(s) & ~uintptr_t(63);
      for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(s + step[i]); a += 64)
        _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
    }
  }
  // weight rows n..n+count-1 of w (none where count <= 0): their packed codes, scales and mins,
  // a 1/parts share of each at every at(0..parts-1)
  template <typename S>
  static Ahead rows(const Packed& w, int64_t n, int64_t count, int64_t parts) {
    Ahead a;
    if (count <= 0) return a;
    const int64_t codes = count * w.row_bytes(), scales = count * w.groups * (int64_t)sizeof(S);
    a.p[0] = reinterpret_cast<const char*>(w.qs + n * w.row_bytes());
    a.step[0] = (codes + parts - 1) / parts;
    a.p[1] = static_cast<const char*>(w.scales) + n * w.groups * (int64_t)sizeof(S);
    a.step[1] = (scales + parts - 1) / parts;
    if (w.mins) {
      a.p[2] = static_cast<const char*>(w.mins) + n * w.groups * (int64_t)sizeof(S);
      a.step[2] = a.step[1];
    }
    return a;
  }
};

// quads ahead whose packed rows widen_tile() fetches while widening one (fetch: decode steps of
// 9-16 rows, whose weights stream from memory once; SmolLM2 at 16 rows on the AVX2 variant, three
// alternating pairs: 24.5-27.8 against 28.7-29.2 ms a step)
constexpr int64_t kAheadQuads = 4;

template <int BITS, typename S>
void widen_tile(const Packed& w, int64_t n0, int64_t rows, WeightTile& t, bool fetch = false) {
  const int64_t nb = w.K / 32, quads = (rows + 3) / 4;
  t.rows = rows;
  t.codes.resize(quads * nb * 128);
  t.factors.resize(quads * nb * 16);
  for (int64_t q = 0; q < quads; ++q) {
    const int64_t left = std::min<int64_t>(4, rows - 4 * q);
    // the packed rows, scales and mins of the quads kAheadQuads on, fetched while this one widens
    if (fetch) {
      const int64_t later = n0 + 4 * (q + kAheadQuads);
      Ahead::rows<S>(w, later, std::min<int64_t>(4, w.N - later), 1).at(0);
    }
    quad_factors<BITS, S>(w, n0 + 4 * q, left, t.factors.data() + q * nb * 16);
    for (int j = 0; j < 4; ++j) {
      uint8_t* c = t.codes.data() + q * nb * 128 + j * 32;
      if (j >= left) {  // padding of the last quad: zero codes (and zero factors)
        for (int64_t b = 0; b < nb; ++b) std::memset(c + b * 128, 0, 32);
        continue;
      }
      const uint8_t* p = w.qs + (n0 + 4 * q + j) * w.row_bytes();
      for (int64_t b = 0; b < nb; ++b) {
        if constexpr (BITS == 8) {
          std::memcpy(c + b * 128, p + b * 32, 32);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + b * 128), codes32<BITS, true>(p + b * 4 * BITS));
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

// The four code vectors of block b of a quad: from a widened tile (many activation rows), or
// unpacked from the packed rows in registers (a few: decode steps), the same bytes either way.
struct WidenedCodes {
  const uint8_t* codes;
  inline void load(int64_t b, __m256i w[4]) const {
    const __m256i* c = reinterpret_cast<const __m256i*>(codes + b * 128);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_loadu_si256(c + i);
  }
};

template <int BITS>
struct PackedCodes {
  const uint8_t* row[4];  // a quad's rows (a short last quad repeats a row; its factors are zero)
  inline void load(int64_t b, __m256i w[4]) const {
    for (int i = 0; i < 4; ++i) {
      if constexpr (BITS == 8) {
        w[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i] + b * 32));
      } else {
        w[i] = codes32<BITS, true>(row[i] + b * 4 * BITS);
      }
    }
  }
};

// the sums of each 4 products of unsigned bytes u and signed bytes s, in 32-bit lanes: exact
// either way (maddubs cannot saturate on the codes here, see quad_rows)
inline __m256i dot4(__m256i u, __m256i s, __m256i ones) {
#ifdef TIANXIA_VNNI
  (void)ones;
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);
#endif
}

// a 4x4 transpose-add of four products' 32-bit sums: lane j of the result sums p_j's lanes there
inline __m256i sum4x4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i e = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
  const __m256i o = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(e, o), _mm256_unpackhi_epi64(e, o));
}

// a quad's factors of block b, 16 floats a block as quad_factors() makes them
struct BlockFactors {
  const float* f;
  template <bool MINS>
  inline void load(int64_t b, __m256& sv, __m256& cv) const {
    sv = _mm256_loadu_ps(f + b * 16);
    if constexpr (MINS) cv = _mm256_loadu_ps(f + b * 16 + 8);
  }
};

// [v0..v3 | v0..v3] from 4 float32 or float16 values
inline __m256 load4x2(const float* p) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)); }
inline __m256 load4x2(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_castpd_si128(_mm_loaddup_pd(reinterpret_cast<const double*>(p))));
}

// a quad's factors of block b from its quad_scale_table() entry: the 4 rows' scales of the
// block's group (G16: of its low half's group, then of its high half's), then their mins where
// the weight has them; min - off * scale by the fma quad_factors() takes, so the same vectors
template <int BITS, typename S, bool G16, bool HAS_MINS>
struct TableFactors {
  const S* t;
  static constexpr int64_t kPerBlock = (G16 ? 8 : 4) * (HAS_MINS ? 2 : 1);
  template <bool MINS>
  inline void load(int64_t b, __m256& sv, __m256& cv) const {
    const S* p = t + b * kPerBlock;
    sv = G16 ? load8(p) : load4x2(p);
    if constexpr (MINS) {
      const __m256 m = HAS_MINS ? (G16 ? load8(p + 8) : load4x2(p + 4)) : _mm256_setzero_ps();
      cv = _mm256_fnmadd_ps(_mm256_set1_ps(kCodeOffset<BITS>), sv, m);
    }
  }
};

// acc[q][m]: rows m of the panel against Q quads of weight rows, over all blocks. The four maddubs
// products are folded (a 4x4 transpose-add in each lane: lane j of h sums p_j's values there)
// while still 16-bit where that cannot overflow: a pair sum is at most 2 * 127 * code, so four
// fit for codes up to 31 (4- and 5-bit: 31496 < 2^15) and two for 6-bit codes. Unpacking
// 32-bit units keeps each row's pair sums side by side, so one madd with ones finishes the fold
// (two for 6-bit codes) where each product took its own: 3-12% faster than four madds.
// MINS: the second multiply-add (weights with mins or offset codes; 8-bit codes without mins
// have none). This is the integer path's register tile: every product, of any number of rows,
// goes through it. Q = 2 (one or two activation rows) keeps two independent chains of
// multiply-adds in flight, where one would wait out their latency at every block; each quad's
// outputs take the same operations either way.
// Factors: where a quad's factors of block b come from (BlockFactors: made per call or per tile;
// TableFactors: a quad_scale_table, the rows' scales and mins as stored, with min - off * scale
// made here by the same fma).
template <int BITS, int MR, bool MINS, int Q, typename Codes, typename Factors>
inline void quad_rows(const Codes* codes, const Factors* factors, const uint8_t* panel, int64_t nb,
                      __m256 acc[Q][MR], const Ahead* ahead = nullptr) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int q = 0; q < Q; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, panel += kPanelBlock<MR>) {
    const float* d = reinterpret_cast<const float*>(panel + MR * 32);
    if (ahead) ahead->at(b);
    for (int q = 0; q < Q; ++q) {
      __m256i w[4];
      codes[q].load(b, w);
      __m256 sv, cv;
      factors[q].template load<MINS>(b, sv, cv);
      if constexpr (BITS == 8) {
        // signed codes: ggml's sign trick (|w| times x with w's sign), once per weight row and
        // activation row; a pair sum reaches 2 * 128 * 127, so each product is widened to 32
        // bits before the fold
        const __m256i a0 = _mm256_abs_epi8(w[0]), a1 = _mm256_abs_epi8(w[1]), a2 = _mm256_abs_epi8(w[2]),
                      a3 = _mm256_abs_epi8(w[3]);
        for (int m = 0; m < MR; ++m) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + m * 32));
          const __m256i p0 = dot4(a0, _mm256_sign_epi8(x, w[0]), ones);
          const __m256i p1 = dot4(a1, _mm256_sign_epi8(x, w[1]), ones);
          const __m256i p2 = dot4(a2, _mm256_sign_epi8(x, w[2]), ones);
          const __m256i p3 = dot4(a3, _mm256_sign_epi8(x, w[3]), ones);
          const __m256i h = sum4x4(p0, p1, p2, p3);
          acc[q][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sv, _mm256_set1_ps(d[m])), acc[q][m]);
          if constexpr (MINS) acc[q][m] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(d + MR + 8 * m), acc[q][m]);
        }
        continue;
      }
#ifdef TIANXIA_VNNI
      // vpdpbusd: each product's sums of 4 byte pairs in 32 bits in one instruction (no 16-bit
      // stage to fold or saturate), then the same 4x4 transpose-add; the same exact integers
      for (int m = 0; m < MR; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + m * 32));
        const __m256i p0 = dot4(w[0], x, ones), p1 = dot4(w[1], x, ones);
        const __m256i p2 = dot4(w[2], x, ones), p3 = dot4(w[3], x, ones);
        const __m256i h = sum4x4(p0, p1, p2, p3);
        acc[q][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sv, _mm256_set1_ps(d[m])), acc[q][m]);
        if constexpr (MINS) acc[q][m] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(d + MR + 8 * m), acc[q][m]);
      }
      continue;
#endif
      for (int m = 0; m < MR; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + m * 32));
        const __m256i p0 = _mm256_maddubs_epi16(w[0], x), p1 = _mm256_maddubs_epi16(w[1], x);
        const __m256i p2 = _mm256_maddubs_epi16(w[2], x), p3 = _mm256_maddubs_epi16(w[3], x);
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
        acc[q][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sv, _mm256_set1_ps(d[m])), acc[q][m]);
        if constexpr (MINS) acc[q][m] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(d + MR + 8 * m), acc[q][m]);
      }
    }
  }
}

// Activation rows per register tile: 8 where 32 vector registers hold their accumulators beside a
// quad's codes (AVX-512), else 4. Each output takes the same operations in either (the rows'
// accumulators are independent), so the bits are the same; 8 rows unpack or load each quad's codes
// half as often (Qwen2.5-0.5B's output head at 8 rows: 10.5 -> 7.7 ms).
#ifdef TIANXIA_VNNI
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif

// f(std::integral_constant<int, rows>) for the 1 .. kTileRows - 1 rows of a last, short tile
template <typename F>
inline void with_rest(int64_t rows, F&& f) {
  auto one = [&](auto r) {
    if constexpr (decltype(r)::value < kTileRows) f(r);
  };
  switch (rows) {
    case 1: return one(std::integral_constant<int, 1>{});
    case 2: return one(std::integral_constant<int, 2>{});
    case 3: return one(std::integral_constant<int, 3>{});
    case 4: return one(std::integral_constant<int, 4>{});
    case 5: return one(std::integral_constant<int, 5>{});
    case 6: return one(std::integral_constant<int, 6>{});
    case 7: return one(std::integral_constant<int, 7>{});
    default: return;
  }
}

// a quad's outputs for MR activation rows: lanes j and j + 4 of acc[m] added, then the bias
// (weight rows n..n+rows-1, rows <= 4)
template <int MR>
inline void store_quad(const __m256 acc[MR], int64_t rows, int64_t m0, int64_t n, const float* bias, float* out,
                       int64_t N) {
  const __m128 bv = bias && rows >= 4 ? _mm_loadu_ps(bias + n) : _mm_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    const __m128 v = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1)), bv);
    if (rows >= 4) {
      _mm_storeu_ps(out + (m0 + m) * N + n, v);
    } else {
      alignas(16) float r[4];
      _mm_store_ps(r, v);
      for (int j = 0; j < rows; ++j) out[(m0 + m) * N + n + j] = r[j] + (bias ? bias[n + j] : 0.f);
    }
  }
}

template <int BITS, int MR, bool MINS>
void tile_outputs(const WeightTile& t, const uint8_t* panel, int64_t nb, int64_t m0, int64_t n0, const float* bias,
                  float* out, int64_t N) {
  for (int64_t q = 0; q < (t.rows + 3) / 4; ++q) {
    __m256 acc[1][MR];
    const WidenedCodes codes{t.codes.data() + q * nb * 128};
    const BlockFactors factors{t.factors.data() + q * nb * 16};
    quad_rows<BITS, MR, MINS, 1>(&codes, &factors, panel, nb, acc);
    store_quad<MR>(acc[0], std::min<int64_t>(4, t.rows - 4 * q), m0, n0 + 4 * q, bias, out, N);
  }
}

#ifdef TIANXIA_VNNI
// Hexes: 16 weight rows widened so that each 4 codes of a row sit in that row's 32-bit lane, the
// layout of AMX's B tiles and of vpdpbusd on 512-bit vectors alike. One vpdpbusd with 4 of an
// activation row's bytes broadcast then adds 16 rows' sums of 4 products, each in its own lane:
// no transpose-add folds the sums (the quad tile spends 9 ops a block and row on it), and each
// weight vector serves every activation row of the panel. Per half block the lanes end with the
// same exact integers as the quad tile's, and the float steps are its own, per output and in the
// same order, so the outputs are the same bits (tests/test_cpu_isa.py). The AMX variant's tiles
// read the same layout.

// one block of 16 weight rows in tile layout: the two halves' B tiles, 4 x 64 bytes each
constexpr int64_t kHexCodes = 512;
// and its factors: the 16 rows' scales of the low half's group, of the high half's, then the
// same for min - off * scale (quad_factors' values, regrouped)
constexpr int64_t kHexFactors = 64;
// std::vector's storage at a cache line's start: the tiles' and the vector units' loads and
// stores of 64 bytes then never straddle two lines
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const LineAligned&) const { return true; }
  bool operator!=(const LineAligned&) const { return false; }
};
template <typename T>
using Lines = std::vector<T, LineAligned<T>>;

struct HexTile {
  Lines<uint8_t> codes;      // [hex][block][kHexCodes]
  Lines<float> factors;      // [hex][block][kHexFactors]
  std::vector<float> quads;  // quad_factors() of one hex's 4 quads
  int64_t rows = 0;
};

// r[i]: row i of an 8 x 8 matrix of 32-bit units, transposed in place
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

template <int BITS>
inline __m256i block_codes(const uint8_t* row, int64_t b) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
  } else {
    return codes32<BITS, true>(row + b * 4 * BITS);
  }
}

// hexes ahead whose packed rows widen_hexes() fetches while widening one (fetch: decode steps,
// whose weights stream from memory once)
constexpr int64_t kAheadHexes = 2;

// weight rows n0..n0+rows-1 in tile layout (missing rows of the last hex: zero codes and factors;
// UNSIGNED: 8-bit codes plus 128, for vpdpbusd's unsigned operand)
template <int BITS, typename S, bool UNSIGNED = false>
void widen_hexes(const Packed& w, int64_t n0, int64_t rows, HexTile& t, bool fetch = false) {
  const int64_t nb = w.K / 32, hexes = (rows + 15) / 16;
  t.rows = rows;
  t.codes.resize(hexes * nb * kHexCodes);
  t.factors.resize(hexes * nb * kHexFactors);
  t.quads.resize(4 * nb * 16);
  for (int64_t x = 0; x < hexes; ++x) {
    const int64_t left = std::min<int64_t>(16, rows - 16 * x), first = n0 + 16 * x;
    const uint8_t* row[16];
    for (int j = 0; j < 16; ++j) row[j] = j < left ? w.qs + (first + j) * w.row_bytes() : nullptr;
    uint8_t* c = t.codes.data() + x * nb * kHexCodes;
    const int64_t later = first + 16 * kAheadHexes;
    const Ahead ahead = fetch ? Ahead::rows<S>(w, later, std::min<int64_t>(16, w.N - later), nb) : Ahead{};
    for (int64_t b = 0; b < nb; ++b) {
      ahead.at(b);
      // 16 rows x 8 units of 4 codes, transposed: unit q of every row is B row q % 4 of half q / 4
      __m256i lo[8], hi[8];
      for (int j = 0; j < 8; ++j) {
        lo[j] = row[j] ? block_codes<BITS>(row[j], b) : _mm256_setzero_si256();
        hi[j] = row[8 + j] ? block_codes<BITS>(row[8 + j], b) : _mm256_setzero_si256();
      }
      if constexpr (UNSIGNED && BITS == 8)
        for (int j = 0; j < 8; ++j) {
          lo[j] = _mm256_xor_si256(lo[j], _mm256_set1_epi8(-128));
          hi[j] = _mm256_xor_si256(hi[j], _mm256_set1_epi8(-128));
        }
      transpose8x8(lo);
      transpose8x8(hi);
      __m256i* dst = reinterpret_cast<__m256i*>(c + b * kHexCodes);
      for (int q = 0; q < 8; ++q) {
        _mm256_storeu_si256(dst + 2 * q, lo[q]);
        _mm256_storeu_si256(dst + 2 * q + 1, hi[q]);
      }
    }
    // the factors as the register tile makes them, per quad: [scales lo | hi | offsets lo | hi]
    // of 4 rows per block, regrouped (a 4 x 4 transpose of 128-bit lanes) into 16 rows each
    for (int q = 0; q < 4; ++q)
      quad_factors<BITS, S>(w, std::min(first + 4 * q, w.N - 1), std::clamp<int64_t>(left - 4 * q, 0, 4),
                            t.quads.data() + q * nb * 16);
    float* f = t.factors.data() + x * nb * kHexFactors;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 v[4];
      for (int q = 0; q < 4; ++q) v[q] = _mm512_loadu_ps(t.quads.data() + q * nb * 16 + b * 16);
      const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
      const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
      _mm512_storeu_ps(f + b * kHexFactors, _mm512_shuffle_f32x4(t0, t2, 0x88));
      _mm512_storeu_ps(f + b * kHexFactors + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
      _mm512_storeu_ps(f + b * kHexFactors + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
      _mm512_storeu_ps(f + b * kHexFactors + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
    }
  }
}

// whether any activation code is -128: the register tiles' 8-bit products (ggml's sign trick)
// take -(-128) as -128 there, which exact products (the hexes', AMX's tiles') would not match.
// Only blocks whose scale is not finite or too small to invert round to -128 (infinities, NaN,
// values below about 4e-37); their 8-bit products go to the register tiles instead.
bool has_min_code(const Activations& a) {
  const int8_t* p = a.q8.data();
  const int64_t n = a.M * a.K;
  const __m512i lowest = _mm512_set1_epi8(-128);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    if (_mm512_cmpeq_epi8_mask(_mm512_loadu_si512(p + i), lowest)) return true;
  for (; i < n; ++i)
    if (p[i] == -128) return true;
  return false;
}

// 4 bytes at p in every 32-bit lane: a load that vpdpbusd takes as its broadcast operand
// (a copy through a general register, as memcpy gave, cost a shuffle each)
using Unaligned32 = int32_t __attribute__((may_alias, aligned(1)));
inline __m512i bytes4(const uint8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const Unaligned32*>(p)); }

// one half block of a hex against panel row m: acc = fma(sum, scale * d, acc), then
// acc = fma(offset, half sum, acc)
template <bool MINS>
inline __m512 hex_half(const __m512i w[4], __m512 s, __m512 o, const uint8_t* x, float d, const float* hs, __m512i h,
                       __m512 acc) {
  h = _mm512_dpbusd_epi32(h, w[0], bytes4(x));
  h = _mm512_dpbusd_epi32(h, w[1], bytes4(x + 4));
  h = _mm512_dpbusd_epi32(h, w[2], bytes4(x + 8));
  h = _mm512_dpbusd_epi32(h, w[3], bytes4(x + 12));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc);
  if constexpr (MINS) acc = _mm512_fmadd_ps(o, _mm512_set1_ps(*hs), acc);
  return acc;
}

// lo[m] / hi[m]: panel row m against the 16 weight rows of one hex, over all blocks, per half
// block as the quad tile makes them. 8-bit codes come plus 128, and each half block's sums start
// from -128 times the sum of its activation codes (start: per panel row, block and half, rows
// `stride` apart), so that they end exact as well
template <int MR, bool MINS>
inline void hex_rows(const uint8_t* codes, const float* factors, const uint8_t* panel, int64_t nb, __m512 lo[MR],
                     __m512 hi[MR], const int32_t* start = nullptr, int64_t stride = 0) {
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, panel += kPanelBlock<MR>, codes += kHexCodes, factors += kHexFactors) {
    const float* d = reinterpret_cast<const float*>(panel + MR * 32);
    const __m512i* c = reinterpret_cast<const __m512i*>(codes);
    __m512i w[4];
    for (int i = 0; i < 4; ++i) w[i] = _mm512_loadu_si512(c + i);
    __m512 s = _mm512_loadu_ps(factors), o = MINS ? _mm512_loadu_ps(factors + 32) : _mm512_setzero_ps();
    const auto from = [&](int m, int half) {
      return start ? _mm512_set1_epi32(start[m * stride + 2 * b + half]) : _mm512_setzero_si512();
    };
    for (int m = 0; m < MR; ++m)
      lo[m] = hex_half<MINS>(w, s, o, panel + m * 32, d[m], d + MR + 8 * m, from(m, 0), lo[m]);
    for (int i = 0; i < 4; ++i) w[i] = _mm512_loadu_si512(c + 4 + i);
    s = _mm512_loadu_ps(factors + 16);
    if constexpr (MINS) o = _mm512_loadu_ps(factors + 48);
    for (int m = 0; m < MR; ++m)
      hi[m] = hex_half<MINS>(w, s, o, panel + m * 32 + 16, d[m], d + MR + 8 * m + 4, from(m, 1), hi[m]);
  }
}

// (lo + hi) + bias into the outputs of weight rows n..n+cols-1 (one hex, cols <= 16), as
// store_quad() makes them: the weight's last quad, where short of 4 rows, adds 0 and then the bias
struct HexStore {
  __mmask16 valid, short_quad;
  __m512 whole_bias, short_bias;
  HexStore(int64_t n, int64_t cols, int64_t N, const float* bias) {
    valid = (__mmask16)((1u << cols) - 1);
    const int64_t whole_cols = std::clamp<int64_t>(N / 4 * 4 - n, 0, 16);
    const __mmask16 whole = (__mmask16)(valid & ((1u << whole_cols) - 1));
    short_quad = valid & ~whole;
    whole_bias = bias ? _mm512_maskz_loadu_ps(whole, bias + n) : _mm512_setzero_ps();
    short_bias = bias ? _mm512_maskz_loadu_ps(short_quad, bias + n) : _mm512_setzero_ps();
  }
  inline void at(__m512 lo_plus_hi, float* dst) const {
    __m512 v = _mm512_add_ps(lo_plus_hi, whole_bias);
    if (short_quad) v = _mm512_mask_add_ps(v, short_quad, v, short_bias);
    _mm512_mask_storeu_ps(dst, valid, v);
  }
};

template <int MR, bool MINS>
void hex_outputs(const HexTile& t, const uint8_t* panel, int64_t nb, int64_t m0, int64_t n0, const float* bias,
                 float* out, int64_t N, const int32_t* start) {
  for (int64_t x = 0; x < (t.rows + 15) / 16; ++x) {
    __m512 lo[MR], hi[MR];
    hex_rows<MR, MINS>(t.codes.data() + x * nb * kHexCodes, t.factors.data() + x * nb * kHexFactors, panel, nb, lo,
                       hi, start ? start + m0 * 2 * nb : nullptr, 2 * nb);
    const int64_t n = n0 + 16 * x;
    const HexStore store(n, std::min<int64_t>(16, t.rows - 16 * x), N, bias);
    for (int m = 0; m < MR; ++m) store.at(_mm512_add_ps(lo[m], hi[m]), out + (m0 + m) * N + n);
  }
}
#endif  // TIANXIA_VNNI

// how many steps ahead a product of a few rows fetches (Q5_0 896 x 896, one row, weights streaming:
// 1 step 1.53x of none, 2 steps 1.13x of 1, 4 steps the same as 2)
constexpr int64_t kAheadSteps = 2;

// Q quads (rows n..n+rows-1, rows <= 4Q) against one panel, their codes unpacked in registers;
// their factors from the weight's quad_scale_table (n a multiple of 4 there; a missing quad past
// the weight's last rows reads the table's zero padding), else made here. fetch: the first panel
// over these rows, which fetches the next steps' rows ahead (the later panels find them in L2;
// SmolLM2's 30 gate/up projections at 8 rows, weights streaming: 3.6-3.9 -> 3.0 ms)
template <int BITS, int MR, bool MINS, int Q, typename S>
void direct_quads(const Packed& w, int64_t n, int64_t rows, const uint8_t* panel, int64_t m0, const float* bias,
                  float* out, std::vector<float>& buffer, bool fetch) {
  const int64_t nb = w.K / 32;
  PackedCodes<BITS> codes[Q];
  for (int q = 0; q < Q; ++q) {
    const int64_t n0 = std::min(n + 4 * q, n + rows - 1);
    for (int j = 0; j < 4; ++j) codes[q].row[j] = w.qs + std::min(n0 + j, n + rows - 1) * w.row_bytes();
  }
  __m256 acc[Q][MR];
  auto from_table = [&](auto g16, auto has_mins) __attribute__((always_inline)) {
    using F = TableFactors<BITS, S, decltype(g16)::value, decltype(has_mins)::value>;
    F factors[Q];
    for (int q = 0; q < Q; ++q) factors[q].t = static_cast<const S*>(w.quad_scales) + (n / 4 + q) * nb * F::kPerBlock;
    if (fetch && n + (kAheadSteps + 1) * 4 * Q <= w.N) {
      // the code rows and table entries kAheadSteps steps on (4Q rows each), fetched ahead a
      // block's share at a time
      Ahead ahead;
      const int64_t rb = w.row_bytes(), skip = kAheadSteps * 4 * Q;
      ahead.p[0] = reinterpret_cast<const char*>(w.qs + (n + skip) * rb);
      ahead.step[0] = 4 * Q * rb / nb;
      ahead.p[1] = reinterpret_cast<const char*>(factors[0].t + skip / 4 * nb * F::kPerBlock);
      ahead.step[1] = Q * F::kPerBlock * sizeof(S);
      quad_rows<BITS, MR, MINS, Q>(codes, factors, panel, nb, acc, &ahead);
    } else {
      quad_rows<BITS, MR, MINS, Q>(codes, factors, panel, nb, acc);
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  if (w.quad_scales) {
    if (w.group == 16) {
      if (w.mins) from_table(T{}, T{});
      else from_table(T{}, F{});
    } else {
      if (w.mins) from_table(F{}, T{});
      else from_table(F{}, F{});
    }
  } else {
    buffer.resize(Q * nb * 16);
    BlockFactors factors[Q];
    for (int q = 0; q < Q; ++q) {
      const int64_t n0 = std::min(n + 4 * q, n + rows - 1), left = std::max<int64_t>(0, std::min<int64_t>(4, rows - 4 * q));
      quad_factors<BITS, S>(w, n0, left, buffer.data() + q * nb * 16);  // (a missing quad: zero factors)
      factors[q].f = buffer.data() + q * nb * 16;
    }
    quad_rows<BITS, MR, MINS, Q>(codes, factors, panel, nb, acc);
  }
  for (int q = 0; q < Q && 4 * q < rows; ++q)
    store_quad<MR>(acc[q], std::min<int64_t>(4, rows - 4 * q), m0, n + 4 * q, bias, out, w.N);
}

// weight rows n0..n1 against every panel of a few activation rows: two quads at a time for one
// or two rows (two chains of multiply-adds in flight), one for more
template <int BITS, bool MINS, typename S>
void direct_rows(const Packed& w, int64_t n0, int64_t n1, const uint8_t* panels, int64_t full, int64_t rest,
                 int64_t span, const float* bias, float* out, std::vector<float>& buffer) {
  constexpr int R = kTileRows;
  for (int64_t c = 0; c < full; ++c)
    for (int64_t n = n0; n < n1; n += 4)
      direct_quads<BITS, R, MINS, 1, S>(w, n, std::min<int64_t>(4, n1 - n), panels + c * span, R * c, bias, out, buffer,
                                        c == 0);
  with_rest(rest, [&](auto mr) {
    constexpr int MR = decltype(mr)::value, Q = MR <= 2 ? 2 : 1;
    for (int64_t n = n0; n < n1; n += 4 * Q)
      direct_quads<BITS, MR, MINS, Q, S>(w, n, std::min<int64_t>(4 * Q, n1 - n), panels + full * span, R * full, bias,
                                         out, buffer, full == 0);
  });
}

// Weight rows per tile of a product of many rows, a multiple of `multiple`: about kTileBytes of
// codes, which stays in L2 while every activation row passes over it, and at least 8 tiles per
// thread, taken in turn by whichever thread is free
inline int64_t tile_rows(int64_t N, int64_t K, int64_t threads, int64_t multiple) {
  constexpr int64_t kTileBytes = 96 << 10;
  const int64_t least = std::max<int64_t>(8 * threads, (N * K + kTileBytes - 1) / kTileBytes);
  return std::max<int64_t>(multiple, ((N + least - 1) / least + multiple - 1) / multiple * multiple);
}

// Up to this many activation rows each quad's codes are unpacked in registers for every panel;
// more widen tiles (hexes with AVX-512 VNNI) that every row then passes over. With the packed rows
// of the hexes ahead fetched while one widens, hexes took a decode step of 10-16 rows where
// weights stream from memory (AMD EPYC Zen 4, 2 threads: SmolLM2 at 16 rows 24-32 -> 18-26 ms,
// at 10 rows 22-23 -> 15-17 ms; Qwen2.5-0.5B at 16 rows 72 -> 41-56 ms, the same tokens), about
// level at 6-8 and slower at 4; a second panel of codes unpacked again costs more than widening.
constexpr int64_t kFewRows = 8;

// Up to this many activation rows a product's widening fetches the weight rows ahead of those it
// widens: such a step reads each weight once and waits on memory, while a prompt's rows pass over
// each widened tile many times, and the fetches did not pay there (SmolLM2, 2,048 rows)
constexpr int64_t kFetchRows = 16;

template <int BITS, bool MINS, typename S>
void product_as(const Packed& w, const Activations& a, const float* bias, float* out) {
  const int64_t N = w.N, K = w.K, M = a.M, nb = K / 32;
  // the activation panels, once per call: rows Rc..Rc+R-1 at c * nb * kPanelBlock<R>, then the
  // last 1..R-1 rows
  constexpr int R = kTileRows;
  const int64_t full = M / R, rest = M % R, span = nb * kPanelBlock<R>;
  thread_local std::vector<uint8_t> buffer;  // (a lambda would see its own thread's: use the pointer)
  buffer.resize(full * span + nb * kPanelBlock<R - 1>);
  uint8_t* const panels = buffer.data();
  at::parallel_for(0, full + (rest > 0), 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      if (c < full) pack_panel<R>(a, R * c, panels + c * span);
      else with_rest(rest, [&](auto mr) { pack_panel<decltype(mr)::value>(a, R * c, panels + c * span); });
    }
  });
  // Shares of weight rows go in turn to whichever thread is free, so a core slowed down by another
  // process takes fewer and neither waits long for the other at the end. Many rows: a share is a
  // tile (tile_rows); a few rows: about 8 shares per thread, a quad at a time.
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  if (M <= kFewRows) {
    const int64_t share = std::max<int64_t>(1, N / (8 * threads * 16)) * 16, shares = (N + share - 1) / share;
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      thread_local std::vector<float> factors;
      for (int64_t i; (i = next.fetch_add(1)) < shares;)
        direct_rows<BITS, MINS, S>(w, i * share, std::min(N, (i + 1) * share), panels, full, rest, span, bias, out,
                                   factors);
    });
    return;
  }
#ifdef TIANXIA_VNNI
  // Many rows widen hexes instead of quad tiles where the CPU has AVX-512 VNNI: 1.4x the prompt
  // tokens a second of SmolLM2 on an AMD EPYC of the Zen 4 generation, and the batched decode
  // steps of 9-16 rows (see kFewRows). Without the packed rows fetched ahead, such steps, whose
  // weights stream from memory, lost to the codes unpacked in registers.
  if (BITS != 8 || !has_min_code(a)) {
    // 8-bit codes: each half block's sum starts from -128 times the sum of its activation codes
    thread_local std::vector<int32_t> starts;
    if constexpr (BITS == 8) {
      starts.resize(M * 2 * nb);
      int32_t* const to = starts.data();  // (the workers' lambda would see their own: the pointer)
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t h = 0; h < 2 * nb; ++h) {
            const int8_t* x = a.q8.data() + m * K + 16 * h;
            int32_t sum = 0;
            for (int i = 0; i < 16; ++i) sum += x[i];
            to[m * 2 * nb + h] = -128 * sum;
          }
      });
    }
    const int32_t* start = BITS == 8 ? starts.data() : nullptr;
    const int64_t tile = tile_rows(N, K, threads, 16), tiles = (N + tile - 1) / tile;
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      thread_local HexTile t;
      for (int64_t i; (i = next.fetch_add(1)) < tiles;) {
        const int64_t n0 = i * tile;
        widen_hexes<BITS, S, true>(w, n0, std::min(tile, N - n0), t, M <= kFetchRows);
        for (int64_t c = 0; c < full; ++c)
          hex_outputs<R, MINS>(t, panels + c * span, nb, R * c, n0, bias, out, N, start);
        with_rest(rest, [&](auto mr) {
          hex_outputs<decltype(mr)::value, MINS>(t, panels + full * span, nb, R * full, n0, bias, out, N, start);
        });
      }
    });
    return;
  }
#endif
  const int64_t tile = tile_rows(N, K, threads, 4), tiles = (N + tile - 1) / tile;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local WeightTile t;
    for (int64_t i; (i = next.fetch_add(1)) < tiles;) {
      const int64_t n0 = i * tile;
      widen_tile<BITS, S>(w, n0, std::min(tile, N - n0), t, M <= kFetchRows);
      for (int64_t c = 0; c < full; ++c) tile_outputs<BITS, R, MINS>(t, panels + c * span, nb, R * c, n0, bias, out, N);
      with_rest(rest, [&](auto mr) {
        tile_outputs<BITS, decltype(mr)::value, MINS>(t, panels + full * span, nb, R * full, n0, bias, out, N);
      });
    }
  });
}

// Calls Kernel<BITS, MINS, S>::run for the weight's packed format: its bits, whether its blocks
// carry mins, and its scales' type (the one dispatch of this file's kernels and the AMX ones)
template <template <int, bool, typename> class Kernel>
void by_packed_format(const Packed& w, const Activations& a, const float* bias, float* out) {
  const auto with_scales = [&](auto scale) {
    using S = decltype(scale);
    switch (w.bits) {
      case 4: return Kernel<4, true, S>::run(w, a, bias, out);
      case 5: return Kernel<5, true, S>::run(w, a, bias, out);
      case 6: return Kernel<6, true, S>::run(w, a, bias, out);
      default:
        if (w.mins) return Kernel<8, true, S>::run(w, a, bias, out);
        return Kernel<8, false, S>::run(w, a, bias, out);
    }
  };
  if (w.half) {
    with_scales(uint16_t{});
  } else {
    with_scales(float{});
  }
}

template <int BITS, bool MINS, typename S>
struct Product {
  static void run(const Packed& w, const Activations& a, const float* bias, float* out) {
    product_as<BITS, MINS, S>(w, a, bias, out);
  }
};

// where a weight's quad scale table keeps its entries (counted in scales): per 32-value block of a
// quad, 4 scales per group (two groups of 16, or one group), then as many mins where it has them;
// one quad of padding past the last, since a two-quad step at the weight's end reads zeros there
struct QuadTableLayout {
  int64_t per_group, per_block, per_quad, entries;
};

QuadTableLayout quad_table_layout(const Packed& w) {
  const int64_t per_group = w.group == 16 ? 8 : 4, per_block = per_group * (w.mins ? 2 : 1);
  const int64_t per_quad = w.K / 32 * per_block;
  return {per_group, per_block, per_quad, ((w.N + 3) / 4 + 1) * per_quad};
}

template <typename S>
std::vector<uint8_t> scale_table_as(const Packed& w) {
  const int64_t nb = w.K / 32, quads = (w.N + 3) / 4, G = w.group;
  const QuadTableLayout l = quad_table_layout(w);
  const int64_t per_group = l.per_group, per_block = l.per_block, per_quad = l.per_quad;
  std::vector<uint8_t> bytes(l.entries * sizeof(S), 0);
  S* table = reinterpret_cast<S*>(bytes.data());
  for (int64_t q = 0; q < quads; ++q)
    for (int64_t r = 0; r < 4 && 4 * q + r < w.N; ++r) {
      const S* sc = w.scales_of<S>(4 * q + r);
      const S* mn = w.mins_of<S>(4 * q + r);
      for (int64_t b = 0; b < nb; ++b) {
        S* dst = table + q * per_quad + b * per_block;
        for (int64_t half = 0; half < (G == 16 ? 2 : 1); ++half) {
          const int64_t g = G == 16 ? 2 * b + half : b * 32 / G;
          dst[4 * half + r] = sc[g];
          if (mn) dst[per_group + 4 * half + r] = mn[g];
        }
      }
    }
  return bytes;
}

}  // namespace

#ifndef TIANXIA_VNNI  // (one definition, in the AVX2 build)
size_t quad_scale_table_bytes(const Packed& w) {
  if (!int8_path(w)) return 0;
  return quad_table_layout(w).entries * (w.half ? 2 : 4);
}

std::vector<uint8_t> quad_scale_table(const Packed& w) {
  if (!int8_path(w)) return {};
  return w.half ? scale_table_as<uint16_t>(w) : scale_table_as<float>(w);
}
#endif

#ifndef TIANXIA_AMX  // (gemm_int8_amx.cpp reuses the pieces above and has its own entry point)
#ifdef TIANXIA_VNNI
// the AVX-512 VNNI variant (gemm_int8_avx512.cpp compiles this file again under that target)
void int8_product_avx512(const Packed& w, const Activations& a, const float* bias, float* out) {
#else
void int8_product_avx512(const Packed& w, const Activations& a, const float* bias, float* out);
void int8_product_amx(const Packed& w, const Activations& a, const float* bias, float* out);

void int8_product(const Packed& w, const Activations& a, const float* bias, float* out) {
  if (use_amx(a.M)) return int8_product_amx(w, a, bias, out);
  if (use_avx512(a.M)) return int8_product_avx512(w, a, bias, out);
#endif
  TORCH_CHECK(int8_path(w) && a.K == w.K && (int64_t)a.sums.size() == a.M * (a.K / 16),
              "int8_product: 8-bit activation rows of the weight's length");
  by_packed_format<Product>(w, a, bias, out);
}
#endif

}  // namespace tianxia
