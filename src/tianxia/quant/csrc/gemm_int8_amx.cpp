// The integer path for AMX-INT8 (Intel Sapphire Rapids and later): the tiles compute every
// half block's exact integer dot products (TDPBSUD: signed activation bytes times unsigned codes;
// TDPBSSD for signed 8-bit codes), 16 activation rows by 16 weight rows an instruction, and the
// float steps around them are those of gemm_int8.cpp's register tile, per output, in the same
// order and on the same operands:
//   per half block: acc = fma(dot, scale * act_scale, acc); acc = fma(min - off * scale, half_sum, acc)
//   then (lo + hi) + bias.
// Integer sums are exact whichever unit makes them, so every output is bit for bit the AVX2 and
// AVX-512 one, whatever the number of rows or the split between variants.
//
// A tile's K is one half block (16 bytes), not the 64 it can take: the halves' scales differ, so
// their sums cannot be added in integers, and every 256 sums of a C tile are stored and taken up
// by the float steps (a convert, a multiply and two fmas per 16). The tile unit's product and
// store of a C tile and the vector units' float steps on one take about as long, so the kernel
// interleaves them (pairs_outputs); on 2 cores of a Xeon it ran 1.3-2.1x the AVX-512 VNNI
// variant from 16 rows (benchmarks/cpu_isa_ab.py --shapes).
//
// Layout: A (activations, 16 rows x 16 bytes) is read straight from the 8-bit rows (stride K);
// B (weights, 4 rows of 64 bytes: row r holds, for each of 16 weight rows, bytes 4r..4r+3 of the
// half block; widen_hexes in gemm_int8.cpp, the AVX-512 variant's layout too) is widened once per
// tile of weight rows, which stays in L2 while every group of 16 activation rows passes over it;
// C is 16 activation rows x 16 weight rows of int32, stored and taken up by the float steps in
// chunks of blocks.
//
// Compiled like gemm_int8_avx512.cpp: the target pragma covers this file's own code only, after
// every header, so the library still loads and runs on CPUs without AMX or AVX-512.
#include "kernels.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <new>

// compilers that know the AMX target (GCC 11, clang 12); older ones build the rest without it
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define TIANXIA_AMX_BUILT 1
#endif

#ifndef TIANXIA_AMX_BUILT
namespace tianxia {
bool amx_built() { return false; }
void int8_product_avx512(const Packed& w, const Activations& a, const float* bias, float* out);
void int8_product_amx(const Packed& w, const Activations& a, const float* bias, float* out) {
  int8_product_avx512(w, a, bias, out);
}
}  // namespace tianxia
#else

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")
#define TIANXIA_VNNI 1
#define TIANXIA_AMX 1
#include "gemm_int8.cpp"

