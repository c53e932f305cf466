// The kernel's three products with bfloat16 multiplicands and float32 sums (AVX-512 BF16's vdpbf16ps),
// for bfloat16 calls (autocast): the windows are still sampled and sorted in float32, and only the
// sorted values, the weights and the output gradients are rounded to bfloat16 for the multiply-adds.
//
// vdpbf16ps adds to each float32 lane the products of the lane's two bfloat16 pairs: a[2j] * b[2j] +
// a[2j + 1] * b[2j + 1]. The depth of each product is therefore taken two rows at a time, and a "pair
// row" holds, per column, the bfloat16 values of two consecutive rows in one 32-bit word (the first in
// the low half); an odd depth ends with a pair whose second row is zero. One instruction does the work
// of two float32 FMAs of the same width.
//
// Compiled into the AVX-512 build only, under a target attribute (x86-64-v4 has no BF16), and called
// only where the running CPU has it (bf16_products()); elsewhere the kernel multiplies in float32.
#pragma once

#if defined(__AVX512F__) && defined(__x86_64__)
#define TIMM_SORTCONV_BF16 1
#define TIMM_SORTCONV_BF16_TARGET __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f")))

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

namespace {

// Whether this CPU multiplies bfloat16 pairs (AVX-512 BF16: Cooper Lake, Sapphire Rapids, Zen 4 on).
inline bool bf16_hardware() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// float32 -> bfloat16, round to nearest even (what vcvtne2ps2bf16 does); NaN stays a quiet NaN.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint32_t bf16_pair(float first, float second) {
  return static_cast<uint32_t>(to_bf16(first)) | (static_cast<uint32_t>(to_bf16(second)) << 16);
}

// out[p][j] = the pair (rows[2p][j], rows[2p + 1][j]) for p < ceil(depth / 2) and j < width (a multiple
// of 16); rows are `ld` floats apart; a missing last row reads as zeros.
TIMM_SORTCONV_BF16_TARGET inline void pack_pair_rows(const float* rows, int64_t depth, int64_t width, int64_t ld,
                                                     uint32_t* out) {
  // Element 2j of the result is element j of the conversion (the first row), 2j + 1 is element 16 + j.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t k = 0; k < depth; k += 2) {
    const float* first = rows + k * ld;
    const float* second = first + ld;
    uint32_t* dst = out + (k / 2) * width;
    for (int64_t j = 0; j < width; j += 16) {
      const __m512 a = _mm512_loadu_ps(first + j);
      const __m512 b = k + 1 < depth ? _mm512_loadu_ps(second + j) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_storeu_si512(dst + j, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// out[r][p] = the pair (rows[r][2p], rows[r][2p + 1]) for r < count_rows and the 32 columns of a row
// (16 pairs); columns at or past `count` read as zeros.
TIMM_SORTCONV_BF16_TARGET inline void pack_column_pairs(const float* rows, int64_t count_rows, int64_t ld,
                                                        int64_t count, uint32_t* out) {
  const __mmask16 lo = static_cast<__mmask16>(count >= 16 ? 0xffff : (1u << count) - 1);
  const __mmask16 hi = static_cast<__mmask16>(count >= 32 ? 0xffff : count <= 16 ? 0 : (1u << (count - 16)) - 1);
  for (int64_t r = 0; r < count_rows; ++r) {
    const __m512 a = _mm512_maskz_loadu_ps(lo, rows + r * ld);
    const __m512 b = _mm512_maskz_loadu_ps(hi, rows + r * ld + 16);
    _mm512_storeu_si512(out + r * 16, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

// tile[m][32 lanes] (+)= sum_p w[p * ldw + m] . panel[p][lanes] for m < kRows, pairs of rows at a time.
template <int kRows>
TIMM_SORTCONV_BF16_TARGET void micro_gemm_bf16(const uint32_t* panel, int64_t pairs, const uint32_t* w, int64_t ldw,
                                               float* tile, bool accumulate) {
  __m512 acc0[kRows], acc1[kRows];
  for (int m = 0; m < kRows; ++m) {
    acc0[m] = accumulate ? _mm512_loadu_ps(tile + m * 32) : _mm512_setzero_ps();
    acc1[m] = accumulate ? _mm512_loadu_ps(tile + m * 32 + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh p0 = (__m512bh)_mm512_loadu_si512(panel + p * 32);
    const __m512bh p1 = (__m512bh)_mm512_loadu_si512(panel + p * 32 + 16);
    const uint32_t* wp = w + p * ldw;
    for (int m = 0; m < kRows; ++m) {
      const __m512bh wm = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[m]));
      acc0[m] = _mm512_dpbf16_ps(acc0[m], wm, p0);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], wm, p1);
    }
  }
  for (int m = 0; m < kRows; ++m) {
    _mm512_storeu_ps(tile + m * 32, acc0[m]);
    _mm512_storeu_ps(tile + m * 32 + 16, acc1[m]);
  }
}

using MicroGemmBf16 = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, bool);

template <int... kRows>
constexpr std::array<MicroGemmBf16, sizeof...(kRows)> micro_gemm_bf16_table(std::integer_sequence<int, kRows...>) {
  return {&micro_gemm_bf16<kRows + 1>...};
}

// gemm_rows with pair rows: tile[rows][32] (+)= w^T panel, in equal register tiles of at most kMaxRows.
template <int kMaxRows>
TIMM_SORTCONV_BF16_TARGET void gemm_rows_bf16(const uint32_t* panel, int64_t pairs, const uint32_t* w, int64_t ldw,
                                              int64_t rows, float* tile, bool accumulate) {
  static constexpr auto table = micro_gemm_bf16_table(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
    const int64_t m = (rows - m0) / (tiles - i);
    table[m - 1](panel, pairs, w + m0, ldw, tile + m0 * 32, accumulate);
    m0 += m;
  }
}

// grad[s][o] += sum_p columns[s][p] . g[p][o] for s < kRows and kVectors * 16 outputs from `grad`:
// columns rows hold 16 pairs (32 lanes), g rows `ldg` pairs, grad rows `ldw` floats.
template <int kRows, int kVectors>
TIMM_SORTCONV_BF16_TARGET void micro_gemm_reduce_bf16(const uint32_t* columns, int64_t pairs, const uint32_t* g,
                                                      int64_t ldg, float* grad, int64_t ldw) {
  __m512 acc[kRows][kVectors];
  for (int m = 0; m < kRows; ++m) {
    for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh gv[kVectors];
    for (int v = 0; v < kVectors; ++v) gv[v] = (__m512bh)_mm512_loadu_si512(g + p * ldg + v * 16);
    for (int m = 0; m < kRows; ++m) {
      const __m512bh c = (__m512bh)_mm512_set1_epi32(static_cast<int>(columns[m * 16 + p]));
      for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], c, gv[v]);
    }
  }
  for (int m = 0; m < kRows; ++m) {
    for (int v = 0; v < kVectors; ++v) {
      float* dst = grad + m * ldw + v * 16;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[m][v]));
    }
  }
}

