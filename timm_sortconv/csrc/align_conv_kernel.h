// The aligned variants (sorting="align", "align-channel") on the CPU: each window turned back by its own
// orientation, then an ordinary convolution (timm_sortconv/ops/alignment.py's docstring is the mathematics;
// aligned_samples there is the specification). Included by sort_conv_float.cpp and sort_conv_double.cpp after
// sort_conv_kernel.h, whose blocks of output positions, image ring, gathering, taps, micro-GEMMs and scatter it
// reuses; sort_conv_cpu.cpp binds it to Python.
//
// Everything is written in the harmonic basis of alignment.harmonic_tables: a window's k*k harmonic rows are the
// centre, each ring's S_0 and, for an even ring, its Nyquist S_{N/2}, and Re S_m and Im S_m of every (ring,
// 0 < m < N/2), here ordered ring by ring (cpu_backend._folded_dft; the tables say which row is which). The weight
// comes in grid order and is taken to that basis per call (harmonic_weight: each channel's slot-order weights through
// the same transform, rows scaled, so that its product with the aligned harmonics equals the product of the
// slot-order weight with the aligned samples); its gradient goes back through the transpose
// (sum_harmonic_weight_parts). Per block of kLanes output positions and group, the forward pass
//   1. gathers every channel's samples (sort_conv_kernel.h's gather_samples) and takes their ring spectra into a
//      per-thread buffer spectra[C/g][k*k][lanes]: rings of 8, 16 and 24 samples by a fast transform in registers
//      (ring_dft), others folded (s_0, s_j + s_{N-j}, s_{N/2}, s_j - s_{N-j}), then their cosine rows from the first
//      and their sine rows from the second, two dense blocks of about N/2 a side (half the products of the whole
//      transform);
//   2. per orientation unit (the group's channels together for "align", each channel for "align-channel") sums
//      c = sum_rings S_1 / N and E = sum_rings sum_{m != 0} |S_m|^2 / N^2 over its channels, and forms the gated
//      powers T_m = g * conj(e)^m, m = 1 .. largest (g = |c|^2 / (|c|^2 + RELATIVE E + TINY), e = c / |c|);
//   3. turns the spectra in place: (Re, Im) S_m times T_m as complex numbers, a Nyquist row times Re T_{N/2},
//      S_0 and the centre as they are;
//   4. multiplies the block's aligned columns (C/g * k*k rows of lanes) into the outputs with the micro-GEMM.
// Nothing of size k*k times the input is written to memory: the buffer holds one block's columns. A guide channel
// (AlignCall::guides: the last of each group's input channels, with no weight) takes steps 1 and 2 only, and where
// the tables allow, without its spectra: its samples' sums give its c and E (add_guide_orientation).
//
// Backward keeps only the input and the weight, as the sorting kernel does: per block it recomputes the spectra,
// the orientation and the aligned columns, then
//   * grad of the harmonic weight += grad_out x aligned columns (gemm_reduce);
//   * grad of the aligned columns = harmonic weight^T x grad_out (gemm_rows);
//   * back through the turn: the spectra's gradient is the aligned gradient turned by conj(T_m) (the turn's
//     transpose), and each T_m collects dL/dT_m = sum over the unit's channels of conj(S_m) * gA_m;
//   * back through the power recurrence T_m = T_{m-1} * conj(e), T_1 = g * conj(e), to (g, e), then to
//     (c_re, c_im, E) through g and e = c / |c| (orientation_backward);
//   * from (c, E) to the spectra: the m = 1 rows through c (weight 1 / N), every row in E through E
//     (E holds 2 |S_m|^2 / N^2 per pair and S_{N/2}^2 / N^2 per Nyquist row: dE/dS = 4 S / N^2 and 2 S / N^2);
//   * from the spectra to the samples through the DFT's blocks and the fold, transposed, then to the input through
//     the sampling taps (scatter_gradients, accumulated into the thread's image ring).
// This is autograd of the reference path written out (the same function; the gradients agree up to rounding).
// The orientation is computed in the call's dtype: float32 or float64 (bfloat16 calls run in float32).
#pragma once

#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>

#include "sort_conv_kernel.h"

namespace {

// One diagonal block of the folded DFT: rows [start, start + size) of the spectra from the same rows of the folded
// samples, as the micro-GEMM reads a weight: `forward` row k holds the block's column k (the products into the
// spectra), `backward` row k its row k (the transpose, for the gradients).
template <typename scalar_t>
struct DftBlock {
  int64_t start = 0, size = 0;
  std::vector<scalar_t> forward, backward;
};

template <typename scalar_t>
struct AlignTables {
  int64_t harmonics = 0, pairs = 0, largest = 0;
  bool shared = true;  // "align": one orientation per group; "align-channel": per channel
  // Guide channels after each group's weighted channels ("align" only): in the orientation, not in the products.
  int64_t guides = 0;
  scalar_t relative = 0, tiny = 0;
  // Folded samples <- samples (slot order): s_0, s_j + s_{N-j}, s_{N/2}, s_j - s_{N-j}; built only where the rings
  // are not folded inline (rings false).
  TapTable<scalar_t> fold;
  TapTable<scalar_t> unfold;  // its transpose, for the gradients
  std::vector<DftBlock<scalar_t>> blocks;
  // Per pair (ring, 0 < m < N/2): the rows of Re S_m and Im S_m, and m.
  std::vector<int64_t> pair_re_row, pair_im_row, pair_m;
  std::vector<int64_t> first_pair;  // the pairs with m = 1, and their 1 / N: c = sum first_weight * S
  std::vector<scalar_t> first_weight;
  std::vector<scalar_t> pair_energy;  // per pair 2 / N^2: E += pair_energy * (Re^2 + Im^2)
  std::vector<int64_t> energy_row;    // fixed rows in E (the Nyquist ones), with their 1 / N^2
  std::vector<scalar_t> energy_weight;
  std::vector<int64_t> nyquist_row, nyquist_m;  // fixed rows turned by Re T_m (m = N / 2)
  std::vector<int64_t> still_row;               // the fixed rows that do not turn (the centre, each S_0)
  // Per harmonic row r, 1 / |analysis row r|^2 (analysis = dft @ fold): a channel's harmonic weight row r is the
  // analysis of its slot-order weights times this (harmonic_weight), as alignment.harmonic_tables' synthesis is
  // analysis^T scaled by it.
  std::vector<scalar_t> weight_scale;
  // A guide channel's (c_re, c_im) as sums over its samples in slot order (the m = 1 rows of the analysis, times
  // first_weight), and per slot the weight of its ring's squared mean in E, where each ring's energy terms are
  // Parseval's (E_ring = the samples' variance over the ring + that weight times their squared mean:
  // cpu_backend._guide_first checks it); empty otherwise, and a guide then takes the spectra path.
  std::vector<scalar_t> guide_re, guide_im, guide_level;
  // Whether every ring is folded as _folded_dft folds it (its rows from the ring's first slot on: the cosine block,
  // then the sine block) with a size ring_dft has unrolled; then per segment of the plan the index in `blocks` of
  // its cosine block and of its sine block (-1: none), and whether its samples can be read straight from the input
  // (polar sampling as PolarTaps<3>, <5> or <7> places it, or square sampling, in float32 where masked loads exist).
  bool rings = false, direct = false;
  std::vector<int64_t> cosine_block, sine_block;
  // Whether each ring's (c, E) terms sit where ring_dft writes its rows (S_0 at row 0, Re S_m at row m, Im S_m at
  // row N / 2 + m, the Nyquist term at N / 2; c from m = 1 only) with one energy weight for all its pairs: then the
  // direct path adds a channel's (c, E) while its rows are in registers (RingOrientation) instead of add_orientation
  // reading them back. Per segment of the plan (4 values each): its pairs' energy weight, its Nyquist row's, its
  // S_0's (the LEVEL term), its m = 1 weight.
  bool ring_orientation = false;
  std::vector<scalar_t> ring_orientation_weights;

  int64_t re(int64_t p) const { return pair_re_row[p]; }
  int64_t im(int64_t p) const { return pair_im_row[p]; }
  // Rows of lanes per orientation unit: c_re, c_im, E, then Re T_m and Im T_m for m = 0 .. largest.
  int64_t state_rows() const { return 3 + 2 * (largest + 1); }
};

// The sparse map of a (rows, rows) float64 matrix (zeros left out), and of its transpose.
template <typename scalar_t>
std::pair<TapTable<scalar_t>, TapTable<scalar_t>> tap_tables_of(const double* a, int64_t rows) {
  std::vector<std::array<int64_t, 2>> forward_pairs, backward_pairs;
  std::vector<scalar_t> weights;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < rows; ++c) {
      if (a[r * rows + c] == 0.0) continue;
      forward_pairs.push_back({r, c});
      backward_pairs.push_back({c, r});
      weights.push_back(static_cast<scalar_t>(a[r * rows + c]));
    }
  }
  return {make_tap_table(rows, forward_pairs, weights), make_tap_table(rows, backward_pairs, weights)};
}

// Ring sizes with an unrolled ring_dft (the centre: 1): the rings of odd square and polar windows up to 7 x 7.
inline bool unrolled_ring(int64_t size) { return size == 1 || size == 8 || size == 16 || size == 24; }

bool known_polar_segment(int64_t k, int64_t start, int64_t size);

// The polar kernel size whose taps sit where PolarTaps says (0: none): plan.polar_k (5, 7), or 3 (plan.polar_3, which
// the sorting kernel leaves to its staged taps).
template <typename scalar_t>
int polar_size(const Plan<scalar_t>& plan) { return plan.polar_3 ? 3 : plan.polar_k; }

// Fills t.cosine_block, t.sine_block and t.rings, t.direct from the plan's segments and the fold (float64, k*k x k*k).
template <typename scalar_t>
void find_rings(const Plan<scalar_t>& plan, const double* f, AlignTables<scalar_t>& t) {
  const int64_t slots = plan.slots;
  std::vector<double> expected(slots * slots, 0.0);
  std::vector<int64_t> block_at(slots + 1, -1);
  for (size_t b = 0; b < t.blocks.size(); ++b) block_at[t.blocks[b].start] = static_cast<int64_t>(b);
  bool rings = !plan.segments.empty();
  for (const auto& segment : plan.segments) {
    const int64_t s = segment.start, n = segment.size, c = n / 2 + 1;
    if (!unrolled_ring(n)) rings = false;
    if (n == 1) {
      expected[s * slots + s] = 1.0;
      t.cosine_block.push_back(block_at[s]);
      t.sine_block.push_back(-1);
      if (block_at[s] < 0 || t.blocks[block_at[s]].size != 1 || t.blocks[block_at[s]].forward[0] != scalar_t(1)) {
        rings = false;
      }
      continue;
    }
    for (int64_t j = 0; j <= n / 2; ++j) {
      expected[(s + j) * slots + s + j] = 1.0;
      if (j > 0 && j < n / 2) {
        expected[(s + j) * slots + s + n - j] = 1.0;
        expected[(s + c + j - 1) * slots + s + j] = 1.0;
        expected[(s + c + j - 1) * slots + s + n - j] = -1.0;
      }
    }
    const int64_t cosine = block_at[s], sine = n / 2 > 1 ? block_at[s + c] : -1;
    t.cosine_block.push_back(cosine);
    t.sine_block.push_back(sine);
    if (n % 2 != 0 || cosine < 0 || t.blocks[cosine].size != c || (n / 2 > 1 && (sine < 0 || t.blocks[sine].size != n - c))) {
      rings = false;
    }
  }
  t.rings = rings && std::equal(expected.begin(), expected.end(), f);
#if defined(TIMM_SORTCONV_SORT_DIRECT)
  t.direct = t.rings && kUnrolledNetworks<scalar_t>
             && (plan.single_tap
                 || (polar_size(plan) != 0 && std::all_of(plan.segments.begin(), plan.segments.end(), [&](const Segment& g) {
                       return known_polar_segment(polar_size(plan), g.start, g.size);
                     })));
#endif
}

// The aligned tables as plain values (cpu_backend._AlignTables computes them; the PyTorch extension takes them as
// tensors, the onnxruntime operator as a node's attributes), row-major.
struct AlignTableValues {
  std::vector<double> fold, dft;        // (k*k, k*k): folded samples <- samples; harmonic rows <- folded samples
  std::vector<int64_t> blocks;          // (n, 2): (start, size) of dft's diagonal blocks
  std::vector<int64_t> pairs;           // (pairs, 3): the rows of Re S_m and Im S_m, and m
  std::vector<double> first;            // (pairs,): 1 / N for the pairs with m = 1, else 0
  std::vector<double> energy_pairs;     // (pairs,): 2 / N^2
  std::vector<int64_t> fixed;           // (fixed, 2): the other rows, and m of a ring's Nyquist term (else 0)
  std::vector<double> energy_fixed;     // (fixed,): 1 / N^2 for a Nyquist row, else 0
  std::vector<double> weight_scale;     // (k*k,): 1 / |row|^2 of dft @ fold
  std::vector<double> guide_first;      // (3, k*k) or empty (cpu_backend._guide_first)
  bool shared = true;                   // one orientation per group ("align"), else per channel
  double relative = 0, tiny = 0;        // alignment.RELATIVE, alignment.TINY
  int64_t guides = 0;                   // guide channels after each group's weighted ones (0 or 1)
};

