// Shared pieces of the CPU kernels (x86, AVX2 + FMA): the packed weight view and the products of
// a few activation rows with it, used by the torch-facing ops (bindings.cpp) and by the fused
// decode step (decoder.cpp).
//
// Packed formats, all "w = q * scale + min" per group of consecutive elements of a row:
//   bits=4:  qs [N, K/2] uint8, groups of 32; in group g of a row, byte j holds element j in its
//            low nibble and element j+16 in its high nibble (ggml's Q4_0/Q4_1 layout), codes 0..15;
//   bits=5:  qs [N, K*5/8], 20 bytes per 32 elements: their low 4 bits as in bits=4, then 4 bytes
//            whose byte j bit i is bit 4 of element 4i+j; codes are those 5 bits minus 16;
//   bits=6:  qs [N, K*3/4], 24 bytes per 32 elements: the low 4 bits as in bits=4, then 8 bytes
//            whose byte j bits 2i..2i+1 are bits 4..5 of element 8i+j; codes are those 6 bits - 32;
//            groups of 16 or 32;
//   bits=8:  qs [N, K] int8, groups of `group` (a multiple of 16);
//   bits=32: qs [N, K] float32, no scales (plain float weights in the fused decode step);
//   bits=16: qs [N, K] float16, no scales (LoRA adapters over a packed model: half the bytes of
//            float32, widened exactly to float32 in registers, so a product equals the float32
//            product with the float16 values).
// scales and mins are [N, K/group] float16 or float32 (the same for both); mins may be absent
// (w = q * scale). fp16 keeps ggml's own scales at their stored size where they are exact in it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tianxia {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t i = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

