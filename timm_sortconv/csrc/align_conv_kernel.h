// The aligned variants (sorting="align", "align-channel") on the CPU: each window turned back by its own
// orientation, then an ordinary convolution (timm_sortconv/ops/alignment.py's docstring is the mathematics;
// aligned_samples there is the specification). Included by sort_conv_float.cpp and sort_conv_double.cpp after
// sort_conv_kernel.h, whose blocks of output positions, image ring, gathering, taps, micro-GEMMs and scatter it
// reuses; sort_conv_cpu.cpp binds it to Python.
//
// Everything is written in the harmonic basis of alignment.harmonic_tables: a window's k*k harmonic rows are the
// centre, each ring's S_0 and, for an even ring, its Nyquist S_{N/2}, and Re S_m and Im S_m of every (ring,
// 0 < m < N/2), here ordered ring by ring (cpu_backend._folded_dft; the tables say which row is which). The caller
// gives the weight in that basis (the slot-order weight times the inverse transform, so that the product with the
// aligned harmonics equals the product of the slot-order weight with the aligned samples) and takes the weight
// gradient back through the same matrix. Per block of kLanes output positions and group, the forward pass
//   1. gathers every channel's samples (sort_conv_kernel.h's gather_samples) and takes their ring spectra into a
//      per-thread buffer spectra[C/g][k*k][lanes]: each ring folded (s_0, s_j + s_{N-j}, s_{N/2}, s_j - s_{N-j}),
//      then its cosine rows from the first and its sine rows from the second, two dense blocks of about N/2 a side
//      multiplied in by the micro-GEMM (half the products of the whole transform, at the GEMM's rate);
//   2. per orientation unit (the group's channels together for "align", each channel for "align-channel") sums
//      c = sum_rings S_1 / N and E = sum_rings sum_{m != 0} |S_m|^2 / N^2 over its channels, and forms the gated
//      powers T_m = g * conj(e)^m, m = 1 .. largest (g = |c|^2 / (|c|^2 + RELATIVE E + TINY), e = c / |c|);
//   3. turns the spectra in place: (Re, Im) S_m times T_m as complex numbers, a Nyquist row times Re T_{N/2},
//      S_0 and the centre as they are;
//   4. multiplies the block's aligned columns (C/g * k*k rows of lanes) into the outputs with the micro-GEMM.
// Nothing of size k*k times the input is written to memory: the buffer holds one block's columns.
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
  scalar_t relative = 0, tiny = 0;
  TapTable<scalar_t> fold;    // folded samples <- samples (slot order): s_0, s_j + s_{N-j}, s_{N/2}, s_j - s_{N-j}
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

  int64_t re(int64_t p) const { return pair_re_row[p]; }
  int64_t im(int64_t p) const { return pair_im_row[p]; }
  // Rows of lanes per orientation unit: c_re, c_im, E, then Re T_m and Im T_m for m = 0 .. largest.
  int64_t state_rows() const { return 3 + 2 * (largest + 1); }
};