// Fills t.ring_orientation and t.ring_orientation_weights (see AlignTables) from the tables' pairs and fixed rows,
// for rings that ring_dft computes (t.rings).
template <typename scalar_t>
void find_ring_orientation(const Plan<scalar_t>& plan, const AlignTableValues& v, AlignTables<scalar_t>& t) {
  t.ring_orientation = false;
  t.ring_orientation_weights.clear();
  if (!t.rings) return;
  // Per row: the pair's m (with whether it is the Im row) or a fixed row's m (0 or the Nyquist m), its energy weight
  // and its weight in c.
  const int64_t slots = plan.slots, pairs = static_cast<int64_t>(v.pairs.size() / 3);
  std::vector<int64_t> harmonic(slots, 0);
  std::vector<double> energy(slots, 0.0), first(slots, 0.0);
  std::vector<bool> im_row(slots, false);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t re = v.pairs[3 * p], im = v.pairs[3 * p + 1], m = v.pairs[3 * p + 2];
    harmonic[re] = harmonic[im] = m;
    im_row[im] = true;
    energy[re] = energy[im] = v.energy_pairs[p];
    first[re] = first[im] = v.first[p];
  }
  for (size_t f = 0; f < v.fixed.size() / 2; ++f) {
    harmonic[v.fixed[2 * f]] = v.fixed[2 * f + 1];
    energy[v.fixed[2 * f]] = v.energy_fixed[f];
  }
  std::vector<scalar_t> weights;
  for (const auto& segment : plan.segments) {
    const int64_t s = segment.start, n = segment.size, cos_rows = n / 2 + 1;
    const double pair_energy = n > 2 ? energy[s + 1] : 0.0, nyquist_energy = n > 1 ? energy[s + n / 2] : 0.0;
    const double first_weight = n > 2 ? first[s + 1] : 0.0, level_energy = energy[s];
    // S_0, or the centre (whose term RingOrientation leaves out: none in E)
    if (harmonic[s] != 0 || im_row[s] || first[s] != 0.0 || (n == 1 && level_energy != 0.0)) return;
    for (int64_t r = 1; r < n; ++r) {
      const bool im = r >= cos_rows;
      const int64_t m = im ? r - cos_rows + 1 : r, row = s + r;
      const bool nyquist = !im && 2 * m == n;
      if (harmonic[row] != m || im_row[row] != im || energy[row] != (nyquist ? nyquist_energy : pair_energy)
          || first[row] != (m == 1 && !nyquist ? first_weight : 0.0)) {
        return;
      }
    }
    weights.push_back(static_cast<scalar_t>(pair_energy));
    weights.push_back(static_cast<scalar_t>(nyquist_energy));
    weights.push_back(static_cast<scalar_t>(level_energy));
    weights.push_back(static_cast<scalar_t>(first_weight));
  }
  t.ring_orientation = true;
  t.ring_orientation_weights = std::move(weights);
}

template <typename scalar_t>
AlignTables<scalar_t> make_align_tables(const AlignTableValues& v, const Plan<scalar_t>& plan) {
  const int64_t slots = plan.slots;
  AlignTables<scalar_t> t;
  t.harmonics = slots;
  t.pairs = static_cast<int64_t>(v.pairs.size() / 3);
  const int64_t fixed_count = static_cast<int64_t>(v.fixed.size() / 2);
  TIMM_SORTCONV_CHECK(static_cast<int64_t>(v.fold.size()) == slots * slots && v.dft.size() == v.fold.size(),
                      "sort_conv_cpu: fold and dft must be (k*k, k*k)");
  TIMM_SORTCONV_CHECK(v.pairs.size() % 3 == 0 && v.fixed.size() % 2 == 0 && fixed_count + 2 * t.pairs == slots
                          && static_cast<int64_t>(v.first.size()) == t.pairs
                          && static_cast<int64_t>(v.energy_pairs.size()) == t.pairs
                          && static_cast<int64_t>(v.energy_fixed.size()) == fixed_count,
                      "sort_conv_cpu: the harmonic tables must describe fixed + 2 * pairs = k*k rows");
  TIMM_SORTCONV_CHECK(v.blocks.size() % 2 == 0, "sort_conv_cpu: blocks must be (n, 2)");
  t.shared = v.shared;
  t.guides = v.guides;
  TIMM_SORTCONV_CHECK(t.guides == 0 || (t.guides == 1 && t.shared),
                      "sort_conv_cpu: a group carries at most one guide channel, and only with one orientation a "
                      "group");
  t.relative = static_cast<scalar_t>(v.relative);
  t.tiny = static_cast<scalar_t>(v.tiny);
  const double* d = v.dft.data();
  int64_t covered = 0;
  for (size_t b = 0; b < v.blocks.size() / 2; ++b) {
    DftBlock<scalar_t> block;
    block.start = v.blocks[2 * b];
    block.size = v.blocks[2 * b + 1];
    TIMM_SORTCONV_CHECK(block.start == covered && block.size >= 1 && block.start + block.size <= slots,
                        "sort_conv_cpu: the DFT's blocks must tile its rows");
    block.forward.reserve(block.size * block.size);
    block.backward.reserve(block.size * block.size);
    covered += block.size;
    for (int64_t k = 0; k < block.size; ++k) {
      for (int64_t m = 0; m < block.size; ++m) {
        block.forward.push_back(static_cast<scalar_t>(d[(block.start + m) * slots + block.start + k]));
        block.backward.push_back(static_cast<scalar_t>(d[(block.start + k) * slots + block.start + m]));
      }
    }
    t.blocks.push_back(std::move(block));
  }
  TIMM_SORTCONV_CHECK(covered == slots, "sort_conv_cpu: the DFT's blocks must cover its k*k rows");
  TIMM_SORTCONV_CHECK(static_cast<int64_t>(v.weight_scale.size()) == slots,
                      "sort_conv_cpu: weight_scale must have k*k rows");
  for (const double scale : v.weight_scale) t.weight_scale.push_back(static_cast<scalar_t>(scale));
  TIMM_SORTCONV_CHECK(v.guide_first.empty() || static_cast<int64_t>(v.guide_first.size()) == 3 * slots,
                      "sort_conv_cpu: guide_first must be (3, k*k) or empty");
  for (size_t i = 0; i < v.guide_first.size(); ++i) {
    auto& row = static_cast<int64_t>(i) < slots ? t.guide_re
                                                : (static_cast<int64_t>(i) < 2 * slots ? t.guide_im : t.guide_level);
    row.push_back(static_cast<scalar_t>(v.guide_first[i]));
  }
  find_rings(plan, v.fold.data(), t);
  if (!t.rings) std::tie(t.fold, t.unfold) = tap_tables_of<scalar_t>(v.fold.data(), slots);  // the ring DFTs inline
  for (int64_t p = 0; p < t.pairs; ++p) {
    const int64_t re = v.pairs[3 * p], im = v.pairs[3 * p + 1], m = v.pairs[3 * p + 2];
    TIMM_SORTCONV_CHECK(re >= 0 && re < slots && im >= 0 && im < slots && m >= 1,
                        "sort_conv_cpu: a pair is out of range");
    t.pair_re_row.push_back(re);
    t.pair_im_row.push_back(im);
    t.pair_m.push_back(m);
    t.largest = std::max(t.largest, m);
    t.pair_energy.push_back(static_cast<scalar_t>(v.energy_pairs[p]));
    if (v.first[p] != 0.0) {
      t.first_pair.push_back(p);
      t.first_weight.push_back(static_cast<scalar_t>(v.first[p]));
    }
  }
  for (int64_t f = 0; f < fixed_count; ++f) {
    const int64_t row = v.fixed[2 * f], m = v.fixed[2 * f + 1];
    TIMM_SORTCONV_CHECK(row >= 0 && row < slots && m >= 0, "sort_conv_cpu: a fixed row is out of range");
    if (m > 0) {
      t.nyquist_row.push_back(row);
      t.nyquist_m.push_back(m);
      t.largest = std::max(t.largest, m);
    } else {
      t.still_row.push_back(row);
    }
    if (v.energy_fixed[f] != 0.0) {
      t.energy_row.push_back(row);
      t.energy_weight.push_back(static_cast<scalar_t>(v.energy_fixed[f]));
    }
  }
  find_ring_orientation(plan, v, t);
  return t;
}

#if !defined(TIMM_SORTCONV_STANDALONE)
template <typename T>
std::vector<T> values_of(const at::Tensor& tensor) {
  const auto c = tensor.to(std::is_same<T, double>::value ? at::kDouble : at::kLong).contiguous();
  return std::vector<T>(c.template data_ptr<T>(), c.template data_ptr<T>() + c.numel());
}

// The PyTorch extension's tables (tensors) as values.
inline AlignTableValues table_values(const timm_sortconv_cpu::AlignCall& align) {
  AlignTableValues v;
  TORCH_CHECK(align.fold.dim() == 2 && align.dft.sizes() == align.fold.sizes() && align.blocks.dim() == 2
                  && align.blocks.size(1) == 2 && align.pairs.dim() == 2 && align.pairs.size(1) == 3
                  && align.fixed.dim() == 2 && align.fixed.size(1) == 2,
              "sort_conv_cpu: fold and dft must be (k*k, k*k), blocks (n, 2), pairs (p, 3), fixed (f, 2)");
  TORCH_CHECK(align.guide_first.numel() == 0 || align.guide_first.dim() == 2,
              "sort_conv_cpu: guide_first must be (3, k*k) or empty");
  v.fold = values_of<double>(align.fold);
  v.dft = values_of<double>(align.dft);
  v.blocks = values_of<int64_t>(align.blocks);
  v.pairs = values_of<int64_t>(align.pairs);
  v.first = values_of<double>(align.first);
  v.energy_pairs = values_of<double>(align.energy_pairs);
  v.fixed = values_of<int64_t>(align.fixed);
  v.energy_fixed = values_of<double>(align.energy_fixed);
  v.weight_scale = values_of<double>(align.weight_scale);
  v.guide_first = values_of<double>(align.guide_first);
  v.shared = align.shared;
  v.relative = align.relative;
  v.tiny = align.tiny;
  v.guides = align.guides;
  return v;
}

template <typename scalar_t>
AlignTables<scalar_t> make_align_tables(const timm_sortconv_cpu::AlignCall& align, const Plan<scalar_t>& plan) {
  return make_align_tables<scalar_t>(table_values(align), plan);
}
#endif

// The 8-point DFT of the real a[0..7] (sum_n a_n exp(-2 pi i n k / 8)): y0 and y4 real, y1 .. y3 as (re[k], im[k]).
template <typename vec, typename scalar_t>
inline __attribute__((always_inline)) void real_dft8(const vec (&a)[8], vec& y0, vec& y4, vec (&re)[4], vec (&im)[4]) {
  const vec c = splat(scalar_t(0.70710678118654752440));  // cos(pi / 4)
  const vec t0 = a[0] + a[4], t1 = a[0] - a[4], t2 = a[2] + a[6], t3 = a[2] - a[6];
  const vec t4 = a[1] + a[5], t5 = a[1] - a[5], t6 = a[3] + a[7], t7 = a[3] - a[7];
  const vec e = t0 + t2, f = t4 + t6, p = t5 - t7, q = t5 + t7;
  y0 = e + f;
  y4 = e - f;
  re[1] = t1 + c * p;
  im[1] = -t3 - c * q;
  re[2] = t0 - t2;
  im[2] = t6 - t4;
  re[3] = t1 - c * p;
  im[3] = t3 - c * q;
}

// ring_dft of a ring of 8 samples: real_dft8's terms are its rows (Re S_0 .. Re S_4, then Im S_1 .. Im S_3).
template <typename vec, typename scalar_t, typename Sample, typename Out>
inline __attribute__((always_inline)) void ring_fft8(const Sample& sample, const Out& out) {
  vec a[8], y0, y4, re[4], im[4];
#pragma GCC unroll 8
  for (int n = 0; n < 8; ++n) a[n] = sample(n);
  real_dft8<vec, scalar_t>(a, y0, y4, re, im);
  out(0, y0);
  out(4, y4);
#pragma GCC unroll 3
  for (int m = 1; m < 4; ++m) {
    out(m, re[m]);
    out(4 + m, im[m]);
  }
}

