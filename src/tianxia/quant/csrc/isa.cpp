// Which instruction-set variant the kernels run, chosen at load (cpu_isa.py) and checked here
// against the CPU itself, so that no setting can reach an instruction the CPU lacks.
#include "kernels.h"

#include <atomic>

namespace tianxia {

namespace {
std::atomic<int> g_isa{kIsaAvx2};
// The fewest activation rows that take the AVX-512 variant. Below them (single-stream decode: a
// memory-bound GEMV) the AVX2 one ran as fast or faster (BENCHMARKS.md), and both give the same
// bits, so the choice is speed alone.
std::atomic<int64_t> g_min_rows{2};
}  // namespace

int best_cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return kIsaAvx512;
  return kIsaAvx2;
}

int set_cpu_isa(int isa, int64_t min_rows) {
  g_isa = std::min(std::max(isa, (int)kIsaAvx2), best_cpu_isa());
  if (min_rows >= 0) g_min_rows = min_rows;
  return g_isa;
}

int cpu_isa() { return g_isa; }

int64_t avx512_min_rows() { return g_min_rows; }

bool use_avx512(int64_t rows) { return g_isa >= kIsaAvx512 && rows >= g_min_rows; }

}  // namespace tianxia
