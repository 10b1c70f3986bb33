// Which instruction-set variant the kernels run, chosen at load (cpu_isa.py) and checked here
// against the CPU itself, so that no setting can reach an instruction the CPU lacks.
#include "kernels.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace tianxia {

namespace {
std::atomic<int> g_isa{kIsaAvx2};
// The fewest activation rows that take the AVX-512 variant. Below them (single-stream decode: a
// memory-bound GEMV) the AVX2 one ran as fast or faster (BENCHMARKS.md), and both give the same
// bits, so the choice is speed alone.
std::atomic<int64_t> g_min_rows{2};
// The fewest that take AMX: below them a 16-row tile is mostly padding and the weights' widening
// into tile layout is not repaid. On SmolLM2-135M's layer shapes, 2 threads of a Xeon (Emerald
// Rapids), AVX-512 VNNI was 1.03-1.27x faster at 8 rows, about even at 9 (one 8-row panel and a
// second for the ninth row), AMX 1.08-1.31x faster at 10 and 1.3-1.7x at 16 and more
// (benchmarks/cpu_isa_ab.py --shapes).
std::atomic<int64_t> g_amx_min_rows{10};

// AMX-TILE and AMX-INT8 by CPUID, their state enabled by the OS (XCR0 bits 17 and 18), and this
// process allowed tile data: Linux (5.16+) grants it on request, once per process (threads and
// forked children share it), and without it the first tile instruction is killed with SIGILL.
// Asked here, not only from Python, so that every process that loads the kernels asks before it
// can run a tile instruction.
bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv works
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
#ifdef SYS_arch_prctl
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}
}  // namespace

int best_cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return amx_built() && amx_usable() ? kIsaAmx : kIsaAvx512;
  return kIsaAvx2;
}

int set_cpu_isa(int isa, int64_t min_rows, int64_t amx_min_rows) {
  g_isa = std::min(std::max(isa, (int)kIsaAvx2), best_cpu_isa());
  if (min_rows >= 0) g_min_rows = min_rows;
  if (amx_min_rows >= 0) g_amx_min_rows = amx_min_rows;
  return g_isa;
}

int cpu_isa() { return g_isa; }

int64_t avx512_min_rows() { return g_min_rows; }

int64_t amx_min_rows() { return g_amx_min_rows; }

bool use_avx512(int64_t rows) { return g_isa >= kIsaAvx512 && rows >= g_min_rows; }

bool use_amx(int64_t rows) { return g_isa >= kIsaAmx && rows >= g_amx_min_rows; }

}  // namespace tianxia