// ring_dft of a ring of 16 samples as a fast transform: S_m = E_m + W^m O_m with E, O the 8-point DFTs of the even and
// the odd samples and W = exp(-2 pi i / 16); with P_j = W^j O_j, S_j = E_j + P_j and S_(8 - j) = conj(E_j - P_j) (W^(8
// - j) = -conj W^j, and E, O of real samples), S_4 = E_4 - i O_4, S_0 and S_8 = E_0 +- O_0. The rows are Re S_0 ..
// Re S_8, then Im S_1 .. Im S_7.
template <typename vec, typename scalar_t, typename Sample, typename Out>
inline __attribute__((always_inline)) void ring_fft16(const Sample& sample, const Out& out) {
  constexpr int kCos = 9;  // the sine row of harmonic m is kCos + m - 1
  vec even[8], odd[8], e0, e4, er[4], ei[4], o0, o4, orr[4], oi[4];
#pragma GCC unroll 8
  for (int n = 0; n < 8; ++n) {
    even[n] = sample(2 * n);
    odd[n] = sample(2 * n + 1);
  }
  real_dft8<vec, scalar_t>(even, e0, e4, er, ei);
  real_dft8<vec, scalar_t>(odd, o0, o4, orr, oi);
  out(0, e0 + o0);
  out(8, e0 - o0);
  out(4, e4);
  out(kCos + 3, -o4);
  // W^1 = c1 - i s1, W^2 = c2 (1 - i), W^3 = s1 - i c1 (cos and sin of pi / 8, pi / 4)
  const vec c1 = splat(scalar_t(0.92387953251128675613)), s1 = splat(scalar_t(0.38268343236508977173));
  const vec c2 = splat(scalar_t(0.70710678118654752440));
  const vec pr[4] = {vec{}, c1 * orr[1] + s1 * oi[1], c2 * (orr[2] + oi[2]), s1 * orr[3] + c1 * oi[3]};
  const vec pi[4] = {vec{}, c1 * oi[1] - s1 * orr[1], c2 * (oi[2] - orr[2]), s1 * oi[3] - c1 * orr[3]};
#pragma GCC unroll 3
  for (int j = 1; j < 4; ++j) {
    out(j, er[j] + pr[j]);
    out(kCos + j - 1, ei[j] + pi[j]);
    out(8 - j, er[j] - pr[j]);
    out(kCos + 7 - j, pi[j] - ei[j]);
  }
}

// ring_dft of a ring of 24 samples as a fast transform (Good-Thomas, 24 = 8 x 3, coprime: no twiddles). Sample
// (3 n1 + 8 n2) mod 24 is term n1 of the 8-point DFT Y_n2 (n2 < 3); harmonic m is term k1 = m mod 8 of those and term
// k2 = m mod 3 of the 3-point DFT across them: S_m = Y_0 + w^k2 Y_1 + w^(2 k2) Y_2, w = exp(-2 pi i / 3), with
// Y[8 - k1] = conj Y[k1] (a real input). The same rows as the folded blocks (Re S_m for m <= 12, then Im S_m for 0 <
// m < 12), from about 110 additions and multiplications instead of their 190; the sums in another order, so within
// rounding of them.
template <typename vec, typename scalar_t, typename Sample, typename Out>
inline __attribute__((always_inline)) void ring_fft24(const Sample& sample, const Out& out) {
  constexpr int kCos = 13;  // the sine row of harmonic m is kCos + m - 1
  const vec half = splat(scalar_t(0.5)), h = splat(scalar_t(0.86602540378443864676));  // sin(pi / 3)
  vec y0[3], y4[3], re[3][4], im[3][4];
#pragma GCC unroll 3
  for (int n2 = 0; n2 < 3; ++n2) {
    vec a[8];
#pragma GCC unroll 8
    for (int n1 = 0; n1 < 8; ++n1) a[n1] = sample((3 * n1 + 8 * n2) % 24);
    real_dft8<vec, scalar_t>(a, y0[n2], y4[n2], re[n2], im[n2]);
  }
  {  // k1 = 0: m = 0 (k2 = 0) and 8 (k2 = 2)
    const vec sum = y0[1] + y0[2];
    out(0, y0[0] + sum);
    out(8, y0[0] - half * sum);
    out(kCos + 7, h * (y0[1] - y0[2]));
  }
  {  // k1 = 4: m = 12 (k2 = 0) and 4 (k2 = 1)
    const vec sum = y4[1] + y4[2];
    out(12, y4[0] + sum);
    out(4, y4[0] - half * sum);
    out(kCos + 3, h * (y4[2] - y4[1]));
  }
  // k1 = 1, 2, 3: z0 = Y_0 + (Y_1 + Y_2), z1 = b - i h d, z2 = b + i h d with b = Y_0 - (Y_1 + Y_2) / 2, d = Y_1 - Y_2;
  // k1 = 5, 6, 7 are their conjugates at 8 - k1 and -k2
  const auto three = [&](int k1, vec (&zr)[3], vec (&zi)[3]) __attribute__((always_inline)) {
    const vec sr = re[1][k1] + re[2][k1], si = im[1][k1] + im[2][k1];
    const vec dr = re[1][k1] - re[2][k1], di = im[1][k1] - im[2][k1];
    const vec br = re[0][k1] - half * sr, bi = im[0][k1] - half * si;
    zr[0] = re[0][k1] + sr;
    zi[0] = im[0][k1] + si;
    zr[1] = br + h * di;
    zi[1] = bi - h * dr;
    zr[2] = br - h * di;
    zi[2] = bi + h * dr;
  };
  vec zr[3], zi[3];
  three(1, zr, zi);  // m = 9, 1, and 7 (the conjugate of k2 = 2)
  out(9, zr[0]);
  out(kCos + 8, zi[0]);
  out(1, zr[1]);
  out(kCos, zi[1]);
  out(7, zr[2]);
  out(kCos + 6, -zi[2]);
  three(2, zr, zi);  // m = 6 (the conjugate of k2 = 0), 10, 2
  out(6, zr[0]);
  out(kCos + 5, -zi[0]);
  out(10, zr[1]);
  out(kCos + 9, zi[1]);
  out(2, zr[2]);
  out(kCos + 1, zi[2]);
  three(3, zr, zi);  // m = 3, 5 (the conjugate of k2 = 1), 11
  out(3, zr[0]);
  out(kCos + 2, zi[0]);
  out(5, zr[1]);
  out(kCos + 4, -zi[1]);
  out(11, zr[2]);
  out(kCos + 10, zi[2]);
}

// One vector of lanes of a ring's N samples (sample(j), j < N) to its N spectra rows (out(row, value)), in registers.
// Rings of 8, 16 and 24 samples (those of k = 3, 5, 7) take a fast transform (ring_fft8, ring_fft16, ring_fft24:
// scripts/bench_onnx_library_ab.py, one thread, the guided networks 2-3% faster than with the folded blocks below,
// outputs within 1e-7 of the largest). Other rings are
// folded (u_0 = s_0, u_j = s_j + s_{N-j}, u_{N/2} = s_{N/2}; v_j = s_j - s_{N-j}, 0 < j < N/2), then the cosine
// block from the u and the sine block from the v. For N a multiple of 4 each block is folded once more (half the
// products; scripts/bench_onnx_library_ab.py: the guided network 5-7% faster at one thread than with the dense
// blocks, outputs within 1.2e-8); otherwise each row is the sum over the block's columns in column order, the
// operations of apply_taps(t.fold) and gemm_rows on the blocks. Nothing is stored and reloaded between the samples
// and the rows.
// `cosine` and `sine` are the blocks' DftBlock::forward.
template <typename vec, int N, typename scalar_t, typename Sample, typename Out>
inline __attribute__((always_inline)) void ring_dft(const Sample& sample, const scalar_t* cosine, const scalar_t* sine,
                                                    const Out& out) {
  if constexpr (N == 1) {
    out(0, sample(0));
  } else if constexpr (N == 8) {
    ring_fft8<vec, scalar_t>(sample, out);
  } else if constexpr (N == 16) {
    ring_fft16<vec, scalar_t>(sample, out);
  } else if constexpr (N == 24) {
    ring_fft24<vec, scalar_t>(sample, out);
  } else {
    constexpr int kCos = N / 2 + 1, kSin = N / 2 - 1;
    vec u[kCos], v[kSin];
    u[0] = sample(0);
    u[N / 2] = sample(N / 2);
#pragma GCC unroll 16
    for (int j = 1; j < N / 2; ++j) {
      const vec a = sample(j), b = sample(N - j);
      u[j] = a + b;
      v[j - 1] = a - b;
    }
    if constexpr (N % 4 == 0) {
      // Each block folded once more (M = N / 2, Q = N / 4): cos(2 pi m (M - j) / N) = (-1)^m cos(2 pi m j / N) and
      // sin(2 pi m (M - j) / N) = -(-1)^m sin(2 pi m j / N), so the even rows of each block read the sums of columns
      // j and M - j, the odd rows their differences, j <= Q only (at j = Q the odd cosines and even sines are 0):
      // about half the products of the two dense blocks, with the blocks' own entries.
      constexpr int M = N / 2, Q = N / 4;
      vec a[Q + 1], b[Q], c[Q], d[Q];  // u_j + u_{M-j} (u_Q alone), u_j - u_{M-j}; v_j - v_{M-j}, v_j + v_{M-j} (v_Q)
#pragma GCC unroll 16
      for (int j = 0; j < Q; ++j) {
        a[j] = u[j] + u[M - j];
        b[j] = u[j] - u[M - j];
      }
      a[Q] = u[Q];
#pragma GCC unroll 16
      for (int j = 1; j < Q; ++j) {
        c[j] = v[j - 1] - v[M - j - 1];
        d[j] = v[j - 1] + v[M - j - 1];
      }
      d[0] = v[Q - 1];  // v_Q, read with row Q of the sine block
#pragma GCC unroll 16
      for (int m = 0; m <= M; m += 2) {
        vec acc{};
#pragma GCC unroll 16
        for (int j = 0; j <= Q; ++j) acc += splat(cosine[j * kCos + m]) * a[j];
        out(m, acc);
      }
#pragma GCC unroll 16
      for (int m = 1; m < M; m += 2) {
        vec acc{};
#pragma GCC unroll 16
        for (int j = 0; j < Q; ++j) acc += splat(cosine[j * kCos + m]) * b[j];
        out(m, acc);
      }
#pragma GCC unroll 16
      for (int m = 2; m < M; m += 2) {
        vec acc{};
#pragma GCC unroll 16
        for (int j = 1; j < Q; ++j) acc += splat(sine[(j - 1) * kSin + m - 1]) * c[j];
        out(kCos + m - 1, acc);
      }
#pragma GCC unroll 16
      for (int m = 1; m < M; m += 2) {
        vec acc = splat(sine[(Q - 1) * kSin + m - 1]) * d[0];
#pragma GCC unroll 16
        for (int j = 1; j < Q; ++j) acc += splat(sine[(j - 1) * kSin + m - 1]) * d[j];
        out(kCos + m - 1, acc);
      }
    } else {
#pragma GCC unroll 16
      for (int m = 0; m < kCos; ++m) {
        vec acc{};
#pragma GCC unroll 16
        for (int k = 0; k < kCos; ++k) acc += splat(cosine[k * kCos + m]) * u[k];
        out(m, acc);
      }
#pragma GCC unroll 16
      for (int m = 0; m < kSin; ++m) {
        vec acc{};
#pragma GCC unroll 16
        for (int k = 0; k < kSin; ++k) acc += splat(sine[k * kSin + m]) * v[k];
        out(kCos + m, acc);
      }
    }
  }
}

// The transpose of ring_dft on one vector of lanes: the N samples' gradient (out(j, value)) from the N spectra rows'
// (grad(row)), through the blocks' transposes (DftBlock::backward; for N a multiple of 4 through ring_dft's second
// fold, transposed) and the unfold: g_{s_j} = g_{u_j} + g_{v_j}, g_{s_{N-j}} = g_{u_j} - g_{v_j}, as gemm_rows and
// apply_taps(t.unfold) compute them.
template <typename vec, int N, typename scalar_t, typename Grad, typename Out>
inline __attribute__((always_inline)) void ring_dft_transposed(const Grad& grad, const scalar_t* cosine,
                                                               const scalar_t* sine, const Out& out) {
  if constexpr (N == 1) {
    out(0, grad(0));
  } else {
    constexpr int kCos = N / 2 + 1, kSin = N / 2 - 1;
    vec gu[kCos], gv[kSin];
    if constexpr (N % 4 == 0) {
      // The transpose of ring_dft's second fold (both blocks are symmetric: row m, column j = row j, column m).
      constexpr int M = N / 2, Q = N / 4;
#pragma GCC unroll 16
      for (int j = 0; j <= Q; ++j) {
        vec even{}, odd{};
#pragma GCC unroll 16
        for (int m = 0; m <= M; m += 2) even += splat(cosine[m * kCos + j]) * grad(m);
        if (j < Q) {
#pragma GCC unroll 16
          for (int m = 1; m < M; m += 2) odd += splat(cosine[m * kCos + j]) * grad(m);
          gu[j] = even + odd;
          gu[M - j] = even - odd;
        } else {
          gu[Q] = even;
        }
      }
#pragma GCC unroll 16
      for (int j = 1; j <= Q; ++j) {
        vec even{}, odd{};
#pragma GCC unroll 16
        for (int m = 1; m < M; m += 2) odd += splat(sine[(m - 1) * kSin + j - 1]) * grad(kCos + m - 1);
        if (j < Q) {
#pragma GCC unroll 16
          for (int m = 2; m < M; m += 2) even += splat(sine[(m - 1) * kSin + j - 1]) * grad(kCos + m - 1);
          gv[j - 1] = even + odd;
          gv[M - j - 1] = odd - even;
        } else {
          gv[Q - 1] = odd;
        }
      }
    } else {
#pragma GCC unroll 16
      for (int m = 0; m < kCos; ++m) {
        vec acc{};
#pragma GCC unroll 16
        for (int k = 0; k < kCos; ++k) acc += splat(cosine[k * kCos + m]) * grad(k);
        gu[m] = acc;
      }
#pragma GCC unroll 16
      for (int m = 0; m < kSin; ++m) {
        vec acc{};
#pragma GCC unroll 16
        for (int k = 0; k < kSin; ++k) acc += splat(sine[k * kSin + m]) * grad(kCos + k);
        gv[m] = acc;
      }
    }
    out(0, gu[0]);
    out(N / 2, gu[N / 2]);
#pragma GCC unroll 16
    for (int j = 1; j < N / 2; ++j) {
      out(j, gu[j] + gv[j - 1]);
      out(N - j, gu[j] - gv[j - 1]);
    }
  }
}

