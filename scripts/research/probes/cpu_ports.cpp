// Throughput probes behind the design notes of BENCHMARKS.md: do AVX-512 min/max run beside the FMAs
// or on the same pipes, and what does an unaligned 64-byte load cost against an aligned one?
//
//   g++ -O3 -march=native -o /tmp/cpu_ports scripts/research/probes/cpu_ports.cpp && /tmp/cpu_ports
//
// Each probe runs 16 independent chains (more than the latency of any of these instructions needs to
// be hidden), so it measures throughput. It prints nanoseconds per instruction; where min/max and FMA
// use different pipes, mixing them halves the time per instruction, where they share the pipes it
// does not. Needs AVX-512 (x86-64 with avx512f).
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr long kIterations = 20000000;


// 8 compare-exchanges (16 min/max) and/or 16 FMAs per iteration, on independent registers. The loop
// is written out (no lambda, no arrays) so that the values stay in registers.
template <bool kMinMax, bool kFma>
double probe_arithmetic(float seed) {
#define TIMM_PROBE_SET(i) __m512 a##i = _mm512_set1_ps(seed * (i + 1)), f##i = _mm512_set1_ps(seed / (i + 1));
  TIMM_PROBE_SET(0) TIMM_PROBE_SET(1) TIMM_PROBE_SET(2) TIMM_PROBE_SET(3) TIMM_PROBE_SET(4) TIMM_PROBE_SET(5)
  TIMM_PROBE_SET(6) TIMM_PROBE_SET(7) TIMM_PROBE_SET(8) TIMM_PROBE_SET(9) TIMM_PROBE_SET(10) TIMM_PROBE_SET(11)
  TIMM_PROBE_SET(12) TIMM_PROBE_SET(13) TIMM_PROBE_SET(14) TIMM_PROBE_SET(15)
#undef TIMM_PROBE_SET
  const __m512 w = _mm512_set1_ps(0.999f);
  const auto start = std::chrono::steady_clock::now();
  for (long it = 0; it < kIterations; ++it) {
    if (kMinMax) {
#define TIMM_PROBE_CX(i, j)                                                   \
  {                                                                           \
    const __m512 lo = _mm512_min_ps(a##i, a##j), hi = _mm512_max_ps(a##i, a##j); \
    a##i = lo;                                                                \
    a##j = hi;                                                                \
  }
      TIMM_PROBE_CX(0, 8) TIMM_PROBE_CX(1, 9) TIMM_PROBE_CX(2, 10) TIMM_PROBE_CX(3, 11)
      TIMM_PROBE_CX(4, 12) TIMM_PROBE_CX(5, 13) TIMM_PROBE_CX(6, 14) TIMM_PROBE_CX(7, 15)
#undef TIMM_PROBE_CX
    }
    if (kFma) {
#define TIMM_PROBE_FMA(i) f##i = _mm512_fmadd_ps(f##i, w, a##i);
      TIMM_PROBE_FMA(0) TIMM_PROBE_FMA(1) TIMM_PROBE_FMA(2) TIMM_PROBE_FMA(3) TIMM_PROBE_FMA(4) TIMM_PROBE_FMA(5)
      TIMM_PROBE_FMA(6) TIMM_PROBE_FMA(7) TIMM_PROBE_FMA(8) TIMM_PROBE_FMA(9) TIMM_PROBE_FMA(10) TIMM_PROBE_FMA(11)
      TIMM_PROBE_FMA(12) TIMM_PROBE_FMA(13) TIMM_PROBE_FMA(14) TIMM_PROBE_FMA(15)
#undef TIMM_PROBE_FMA
    }
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  __m512 sum = _mm512_setzero_ps();
#define TIMM_PROBE_SUM(i) sum = _mm512_add_ps(sum, _mm512_add_ps(a##i, f##i));
  TIMM_PROBE_SUM(0) TIMM_PROBE_SUM(1) TIMM_PROBE_SUM(2) TIMM_PROBE_SUM(3) TIMM_PROBE_SUM(4) TIMM_PROBE_SUM(5)
  TIMM_PROBE_SUM(6) TIMM_PROBE_SUM(7) TIMM_PROBE_SUM(8) TIMM_PROBE_SUM(9) TIMM_PROBE_SUM(10) TIMM_PROBE_SUM(11)
  TIMM_PROBE_SUM(12) TIMM_PROBE_SUM(13) TIMM_PROBE_SUM(14) TIMM_PROBE_SUM(15)
#undef TIMM_PROBE_SUM
  std::printf("  (checksum %g)\n", _mm512_reduce_add_ps(sum));
  return ns / (kIterations * 16.0 * ((kMinMax ? 1 : 0) + (kFma ? 1 : 0)));
}

// Loads of 16 floats from an L1-resident buffer: at 64-byte aligned addresses or at odd offsets
// (each such load spans two cache lines).
double probe_loads(bool aligned) {
  float* buffer = static_cast<float*>(std::aligned_alloc(64, 64 * 1024));
  for (int i = 0; i < 16 * 1024; ++i) buffer[i] = static_cast<float>(i % 97);
  const int shift = aligned ? 0 : 3;
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  const auto start = std::chrono::steady_clock::now();
  for (long it = 0; it < kIterations / 4; ++it) {
    const float* base = buffer + (it % 64) * 64 + shift;
    for (int i = 0; i < 16; ++i) acc[i % 8] = _mm512_max_ps(acc[i % 8], _mm512_loadu_ps(base + 16 * i));
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  float sink = 0;
  for (int i = 0; i < 8; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("  (checksum %g)\n", sink);
  std::free(buffer);
  return ns / (kIterations / 4 * 16.0);
}

}  // namespace

int main(int argc, char**) {
  const float seed = 0.37f + argc;
  const double minmax = probe_arithmetic<true, false>(seed);
  const double fma = probe_arithmetic<false, true>(seed);
  const double both = probe_arithmetic<true, true>(seed);
  const double aligned = probe_loads(true);
  const double unaligned = probe_loads(false);
  std::printf("min/max alone:            %.3f ns per instruction\n", minmax);
  std::printf("FMA alone:                %.3f ns per instruction\n", fma);
  std::printf("min/max + FMA, mixed:     %.3f ns per instruction (same pipes: as long as each alone; "
              "separate pipes: about half)\n", both);
  std::printf("64-byte loads, aligned:   %.3f ns per load (each with a max)\n", aligned);
  std::printf("64-byte loads, unaligned: %.3f ns per load (each with a max)\n", unaligned);
  return 0;
}