using MicroGemmReduceBf16 = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t);

template <int kVectors, int... kRows>
constexpr std::array<MicroGemmReduceBf16, sizeof...(kRows)> reduce_bf16_table(std::integer_sequence<int, kRows...>) {
  return {&micro_gemm_reduce_bf16<kRows + 1, kVectors>...};
}

// gemm_reduce with pair columns: grad[slots][outputs_padded] += columns . g, where `columns` holds
// pack_column_pairs of the block's sorted values and `g` pack_pair_rows of its (lanes, outputs) gradient.
template <int kMaxRows>
TIMM_SORTCONV_BF16_TARGET void gemm_reduce_bf16(const uint32_t* columns, int64_t slots, int64_t pairs,
                                                const uint32_t* g, int64_t outputs_padded, float* grad) {
  static constexpr auto doubles = reduce_bf16_table<2>(std::make_integer_sequence<int, kMaxRows>{});
  static constexpr auto singles = reduce_bf16_table<1>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t tiles = (slots + kMaxRows - 1) / kMaxRows;
  for (int64_t i = 0, s0 = 0; i < tiles; ++i) {
    const int64_t m = (slots - s0) / (tiles - i);
    int64_t o0 = 0;
    for (; o0 + 32 <= outputs_padded; o0 += 32) {
      doubles[m - 1](columns + s0 * 16, pairs, g + o0, outputs_padded, grad + s0 * outputs_padded + o0,
                     outputs_padded);
    }
    if (o0 < outputs_padded) {
      singles[m - 1](columns + s0 * 16, pairs, g + o0, outputs_padded, grad + s0 * outputs_padded + o0,
                     outputs_padded);
    }
    s0 += m;
  }
}

}  // namespace

#endif