// Calls fn(std::integral_constant<int, N>) for an unrolled ring size N (unrolled_ring).
template <typename F>
inline __attribute__((always_inline)) void with_ring_size(int64_t size, const F& fn) {
  switch (size) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 16: fn(std::integral_constant<int, 16>{}); break;
    case 24: fn(std::integral_constant<int, 24>{}); break;
    default: TIMM_SORTCONV_CHECK(false, "sort_conv_cpu: no unrolled ring DFT for ", size, " samples");
  }
}

template <typename scalar_t>
const scalar_t* block_weights(const AlignTables<scalar_t>& t, int64_t block, bool backward) {
  if (block < 0) return nullptr;
  return backward ? t.blocks[block].backward.data() : t.blocks[block].forward.data();
}

// spectra[k*k][lanes] from samples[k*k][lanes], ring by ring (t.rings).
template <typename scalar_t>
void rings_to_spectra(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* samples,
                      scalar_t* spectra) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const int64_t start = plan.segments[i].start;
    const scalar_t* cosine = block_weights(t, t.cosine_block[i], false);
    const scalar_t* sine = block_weights(t, t.sine_block[i], false);
    with_ring_size(plan.segments[i].size, [&](auto size) {
      for (int64_t h = 0; h < lanes; h += half) {
        const scalar_t* in = samples + start * lanes + h;
        scalar_t* out = spectra + start * lanes + h;
        ring_dft<vec, decltype(size)::value>([&](int j) __attribute__((always_inline)) { return load(in + j * lanes); }, cosine, sine,
                                             [&](int row, vec value) __attribute__((always_inline)) { store(out + row * lanes, value); });
      }
    });
  }
}

// The samples' gradient grad_samples[k*k][lanes] from the spectra's, ring by ring (t.rings).
template <typename scalar_t>
void rings_to_samples(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* grad_spectra,
                      scalar_t* grad_samples) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const int64_t start = plan.segments[i].start;
    const scalar_t* cosine = block_weights(t, t.cosine_block[i], true);
    const scalar_t* sine = block_weights(t, t.sine_block[i], true);
    with_ring_size(plan.segments[i].size, [&](auto size) {
      for (int64_t h = 0; h < lanes; h += half) {
        const scalar_t* in = grad_spectra + start * lanes + h;
        scalar_t* out = grad_samples + start * lanes + h;
        ring_dft_transposed<vec, decltype(size)::value>([&](int row) __attribute__((always_inline)) { return load(in + row * lanes); }, cosine, sine,
                                                        [&](int j, vec value) __attribute__((always_inline)) { store(out + j * lanes, value); });
      }
    });
  }
}

#if defined(TIMM_SORTCONV_SORT_DIRECT)
// a * b + c rounded once, as the compiler contracts apply_taps' sums (an explicit instruction: the contraction of an
// expression may fuse either product of a sum of two).
inline vfloat fused_multiply_add(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

bool known_polar_segment(int64_t k, int64_t start, int64_t size) {
  return (k == 3 && ((start == 0 && size == 1) || (start == 1 && size == 8)))
         || (k == 5 && ((start == 0 && size == 1) || (start == 1 && size == 8) || (start == 9 && size == 16)))
         || (k == 7 && ((start == 0 && size == 1) || (start == 1 && size == 8) || (start == 9 && size == 16)
                        || (start == 25 && size == 24)));
}

// Calls out(j, sample j) for a ring's N samples, as ring_dft would read them: the samples themselves where only they
// are wanted (kSamples: a guide's, add_guide_orientation), else ring_dft's spectra rows.
template <bool kSamples, typename vec, int N, typename scalar_t, typename Sample, typename Out>
inline __attribute__((always_inline)) void ring_rows(const Sample& sample, const scalar_t* cosine, const scalar_t* sine,
                                                     const Out& out) {
  if constexpr (kSamples) {
#pragma GCC unroll 24
    for (int j = 0; j < N; ++j) out(j, sample(j));
  } else {
    ring_dft<vec, N>(sample, cosine, sine, out);
  }
}

// One ring's (c, E) terms, taken from its rows as ring_dft hands them over (row r of N, in registers): the squares of
// the pairs' rows in four sums (so that the additions' latency does not bound the transform), the Nyquist row's and
// S_0's squares, the rows of S_1. add() folds them into a unit's state (c_re, c_im and E, kLanes apart) with the
// ring's 4 weights (AlignTables::ring_orientation_weights): the terms add_orientation adds, summed in another order.
template <int N>
struct RingOrientation {
  static constexpr int kCos = N / 2 + 1;
  vfloat squares[4] = {}, nyquist{}, level{}, first_re{}, first_im{};

  inline __attribute__((always_inline)) void row(int r, vfloat value) {
    if (r == 0) {
      level = value * value;
      return;
    }
    if (2 * r == N) {
      nyquist = value * value;
      return;
    }
    if (r == 1) first_re = value;
    if (r == kCos) first_im = value;
    squares[r & 3] += value * value;
  }

  inline __attribute__((always_inline)) void add(const float* weights, float* state) const {
    constexpr int64_t lanes = kLanes<float>;
    if constexpr (N == 1) return;
    const vfloat energy = splat(weights[0]) * ((squares[0] + squares[1]) + (squares[2] + squares[3]))
                          + splat(weights[1]) * nyquist + splat(weights[2]) * level;
    store(state, load(state) + splat(weights[3]) * first_re);
    store(state + lanes, load(state + lanes) + splat(weights[3]) * first_im);
    store(state + 2 * lanes, load(state + 2 * lanes) + energy);
  }
};

// One vector of ring [kStart, kStart + N)'s spectra (or samples: kSamples) with its samples read straight from the
// input: polar taps at compile-time positions (sort_polar_fixed's loads) or square samples (single_tap). kOriented:
// the ring's (c, E) terms added to `state` too (RingOrientation, with the ring's 4 `weights`).
template <int K, int kStart, int N, bool kTwo, bool kSamples, bool kOriented>
void polar_ring_spectra(const Plan<float>& plan, const float* cosine, const float* sine, const float* p0,
                        const float* p1, PieceMask m0, PieceMask m1, float* out, const float* weights,
                        float* state) {
  static_assert(!(kSamples && kOriented), "a guide's samples carry no spectra to orient by");
  using taps = PolarTaps<K>;
  constexpr int64_t lanes = kLanes<float>;
  RingOrientation<N> orientation;
  int64_t row[K], col[K];
  for (int i = 0; i < K; ++i) {
    row[i] = plan.grid_offset[i * K];
    col[i] = plan.grid_offset[i];
  }
  const float* weight = plan.polar_weight.data() + kStart * kPolarTaps;
  ring_rows<kSamples, vfloat, N>(
      [&](int i) __attribute__((always_inline)) {
        const int s = kStart + i;
        const auto tap = [&](int t) __attribute__((always_inline)) {
          return load_pieces<kTwo>(p0, p1, m0, m1, row[taps::kTap[s][t][0]] + col[taps::kTap[s][t][1]]);
        };
        const auto w = [&](int t) __attribute__((always_inline)) { return splat(weight[i * kPolarTaps + t]); };
        if (taps::kCount[s] == 1) return w(0) * tap(0);
        vfloat acc = fused_multiply_add(w(0), tap(0), w(1) * tap(1));
#pragma GCC unroll 4
        for (int t = 2; t < kPolarTaps; ++t) {
          if (t < taps::kCount[s]) acc = fused_multiply_add(w(t), tap(t), acc);
        }
        return acc;
      },
      cosine, sine, [&](int r, vfloat value) __attribute__((always_inline)) {
        store(out + r * lanes, value);
        if constexpr (kOriented) orientation.row(r, value);
      });
  if constexpr (kOriented) orientation.add(weights, state);
}

template <int N, bool kTwo, bool kSamples, bool kOriented>
void square_ring_spectra(const Plan<float>& plan, int64_t start, const float* cosine, const float* sine,
                         const float* p0, const float* p1, PieceMask m0, PieceMask m1, float* out,
                         const float* weights, float* state) {
  constexpr int64_t lanes = kLanes<float>;
  const int64_t* offset = plan.sample_offset.data() + start;
  RingOrientation<N> orientation;
  ring_rows<kSamples, vfloat, N>([&](int i) __attribute__((always_inline)) { return load_pieces<kTwo>(p0, p1, m0, m1, offset[i]); }, cosine, sine,
                      [&](int r, vfloat value) __attribute__((always_inline)) {
                        store(out + r * lanes, value);
                        if constexpr (kOriented) orientation.row(r, value);
                      });
  if constexpr (kOriented) orientation.add(weights, state);
}

template <bool kTwo, bool kSamples, bool kOriented>
void direct_ring_spectra(const Plan<float>& plan, const Segment& segment, const float* cosine, const float* sine,
                         const float* p0, const float* p1, PieceMask m0, PieceMask m1, float* out,
                         const float* weights, float* state) {
  if (polar_size(plan) == 0) {
    with_ring_size(segment.size, [&](auto size) {
      square_ring_spectra<decltype(size)::value, kTwo, kSamples, kOriented>(plan, segment.start, cosine, sine, p0, p1,
                                                                            m0, m1, out, weights, state);
    });
    return;
  }
  const int64_t key = polar_size(plan) * 10000 + segment.start * 100 + segment.size;
#define TIMM_SORTCONV_CASE(k, start, size)                                                                    \
  case k * 10000 + start * 100 + size:                                                                        \
    return polar_ring_spectra<k, start, size, kTwo, kSamples, kOriented>(plan, cosine, sine, p0, p1, m0, m1, out, \
                                                                         weights, state);
  switch (key) {
    TIMM_SORTCONV_CASE(3, 0, 1)
    TIMM_SORTCONV_CASE(3, 1, 8)
    TIMM_SORTCONV_CASE(5, 0, 1)
    TIMM_SORTCONV_CASE(5, 1, 8)
    TIMM_SORTCONV_CASE(5, 9, 16)
    TIMM_SORTCONV_CASE(7, 0, 1)
    TIMM_SORTCONV_CASE(7, 1, 8)
    TIMM_SORTCONV_CASE(7, 9, 16)
    TIMM_SORTCONV_CASE(7, 25, 24)
    default:
      TIMM_SORTCONV_CHECK(false, "sort_conv_cpu: no polar ring [", segment.start, ", ", segment.start + segment.size,
                  ") for k = ", polar_size(plan));
  }
#undef TIMM_SORTCONV_CASE
}

// window_spectra straight from the input (gathering, the fold and the DFT in registers, as sort_direct gathers and
// sorts), or only the samples (kSamples: gather_samples' values); false (nothing done) where the tables or the
// block do not allow it. `state` (spectra only, t.ring_orientation): the unit's state, to which the channel's (c, E)
// are added as its rows are made (RingOrientation); nullptr: none.
template <bool kSamples = false>
bool direct_spectra(const Plan<float>& plan, const AlignTables<float>& t, const float* channel_input,
                    const Block& block, float* spectra, bool narrow = false, float* state = nullptr) {
  constexpr int64_t lanes = kLanes<float>, half = kVecLanes<float>;
  if (!t.direct || !block.direct) return false;
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const Segment& segment = plan.segments[i];
    const float* cosine = block_weights(t, t.cosine_block[i], false);
    const float* sine = block_weights(t, t.sine_block[i], false);
    const float* weights = state != nullptr ? t.ring_orientation_weights.data() + 4 * i : nullptr;
    for (int64_t h = 0; h < (narrow ? 1 : lanes / half); ++h) {
      const VectorSource& source = block.source[h];
      const float* p0 = channel_input + source.base[0];
      const float* p1 = channel_input + source.base[1];
      const PieceMask m0 = piece_mask(source.mask[0]), m1 = piece_mask(source.mask[1]);
      float* out = spectra + segment.start * lanes + h * half;
      const auto ring = [&](auto two, auto oriented) __attribute__((always_inline)) {
        direct_ring_spectra<decltype(two)::value, kSamples, decltype(oriented)::value>(
            plan, segment, cosine, sine, p0, p1, m0, m1, out, weights, state != nullptr ? state + h * half : nullptr);
      };
      using yes = std::true_type;
      using no = std::false_type;
      if constexpr (!kSamples) {  // a guide's samples are never oriented (polar_ring_spectra's static_assert)
        if (state != nullptr) {
          source.mask[1] != 0 ? ring(yes{}, yes{}) : ring(no{}, yes{});
          continue;
        }
      }
      source.mask[1] != 0 ? ring(yes{}, no{}) : ring(no{}, no{});
    }
  }
  return true;
}
#else
bool known_polar_segment(int64_t, int64_t, int64_t) { return false; }
#endif

template <bool kSamples = false, typename scalar_t>
bool direct_spectra(const Plan<scalar_t>&, const AlignTables<scalar_t>&, const scalar_t*, const Block&, scalar_t*,
                    bool = false, scalar_t* = nullptr) {
  return false;
}

