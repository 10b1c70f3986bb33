// KV cache rows in llama.cpp's Q8_0 and Q4_0 block formats (--kv-cache-dtype q8_0 / q4_0, llama.cpp's
// -ctk/-ctv): one head's row of D values (D a multiple of 32) is D/32 blocks of 32 values,
//   Q8_0: 34 bytes = float16 scale d, then 32 int8 codes q;             value = q * d
//   Q4_0: 18 bytes = float16 scale d, then 16 bytes of 4-bit codes q:   value = (q - 8) * d
//         (byte j holds value j in its low nibble and value j+16 in its high nibble).
// A row is quantized on its own, the same way whichever path writes it (the module path's
// quantize_kv, the fused decode step), and the attention reads the codes and widens them in
// registers: a token's K/V, and so its attention, do not depend on the batch, the chunking or a
// prefix-cache hit. The quantizers are ggml's reference ones (quantize_row_q8_0_ref /
// quantize_row_q4_0_ref), so the bytes equal the gguf package's.
#pragma once

#include "kernels.h"

namespace tianxia {

// byte-sized tags: a `const KvQ8_0*` points at the first byte of a row of Q8_0 blocks, so the
// attention's templates take block rows beside float32 (float) and float16 (uint16_t) rows
struct KvQ8_0 { uint8_t byte; };
struct KvQ4_0 { uint8_t byte; };

// one head's row of D values in a cache of T: elements (float, float16) or bytes (blocks)
template <typename T> inline int64_t kv_row_stride(int64_t D) { return D; }
template <> inline int64_t kv_row_stride<KvQ8_0>(int64_t D) { return D / 32 * 34; }
template <> inline int64_t kv_row_stride<KvQ4_0>(int64_t D) { return D / 32 * 18; }

inline float kv_scale(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, 2);
  return _cvtsh_ss(h);
}

// values c..c+7 of a row (c a multiple of 8), as floats
inline __m256 kv_load8(const float* row, int64_t c) { return _mm256_loadu_ps(row + c); }
inline __m256 kv_load8(const uint16_t* row, int64_t c) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m256 kv_load8(const KvQ8_0* row, int64_t c) {
  const uint8_t* b = &row->byte + c / 32 * 34;
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + c % 32));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(kv_scale(b)));
}
inline __m256 kv_load8(const KvQ4_0* row, int64_t c) {
  const uint8_t* b = &row->byte + c / 32 * 18;
  const int64_t j = c % 32;
  __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + (j & 15)));
  if (j >= 16) q = _mm_srli_epi16(q, 4);  // values 16..31: the high nibbles
  q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
  const __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_set1_ps(8.f));
  return _mm256_mul_ps(v, _mm256_set1_ps(kv_scale(b)));
}

// value d of a row
inline float kv_elem(const float* row, int64_t d) { return row[d]; }
inline float kv_elem(const uint16_t* row, int64_t d) { return _cvtsh_ss(row[d]); }
inline float kv_elem(const KvQ8_0* row, int64_t d) {
  const uint8_t* b = &row->byte + d / 32 * 34;
  return (float)(int8_t)b[2 + d % 32] * kv_scale(b);
}
inline float kv_elem(const KvQ4_0* row, int64_t d) {
  const uint8_t* b = &row->byte + d / 32 * 18;
  const int64_t j = d % 32;
  const int q = j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4);
  return (float)(q - 8) * kv_scale(b);
}

// n float32 values (a multiple of 32 for the block formats) into a cache row
inline void kv_store_row(const float* x, float* out, int64_t n) { std::memcpy(out, x, sizeof(float) * n); }
inline void kv_store_row(const float* x, uint16_t* out, int64_t n) {  // rounded to nearest even
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}
inline void kv_store_row(const float* x, KvQ8_0* out, int64_t n) {
  uint8_t* o = &out->byte;
  for (int64_t blk = 0; blk < n / 32; ++blk, x += 32, o += 34) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(o, &h, 2);
    for (int i = 0; i < 32; ++i) o[2 + i] = (uint8_t)(int8_t)std::roundf(x[i] * id);  // half away from 0
  }
}
inline void kv_store_row(const float* x, KvQ4_0* out, int64_t n) {
  uint8_t* o = &out->byte;
  for (int64_t blk = 0; blk < n / 32; ++blk, x += 32, o += 18) {
    float amax = 0.f, mx = 0.f;  // the value of largest magnitude, with its sign (the first such)
    for (int i = 0; i < 32; ++i)
      if (amax < std::fabs(x[i])) { amax = std::fabs(x[i]); mx = x[i]; }
    const float d = mx / -8.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(o, &h, 2);
    for (int j = 0; j < 16; ++j) {
      const int q0 = std::min(15, (int)(int8_t)(x[j] * id + 8.5f));
      const int q1 = std::min(15, (int)(int8_t)(x[j + 16] * id + 8.5f));
      o[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
  }
}

// sum_i row[i] * b[i]: float32 and float16 rows through dot_mixed (their sums as before), block rows
// 8 values at a time the same way
inline float kv_dot(const float* row, const float* b, int64_t n) { return dot_mixed(row, b, n); }
inline float kv_dot(const uint16_t* row, const float* b, int64_t n) { return dot_mixed(row, b, n); }
template <typename T>
inline float kv_dot(const T* row, const float* b, int64_t n) {  // n a multiple of 32
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(kv_load8(row, i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

}  // namespace tianxia