// The sparse map of a (rows, rows) float64 matrix (zeros left out), and of its transpose.
template <typename scalar_t>
std::pair<TapTable<scalar_t>, TapTable<scalar_t>> tap_tables_of(const at::Tensor& matrix, int64_t rows) {
  const double* a = matrix.data_ptr<double>();
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

template <typename scalar_t>
AlignTables<scalar_t> make_align_tables(const timm_sortconv_cpu::AlignCall& align, int64_t slots) {
  AlignTables<scalar_t> t;
  const auto fold = align.fold.to(at::kDouble).contiguous();
  const auto dft = align.dft.to(at::kDouble).contiguous();
  const auto blocks = align.blocks.to(at::kLong).contiguous();
  const auto pairs = align.pairs.to(at::kLong).contiguous();
  const auto fixed = align.fixed.to(at::kLong).contiguous();
  const auto first = align.first.to(at::kDouble).contiguous();
  const auto energy_pairs = align.energy_pairs.to(at::kDouble).contiguous();
  const auto energy_fixed = align.energy_fixed.to(at::kDouble).contiguous();
  t.harmonics = slots;
  t.pairs = pairs.size(0);
  const int64_t fixed_count = fixed.size(0);
  TORCH_CHECK(fold.dim() == 2 && fold.size(0) == slots && fold.size(1) == slots && dft.sizes() == fold.sizes(),
              "sort_conv_cpu: fold and dft must be (k*k, k*k)");
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(1) == 3 && fixed.dim() == 2 && fixed.size(1) == 2
                  && fixed_count + 2 * t.pairs == slots && first.numel() == t.pairs
                  && energy_pairs.numel() == t.pairs && energy_fixed.numel() == fixed_count,
              "sort_conv_cpu: the harmonic tables must describe fixed + 2 * pairs = k*k rows");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 2, "sort_conv_cpu: blocks must be (n, 2)");
  t.shared = align.shared;
  t.relative = static_cast<scalar_t>(align.relative);
  t.tiny = static_cast<scalar_t>(align.tiny);
  std::tie(t.fold, t.unfold) = tap_tables_of<scalar_t>(fold, slots);
  const double* d = dft.data_ptr<double>();
  int64_t covered = 0;
  for (int64_t b = 0; b < blocks.size(0); ++b) {
    DftBlock<scalar_t> block;
    block.start = blocks.data_ptr<int64_t>()[2 * b];
    block.size = blocks.data_ptr<int64_t>()[2 * b + 1];
    TORCH_CHECK(block.start == covered && block.size >= 1, "sort_conv_cpu: the DFT's blocks must tile its rows");
    covered += block.size;
    for (int64_t k = 0; k < block.size; ++k) {
      for (int64_t m = 0; m < block.size; ++m) {
        block.forward.push_back(static_cast<scalar_t>(d[(block.start + m) * slots + block.start + k]));
        block.backward.push_back(static_cast<scalar_t>(d[(block.start + k) * slots + block.start + m]));
      }
    }
    t.blocks.push_back(std::move(block));
  }
  TORCH_CHECK(covered == slots, "sort_conv_cpu: the DFT's blocks must cover its k*k rows");
  const int64_t* pair = pairs.data_ptr<int64_t>();
  for (int64_t p = 0; p < t.pairs; ++p) {
    const int64_t re = pair[3 * p], im = pair[3 * p + 1], m = pair[3 * p + 2];
    TORCH_CHECK(re >= 0 && re < slots && im >= 0 && im < slots && m >= 1, "sort_conv_cpu: a pair is out of range");
    t.pair_re_row.push_back(re);
    t.pair_im_row.push_back(im);
    t.pair_m.push_back(m);
    t.largest = std::max(t.largest, m);
    t.pair_energy.push_back(static_cast<scalar_t>(energy_pairs.data_ptr<double>()[p]));
    if (first.data_ptr<double>()[p] != 0.0) {
      t.first_pair.push_back(p);
      t.first_weight.push_back(static_cast<scalar_t>(first.data_ptr<double>()[p]));
    }
  }
  for (int64_t f = 0; f < fixed_count; ++f) {
    const int64_t row = fixed.data_ptr<int64_t>()[2 * f], m = fixed.data_ptr<int64_t>()[2 * f + 1];
    TORCH_CHECK(row >= 0 && row < slots && m >= 0, "sort_conv_cpu: a fixed row is out of range");
    if (m > 0) {
      t.nyquist_row.push_back(row);
      t.nyquist_m.push_back(m);
      t.largest = std::max(t.largest, m);
    }
    if (energy_fixed.data_ptr<double>()[f] != 0.0) {
      t.energy_row.push_back(row);
      t.energy_weight.push_back(static_cast<scalar_t>(energy_fixed.data_ptr<double>()[f]));
    }
  }
  return t;
}

// The harmonic rows spectra[k*k][lanes] of one channel's windows in the block: gathered, folded, and each block of
// the DFT a micro-GEMM over the lanes.
template <typename scalar_t, bool kUnitStride>
void window_spectra(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const scalar_t* channel_input,
                    const Block& block, scalar_t* grid, scalar_t* samples, scalar_t* folded, scalar_t* spectra) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  gather_samples<scalar_t, kUnitStride>(plan, channel_input, block, grid, samples);
  apply_taps(t.fold, samples, folded);
  for (const auto& b : t.blocks) {
    gemm_rows(folded + b.start * lanes, b.size, b.forward.data(), b.size, b.size, spectra + b.start * lanes, false);
  }
}

// The samples' gradient grad_samples[k*k][lanes] from the spectra's, through the DFT's and the fold's transposes.
template <typename scalar_t>
void spectra_to_samples(const AlignTables<scalar_t>& t, const scalar_t* grad_spectra, scalar_t* grad_folded,
                        scalar_t* grad_samples) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  for (const auto& b : t.blocks) {
    gemm_rows(grad_spectra + b.start * lanes, b.size, b.backward.data(), b.size, b.size, grad_folded + b.start * lanes,
              false);
  }
  apply_taps(t.unfold, grad_folded, grad_samples);
}