// The harmonic rows spectra[k*k][lanes] of one channel's windows in the block: straight from the input where
// direct_spectra can, else gathered, then folded and each block of the DFT taken ring by ring in registers
// (t.rings) or as a micro-GEMM over the lanes.
// spectra[k*k][lanes] from samples[k*k][lanes] (slot order): the fold, then the DFT's blocks.
template <typename scalar_t>
void samples_to_spectra(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* samples,
                        scalar_t* folded, scalar_t* spectra) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  if (t.rings) {
    rings_to_spectra(plan, t, samples, spectra);
    return;
  }
  apply_taps(t.fold, samples, folded);
  for (const auto& b : t.blocks) {
    gemm_rows(folded + b.start * lanes, b.size, b.forward.data(), b.size, b.size, spectra + b.start * lanes, false);
  }
}

// Returns whether the channel's (c, E) were added to `state` on the way (the direct path with t.ring_orientation);
// otherwise the caller adds them (add_orientation). `state`: the unit's state, or nullptr where nothing turns.
template <typename scalar_t, bool kUnitStride>
bool window_spectra(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* channel_input,
                    const Block& block, scalar_t* grid, scalar_t* samples, scalar_t* folded, scalar_t* spectra,
                    bool narrow = false, scalar_t* state = nullptr) {
  scalar_t* oriented = t.ring_orientation ? state : nullptr;
  if (kUnitStride && direct_spectra(plan, t, channel_input, block, spectra, narrow, oriented)) {
    return oriented != nullptr;
  }
  gather_samples<scalar_t, kUnitStride>(plan, channel_input, block, grid, samples);
  samples_to_spectra(plan, t, samples, folded, spectra);
  return false;
}

// The samples' gradient grad_samples[k*k][lanes] from the spectra's, through the DFT's and the fold's transposes.
template <typename scalar_t>
void spectra_to_samples(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* grad_spectra,
                        scalar_t* grad_folded, scalar_t* grad_samples) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  if (t.rings) {
    rings_to_samples(plan, t, grad_spectra, grad_samples);
    return;
  }
  for (const auto& b : t.blocks) {
    gemm_rows(grad_spectra + b.start * lanes, b.size, b.backward.data(), b.size, b.size, grad_folded + b.start * lanes,
              false);
  }
  apply_taps(t.unfold, grad_folded, grad_samples);
}

// state[0..2] += one channel's (c_re, c_im, E), summed in registers a vector of lanes at a time (`narrow`: the
// first vector only).
template <typename scalar_t>
void add_orientation(const AlignTables<scalar_t>& t, const scalar_t* spectra, scalar_t* state, bool narrow = false) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  for (int64_t h = 0; h < (narrow ? half : lanes); h += half) {
    vec c_re = load(state + h), c_im = load(state + lanes + h), energy = load(state + 2 * lanes + h);
    for (size_t i = 0; i < t.first_pair.size(); ++i) {
      const vec w = splat(t.first_weight[i]);
      c_re += w * load(spectra + t.re(t.first_pair[i]) * lanes + h);
      c_im += w * load(spectra + t.im(t.first_pair[i]) * lanes + h);
    }
    for (int64_t p = 0; p < t.pairs; ++p) {
      const vec re = load(spectra + t.re(p) * lanes + h), im = load(spectra + t.im(p) * lanes + h);
      energy += splat(t.pair_energy[p]) * (re * re + im * im);
    }
    for (size_t i = 0; i < t.energy_row.size(); ++i) {
      const vec x = load(spectra + t.energy_row[i] * lanes + h);
      energy += splat(t.energy_weight[i]) * x * x;
    }
    store(state + h, c_re);
    store(state + lanes + h, c_im);
    store(state + 2 * lanes + h, energy);
  }
}

// The mean of one vector of lanes of a ring's n samples (rows kLanes apart), its sum in two chains of additions.
template <typename scalar_t>
inline typename Simd<scalar_t>::vec ring_mean(const scalar_t* ring, int64_t n) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>;
  vec even{}, odd{};
  int64_t j = 0;
  for (; j + 1 < n; j += 2) {
    even += load(ring + j * lanes);
    odd += load(ring + (j + 1) * lanes);
  }
  if (j < n) even += load(ring + j * lanes);
  return (even + odd) * splat(scalar_t(1) / static_cast<scalar_t>(n));
}

// state[0..2] += a guide channel's (c_re, c_im, E) from its samples[k*k][lanes] (t.guide_re non-empty): c from the
// tables' sums over the samples, E per ring as the samples' variance, sum_j (s_j - mean)^2 / N, which by Parseval
// is sum_{m != 0} |S_m|^2 / N^2, plus the ring's guide_level times mean^2 (S_0's term): add_orientation's sum, the
// same values up to rounding, without the ring DFTs.
template <typename scalar_t>
void add_guide_orientation(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* samples,
                           scalar_t* state) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  static_assert(lanes == 2 * half, "a block's lanes are two vectors");
  // Both vectors of lanes (a and b) at once, and even and odd samples in separate sums: four independent chains of
  // additions for each quantity, so that the adds' latency does not bound the loops.
  vec re_a[2] = {}, re_b[2] = {}, im_a[2] = {}, im_b[2] = {}, energy_a{}, energy_b{};
  const auto first = [&](int64_t s, int u) __attribute__((always_inline)) {
    const vec wr = splat(t.guide_re[s]), wi = splat(t.guide_im[s]);
    const vec a = load(samples + s * lanes), b = load(samples + s * lanes + half);
    re_a[u] += wr * a;
    re_b[u] += wr * b;
    im_a[u] += wi * a;
    im_b[u] += wi * b;
  };
  int64_t s = 0;
  for (; s + 1 < plan.slots; s += 2) {
    first(s, 0);
    first(s + 1, 1);
  }
  if (s < plan.slots) first(s, 0);
  for (const auto& segment : plan.segments) {
    const scalar_t* ring = samples + segment.start * lanes;
    const int64_t n = segment.size;
    const vec per = splat(scalar_t(1) / static_cast<scalar_t>(n));
    const vec mean_a = ring_mean(ring, n), mean_b = ring_mean(ring + half, n);
    const vec level = splat(t.guide_level[segment.start]);
    energy_a += level * mean_a * mean_a;
    energy_b += level * mean_b * mean_b;
    if (n == 1) continue;
    vec squares_a[2] = {}, squares_b[2] = {};
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      for (int u = 0; u < 2; ++u) {
        const vec da = load(ring + (j + u) * lanes) - mean_a, db = load(ring + (j + u) * lanes + half) - mean_b;
        squares_a[u] += da * da;
        squares_b[u] += db * db;
      }
    }
    if (j < n) {
      const vec da = load(ring + j * lanes) - mean_a, db = load(ring + j * lanes + half) - mean_b;
      squares_a[0] += da * da;
      squares_b[0] += db * db;
    }
    energy_a += per * (squares_a[0] + squares_a[1]);
    energy_b += per * (squares_b[0] + squares_b[1]);
  }
  const vec sums[6] = {re_a[0] + re_a[1], re_b[0] + re_b[1], im_a[0] + im_a[1], im_b[0] + im_b[1], energy_a, energy_b};
  for (int64_t r = 0; r < 6; ++r) store(state + r * half, load(state + r * half) + sums[r]);
}

// The transpose of add_guide_orientation: the guide's samples' gradient grad_samples[k*k][lanes] from its
// orientation's (grad_orientation: dL/dc_re, dL/dc_im, dL/dE): the tables' sums' weights, 2 (s_j - mean) / N from
// each ring's variance and 2 level mean / N from its squared mean.
template <typename scalar_t>
void guide_samples_gradient(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t,
                            const scalar_t* grad_orientation, const scalar_t* samples, scalar_t* grad_samples) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  for (int64_t h = 0; h < lanes; h += half) {
    const vec g_re = load(grad_orientation + h), g_im = load(grad_orientation + lanes + h);
    const vec g_energy = load(grad_orientation + 2 * lanes + h);
    for (int64_t s = 0; s < plan.slots; ++s) {
      store(grad_samples + s * lanes + h, splat(t.guide_re[s]) * g_re + splat(t.guide_im[s]) * g_im);
    }
    for (const auto& segment : plan.segments) {
      const scalar_t* ring = samples + segment.start * lanes + h;
      scalar_t* grad = grad_samples + segment.start * lanes + h;
      const vec per = splat(scalar_t(1) / static_cast<scalar_t>(segment.size));
      const vec mean = ring_mean(ring, segment.size), scale = splat(scalar_t(2)) * per * g_energy;
      const vec offset = (splat(t.guide_level[segment.start]) - splat(scalar_t(1))) * mean;
      for (int64_t j = 0; j < segment.size; ++j) {
        store(grad + j * lanes, load(grad + j * lanes) + scale * (load(ring + j * lanes) + offset));
      }
    }
  }
}

// The direction e = c / |c| and the gate g of a unit's (c, E), per lane (alignment._gate_and_direction).
template <typename scalar_t>
struct Direction {
  scalar_t re[kLanes<scalar_t>], im[kLanes<scalar_t>], gate[kLanes<scalar_t>], norm[kLanes<scalar_t>];
};

template <typename scalar_t>
void direction_of(const AlignTables<scalar_t>& t, const scalar_t* state, Direction<scalar_t>& d) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const scalar_t* c_re = state;
  const scalar_t* c_im = state + lanes;
  const scalar_t* energy = state + 2 * lanes;
#pragma omp simd
  for (int64_t l = 0; l < lanes; ++l) {
    const scalar_t power = c_re[l] * c_re[l] + c_im[l] * c_im[l];
    d.norm[l] = scalar_t(1) / std::sqrt(power + t.tiny);
    d.gate[l] = power / (power + t.relative * energy[l] + t.tiny);
    d.re[l] = c_re[l] * d.norm[l];
    d.im[l] = c_im[l] * d.norm[l];
  }
}

// The unit's gated powers T_m = g * conj(e)^m, m = 1 .. largest, into its state rows, from its (c, E); each
// power is the previous one times conj(e), as the reference builds them.
template <typename scalar_t>
void make_turns(const AlignTables<scalar_t>& t, scalar_t* state) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  Direction<scalar_t> d;
  direction_of(t, state, d);
  scalar_t* turn_re = state + 3 * lanes;
  scalar_t* turn_im = turn_re + (t.largest + 1) * lanes;
#pragma omp simd
  for (int64_t l = 0; l < lanes; ++l) {
    turn_re[lanes + l] = d.re[l] * d.gate[l];
    turn_im[lanes + l] = -d.im[l] * d.gate[l];
  }
  for (int64_t m = 2; m <= t.largest; ++m) {
    const scalar_t* __restrict pr = turn_re + (m - 1) * lanes;
    const scalar_t* __restrict pi = turn_im + (m - 1) * lanes;
    scalar_t* __restrict r = turn_re + m * lanes;
    scalar_t* __restrict i = turn_im + m * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      r[l] = pr[l] * d.re[l] + pi[l] * d.im[l];
      i[l] = pi[l] * d.re[l] - pr[l] * d.im[l];
    }
  }
}

// out = the spectra turned by the unit's powers (out may be `in`): A_m = S_m * T_m for the pairs, a Nyquist
// channel times Re T_{N/2}, the other fixed channels as they are; `narrow`: the first vector of lanes only.
template <typename scalar_t>
void turn_spectra(const AlignTables<scalar_t>& t, const scalar_t* state, const scalar_t* in, scalar_t* out,
                  bool narrow = false) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t used = narrow ? kVecLanes<scalar_t> : lanes;
  const scalar_t* turn_re = state + 3 * lanes;
  const scalar_t* turn_im = turn_re + (t.largest + 1) * lanes;
  if (out != in) {
    for (const int64_t row : t.still_row) std::memcpy(out + row * lanes, in + row * lanes, used * sizeof(scalar_t));
  }
  for (size_t i = 0; i < t.nyquist_row.size(); ++i) {
    const scalar_t* tr = turn_re + t.nyquist_m[i] * lanes;
    const scalar_t* s = in + t.nyquist_row[i] * lanes;
    scalar_t* o = out + t.nyquist_row[i] * lanes;
#pragma omp simd
    for (int64_t l = 0; l < used; ++l) o[l] = s[l] * tr[l];
  }
  for (int64_t p = 0; p < t.pairs; ++p) {
    const scalar_t* tr = turn_re + t.pair_m[p] * lanes;
    const scalar_t* ti = turn_im + t.pair_m[p] * lanes;
    const scalar_t* re = in + t.re(p) * lanes;
    const scalar_t* im = in + t.im(p) * lanes;
    scalar_t* out_re = out + t.re(p) * lanes;
    scalar_t* out_im = out + t.im(p) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < used; ++l) {
      const scalar_t a = re[l], b = im[l];
      out_re[l] = a * tr[l] - b * ti[l];
      out_im[l] = a * ti[l] + b * tr[l];
    }
  }
}

