// The integer path again, compiled for AVX-512 F/BW/VL + VNNI (vpdpbusd): the same register tiles
// and operation sequences as gemm_int8.cpp (whose source this is), and from 17 activation rows its
// hexes (16 weight rows a 512-bit vector), whose float steps per output are the register tile's,
// so every output is bit for bit the AVX2 one; int8_product() calls it where the CPU has these
// sets (isa.cpp).
//
// One build carries both variants: the target pragma covers only this file's own code, after
// every header is included under the build's AVX2 flags, so no inline function or template that
// the AVX2 code may share with this file (the linker keeps one copy) holds AVX-512 instructions.
#include "kernels.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <new>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define TIANXIA_VNNI 1
#include "gemm_int8.cpp"
#pragma GCC pop_options