// state[0..2] += one channel's (c_re, c_im, E).
template <typename scalar_t>
void add_orientation(const AlignTables<scalar_t>& t, const scalar_t* spectra, scalar_t* state) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  scalar_t* __restrict c_re = state;
  scalar_t* __restrict c_im = state + lanes;
  scalar_t* __restrict energy = state + 2 * lanes;
  for (size_t i = 0; i < t.first_pair.size(); ++i) {
    const scalar_t w = t.first_weight[i];
    const scalar_t* re = spectra + t.re(t.first_pair[i]) * lanes;
    const scalar_t* im = spectra + t.im(t.first_pair[i]) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      c_re[l] += w * re[l];
      c_im[l] += w * im[l];
    }
  }
  for (int64_t p = 0; p < t.pairs; ++p) {
    const scalar_t w = t.pair_energy[p];
    const scalar_t* re = spectra + t.re(p) * lanes;
    const scalar_t* im = spectra + t.im(p) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) energy[l] += w * (re[l] * re[l] + im[l] * im[l]);
  }
  for (size_t i = 0; i < t.energy_row.size(); ++i) {
    const scalar_t w = t.energy_weight[i];
    const scalar_t* s = spectra + t.energy_row[i] * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) energy[l] += w * s[l] * s[l];
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
// channel times Re T_{N/2}, the other fixed channels as they are.
template <typename scalar_t>
void turn_spectra(const AlignTables<scalar_t>& t, const scalar_t* state, const scalar_t* in, scalar_t* out) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const scalar_t* turn_re = state + 3 * lanes;
  const scalar_t* turn_im = turn_re + (t.largest + 1) * lanes;
  if (out != in) std::memcpy(out, in, t.harmonics * lanes * sizeof(scalar_t));  // the rows that do not turn
  for (size_t i = 0; i < t.nyquist_row.size(); ++i) {
    const scalar_t* tr = turn_re + t.nyquist_m[i] * lanes;
    const scalar_t* s = in + t.nyquist_row[i] * lanes;
    scalar_t* o = out + t.nyquist_row[i] * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) o[l] = s[l] * tr[l];
  }
  for (int64_t p = 0; p < t.pairs; ++p) {
    const scalar_t* tr = turn_re + t.pair_m[p] * lanes;
    const scalar_t* ti = turn_im + t.pair_m[p] * lanes;
    const scalar_t* re = in + t.re(p) * lanes;
    const scalar_t* im = in + t.im(p) * lanes;
    scalar_t* out_re = out + t.re(p) * lanes;
    scalar_t* out_im = out + t.im(p) * lanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      const scalar_t a = re[l], b = im[l];
      out_re[l] = a * tr[l] - b * ti[l];
      out_im[l] = a * ti[l] + b * tr[l];
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

// Turns the group's spectra[C/g][k*k][lanes] into `aligned` (which may be `spectra`) and leaves each unit's
// state in states[unit] (state_rows() rows of lanes; one row block per unit).
template <typename scalar_t>
void align_group(const AlignTables<scalar_t>& t, int64_t channels, const scalar_t* spectra, scalar_t* aligned,
                 scalar_t* states) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t slots = t.harmonics, state_size = t.state_rows() * lanes;
  const int64_t units = units_of(t.shared, channels);
  std::fill(states, states + units * state_size, scalar_t(0));
  for (int64_t ci = 0; ci < channels; ++ci) {
    add_orientation(t, spectra + ci * slots * lanes, states + (t.shared ? 0 : ci) * state_size);
  }
  for (int64_t u = 0; u < units; ++u) make_turns(t, states + u * state_size);
  for (int64_t ci = 0; ci < channels; ++ci) {
    turn_spectra(t, states + (t.shared ? 0 : ci) * state_size, spectra + ci * slots * lanes,
                 aligned + ci * slots * lanes);
  }
}