// turn_spectra in place on `channels` channels' spectra (slots rows of lanes each, one after the other) that share the
// unit's powers in `state` ("align"): pair by pair, each power's vectors loaded once for all the channels.
template <typename scalar_t>
void turn_panel(const AlignTables<scalar_t>& t, const scalar_t* state, scalar_t* spectra, int64_t channels,
                int64_t slots, bool narrow = false) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t stride = slots * lanes;
  const scalar_t* turn_re = state + 3 * lanes;
  const scalar_t* turn_im = turn_re + (t.largest + 1) * lanes;
  for (int64_t h = 0; h < (narrow ? half : lanes); h += half) {
    for (size_t i = 0; i < t.nyquist_row.size(); ++i) {
      const vec tr = load(turn_re + t.nyquist_m[i] * lanes + h);
      scalar_t* s = spectra + t.nyquist_row[i] * lanes + h;
      for (int64_t c = 0; c < channels; ++c) store(s + c * stride, load(s + c * stride) * tr);
    }
    for (int64_t p = 0; p < t.pairs; ++p) {
      const vec tr = load(turn_re + t.pair_m[p] * lanes + h), ti = load(turn_im + t.pair_m[p] * lanes + h);
      scalar_t* re = spectra + t.re(p) * lanes + h;
      scalar_t* im = spectra + t.im(p) * lanes + h;
      for (int64_t c = 0; c < channels; ++c) {
        const vec a = load(re + c * stride), b = load(im + c * stride);
        store(re + c * stride, a * tr - b * ti);
        store(im + c * stride, a * ti + b * tr);
      }
    }
  }
}

// The transpose of turn_spectra on the aligned gradient `grad` (in place, becoming the spectra's gradient through
// the turn), and dL/dT_m added to grad_turn (Re rows then Im rows, m = 0 .. largest): for A = S * T,
// dL/dS = gA * conj(T) and dL/dT = gA * conj(S) (as pairs of reals: the gradient of a complex product).
template <typename scalar_t>
void turn_back(const AlignTables<scalar_t>& t, const scalar_t* state, const scalar_t* spectra, scalar_t* grad,
               scalar_t* grad_turn) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const scalar_t* turn_re = state + 3 * lanes;
  const scalar_t* turn_im = turn_re + (t.largest + 1) * lanes;
  scalar_t* grad_re = grad_turn;
  scalar_t* grad_im = grad_turn + (t.largest + 1) * lanes;
  for (size_t i = 0; i < t.nyquist_row.size(); ++i) {
    const int64_t m = t.nyquist_m[i];
    const scalar_t* __restrict tr = turn_re + m * lanes;
    const scalar_t* __restrict s = spectra + t.nyquist_row[i] * lanes;
    scalar_t* __restrict g = grad + t.nyquist_row[i] * lanes;
    scalar_t* __restrict gr = grad_re + m * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      gr[l] += g[l] * s[l];
      g[l] *= tr[l];
    }
  }
  for (int64_t p = 0; p < t.pairs; ++p) {
    const int64_t m = t.pair_m[p];
    const scalar_t* __restrict tr = turn_re + m * lanes;
    const scalar_t* __restrict ti = turn_im + m * lanes;
    const scalar_t* __restrict re = spectra + t.re(p) * lanes;
    const scalar_t* __restrict im = spectra + t.im(p) * lanes;
    scalar_t* __restrict g_re = grad + t.re(p) * lanes;
    scalar_t* __restrict g_im = grad + t.im(p) * lanes;
    scalar_t* __restrict gr = grad_re + m * lanes;
    scalar_t* __restrict gi = grad_im + m * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      const scalar_t a = g_re[l], b = g_im[l];
      gr[l] += a * re[l] + b * im[l];
      gi[l] += b * re[l] - a * im[l];
      g_re[l] = a * tr[l] + b * ti[l];
      g_im[l] = b * tr[l] - a * ti[l];
    }
  }
}

// (dL/dc_re, dL/dc_im, dL/dE) into grad_orientation[3][lanes] from the unit's dL/dT_m (grad_turn, consumed).
//   T_m = T_{m-1} * conj(e):  with T_{m-1} = (a, b), Re T_m = a e_re + b e_im, Im T_m = b e_re - a e_im, so
//     dL/de_re += gr a + gi b,  dL/de_im += gr b - gi a,  dL/dT_{m-1} += (gr e_re - gi e_im, gr e_im + gi e_re);
//   T_1 = (g e_re, -g e_im):  dL/dg = gr e_re - gi e_im,  dL/de_re += gr g,  dL/de_im -= gi g;
//   e = c n with n = (|c|^2 + TINY)^(-1/2), dn/d|c|^2 = -n^3 / 2; g = |c|^2 / D with D = |c|^2 + RELATIVE E + TINY,
//     dg/d|c|^2 = (RELATIVE E + TINY) / D^2, dg/dE = -RELATIVE |c|^2 / D^2; d|c|^2/dc = 2 c.
template <typename scalar_t>
void orientation_backward(const AlignTables<scalar_t>& t, const scalar_t* state, scalar_t* grad_turn,
                          scalar_t* grad_orientation) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  Direction<scalar_t> d;
  direction_of(t, state, d);
  const scalar_t* turn_re = state + 3 * lanes;
  const scalar_t* turn_im = turn_re + (t.largest + 1) * lanes;
  scalar_t* grad_re = grad_turn;
  scalar_t* grad_im = grad_turn + (t.largest + 1) * lanes;
  scalar_t g_er[lanes] = {}, g_ei[lanes] = {};
  for (int64_t m = t.largest; m >= 2; --m) {
    const scalar_t* __restrict a = turn_re + (m - 1) * lanes;
    const scalar_t* __restrict b = turn_im + (m - 1) * lanes;
    const scalar_t* __restrict gr = grad_re + m * lanes;
    const scalar_t* __restrict gi = grad_im + m * lanes;
    scalar_t* __restrict ga = grad_re + (m - 1) * lanes;
    scalar_t* __restrict gb = grad_im + (m - 1) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      g_er[l] += gr[l] * a[l] + gi[l] * b[l];
      g_ei[l] += gr[l] * b[l] - gi[l] * a[l];
      ga[l] += gr[l] * d.re[l] - gi[l] * d.im[l];
      gb[l] += gr[l] * d.im[l] + gi[l] * d.re[l];
    }
  }
  const scalar_t* c_re = state;
  const scalar_t* c_im = state + lanes;
  const scalar_t* energy = state + 2 * lanes;
  const scalar_t* gr = grad_re + lanes;
  const scalar_t* gi = grad_im + lanes;
#pragma omp simd
  for (int64_t l = 0; l < lanes; ++l) {
    const scalar_t g_gate = gr[l] * d.re[l] - gi[l] * d.im[l];
    const scalar_t er = g_er[l] + gr[l] * d.gate[l], ei = g_ei[l] - gi[l] * d.gate[l];
    const scalar_t power = c_re[l] * c_re[l] + c_im[l] * c_im[l];
    const scalar_t rest = t.relative * energy[l] + t.tiny, per_denominator = g_gate / (power + rest);
    // n^3 (c . dL/de) as n^2 (e . dL/de), and dL/dg / D^2 as (dL/dg / D) times a quotient <= 1: for a flat window
    // (D = TINY) they stay within float32's range, where D^2 and n^3 would leave it.
    const scalar_t g_power = -scalar_t(0.5) * (er * d.re[l] + ei * d.im[l]) * d.norm[l] * d.norm[l]
                             + per_denominator * (rest / (power + rest));
    grad_orientation[l] = er * d.norm[l] + 2 * c_re[l] * g_power;
    grad_orientation[lanes + l] = ei * d.norm[l] + 2 * c_im[l] * g_power;
    grad_orientation[2 * lanes + l] = -per_denominator * t.relative * d.gate[l];
  }
}

// grad (one channel's spectra gradient) += the orientation's term: through c (m = 1 pairs, 1 / N) and through E.
template <typename scalar_t>
void add_orientation_gradient(const AlignTables<scalar_t>& t, const scalar_t* grad_orientation,
                              const scalar_t* spectra, scalar_t* grad) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const scalar_t* __restrict g_re = grad_orientation;
  const scalar_t* __restrict g_im = grad_orientation + lanes;
  const scalar_t* __restrict g_energy = grad_orientation + 2 * lanes;
  for (size_t i = 0; i < t.first_pair.size(); ++i) {
    const scalar_t w = t.first_weight[i];
    scalar_t* __restrict re = grad + t.re(t.first_pair[i]) * lanes;
    scalar_t* __restrict im = grad + t.im(t.first_pair[i]) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      re[l] += w * g_re[l];
      im[l] += w * g_im[l];
    }
  }
  for (int64_t p = 0; p < t.pairs; ++p) {
    const scalar_t w = 2 * t.pair_energy[p];
    const scalar_t* __restrict s_re = spectra + t.re(p) * lanes;
    const scalar_t* __restrict s_im = spectra + t.im(p) * lanes;
    scalar_t* __restrict re = grad + t.re(p) * lanes;
    scalar_t* __restrict im = grad + t.im(p) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      re[l] += w * g_energy[l] * s_re[l];
      im[l] += w * g_energy[l] * s_im[l];
    }
  }
  for (size_t i = 0; i < t.energy_row.size(); ++i) {
    const scalar_t w = 2 * t.energy_weight[i];
    const scalar_t* __restrict s = spectra + t.energy_row[i] * lanes;
    scalar_t* __restrict g = grad + t.energy_row[i] * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) g[l] += w * g_energy[l] * s[l];
  }
}

// The group's orientation units (one for "align", one per channel for "align-channel"): the state of the
// unit of channel ci, or of every channel's unit in turn.
inline int64_t units_of(bool shared, int64_t channels_per_group) { return shared ? 1 : channels_per_group; }

// The group's spectra[C/g][k*k][lanes] of the block, each channel's (c, E) added to its unit's state as its rows are
// made (the direct path, RingOrientation) or while they are still in L1 (add_orientation), and, where
// anything turns, each unit's gated powers: states[unit] holds state_rows() rows of lanes. A guide channel's rows
// hold its samples instead where add_guide_orientation serves it (t.guide_re non-empty; spectra then has a vector
// more than its rows, which gather_samples may write).
template <typename scalar_t, bool kUnitStride>
void group_spectra(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, int64_t channels,
                   const scalar_t* group_input, const Block& block, scalar_t* grid, scalar_t* samples,
                   scalar_t* folded, scalar_t* spectra, scalar_t* states, bool narrow = false) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t slots = plan.slots, plane = plan.in_h * plan.in_w, state_size = t.state_rows() * lanes;
  const int64_t units = units_of(t.shared, channels);
  const bool turns = t.pairs > 0;
  if (turns) std::fill(states, states + units * state_size, scalar_t(0));
  for (int64_t ci = 0; ci < channels; ++ci) {
    scalar_t* channel_spectra = spectra + ci * slots * lanes;
    if (ci >= channels - t.guides && !t.guide_re.empty()) {  // a guide: its samples in its rows, for the backward
      if (!turns) continue;
      if (!kUnitStride || !direct_spectra<true>(plan, t, group_input + ci * plane, block, channel_spectra,
                                                            narrow)) {
        gather_samples<scalar_t, kUnitStride>(plan, group_input + ci * plane, block, grid, channel_spectra);
      }
      add_guide_orientation(plan, t, channel_spectra, states);
      continue;
    }
    scalar_t* state = turns ? states + (t.shared ? 0 : ci) * state_size : nullptr;
    if (!window_spectra<scalar_t, kUnitStride>(plan, t, group_input + ci * plane, block, grid, samples, folded,
                                               channel_spectra, narrow, state) && turns) {
      add_orientation(t, channel_spectra, state, narrow);
    }
  }
  if (turns) {
    for (int64_t u = 0; u < units; ++u) make_turns(t, states + u * state_size);
  }
}