namespace tianxia {

void int8_product_avx512(const Packed& w, const Activations& a, const float* bias, float* out);

namespace {

// blocks per chunk of C tiles that the tiles make while the float steps take up the chunk before
constexpr int64_t kChunk = 2;
// int32 per block of a chunk: 2 halves x 4 C tiles x 16 x 16
constexpr int64_t kBlockInts = 2 * 4 * 256;

// palette 1: C tiles 0-3 (16 rows x 16 int32: 2 groups of activation rows by 2 of weight rows),
// A tiles 4-5 (16 rows x 16 bytes), B tiles 6-7 (4 rows x 64 bytes); four independent C tiles
// keep the tile unit busy where one waited out each product's latency. Each thread that runs
// tile instructions loads the configuration (its state is per thread).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 16, 16, 64, 64}, {16, 16, 16, 16, 16, 16, 4, 4}};
static_assert(sizeof(TileConfig) == 64);

// The activation rows by groups of 16 as the tiles and the float steps read them: each group's
// 8-bit rows (the last one padded with zero rows to the 16 an A tile loads), and per group and
// block its 16 rows' scales, low half sums and high half sums (48 floats: one pointer reaches
// every row's, where a pointer per row ran the float steps out of registers)
struct Groups {
  int64_t M = 0, K = 0;
  std::vector<const int8_t*> q8;
  Lines<int8_t> padded;
  Lines<float> factors;
  void prepare(const Activations& a) {
    M = a.M;
    K = a.K;
    const int64_t nb = K / 32, groups = (M + 15) / 16, whole = M / 16;
    padded.assign(whole < groups ? 16 * K : 0, 0);
    if (whole < groups) std::memcpy(padded.data(), a.q8.data() + whole * 16 * K, (M - whole * 16) * K);
    q8.resize(groups);
    for (int64_t g = 0; g < groups; ++g) q8[g] = g < whole ? a.q8.data() + g * 16 * K : padded.data();
    factors.assign(groups * nb * 48, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        float* f = factors.data() + ((m / 16) * nb + b) * 48 + m % 16;
        f[0] = a.d8[m * nb + b];
        f[16] = a.sums[m * 2 * nb + 2 * b];
        f[32] = a.sums[m * 2 * nb + 2 * b + 1];
      }
  }
};

// The float steps of R activation rows (m..m+R-1 of a group) against one hex over blocks b0..b1:
// its C tiles at c ([block][half][4 tiles][row][16]), the group's activation factors at s
// ([block][scales, low half sums, high half sums][16 rows]), the running sums in acc ([row][half][16]).
template <int R, bool MINS>
inline void float_steps(const int32_t* c, const float* f, int64_t b0, int64_t b1, const float* s, int64_t m,
                        float* acc) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    if (b0 == 0) {
      lo[r] = hi[r] = _mm512_setzero_ps();
    } else {
      lo[r] = _mm512_loadu_ps(acc + (m + r) * 32);
      hi[r] = _mm512_loadu_ps(acc + (m + r) * 32 + 16);
    }
  }
  for (int64_t b = b0; b < b1; ++b) {
    const float* fb = f + b * kHexFactors;
    const __m512 slo = _mm512_loadu_ps(fb), shi = _mm512_loadu_ps(fb + 16);
    const int32_t* cb = c + (b - b0) * kBlockInts;
    const float* sb = s + b * 48 + m;
    for (int r = 0; r < R; ++r) {
      const int64_t row = m + r;
      const __m512 d = _mm512_set1_ps(sb[r]);
      const __m512 xlo = _mm512_cvtepi32_ps(_mm512_loadu_si512(cb + row * 16));
      const __m512 xhi = _mm512_cvtepi32_ps(_mm512_loadu_si512(cb + kBlockInts / 2 + row * 16));
      lo[r] = _mm512_fmadd_ps(xlo, _mm512_mul_ps(slo, d), lo[r]);
      hi[r] = _mm512_fmadd_ps(xhi, _mm512_mul_ps(shi, d), hi[r]);
      if constexpr (MINS) {
        lo[r] = _mm512_fmadd_ps(_mm512_loadu_ps(fb + 32), _mm512_set1_ps(sb[16 + r]), lo[r]);
        hi[r] = _mm512_fmadd_ps(_mm512_loadu_ps(fb + 48), _mm512_set1_ps(sb[32 + r]), hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + (m + r) * 32, lo[r]);
    _mm512_storeu_ps(acc + (m + r) * 32 + 16, hi[r]);
  }
}

// the tiles' products of block b's half h into c (layout as float_steps reads it): NG groups of
// 16 activation rows (8-bit codes at q8[g], stride K) by NX hexes (codes at w[x])
template <int BITS, int NG, int NX>
inline void tile_step(const int8_t* const q8[2], const uint8_t* const w[2], int64_t K, int64_t b, int h, int32_t* c) {
  _tile_loadd(4, q8[0] + b * 32 + h * 16, K);
  if constexpr (NG == 2) _tile_loadd(5, q8[1] + b * 32 + h * 16, K);
  _tile_loadd(6, w[0] + b * kHexCodes + h * 256, 64);
  if constexpr (NX == 2) _tile_loadd(7, w[1] + b * kHexCodes + h * 256, 64);
  _tile_zero(0);
  if constexpr (NX == 2) _tile_zero(1);
  if constexpr (NG == 2) _tile_zero(2);
  if constexpr (NG == 2 && NX == 2) _tile_zero(3);
  if constexpr (BITS == 8) {
    _tile_dpbssd(0, 4, 6);
    if constexpr (NX == 2) _tile_dpbssd(1, 4, 7);
    if constexpr (NG == 2) _tile_dpbssd(2, 5, 6);
    if constexpr (NG == 2 && NX == 2) _tile_dpbssd(3, 5, 7);
  } else {
    _tile_dpbsud(0, 4, 6);
    if constexpr (NX == 2) _tile_dpbsud(1, 4, 7);
    if constexpr (NG == 2) _tile_dpbsud(2, 5, 6);
    if constexpr (NG == 2 && NX == 2) _tile_dpbsud(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  if constexpr (NX == 2) _tile_stored(1, c + 256, 64);
  if constexpr (NG == 2) _tile_stored(2, c + 512, 64);
  if constexpr (NG == 2 && NX == 2) _tile_stored(3, c + 768, 64);
}

// (lo + hi) + bias into out for groups g0.. (NG) by hexes x0.. (NX) of the tile t (HexStore)
template <int NG, int NX>
void store_pair(const HexTile& t, const Groups& a, int64_t g0, int64_t x0, int64_t n0, const float* bias, float* out,
                int64_t N, const float* acc) {
  for (int x = 0; x < NX; ++x) {
    const int64_t n = n0 + 16 * (x0 + x);
    const HexStore store(n, std::min<int64_t>(16, t.rows - 16 * (x0 + x)), N, bias);
    for (int g = 0; g < NG; ++g) {
      const int64_t m0 = 16 * (g0 + g), rows = std::min<int64_t>(16, a.M - m0);
      const float* ax = acc + (2 * g + x) * 16 * 32;
      for (int64_t m = 0; m < rows; ++m)
        store.at(_mm512_add_ps(_mm512_loadu_ps(ax + m * 32), _mm512_loadu_ps(ax + m * 32 + 16)), out + (m0 + m) * N + n);
    }
  }
}

// Pairs of (groups g0.., hexes x0..) of one shape (NG groups of activation rows by NX hexes of
// the tile t), each over its blocks a chunk at a time: the tiles make the next chunk (of this pair
// or the next) a step at a time between the float steps of this one, so that the tile unit works
// while the vector units do. (Issued as a whole before them, the float steps waited in the
// reorder buffer behind the tiles' long latencies.)
template <int BITS, bool MINS, int NG, int NX>
void pairs_outputs(const HexTile& t, const Groups& a, const std::vector<std::pair<int64_t, int64_t>>& pairs,
                   int64_t n0, const float* bias, float* out, int64_t N, int32_t* ibuf, float* acc) {
  const int64_t K = a.K, nb = K / 32, chunks = (nb + kChunk - 1) / kChunk, items = (int64_t)pairs.size() * chunks;
  struct Job {
    const int8_t* q8[2];
    const uint8_t* w[2];
    int64_t b0 = 0, steps = 0;
    int32_t* c = nullptr;
    void step(int64_t k, int64_t K) const {
      tile_step<BITS, NG, NX>(q8, w, K, b0 + k / 2, k % 2, c + (k / 2) * kBlockInts + (k % 2) * (kBlockInts / 2));
    }
  };
  auto job = [&](int64_t j) {
    Job o;
    if (j >= items) return o;
    const auto [g0, x0] = pairs[j / chunks];
    o.q8[0] = a.q8[g0], o.q8[1] = a.q8[g0 + NG - 1];
    o.w[0] = t.codes.data() + x0 * nb * kHexCodes, o.w[1] = t.codes.data() + (x0 + NX - 1) * nb * kHexCodes;
    o.b0 = j % chunks * kChunk;
    o.steps = 2 * (std::min(nb, o.b0 + kChunk) - o.b0);
    o.c = ibuf + (j & 1) * kChunk * kBlockInts;
    return o;
  };
  Job next = job(0);
  for (int64_t k = 0; k < next.steps; ++k) next.step(k, K);
  for (int64_t j = 0; j < items; ++j) {
    const auto [g0, x0] = pairs[j / chunks];
    const int64_t b0 = j % chunks * kChunk, b1 = std::min(nb, b0 + kChunk);
    const int32_t* c = ibuf + (j & 1) * kChunk * kBlockInts;
    next = job(j + 1);  // its tile steps spread over this item's NG * NX float parts
    int64_t k = 0;
    for (int part = 0; part < NG * NX; ++part) {
      for (; k * NG * NX < (part + 1) * next.steps; ++k) next.step(k, K);
      const int g = part / NX, x = part % NX;
      const int64_t rows = std::min<int64_t>(16, a.M - 16 * (g0 + g));
      const float* sg = a.factors.data() + (g0 + g) * nb * 48;
      const int32_t* cx = c + (2 * g + x) * 256;
      const float* f = t.factors.data() + (x0 + x) * nb * kHexFactors;
      float* ax = acc + (2 * g + x) * 16 * 32;
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4) float_steps<4, MINS>(cx, f, b0, b1, sg, m, ax);
      for (; m < rows; ++m) float_steps<1, MINS>(cx, f, b0, b1, sg, m, ax);
    }
    if (b1 == nb) store_pair<NG, NX>(t, a, g0, x0, n0, bias, out, N, acc);
  }
}

// every group of activation rows against the tile t (weight rows n0..), by pairs of groups and
// pairs of hexes (four C tiles), the odd group or hex left over by pairs of two C tiles or one
template <int BITS, bool MINS>
void tile_outputs_amx(const HexTile& t, const Groups& a, int64_t n0, const float* bias, float* out, int64_t N,
                      int32_t* ibuf, float* acc) {
  const int64_t groups = (a.M + 15) / 16, hexes = (t.rows + 15) / 16;
  thread_local std::vector<std::pair<int64_t, int64_t>> pairs[4];  // by shape: 2x2, 2x1, 1x2, 1x1
  for (auto& p : pairs) p.clear();
  for (int64_t g = 0; g < groups; g += 2)
    for (int64_t x = 0; x < hexes; x += 2) pairs[(g + 1 < groups ? 0 : 2) + (x + 1 < hexes ? 0 : 1)].emplace_back(g, x);
  if (!pairs[0].empty()) pairs_outputs<BITS, MINS, 2, 2>(t, a, pairs[0], n0, bias, out, N, ibuf, acc);
  if (!pairs[1].empty()) pairs_outputs<BITS, MINS, 2, 1>(t, a, pairs[1], n0, bias, out, N, ibuf, acc);
  if (!pairs[2].empty()) pairs_outputs<BITS, MINS, 1, 2>(t, a, pairs[2], n0, bias, out, N, ibuf, acc);
  if (!pairs[3].empty()) pairs_outputs<BITS, MINS, 1, 1>(t, a, pairs[3], n0, bias, out, N, ibuf, acc);
}

template <int BITS, bool MINS, typename S>
void amx_product_as(const Packed& w, const Activations& a, const float* bias, float* out) {
  const int64_t N = w.N, K = w.K, M = a.M;
  thread_local Groups mine;  // (the workers' lambda would see their own: use the reference)
  const Groups& groups = mine;
  mine.prepare(a);
  // shares of weight rows as in product_as: tiles in multiples of 16 rows
  const int64_t threads = at::get_num_threads();
  const int64_t tile = tile_rows(N, K, threads, 16), tiles = (N + tile - 1) / tile;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    _tile_loadconfig(&kTileConfig);
    thread_local HexTile t;
    thread_local Lines<int32_t> ibuf(2 * kChunk * kBlockInts);
    thread_local Lines<float> acc(4 * 16 * 32);
    for (int64_t i; (i = next.fetch_add(1)) < tiles;) {
      const int64_t n0 = i * tile;
      widen_hexes<BITS, S>(w, n0, std::min(tile, N - n0), t);
      // (GCC's tile loads do not tell the compiler that they read memory: the widened codes
      // must be stored before them)
      __asm__ volatile("" ::: "memory");
      tile_outputs_amx<BITS, MINS>(t, groups, n0, bias, out, N, ibuf.data(), acc.data());
    }
    _tile_release();
  });
}

template <int BITS, bool MINS, typename S>
struct AmxProduct {
  static void run(const Packed& w, const Activations& a, const float* bias, float* out) {
    amx_product_as<BITS, MINS, S>(w, a, bias, out);
  }
};

}  // namespace

// the AMX variant of int8_product (which calls it where use_amx(), isa.cpp)
void int8_product_amx(const Packed& w, const Activations& a, const float* bias, float* out) {
  TORCH_CHECK(int8_path(w) && a.K == w.K && (int64_t)a.sums.size() == a.M * (a.K / 16),
              "int8_product: 8-bit activation rows of the weight's length");
  if (w.bits == 8 && has_min_code(a)) return int8_product_avx512(w, a, bias, out);
  by_packed_format<AmxProduct>(w, a, bias, out);
}

bool amx_built() { return true; }

}  // namespace tianxia

#pragma GCC pop_options
#endif  // TIANXIA_AMX_BUILT