template <typename scalar_t, bool kUnitStride>
void align_forward_kernel(const Plan<scalar_t>& plan, const AlignTables<scalar_t>& t, const Shape& shape,
                          const scalar_t* input, const scalar_t* weight_packed, const scalar_t* bias,
                          scalar_t* output) {
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, positions = plan.positions(), plane = plan.in_h * plan.in_w;
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group();
  const int64_t panel_channels = panel_channels_of(cg, slots);
  const int64_t threads = thread_count(shape.batch * positions / lanes, multiply_adds(shape, positions, slots));
  for_each_thread_range(shape.batch, positions, threads, false, [&](int64_t, int64_t begin, int64_t end) {
    // gather_samples may write a vector past its last row.
    std::vector<scalar_t> spectra(cg * slots * lanes), samples(slots * lanes + half), grid(slots * lanes + half),
        folded(slots * lanes);
    std::vector<scalar_t> states(units_of(t.shared, cg) * t.state_rows() * lanes), tile(shape.out_channels * lanes);
    std::vector<Block> blocks(1);
    ImageRing<scalar_t> ring(plan, input, nullptr, shape.batch, shape.channels, begin, end, lanes);
    for (int64_t start = begin; start < end; start += lanes) {
      const int64_t stop = std::min(start + lanes, end);
      cover_pass<scalar_t, kUnitStride>(plan, ring, start, stop, shape.channels, blocks);
      const Block& block = blocks[0];
      const scalar_t* images = ring.images();
      for (int64_t o = 0; o < shape.out_channels; ++o) {
        std::fill(tile.data() + o * lanes, tile.data() + (o + 1) * lanes, bias != nullptr ? bias[o] : scalar_t(0));
      }
      for (int64_t g = 0; g < shape.groups; ++g) {
        for (int64_t ci = 0; ci < cg; ++ci) {
          window_spectra<scalar_t, kUnitStride>(plan, t, images + (g * cg + ci) * plane, block, grid.data(),
                                                samples.data(), folded.data(), spectra.data() + ci * slots * lanes);
        }
        if (t.pairs > 0) align_group(t, cg, spectra.data(), spectra.data(), states.data());
        // weight_packed is (groups, C/g * k*k, O/g), the harmonic channels of these channels as rows.
        for (int64_t c0 = 0; c0 < cg; c0 += panel_channels) {
          const int64_t channels = std::min(panel_channels, cg - c0);
          gemm_rows(spectra.data() + c0 * slots * lanes, channels * slots, weight_packed + (g * cg + c0) * slots * og,
                    og, og, tile.data() + g * og * lanes, true);
        }
      }
      for (int64_t o = 0; o < shape.out_channels; ++o) {
        store_lanes(plan, block, tile.data() + o * lanes, output + o * positions, shape.out_channels * positions);
      }
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
  const bool need_input = grad_input != nullptr || !grad_input_parts.empty();
  const bool need_weight = !grad_weight_parts.empty();
  // A thread owns whole images (its scatter races with nobody) unless there are fewer images than threads.
  const bool whole_images = need_input && grad_input_parts.empty();
  for_each_thread_range(shape.batch, positions, threads, whole_images, [&](int64_t thread, int64_t begin, int64_t end) {
    std::vector<scalar_t> grad_tile(shape.out_channels * lanes), grad_tile_t(shape.groups * lanes * outputs_padded);
    std::vector<scalar_t> spectra(cg * slots * lanes), aligned(cg * slots * lanes), samples(slots * lanes + half),
        grid(slots * lanes + half), folded(slots * lanes), grad_samples(slots * lanes), grad_grid(slots * lanes);
    std::vector<scalar_t> states(units_of(t.shared, cg) * state_size), grad_turn(2 * (t.largest + 1) * lanes),
        grad_orientation(3 * lanes);
    std::vector<Block> blocks(1);
    scalar_t* grad_in = grad_input_parts.empty() ? grad_input : grad_input_parts[thread].data();
    scalar_t* grad_weight = need_weight ? grad_weight_parts[thread].data() : nullptr;
    ImageRing<scalar_t> ring(plan, input, need_input ? grad_in : nullptr, shape.batch, shape.channels, begin, end,
                             lanes);
    for (int64_t start = begin; start < end; start += lanes) {
      const int64_t stop = std::min(start + lanes, end);
      cover_pass<scalar_t, kUnitStride>(plan, ring, start, stop, shape.channels, blocks);
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
        for (int64_t ci = 0; ci < cg; ++ci) {
          window_spectra<scalar_t, kUnitStride>(plan, t, images + (g * cg + ci) * plane, block, grid.data(),
                                                samples.data(), folded.data(), spectra.data() + ci * slots * lanes);
        }
        const bool turns = t.pairs > 0;
        scalar_t* columns = turns ? aligned.data() : spectra.data();
        if (turns) align_group(t, cg, spectra.data(), columns, states.data());
        if (need_weight) {
          gemm_reduce(columns, 0, cg * slots, &count, 1, grad_tile_t.data() + g * lanes * outputs_padded,
                      outputs_padded, grad_weight + g * cg * slots * outputs_padded);
        }
        if (!need_input) continue;
        // The aligned columns' gradient, into `aligned` (no longer needed): for each of the group's O/g outputs,
        // the harmonic weight's row times the output gradient.
        scalar_t* grad_columns = aligned.data();
        gemm_rows(grad_tile.data() + g * og * lanes, og, weight + g * og * cg * slots, cg * slots, cg * slots,
                  grad_columns, false);
        const auto to_input = [&](int64_t ci) {
          spectra_to_samples(t, grad_columns + ci * slots * lanes, folded.data(), grad_samples.data());
          scatter_gradients<scalar_t, kUnitStride>(plan, block, grad_samples.data(), grad_grid.data(),
                                                   grad_images + (g * cg + ci) * plane);
        };
        if (!turns) {
          for (int64_t ci = 0; ci < cg; ++ci) to_input(ci);
          continue;
        }
        // One unit at a time: its channels' turns transposed (collecting dL/dT), its orientation's gradient, then
        // that gradient added to each of its channels before they go back to the input.
        const int64_t units = units_of(t.shared, cg), per_unit = cg / units;
        for (int64_t u = 0; u < units; ++u) {
          const scalar_t* state = states.data() + u * state_size;
          std::fill(grad_turn.begin(), grad_turn.end(), scalar_t(0));
          for (int64_t ci = u * per_unit; ci < (u + 1) * per_unit; ++ci) {
            turn_back(t, state, spectra.data() + ci * slots * lanes, grad_columns + ci * slots * lanes,
                      grad_turn.data());
          }
          orientation_backward(t, state, grad_turn.data(), grad_orientation.data());
          for (int64_t ci = u * per_unit; ci < (u + 1) * per_unit; ++ci) {
            add_orientation_gradient(t, grad_orientation.data(), spectra.data() + ci * slots * lanes,
                                     grad_columns + ci * slots * lanes);
            to_input(ci);
          }
        }
      }
    }
    ring.finish();
  });
}

template <typename scalar_t>
at::Tensor align_forward_impl(const timm_sortconv_cpu::AlignCall& align) {
  const auto& call = align.call;
  const Shape shape = check_tensors(call.input, call.weight_slots, call.groups, call.kernel_size);
  if (call.bias.has_value() && call.bias->defined()) {
    TORCH_CHECK(call.bias->scalar_type() == call.input.scalar_type() && call.bias->numel() == shape.out_channels,
                "sort_conv_cpu: bias must have O entries of the input's dtype");
  }
  const auto plan = make_plan<scalar_t>(call.input, call.tap_offsets, call.tap_weights, call.segments,
                                        call.comparators, call.kernel_size, call.stride_h, call.stride_w,
                                        call.dilation_h, call.dilation_w, call.pad);
  const auto tables = make_align_tables<scalar_t>(align, plan.slots);
  at::Tensor output = at::empty({shape.batch, shape.out_channels, plan.out_h, plan.out_w}, call.input.options());
  // The harmonic weight as (groups, C/g * k*k, O/g): pack_by_slot with the identity order.
  const at::Tensor weight_packed =
      pack_by_slot<scalar_t>(call.weight_slots, shape, slot_order(at::Tensor(), plan.slots));
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
  const Shape shape = check_tensors(call.input, call.weight_slots, call.groups, call.kernel_size);
  const at::Tensor& grad_output = call.grad_output;
  TORCH_CHECK(grad_output.is_contiguous() && grad_output.scalar_type() == call.input.scalar_type(),
              "sort_conv_cpu: grad_output must be contiguous with the input's dtype");
  const auto plan = make_plan<scalar_t>(call.input, call.tap_offsets, call.tap_weights, call.segments,
                                        call.comparators, call.kernel_size, call.stride_h, call.stride_w,
                                        call.dilation_h, call.dilation_w, call.pad);
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == shape.batch && grad_output.size(1) == shape.out_channels
                  && grad_output.size(2) == plan.out_h && grad_output.size(3) == plan.out_w,
              "sort_conv_cpu: grad_output has the wrong shape");
  const auto tables = make_align_tables<scalar_t>(align, plan.slots);
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
  const at::Tensor weight = call.weight_slots.contiguous();
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
    // The harmonic weight's gradient, in its own (the kernel's) order.
    grad_weight = sum_weight_parts(grad_weight_parts, weight, shape, outputs_padded, slot_order(at::Tensor(), slots));
  }
  return {grad_input, grad_weight};
}

}  // namespace

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