// weight_packed: the harmonic weight (groups, C/g * k*k, O/g) with each panel chunk's rows in gemm_tiles' layout
// (tile_forward_weights).
template <typename scalar_t, bool kUnitStride>
void align_forward_kernel(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const Shape& shape,
                          const scalar_t* input, const scalar_t* weight_packed, const scalar_t* bias,
                          scalar_t* output) {
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, positions = plan.positions(), plane = plan.in_h * plan.in_w;
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group(), state_size = t.state_rows() * lanes;
  // The input's channels per group: the weighted ones, then the guide's (t.guides), read for the orientation only.
  const int64_t cin = cg + t.guides, in_channels = cin * shape.groups;
  const int64_t panel_channels = panel_channels_of(cg, slots);
  const ForwardSplit split = forward_split<scalar_t>(shape, positions, slots, true);
  for_each_forward_part(split, shape.batch * positions, og, half,
                        [&](int64_t begin, int64_t end, const RowRange& rows) {
    // gather_samples may write a vector past its last row.
    std::vector<scalar_t> spectra(cin * slots * lanes + half), samples(slots * lanes + half),
        grid(slots * lanes + half), folded(slots * lanes);
    std::vector<scalar_t> states(units_of(t.shared, cg) * t.state_rows() * lanes), tile(shape.out_channels * lanes);
    std::vector<Block> blocks(1);
    ImageRing<scalar_t> ring(plan, input, nullptr, shape.batch, in_channels, begin, end, lanes);
    for (int64_t start = begin; start < end; start += lanes) {
      const int64_t stop = std::min(start + lanes, end);
      cover_pass<scalar_t, kUnitStride>(plan, ring, start, stop, in_channels, blocks);
      const Block& block = blocks[0];
      // A block within the first vector of lanes takes its spectra, turn and products there only (store_lanes
      // writes the block's own lanes). A few positions past the block's last whole vector (a 7 x 7 map's 49th,
      // 14 x 14's last 4) take their products with the outputs on the lanes instead (gemm_tiles_positions).
      const bool narrow = narrow_block<scalar_t>(block.count), tail = position_tail<scalar_t>(block.count);
      const int64_t whole = block.count / half * half;
      const scalar_t* images = ring.images();
      for_each_output(shape, rows, [&](int64_t o) {
        start_tile_row(plan, shape, block, bias, o, tile.data() + o * lanes);
      });
      for (int64_t g = 0; g < shape.groups; ++g) {
        group_spectra<scalar_t, kUnitStride>(plan, t, cin, images + g * cin * plane, block, grid.data(),
                                             samples.data(), folded.data(), spectra.data(), states.data(), narrow);
        // Panel by panel, each turned in place just before its product, so that the product reads it from L1
        // (turn_panel: a pair's powers loaded once for the panel's channels).
        // weight_packed holds (groups, C/g * k*k, O/g) values: these channels' harmonic rows, tiled per panel chunk.
        for (int64_t c0 = 0; c0 < cg; c0 += panel_channels) {
          const int64_t channels = std::min(panel_channels, cg - c0);
          scalar_t* panel = spectra.data() + c0 * slots * lanes;
          if (t.pairs > 0 && t.shared) turn_panel(t, states.data(), panel, channels, slots, narrow);
          for (int64_t ci = c0; t.pairs > 0 && !t.shared && ci < c0 + channels; ++ci) {
            scalar_t* channel_spectra = spectra.data() + ci * slots * lanes;
            turn_spectra(t, states.data() + ci * state_size, channel_spectra, channel_spectra, narrow);
          }
          const scalar_t* w = weight_packed + (g * cg + c0) * slots * og;
          scalar_t* group_tile = tile.data() + g * og * lanes;
          // (a tail follows at most one whole vector: narrow)
          const int64_t depth = channels * slots;
          if (!tail || whole > 0) gemm_tiles(panel, depth, w, og, group_tile, true, &rows, narrow || tail);
          if (tail) gemm_tiles_positions(panel, depth, w, og, rows, group_tile, whole, block.count - whole);
        }
      }
      for_each_output(shape, rows, [&](int64_t o) {
        if (shape.relu) rectify(tile.data() + o * lanes);
        store_lanes(plan, block, tile.data() + o * lanes, output + o * positions, shape.out_channels * positions);
      });
    }
  });
}

// weight: the harmonic weight (O, C/g * k*k); grad_weight_parts: per thread (C * k*k, outputs_padded).
template <typename scalar_t, bool kUnitStride>
void align_backward_kernel(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const Shape& shape,
                           const scalar_t* input, const scalar_t* grad_output, const scalar_t* weight,
                           scalar_t* grad_input, std::vector<std::vector<scalar_t>>& grad_input_parts,
                           std::vector<std::vector<scalar_t>>& grad_weight_parts, int64_t outputs_padded,
                           int64_t threads) {
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, positions = plan.positions(), plane = plan.in_h * plan.in_w;
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group(), state_size = t.state_rows() * lanes;
  const int64_t cin = cg + t.guides, in_channels = cin * shape.groups;  // as in align_forward_kernel
  const int64_t panel_channels = panel_channels_of(cg, slots);
  const bool need_input = grad_input != nullptr || !grad_input_parts.empty();
  const bool need_weight = !grad_weight_parts.empty();
  // A thread owns whole images (its scatter races with nobody) unless there are fewer images than threads.
  const bool whole_images = need_input && grad_input_parts.empty();
  for_each_thread_range(shape.batch, positions, threads, whole_images, [&](int64_t thread, int64_t begin, int64_t end) {
    std::vector<scalar_t> grad_tile(shape.out_channels * lanes), grad_tile_t(shape.groups * lanes * outputs_padded);
    std::vector<scalar_t> spectra(cin * slots * lanes + half), aligned(panel_channels * slots * lanes),
        grad_columns(cin * slots * lanes), samples(slots * lanes + half), grid(slots * lanes + half),
        folded(slots * lanes), grad_samples(slots * lanes), grad_grid(slots * lanes);
    std::vector<scalar_t> states(units_of(t.shared, cg) * state_size), grad_turn(2 * (t.largest + 1) * lanes),
        grad_orientation(3 * lanes);
    std::vector<Block> blocks(1);
    scalar_t* grad_in = grad_input_parts.empty() ? grad_input : grad_input_parts[thread].data();
    scalar_t* grad_weight = need_weight ? grad_weight_parts[thread].data() : nullptr;
    ImageRing<scalar_t> ring(plan, input, need_input ? grad_in : nullptr, shape.batch, in_channels, begin, end,
                             lanes);
    for (int64_t start = begin; start < end; start += lanes) {
      const int64_t stop = std::min(start + lanes, end);
      cover_pass<scalar_t, kUnitStride>(plan, ring, start, stop, in_channels, blocks);
      const Block& block = blocks[0];
      const int64_t count = block.count;
      const scalar_t* images = ring.images();
      scalar_t* grad_images = need_input ? ring.grads() : nullptr;
      std::fill(grad_tile.begin(), grad_tile.end(), scalar_t(0));
      for (int64_t o = 0; o < shape.out_channels; ++o) {
        load_lanes(plan, block, grad_output + o * positions, shape.out_channels * positions,
                   grad_tile.data() + o * lanes);
      }
      if (need_weight) {
        // Per group, the block's lanes by O/g padded: the layout gemm_reduce reads.
        std::fill(grad_tile_t.begin(), grad_tile_t.end(), scalar_t(0));
        for (int64_t g = 0; g < shape.groups; ++g) {
          scalar_t* rows = grad_tile_t.data() + g * lanes * outputs_padded;
          for (int64_t o = 0; o < og; ++o) {
            const scalar_t* from = grad_tile.data() + (g * og + o) * lanes;
            for (int64_t lane = 0; lane < count; ++lane) rows[lane * outputs_padded + o] = from[lane];
          }
        }
      }
      for (int64_t g = 0; g < shape.groups; ++g) {
        group_spectra<scalar_t, kUnitStride>(plan, t, cin, images + g * cin * plane, block, grid.data(),
                                             samples.data(), folded.data(), spectra.data(), states.data());
        const bool turns = t.pairs > 0;
        const auto state_of = [&](int64_t ci) { return states.data() + (t.shared ? 0 : ci) * state_size; };
        const auto to_input = [&](int64_t ci) {
          spectra_to_samples(plan, t, grad_columns.data() + ci * slots * lanes, folded.data(), grad_samples.data());
          scatter_gradients<scalar_t, kUnitStride>(plan, block, grad_samples.data(), grad_grid.data(),
                                                   grad_images + (g * cin + ci) * plane);
        };
        if (turns && t.shared) std::fill(grad_turn.begin(), grad_turn.end(), scalar_t(0));
        // Panel by panel, so that what it reads and writes stays in L1: its aligned columns (turned into `aligned`),
        // their share of the weight gradient, their gradient (for each of the group's O/g outputs the harmonic
        // weight's row times the output gradient) and that gradient back through the turn, collecting dL/dT. A unit
        // of one channel then goes on to its orientation's gradient and to the input; the group's unit ("align")
        // does once all its channels have added to dL/dT.
        for (int64_t c0 = 0; c0 < cg; c0 += panel_channels) {
          const int64_t channels = std::min(panel_channels, cg - c0);
          const scalar_t* columns = spectra.data() + c0 * slots * lanes;
          if (turns) {
            for (int64_t ci = c0; ci < c0 + channels; ++ci) {
              turn_spectra(t, state_of(ci), spectra.data() + ci * slots * lanes,
                           aligned.data() + (ci - c0) * slots * lanes);
            }
            columns = aligned.data();
          }
          if (need_weight) {
            gemm_reduce(columns, 0, channels * slots, &count, 1, grad_tile_t.data() + g * lanes * outputs_padded,
                        outputs_padded, grad_weight + (g * cg + c0) * slots * outputs_padded);
          }
          if (!need_input) continue;
          gemm_rows(grad_tile.data() + g * og * lanes, og, weight + g * og * cg * slots + c0 * slots, cg * slots,
                    channels * slots, grad_columns.data() + c0 * slots * lanes, false);
          for (int64_t ci = c0; ci < c0 + channels; ++ci) {
            if (!turns) {
              to_input(ci);
              continue;
            }
            const scalar_t* channel_spectra = spectra.data() + ci * slots * lanes;
            scalar_t* channel_grad = grad_columns.data() + ci * slots * lanes;
            if (!t.shared) std::fill(grad_turn.begin(), grad_turn.end(), scalar_t(0));
            turn_back(t, state_of(ci), channel_spectra, channel_grad, grad_turn.data());
            if (t.shared) continue;
            orientation_backward(t, state_of(ci), grad_turn.data(), grad_orientation.data());
            add_orientation_gradient(t, grad_orientation.data(), channel_spectra, channel_grad);
            to_input(ci);
          }
        }
        if (need_input && turns && t.shared) {
          orientation_backward(t, states.data(), grad_turn.data(), grad_orientation.data());
          // A guide channel's columns have no weight: its gradient comes through the orientation alone.
          std::fill(grad_columns.begin() + cg * slots * lanes, grad_columns.end(), scalar_t(0));
          for (int64_t ci = 0; ci < cin; ++ci) {
            if (ci >= cg && !t.guide_re.empty()) {  // its rows hold its samples (group_spectra)
              guide_samples_gradient(plan, t, grad_orientation.data(), spectra.data() + ci * slots * lanes,
                                     grad_samples.data());
              scatter_gradients<scalar_t, kUnitStride>(plan, block, grad_samples.data(), grad_grid.data(),
                                                       grad_images + (g * cin + ci) * plane);
              continue;
            }
            add_orientation_gradient(t, grad_orientation.data(), spectra.data() + ci * slots * lanes,
                                     grad_columns.data() + ci * slots * lanes);
            to_input(ci);
          }
        }
      }
    }
    ring.finish();
  });
}

// One stage of a vector transpose on rows a and b = a's partner D rows on: lane j of the first result is a[j] where
// bit D of j is clear and b[j - D] where it is set, of the second a[j + D] and b[j], so that rows and lanes trade that
// bit. Both are two-source shuffles with constant masks (one instruction each with AVX-512 or AVX2).
template <int D, typename vec, int... J>
inline __attribute__((always_inline)) void trade_bit(vec& a, vec& b, std::integer_sequence<int, J...>) {
  constexpr int V = sizeof...(J);
#if defined(__clang__)
  const vec low = __builtin_shufflevector(a, b, ((J & D) == 0 ? J : V + J - D)...);
  const vec high = __builtin_shufflevector(a, b, ((J & D) == 0 ? J + D : V + J)...);
#else
  using mask = decltype(a < b);  // the lane-wise integer vector of the scalar's width (as SwapMaskOf's default)
  const vec low = __builtin_shuffle(a, b, mask{((J & D) == 0 ? J : V + J - D)...});
  const vec high = __builtin_shuffle(a, b, mask{((J & D) == 0 ? J + D : V + J)...});
#endif
  a = low;
  b = high;
}

// dst[j * dst_stride + i] = src[i * src_stride + j] for i, j < kVecLanes: a square of one vector a side transposed in
// registers (log2 kVecLanes stages of kVecLanes shuffles), where moving it value by value costs a scalar load and a
// store to another cache line per value.
template <typename scalar_t>
inline void transpose_square(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t dst_stride) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int V = static_cast<int>(kVecLanes<scalar_t>);
  vec r[V];
  for (int i = 0; i < V; ++i) r[i] = load(src + i * src_stride);
  const auto lanes = std::make_integer_sequence<int, V>{};
  const auto stage = [&](auto distance) {
    constexpr int D = decltype(distance)::value;
    for (int i = 0; i < V; ++i) {
      if ((i & D) == 0) trade_bit<D>(r[i], r[i + D], lanes);
    }
  };
  if constexpr (V >= 16) stage(std::integral_constant<int, 8>{});
  if constexpr (V >= 8) stage(std::integral_constant<int, 4>{});
  if constexpr (V >= 4) stage(std::integral_constant<int, 2>{});
  if constexpr (V >= 2) stage(std::integral_constant<int, 1>{});
  for (int i = 0; i < V; ++i) store(dst + i * dst_stride, r[i]);
}

// dst[j * dst_stride + i] = src[i * src_stride + j] for i < rows, j < columns: squares of kVecLanes in registers, the
// edges value by value.
template <typename scalar_t>
void transpose(const scalar_t* src, int64_t src_stride, int64_t rows, int64_t columns, scalar_t* dst,
               int64_t dst_stride) {
  constexpr int64_t V = kVecLanes<scalar_t>;
  const int64_t full_rows = rows / V * V, full_columns = columns / V * V;
  for (int64_t i = 0; i < full_rows; i += V) {
    for (int64_t j = 0; j < full_columns; j += V) {
      transpose_square(src + i * src_stride + j, src_stride, dst + j * dst_stride + i, dst_stride);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = i < full_rows ? full_columns : 0; j < columns; ++j) {
      dst[j * dst_stride + i] = src[i * src_stride + j];
    }
  }
}