// e^x for 8 floats (Cephes' expf: a degree-6 polynomial on [-ln2/2, ln2/2] times 2^n; about 1 ulp),
// where std::exp one value at a time took a large share of a batched decode step
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline void widen_q8x16(const int8_t* p, __m256 w[2]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

// the 32 codes of one block of a 4-, 5- or 6-bit row (see the formats above) as bytes in
// element order: unsigned 0..15 for bits=4, signed for 5 and 6 (or, with UNSIGNED, their stored
// bits: 0..31 and 0..63)
template <int BITS, bool UNSIGNED = false>
inline __m256i codes32(const uint8_t* p) {
  // the 16 bytes in both lanes (a broadcast load), the high lane shifted down a nibble: one shift
  // and one mask, where two masks, a shift and an insert took the low and high nibbles apart
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
  if constexpr (BITS == 4) {
    return lo;
  } else if constexpr (BITS == 5) {
    uint32_t h;
    std::memcpy(&h, p + 16, 4);
    __m256i hb = _mm256_srlv_epi32(_mm256_set1_epi32((int)h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    hb = _mm256_and_si256(hb, _mm256_set1_epi8(1));
    const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    return UNSIGNED ? u : _mm256_sub_epi8(u, _mm256_set1_epi8(16));
  } else {
    static_assert(BITS == 6);
    int64_t h;
    std::memcpy(&h, p + 16, 8);
    __m256i hb = _mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_setr_epi64x(0, 2, 4, 6));
    hb = _mm256_and_si256(hb, _mm256_set1_epi8(3));
    const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    return UNSIGNED ? u : _mm256_sub_epi8(u, _mm256_set1_epi8(32));
  }
}

// the 32 codes of one block of a 4-, 5- or 6-bit row as 4 x 8 floats, in element order
inline void widen_block(int64_t bits, const uint8_t* p, __m256 w[4]) {
  const __m256i q = bits == 4 ? codes32<4>(p) : bits == 5 ? codes32<5>(p) : codes32<6>(p);
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

// the offset that 5- and 6-bit codes keep when they stay unsigned (their stored bits): 16 and 32
template <int BITS>
constexpr float kCodeOffset = BITS == 5 ? 16.f : BITS == 6 ? 32.f : 0.f;

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return _cvtsh_ss(v); }

// 8 floats from float32 or float16 (widened with F16C) memory
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const uint16_t* p) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// sum_i a[i] * b[i] with a's float16 or float32 values (for float32, the same sums as dot)
template <typename S>
inline float dot_mixed(const S* a, const float* b, int64_t n) {
  int64_t i = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += to_float(a[i]) * b[i];
  return s;
}

struct Packed {
  const uint8_t* qs = nullptr;
  const void* scales = nullptr;  // float16 (half) or float32 [N, groups]
  const void* mins = nullptr;    // like scales; nullptr: no offsets
  bool half = false;
  int64_t bits = 0, group = 0, K = 0, N = 0, groups = 0;
  // The scales and mins per quad of rows and block (quad_scale_table), laid out once where a
  // weight is held for many products (the fused decode step); nullptr: gathered at each product
  const void* quad_scales = nullptr;
  bool is_float() const { return bits == 32 || bits == 16; }  // plain float weights, no scales
  int64_t row_bytes() const { return K * bits / 8; }
  template <typename S>
  const S* scales_of(int64_t n) const { return static_cast<const S*>(scales) + n * groups; }
  template <typename S>
  const S* mins_of(int64_t n) const { return mins ? static_cast<const S*>(mins) + n * groups : nullptr; }
};

// A packed weight from its tensors (checked); bits=32 takes a float32 [N, K] matrix as qs.
Packed unpack(const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
              int64_t group);

// ---- products with a weight: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) ----
//
// Every product computes each output (m, n) by one fixed sequence of float operations that
// depends only on x's row m, w's row n and the weight's layout: not on the number of rows M, on
// the rows beside m, on which thread takes row n, nor on the register tile that computes it. A
// token's row is therefore the same in a prompt of any length, in a decode step of any batch,
// chunked or not, and the prompt and decode paths agree bit for bit. Threads split the weight
// rows, never K. The register tiles are the inner loops a per-ISA variant replaces (they must
// keep these operation sequences):
//
// Float path (float32 activations, float32 weights): w dequantized with one rounding,
// fma(q, scale, min) (float16 weights: widened, which is exact); per output one chain of 8-lane fmas over k ascending (lane j: k = j mod 8),
// then hsum, then the K % 8 tail by scalar fmas, then + bias.
// Integer path (8-bit activations, K a multiple of 32): per output and block of 32, the exact
// integer dot products of its two halves with the 8-bit codes, and per half one chain over the
// blocks: acc = fma(dot, scale * act_scale, acc); acc = fma(min - off * scale, act_half_sum, acc)
// (the second only where the weight has mins or offset codes); then (lo + hi) + bias.

// Activation rows rounded for the integer path: 8-bit codes with one scale per 32 values and the
// sums of each 16 rounded values (for the weights' mins and code offsets)
struct Activations {
  const float* x = nullptr;
  int64_t M = 0, K = 0;
  std::vector<int8_t> q8;    // [M, K]
  std::vector<float> d8;     // [M, K / 32]
  std::vector<float> sums;   // [M, K / 16]
  void prepare(const float* rows, int64_t m, int64_t k);  // k a multiple of 32
};

// Whether products with `w` take the integer path when the activations are 8-bit.
bool int8_path(const Packed& w);

// out = x w^T (+ bias) for M rows of x: the integer path with int8 (where int8_path(w); `a` holds
// the rounded rows), else the float path
void product_rows(const Packed& w, const float* x, int64_t M, bool int8, const float* bias, float* out,
                  Activations& a);

// the float path (kernels.cpp) and the integer path (gemm_int8.cpp, `a` prepared), any M
void float_product(const Packed& w, const float* x, int64_t M, const float* bias, float* out);
void int8_product(const Packed& w, const Activations& a, const float* bias, float* out);
// w's scales and mins in the order a decode step's products read them: per quad of rows and block,
// the 4 rows' scales of the block's group (groups of 16: of each half's), then their mins where w
// has them, as stored (float16 or float32), so no larger than w's own; the products make the
// same factors from them bit for bit. Bytes; empty where w takes the float path.
std::vector<uint8_t> quad_scale_table(const Packed& w);
size_t quad_scale_table_bytes(const Packed& w);

// row n of w dequantized into dst[K] as the float path sees it
void dequant_row(const Packed& w, int64_t n, float* dst);

// ---- run-time instruction-set dispatch (isa.cpp) ----
//
// The build carries the AVX2 kernels and, for the integer path, an AVX-512 VNNI variant
// (gemm_int8_avx512.cpp) and an AMX-INT8 one (gemm_int8_amx.cpp) with the same operation
// sequences per output: all give the same bits, so the choice (per call, by the number of
// activation rows) changes speed only.
enum CpuIsa : int { kIsaAvx2 = 0, kIsaAvx512 = 1, kIsaAmx = 2 };
int best_cpu_isa();  // by CPUID (and, for AMX, the OS's permission for tile data, requested here)
// clamped to best_cpu_isa(); min_rows / amx_min_rows < 0 keep the thresholds
int set_cpu_isa(int isa, int64_t min_rows, int64_t amx_min_rows = -1);
int cpu_isa();
int64_t avx512_min_rows();
int64_t amx_min_rows();
bool use_avx512(int64_t rows);                 // whether a product of `rows` rows takes AVX-512
bool use_amx(int64_t rows);                    // whether it takes AMX
bool amx_built();                              // whether the compiler built the AMX variant

// ---- the float32 ops of a decode step, on raw rows ----

// out = rmsnorm(x (+ res)) * (offset + w) over T rows of H; with res, sum_out gets x + res
void rms_norm_rows(const float* x, const float* res, float* sum_out, float* out, const float* w,
                   int64_t T, int64_t H, float eps, float offset);

// in-place RoPE of T tokens: q has Hq heads, k Hk heads of D floats (row strides sq, sk), rotated
// over the first rd dims from the [*, rd] cos|sin table rows pos[t]
void rope_rows(float* q, int64_t sq, int64_t Hq, float* k, int64_t sk, int64_t Hk, int64_t D,
               const int64_t* pos, int64_t T, const float* cos_sin, int64_t rd, bool interleaved);

// out[t, i] = act(x[t, i]) * x[t, I + i] over T rows of 2I: SiLU, or tanh-GELU with gelu
void gated_act_rows(const float* x, float* out, int64_t T, int64_t I, bool gelu);

// attention of B query tokens (q rows of Hq*D floats, stride sq), each over the first seq_lens[b]
// positions of its sequence's paged K/V (caches [blocks, bs, Hk, D] of float32 or float16, T =
// float or uint16_t; block table row seq_of[b], or b where seq_of is null): a decode step's
// queries, or a prompt's one position at a time, by the same operations. out rows of Hq*D floats
// (stride so)
template <typename T>
void paged_decode_rows(const float* q, int64_t sq, float* out, int64_t so, const T* k_cache, const T* v_cache,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens, const int64_t* seq_of,
                       int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, float scale, int64_t window,
                       float softcap);

}  // namespace tianxia