// fn(channel, o0, count, buffers) for each of the layer's input channels (in parallel) and each run of up to kLanes
// of its group's outputs from o0 on: the weight's values of a channel taking the place of a block's positions.
// `buffers` holds three rows of k*k by kLanes per thread.
template <typename scalar_t, typename F>
void for_each_weight_run(const Shape& shape, int64_t slots, const F& fn) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t og = shape.out_per_group();
  timm_sortconv_host::parallel_for(0, shape.channels, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> buffers(3 * slots * lanes);
    for (int64_t channel = begin; channel < end; ++channel) {
      for (int64_t o0 = 0; o0 < og; o0 += lanes) fn(channel, o0, std::min(lanes, og - o0), buffers.data());
    }
  });
}

// The weight (O, C/g * k*k), each channel's k*k values in grid order, in the harmonic basis the kernel multiplies
// in: per channel, the slot-order values (slot s at grid position slot_to_grid[s]) through the analysis (the fold and
// the DFT's blocks, as a window's samples go: samples_to_spectra), each harmonic row then scaled by weight_scale.
// The product of this weight with the aligned harmonics is the product of the slot-order weight with the aligned
// samples (alignment.harmonic_tables' synthesis). Written as (groups, C/g * k*k, O/g), the forward's products'
// layout, where `packed`, else as (O, C/g * k*k).
template <typename scalar_t>
void harmonic_weight_into(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const Shape& shape,
                          const scalar_t* src, const std::vector<int64_t>& slot_to_grid, bool packed, scalar_t* dst) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t slots = plan.slots, cg = shape.in_per_group(), og = shape.out_per_group(), row = cg * slots;
  for_each_weight_run<scalar_t>(shape, slots, [&](int64_t channel, int64_t o0, int64_t count, scalar_t* buffers) {
    scalar_t *samples = buffers, *folded = buffers + slots * lanes, *spectra = buffers + 2 * slots * lanes;
    const int64_t g = channel / cg, ci = channel % cg;
    const scalar_t* from = src + (g * og + o0) * row + ci * slots;
    scalar_t* to = dst + (g * og + o0) * row + ci * slots;  // unpacked
    // The run's outputs' k*k values (contiguous in each output's row) to one row of lanes per slot. Windows of a
    // vector or more are transposed into grid order (in `spectra`, free until samples_to_spectra) and the rows then
    // taken in slot order; smaller ones are read value by value in slot order.
    const bool squares = slots >= kVecLanes<scalar_t>;
    scalar_t* grid = squares ? spectra : samples;
    if (count < lanes) std::fill(grid, grid + slots * lanes, scalar_t(0));
    if (squares) {
      transpose(from, row, count, slots, grid, lanes);
      for (int64_t s = 0; s < slots; ++s) {
        std::copy(grid + slot_to_grid[s] * lanes, grid + (slot_to_grid[s] + 1) * lanes, samples + s * lanes);
      }
    } else {
      for (int64_t l = 0; l < count; ++l) {
        for (int64_t s = 0; s < slots; ++s) samples[s * lanes + l] = from[l * row + slot_to_grid[s]];
      }
    }
    samples_to_spectra(plan, t, samples, folded, spectra);
    if (packed) {
      for (int64_t r = 0; r < slots; ++r) {
        const scalar_t scale = t.weight_scale[r];
        const scalar_t* values = spectra + r * lanes;
        scalar_t* packed_row = dst + (channel * slots + r) * og + o0;
        for (int64_t l = 0; l < count; ++l) packed_row[l] = values[l] * scale;
      }
    } else if (squares) {
      for (int64_t r = 0; r < slots; ++r) {
        for (int64_t l = 0; l < lanes; ++l) spectra[r * lanes + l] *= t.weight_scale[r];
      }
      transpose(spectra, lanes, slots, count, to, row);
    } else {
      for (int64_t l = 0; l < count; ++l) {
        for (int64_t r = 0; r < slots; ++r) to[l * row + r] = spectra[r * lanes + l] * t.weight_scale[r];
      }
    }
  });
}

#if !defined(TIMM_SORTCONV_STANDALONE)
template <typename scalar_t>
at::Tensor harmonic_weight(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const Shape& shape,
                           const at::Tensor& weight, const std::vector<int64_t>& slot_to_grid, bool packed) {
  const int64_t row = shape.in_per_group() * plan.slots;
  at::Tensor out = packed ? at::empty({shape.groups, row, shape.out_per_group()}, weight.options())
                          : at::empty({shape.out_channels, row}, weight.options());
  harmonic_weight_into(plan, t, shape, weight.data_ptr<scalar_t>(), slot_to_grid, packed, out.data_ptr<scalar_t>());
  return out;
}

// The gradient of the grid-order weight (O, C/g * k*k) from the threads' parts of the harmonic weight's, (C * k*k,
// outputs_padded) each: summed, scaled by weight_scale and taken back through the analysis (its transpose:
// spectra_to_samples), slot s to grid position slot_to_grid[s]. harmonic_weight's transpose.
template <typename scalar_t>
at::Tensor sum_harmonic_weight_parts(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t,
                                     const std::vector<std::vector<scalar_t>>& parts, const at::Tensor& weight,
                                     const Shape& shape, int64_t outputs_padded,
                                     const std::vector<int64_t>& slot_to_grid) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t slots = plan.slots, cg = shape.in_per_group(), og = shape.out_per_group(), row = cg * slots;
  at::Tensor grad_weight = at::empty_like(weight);
  scalar_t* dst = grad_weight.data_ptr<scalar_t>();
  for_each_weight_run<scalar_t>(shape, slots, [&](int64_t channel, int64_t o0, int64_t count, scalar_t* buffers) {
    scalar_t *grad_spectra = buffers, *grad_folded = buffers + slots * lanes,
             *grad_samples = buffers + 2 * slots * lanes;
    for (int64_t r = 0; r < slots; ++r) {
      scalar_t* to = grad_spectra + r * lanes;
      std::fill(to, to + lanes, scalar_t(0));
      for (const auto& part : parts) {
        const scalar_t* from = part.data() + (channel * slots + r) * outputs_padded + o0;
        for (int64_t l = 0; l < count; ++l) to[l] += from[l];
      }
      for (int64_t l = 0; l < count; ++l) to[l] *= t.weight_scale[r];
    }
    spectra_to_samples(plan, t, grad_spectra, grad_folded, grad_samples);
    scalar_t* to = dst + ((channel / cg) * og + o0) * row + (channel % cg) * slots;
    if (slots < kVecLanes<scalar_t>) {  // output by output, as harmonic_weight reads small windows
      for (int64_t l = 0; l < count; ++l) {
        for (int64_t s = 0; s < slots; ++s) to[l * row + slot_to_grid[s]] = grad_samples[s * lanes + l];
      }
      return;
    }
    // The rows in grid order (in `grad_spectra`, free now), then transposed into the run's outputs' rows.
    scalar_t* grid = grad_spectra;
    for (int64_t s = 0; s < slots; ++s) {
      std::copy(grad_samples + s * lanes, grad_samples + (s + 1) * lanes, grid + slot_to_grid[s] * lanes);
    }
    transpose(grid, lanes, slots, count, to, row);
  });
  return grad_weight;
}

template <typename scalar_t>
at::Tensor align_forward_impl(const timm_sortconv_cpu::AlignCall& align) {
  const auto& call = align.call;
  const Shape shape = check_tensors(call.input, call.weight_slots, call.groups, call.kernel_size, align.guides);
  if (call.bias.has_value() && call.bias->defined()) {
    TIMM_SORTCONV_CHECK(call.bias->scalar_type() == call.input.scalar_type() && call.bias->numel() == shape.out_channels,
                "sort_conv_cpu: bias must have O entries of the input's dtype");
  }
  const auto plan = make_plan<scalar_t>(call.input, call.tap_offsets, call.tap_weights, call.segments,
                                        call.comparators, call.kernel_size, call.stride_h, call.stride_w,
                                        call.dilation_h, call.dilation_w, call.pad);
  const auto tables = make_align_tables<scalar_t>(align, plan);
  at::Tensor output = at::empty({shape.batch, shape.out_channels, plan.out_h, plan.out_w}, call.input.options());
  // The harmonic weight as (groups, C/g * k*k, O/g), then each panel chunk's rows in gemm_tiles' layout: each
  // register tile's weights one sequential stream for the products.
  const at::Tensor harmonic = harmonic_weight(plan, tables, shape, call.weight_slots.contiguous(),
                                              slot_order(call.slot_to_grid, plan.slots), true);
  at::Tensor weight_packed = at::empty_like(harmonic);
  tile_forward_weights<scalar_t>(harmonic.data_ptr<scalar_t>(), weight_packed.data_ptr<scalar_t>(), shape, plan.slots);
  const bool has_bias = call.bias.has_value() && call.bias->defined();
  const auto bias_values = has_bias ? call.bias->contiguous() : at::Tensor();
  const scalar_t* in = call.input.data_ptr<scalar_t>();
  const scalar_t* w = weight_packed.data_ptr<scalar_t>();
  const scalar_t* b = has_bias ? bias_values.data_ptr<scalar_t>() : nullptr;
  scalar_t* out = output.data_ptr<scalar_t>();
  if (plan.stride_w == 1) {
    align_forward_kernel<scalar_t, true>(plan, tables, shape, in, w, b, out);
  } else {
    align_forward_kernel<scalar_t, false>(plan, tables, shape, in, w, b, out);
  }
  return output;
}

template <typename scalar_t>
std::vector<at::Tensor> align_backward_impl(const timm_sortconv_cpu::AlignCall& align) {
  const auto& call = align.call;
  const Shape shape = check_tensors(call.input, call.weight_slots, call.groups, call.kernel_size, align.guides);
  const at::Tensor& grad_output = call.grad_output;
  TIMM_SORTCONV_CHECK(grad_output.is_contiguous() && grad_output.scalar_type() == call.input.scalar_type(),
              "sort_conv_cpu: grad_output must be contiguous with the input's dtype");
  const auto plan = make_plan<scalar_t>(call.input, call.tap_offsets, call.tap_weights, call.segments,
                                        call.comparators, call.kernel_size, call.stride_h, call.stride_w,
                                        call.dilation_h, call.dilation_w, call.pad);
  TIMM_SORTCONV_CHECK(grad_output.dim() == 4 && grad_output.size(0) == shape.batch && grad_output.size(1) == shape.out_channels
                  && grad_output.size(2) == plan.out_h && grad_output.size(3) == plan.out_w,
              "sort_conv_cpu: grad_output has the wrong shape");
  const auto tables = make_align_tables<scalar_t>(align, plan);
  constexpr int64_t half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, og = shape.out_per_group();
  const int64_t outputs_padded = (og + half - 1) / half * half;
  const int64_t threads = thread_count(shape.batch * plan.positions() / kLanes<scalar_t>,
                                       2 * multiply_adds(shape, plan.positions(), slots));
  const bool need_input = call.need_input_grad, need_weight = call.need_weight_grad;
  const bool private_grad_input = need_input && shape.batch < threads;
  at::Tensor grad_input = need_input ? at::zeros_like(call.input) : at::Tensor();
  at::Tensor grad_weight;
  if (!need_input && !need_weight) return {grad_input, grad_weight};
  std::vector<std::vector<scalar_t>> grad_input_parts, grad_weight_parts;
  if (private_grad_input) {
    grad_input_parts.assign(threads, std::vector<scalar_t>(call.input.numel(), scalar_t(0)));
  }
  if (need_weight) {
    grad_weight_parts.assign(threads, std::vector<scalar_t>(shape.channels * slots * outputs_padded, scalar_t(0)));
  }
  const std::vector<int64_t> order = slot_order(call.slot_to_grid, slots);
  const at::Tensor weight = harmonic_weight(plan, tables, shape, call.weight_slots.contiguous(), order, false);
  scalar_t* grad_in = need_input && !private_grad_input ? grad_input.data_ptr<scalar_t>() : nullptr;
  const scalar_t* in = call.input.data_ptr<scalar_t>();
  const scalar_t* grad_out = grad_output.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  if (plan.stride_w == 1) {
    align_backward_kernel<scalar_t, true>(plan, tables, shape, in, grad_out, w, grad_in, grad_input_parts,
                                          grad_weight_parts, outputs_padded, threads);
  } else {
    align_backward_kernel<scalar_t, false>(plan, tables, shape, in, grad_out, w, grad_in, grad_input_parts,
                                           grad_weight_parts, outputs_padded, threads);
  }
  if (private_grad_input) sum_input_parts(grad_input_parts, grad_input);
  if (need_weight) {
    grad_weight = sum_harmonic_weight_parts(plan, tables, grad_weight_parts, call.weight_slots, shape, outputs_padded,
                                            order);
  }
  return {grad_input, grad_weight};
}

#endif  // !TIMM_SORTCONV_STANDALONE

}  // namespace

#if !defined(TIMM_SORTCONV_STANDALONE)
namespace timm_sortconv_cpu {

template <typename scalar_t>
at::Tensor align_forward(const AlignCall& align) {
  return align_forward_impl<scalar_t>(align);
}

template <typename scalar_t>
std::vector<at::Tensor> align_backward(const AlignCall& align) {
  return align_backward_impl<scalar_t>(align);
}

}  // namespace timm_sortconv_cpu
#endif  // !TIMM_SORTCONV_STANDALONE
