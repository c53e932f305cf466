// Fused Sorting Convolution for CPU: the kernel, a template over the dtype, instantiated by
// sort_conv_float.cpp and sort_conv_double.cpp (separate translation units, so that they compile in
// parallel); sort_conv_cpu.cpp binds them to Python.
//
// Works on an input (B, C, H, W) with zero padding (pad_* on each side, added while copying, see
// ImageRing) and computes 'valid' windows of the padded input with stride and dilation. Output
// positions are processed in blocks of kLanes (two SIMD vectors) consecutive positions, across row
// and image boundaries so that no lane idles. Per block and input channel the
// forward pass
//   1. gathers the k*k samples of every window in ring order (square sampling: the grid values;
//      polar sampling: bilinear interpolation of the window's values, read from the input where a
//      block is a row or two, else from the staged k x k grid), as value[sample][lane];
//   2. sorts every segment (a ring, or the whole window) with Batcher's odd-even merge network,
//      each comparator a compare-exchange (min and max) of whole vectors; in float32 the common
//      sizes are unrolled at compile time so that the values stay in registers;
//   3. multiplies the sorted panel with the weight (already in slot order) in a register-tiled
//      micro-GEMM that accumulates the block's outputs for all output channels.
// For the forward pass in float32 with AVX-512 or AVX2 and unit stride (square sampling, and polar
// sampling with k = 5 or 7), steps 1 and 2 are one pass (sort_direct): each vector of lanes is read straight
// from the input with masked loads (the end of one image row and the start of the next are its two
// pieces), interpolated and sorted in registers and stored once, instead of being staged first.
// Both passes read the windows from a per-thread copy of the images its blocks touch (ImageRing): one
// sequential copy per image instead of scattered first reads of every channel's rows, which also adds
// the zero padding, so the caller passes the input unpadded.
// Where a group's weights are large (blocks_per_pass), several consecutive blocks share one pass over
// them: each weight chunk is multiplied with those blocks one after the other, and the backward sums
// the weight gradient over all of them in one visit, so the weights come from far once per pass.
// No column buffer is materialised: the sorted values stay in L1 between steps 2 and 3. A general
// BLAS is avoided on purpose: on AMD CPUs MKL's sgemm runs well below the direct convolution that
// nn.Conv2d uses (oneDNN), and the goal is a cost near that convolution.
//
// The compare-exchange is a swap decided by `b < a`: the pair is always permuted, never
// overwritten, so a NaN stays exactly one value (it is not duplicated or dropped; it only leaves the
// values around it unsorted, and every output whose window holds it is NaN anyway).
//
// Backward saves nothing but the input: per block and channel it gathers and sorts again,
// recording each comparator's swap decisions (a lane mask, kept in L1), uses the sorted panel for
// the weight gradient, and sends the panel's gradient back to sample order by replaying the recorded
// swaps in reverse (the transpose of the permutation), then through the bilinear taps to the input.
// Re-sorting was measured cheaper than storing a uint8 permutation (k*k bytes per input value,
// written, page-faulted and read back) and it keeps the memory saved for backward to the input.
//
// bfloat16 calls (sort_conv_cpu.cpp) run this float32 kernel with the three products in bfloat16
// (bf16_gemm.h) where the CPU has AVX-512 BF16: the sorted panel, the weights and the output
// gradient are packed into bfloat16 pairs just before each product; sampling, sorting, unsorting and
// the scatter stay in float32.
//
// Inside, the kernel reads and writes raw memory; the checks, the threads and the parallel loop come from
// kernel_support.h. ATen appears only at the edges (make_plan's tensor overload, the weight packing's tensor
// overload, forward_impl, backward_impl and timm_sortconv_cpu::forward / backward), which are left out of a
// build without libtorch (TIMM_SORTCONV_STANDALONE: the onnxruntime operator, onnxruntime/sort_conv_op.cpp,
// which calls make_plan's plain overload and run_forward).
#pragma once

#include "kernel_support.h"

#if !defined(TIMM_SORTCONV_STANDALONE)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "polar_taps.h"
#if !defined(TIMM_SORTCONV_STANDALONE)
#include "sort_conv_cpu.h"
#endif

// Taps per polar sample: bilinear interpolation reads at most 4 window values (PolarTaps' second extent).
constexpr int kPolarTaps = 4;
static_assert(std::extent<decltype(PolarTaps<7>::kTap), 1>::value == kPolarTaps, "polar_taps.h: 4 taps per sample");

// One source, compiled once per instruction-set level (cpu_backend.ISA_LEVELS). The vectors are the
// level's registers: 64 bytes with AVX-512, 32 with AVX2 (and AVX), 16 otherwise (SSE2, NEON), so that
// GCC never splits a vector into several registers (splitting made the unrolled sorting networks take
// minutes to compile and run from memory). x86 intrinsics are used only under the macros of the level
// that has them; every other machine takes the portable GCC vector code.
#if defined(__AVX512F__)
#define TIMM_SORTCONV_VECTOR_BYTES 64
#elif defined(__AVX__)
#define TIMM_SORTCONV_VECTOR_BYTES 32
#else
#define TIMM_SORTCONV_VECTOR_BYTES 16
#endif

namespace {

typedef float vfloat __attribute__((vector_size(TIMM_SORTCONV_VECTOR_BYTES)));
typedef double vdouble __attribute__((vector_size(TIMM_SORTCONV_VECTOR_BYTES)));

template <typename scalar_t>
struct Simd;
template <>
struct Simd<float> {
  using vec = vfloat;
};
template <>
struct Simd<double> {
  using vec = vdouble;
};

template <typename scalar_t>
constexpr int64_t kVecLanes = TIMM_SORTCONV_VECTOR_BYTES / sizeof(scalar_t);

// Output positions per block: two vectors.
template <typename scalar_t>
constexpr int64_t kLanes = 2 * kVecLanes<scalar_t>;
// Vector registers: 32 with AVX-512 and on aarch64, 16 with AVX2 and SSE2.
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
// Micro-GEMM register tile: kTileRows rows by kLanes columns of accumulators (2 * kTileRows vectors),
// plus the two panel vectors and a broadcast weight: 27 of 32 registers, or 15 of 16.
constexpr int kTileRows = kVectorRegisters == 32 ? 12 : 6;
// Input channels whose sorted samples are multiplied together, up to this many samples.
constexpr int64_t kPanelSlots = 256;

template <typename scalar_t>
inline typename Simd<scalar_t>::vec load(const scalar_t* p) {
  typename Simd<scalar_t>::vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename scalar_t>
inline void store(scalar_t* p, typename Simd<scalar_t>::vec v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename scalar_t>
inline typename Simd<scalar_t>::vec splat(scalar_t x) {
  // x - 0 is x for every x (-0 and NaN included), so this folds to a plain broadcast.
  return x - typename Simd<scalar_t>::vec{};
}

// A sparse linear map between rows of kLanes values: out[target] = sum_t weight * in[source]. Targets
// are grouped by their number of terms so that the inner loop has a fixed length (no branch per row).
template <typename scalar_t>
struct TapGroup {
  int64_t terms = 0;
  std::vector<int64_t> targets, sources;  // sources and weights: `terms` per target
  std::vector<scalar_t> weights;
};

template <typename scalar_t>
using TapTable = std::vector<TapGroup<scalar_t>>;

// The table for the triplets (target, source, weight), targets in [0, rows).
template <typename scalar_t>
TapTable<scalar_t> make_tap_table(int64_t rows, const std::vector<std::array<int64_t, 2>>& pairs,
                                  const std::vector<scalar_t>& weights) {
  std::vector<std::vector<std::pair<int64_t, scalar_t>>> terms(rows);
  for (size_t i = 0; i < pairs.size(); ++i) {
    terms[pairs[i][0]].push_back({pairs[i][1], weights[i]});
  }
  TapTable<scalar_t> table;
  for (int64_t target = 0; target < rows; ++target) {
    const int64_t count = static_cast<int64_t>(terms[target].size());
    auto group = std::find_if(table.begin(), table.end(),
                              [&](const TapGroup<scalar_t>& g) { return g.terms == count; });
    if (group == table.end()) {
      table.push_back(TapGroup<scalar_t>{});
      group = table.end() - 1;
      group->terms = count;
    }
    group->targets.push_back(target);
    for (const auto& term : terms[target]) {
      group->sources.push_back(term.first);
      group->weights.push_back(term.second);
    }
  }
  return table;
}

// A range of ring-order slots sorted together, and where its comparators are.
struct Segment {
  int64_t start = 0, size = 0, first_pair = 0, pairs = 0;
  bool fixed = false;  // an unrolled network of this size exists and equals the given comparators
};

template <typename scalar_t>
struct Plan {
  int64_t kernel_size = 0;
  int64_t slots = 0;
  bool single_tap = true;  // square sampling: every sample is one window value, weight 1
  bool direct = false;     // every segment has an unrolled network or one slot, and sort_direct knows the sampling
  int polar_k = 0;         // polar sampling whose taps sit where PolarTaps<polar_k> says (k = 5, 7)
  bool polar_3 = false;    // polar sampling with k = 3 whose taps sit where PolarTaps<3> says (interpolate_runs)
  std::vector<scalar_t> polar_weight;  // then per sample, kPolarTaps weights in that order (0 past its count)
  std::vector<int64_t> sample_offset;    // square sampling: per sample, its flat offset in the window
  std::vector<int64_t> position_sample;  // square sampling: per row-major window position, its sample
  std::vector<int64_t> grid_offset;      // per row-major window position, its flat offset
  TapTable<scalar_t> sampling;   // polar: samples from window positions (bilinear taps)
  TapTable<scalar_t> spreading;  // polar: the transpose, window positions from samples
  std::vector<int32_t> comparators;  // pairs (i, j), i < j, over ring-order slots, segment by segment
  std::vector<Segment> segments;
  int64_t in_h = 0, in_w = 0, out_h = 0, out_w = 0;  // in_*: the padded input
  // The input as given (src_h x src_w) sits at (pad_top, pad_left) of the padded plane; the rest is zeros.
  int64_t src_h = 0, src_w = 0, pad_top = 0, pad_left = 0;
  int64_t stride_h = 1, stride_w = 1;

  int64_t positions() const { return out_h * out_w; }
  bool padded() const { return src_h != in_h || src_w != in_w; }
};

// Output positions of one image row, [col, col + cols) of row `row`, held by lanes [lane, lane + cols).
// `input` is the offset of its first window in a channel's input planes (relative to image 0), and
// `vectors` the whole vectors that copy the run from there (0: element by element, see stage_windows).
struct Run {
  int64_t image, row, col, cols, lane, input, vectors;
};

// Up to kLanes consecutive output positions in (image, row, column) order, so that no lane is left
// empty when rows are shorter than a block or end inside one: the block is cut into runs.
constexpr int64_t kMaxRuns = 32;

// Where the lanes of one vector of a block come from (unit stride only): lane j of piece p reads
// input[base[p] + j + offset] for the lanes set in mask[p]; a vector holds at most two pieces (the end
// of one image row and the start of the next) for sort_direct, else the block is staged.
struct VectorSource {
  int64_t base[2] = {0, 0};
  uint32_t mask[2] = {0, 0};
};

struct Block {
  int64_t count = 0, runs = 0;
  Run run[kMaxRuns];
  bool direct = false;  // every vector has at most two pieces
  VectorSource source[2];
};

// The block of the flat output positions [first, last) (flat: image * out_h * out_w + row * out_w + col).
// Its input offsets (Run::input, VectorSource::base) count from the start of image `first_image` in
// input images `image_stride` apart, of which `readable` values may be read from there on.
template <typename scalar_t, bool kUnitStride>
Block make_block(const Plan<scalar_t>& plan, int64_t first, int64_t last, int64_t image_stride, int64_t first_image,
                 int64_t readable, int64_t channels) {
  static_assert(kLanes<scalar_t> <= kMaxRuns, "a block has at most one run per lane");
  constexpr int64_t half = kVecLanes<scalar_t>;
  Block block;
  block.count = last - first;
  for (int64_t p = first; p < last;) {
    const int64_t image = p / plan.positions(), position = p % plan.positions();
    const int64_t row = position / plan.out_w, col = position % plan.out_w;
    const int64_t cols = std::min(plan.out_w - col, last - p);
    const int64_t offset = (image - first_image) * image_stride + row * plan.stride_h * plan.in_w + col * plan.stride_w;
    // Whole vectors may read past the run, but not past the input (last channel's farthest window).
    const int64_t vectors = (cols + half - 1) / half;
    const bool fits = (channels - 1) * plan.in_h * plan.in_w + offset + plan.grid_offset.back() + vectors * half
                      <= readable;
    block.run[block.runs++] = {image, row, col, cols, p - first, offset, kUnitStride && fits ? vectors : 0};
    p += cols;
  }
  if (kUnitStride) {
    block.direct = true;
    int pieces[2] = {0, 0};
    for (int64_t i = 0; i < block.runs; ++i) {
      const Run& run = block.run[i];
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t a = std::max(run.lane, h * half), b = std::min(run.lane + run.cols, (h + 1) * half);
        if (a >= b) continue;
        if (pieces[h] == 2) {
          block.direct = false;
          continue;
        }
        block.source[h].base[pieces[h]] = run.input - run.lane + h * half;
        block.source[h].mask[pieces[h]] = ((uint32_t(1) << (b - a)) - 1) << (a - h * half);
        ++pieces[h];
      }
    }
  }
  return block;
}

bool matches_fixed_network(int64_t size, const int32_t* pairs, int64_t count, int64_t start);

// Whether the taps per sample (window position, weight) sit exactly where PolarTaps<K> puts them.
template <int K>
bool same_polar_taps(const std::vector<std::vector<std::pair<int64_t, double>>>& taps) {
  if (static_cast<int64_t>(taps.size()) != K * K) return false;
  for (int s = 0; s < K * K; ++s) {
    if (static_cast<int>(taps[s].size()) != PolarTaps<K>::kCount[s]) return false;
    for (int t = 0; t < PolarTaps<K>::kCount[s]; ++t) {
      if (taps[s][t].first != PolarTaps<K>::kTap[s][t][0] * K + PolarTaps<K>::kTap[s][t][1]) return false;
    }
  }
  return true;
}

// Unrolled networks are compiled for float32 only, which training uses; float64 (tests, gradcheck)
// runs the same comparators from memory, and the build stays short.
template <typename scalar_t>
constexpr bool kUnrolledNetworks = std::is_same<scalar_t, float>::value;

// The geometry tables of one variant as make_plan reads them (cpu_backend._Tables; the onnxruntime operator's
// attributes): per sample (slot order) `taps` taps, each a window offset (dy, dx) from pixel k / 2 and a weight (0:
// unused); the segments as [start, end) slot ranges; the comparators as (lo, hi) slot pairs, segment by segment.
struct PlanTables {
  const int64_t* tap_offsets = nullptr;  // (k*k, taps, 2)
  const double* tap_weights = nullptr;   // (k*k, taps)
  int64_t taps = 0;
  const int64_t* segments = nullptr;  // (segment_count, 2)
  int64_t segment_count = 0;
  const int32_t* comparators = nullptr;  // (comparator_count, 2)
  int64_t comparator_count = 0;
};

// The plan of a call on an input of src_h x src_w with these tables and settings.
template <typename scalar_t>
Plan<scalar_t> make_plan(const PlanTables& tables, int64_t src_h, int64_t src_w, int64_t kernel_size,
                         int64_t stride_h, int64_t stride_w, int64_t dilation_h, int64_t dilation_w,
                         const std::array<int64_t, 4>& pad) {
  Plan<scalar_t> plan;
  const int64_t slots = kernel_size * kernel_size;
  TIMM_SORTCONV_CHECK(kernel_size >= 1, "sort_conv_cpu: kernel_size must be >= 1, got ", kernel_size);
  TIMM_SORTCONV_CHECK(stride_h >= 1 && stride_w >= 1 && dilation_h >= 1 && dilation_w >= 1,
                      "sort_conv_cpu: stride and dilation must be >= 1");
  plan.kernel_size = kernel_size;
  plan.slots = slots;
  // pad: (left, right, top, bottom) zeros around the input, as F.pad takes them.
  TIMM_SORTCONV_CHECK(std::all_of(pad.begin(), pad.end(), [](int64_t p) { return p >= 0; }),
                      "sort_conv_cpu: padding must be >= 0");
  plan.src_h = src_h;
  plan.src_w = src_w;
  plan.pad_left = pad[0];
  plan.pad_top = pad[2];
  plan.in_h = plan.src_h + pad[2] + pad[3];
  plan.in_w = plan.src_w + pad[0] + pad[1];
  plan.stride_h = stride_h;
  plan.stride_w = stride_w;
  plan.out_h = (plan.in_h - dilation_h * (kernel_size - 1) - 1) / stride_h + 1;
  plan.out_w = (plan.in_w - dilation_w * (kernel_size - 1) - 1) / stride_w + 1;
  TIMM_SORTCONV_CHECK(
      plan.in_h >= dilation_h * (kernel_size - 1) + 1 && plan.in_w >= dilation_w * (kernel_size - 1) + 1,
      "sort_conv_cpu: padded input (", plan.in_h, ", ", plan.in_w, ") is smaller than the dilated kernel");

  const int64_t* off = tables.tap_offsets;
  const double* wgt = tables.tap_weights;
  // Offsets count from the window's pixel k / 2 (its centre for odd k, the pixel below and right of it for even k).
  const int64_t half = kernel_size / 2, last = kernel_size - 1 - half, max_taps = tables.taps;
  plan.grid_offset.resize(slots);
  for (int64_t q = 0; q < slots; ++q) {
    plan.grid_offset[q] = (q / kernel_size) * dilation_h * plan.in_w + (q % kernel_size) * dilation_w;
  }
  // Triplets (sample, window position, weight) of the taps with a nonzero weight.
  std::vector<std::array<int64_t, 2>> sample_position, position_sample;
  std::vector<scalar_t> tap_weight;
  plan.position_sample.assign(slots, 0);
  std::vector<std::vector<std::pair<int64_t, double>>> taps_of(slots);
  for (int64_t s = 0; s < slots; ++s) {
    int64_t used = 0;
    for (int64_t t = 0; t < max_taps; ++t) {
      const double w = wgt[s * max_taps + t];
      if (w == 0.0) {
        continue;
      }
      const int64_t dy = off[(s * max_taps + t) * 2], dx = off[(s * max_taps + t) * 2 + 1];
      TIMM_SORTCONV_CHECK(dy >= -half && dy <= last && dx >= -half && dx <= last,
                          "sort_conv_cpu: a tap leaves the window");
      const int64_t q = (dy + half) * kernel_size + (dx + half);
      sample_position.push_back({s, q});
      position_sample.push_back({q, s});
      tap_weight.push_back(static_cast<scalar_t>(w));
      taps_of[s].push_back({q, w});
      if (used == 0) {
        plan.sample_offset.push_back(plan.grid_offset[q]);
        plan.position_sample[q] = s;
      }
      if (used > 0 || w != 1.0) {
        plan.single_tap = false;
      }
      ++used;
    }
    TIMM_SORTCONV_CHECK(used >= 1, "sort_conv_cpu: sample ", s, " has no tap");
  }
  plan.sampling = make_tap_table(slots, sample_position, tap_weight);
  plan.spreading = make_tap_table(slots, position_sample, tap_weight);

  const int32_t* pair = tables.comparators;
  const int64_t comparator_count = tables.comparator_count;
  plan.comparators.assign(pair, pair + 2 * comparator_count);
  const int64_t* bound = tables.segments;
  int64_t next_pair = 0, next_slot = 0;
  for (int64_t i = 0; i < tables.segment_count; ++i) {
    Segment segment;
    segment.start = bound[2 * i];
    segment.size = bound[2 * i + 1] - segment.start;
    TIMM_SORTCONV_CHECK(segment.start == next_slot && segment.size >= 1,
                        "sort_conv_cpu: segments must tile the slots in order");
    next_slot += segment.size;
    segment.first_pair = next_pair;
    while (next_pair < comparator_count && pair[2 * next_pair] >= segment.start
           && pair[2 * next_pair + 1] < segment.start + segment.size) {
      TIMM_SORTCONV_CHECK(pair[2 * next_pair] < pair[2 * next_pair + 1],
                          "sort_conv_cpu: a comparator is not (lo, hi)");
      ++next_pair;
    }
    segment.pairs = next_pair - segment.first_pair;
    segment.fixed = matches_fixed_network(segment.size, pair + 2 * segment.first_pair, segment.pairs, segment.start);
    plan.segments.push_back(segment);
  }
  TIMM_SORTCONV_CHECK(tables.segment_count == 0 || next_slot == slots,
                      "sort_conv_cpu: segments must cover all k*k slots");
  TIMM_SORTCONV_CHECK(next_pair == comparator_count, "sort_conv_cpu: comparator ", next_pair,
                      " lies outside its segment");
  // sort_direct not for k = 3: there the staged taps measured as fast (A/B, 64x64 maps) and the fused ones up to 10%
  // slower; its taps at compile-time positions serve interpolate_runs.
  plan.polar_3 = !plan.single_tap && same_polar_taps<3>(taps_of);
  if (!plan.single_tap && (same_polar_taps<5>(taps_of) || same_polar_taps<7>(taps_of))) {
    plan.polar_k = static_cast<int>(kernel_size);
  }
  if (plan.polar_k != 0 || plan.polar_3) {
    plan.polar_weight.assign(slots * kPolarTaps, scalar_t(0));
    for (int64_t s = 0; s < slots; ++s) {
      for (size_t t = 0; t < taps_of[s].size(); ++t) {
        plan.polar_weight[s * kPolarTaps + t] = static_cast<scalar_t>(taps_of[s][t].second);
      }
    }
  }
  plan.direct = kUnrolledNetworks<scalar_t> && (plan.single_tap || plan.polar_k != 0) && !plan.segments.empty()
                && std::all_of(plan.segments.begin(), plan.segments.end(),
                               [](const Segment& segment) { return segment.fixed || segment.size == 1; });
  return plan;
}

#if !defined(TIMM_SORTCONV_STANDALONE)
// make_plan from the tables as tensors (the PyTorch extension's arguments) and the input.
template <typename scalar_t>
Plan<scalar_t> make_plan(const at::Tensor& input, const at::Tensor& tap_offsets, const at::Tensor& tap_weights,
                         const at::Tensor& segments, const at::Tensor& comparators, int64_t kernel_size,
                         int64_t stride_h, int64_t stride_w, int64_t dilation_h, int64_t dilation_w,
                         const std::array<int64_t, 4>& pad) {
  const int64_t slots = kernel_size * kernel_size;
  TORCH_CHECK(tap_offsets.dim() == 3 && tap_offsets.size(0) == slots && tap_offsets.size(2) == 2,
              "sort_conv_cpu: tap_offsets must be (k*k, T, 2)");
  TORCH_CHECK(tap_weights.dim() == 2 && tap_weights.size(0) == slots && tap_weights.size(1) == tap_offsets.size(1),
              "sort_conv_cpu: tap_weights must be (k*k, T)");
  TORCH_CHECK(comparators.dim() == 2 && comparators.size(1) == 2, "sort_conv_cpu: comparators must be (n, 2)");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 2, "sort_conv_cpu: segments must be (n, 2)");
  const auto offsets = tap_offsets.to(at::kLong).contiguous();
  const auto weights = tap_weights.to(at::kDouble).contiguous();
  const auto pairs = comparators.to(at::kInt).contiguous();
  const auto bounds = segments.to(at::kLong).contiguous();
  PlanTables tables;
  tables.tap_offsets = offsets.data_ptr<int64_t>();
  tables.tap_weights = weights.data_ptr<double>();
  tables.taps = tap_offsets.size(1);
  tables.segments = bounds.data_ptr<int64_t>();
  tables.segment_count = bounds.size(0);
  tables.comparators = pairs.data_ptr<int32_t>();
  tables.comparator_count = pairs.size(0);
  return make_plan<scalar_t>(tables, input.size(2), input.size(3), kernel_size, stride_h, stride_w, dilation_h,
                             dilation_w, pad);
}
#endif

// Copies the window values at `offsets[e]` (flat, from a window's top-left corner) of every lane of
// the block into dest[e][lanes]; `channel_input` is one channel's plane of image 0. Runs are copied
// as whole vectors where the input allows: what spills past a run lands in lanes that are written
// later or never used (lanes past the block only ever meet themselves: sorting and the output GEMM
// are per lane, and the backward pass ignores them), so `dest` needs kVecLanes entries of slack.
template <typename scalar_t, bool kUnitStride>
void stage_windows(const Plan<scalar_t>& plan, const scalar_t* channel_input, const Block& block,
                   const int64_t* offsets, int64_t entries, scalar_t* dest) {
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t step = kUnitStride ? 1 : plan.stride_w;
  for (int64_t e = 0; e < entries; ++e) {
    for (int64_t i = 0; i < block.runs; ++i) {
      const Run& run = block.run[i];
      const scalar_t* src = channel_input + run.input + offsets[e];
      scalar_t* dst = dest + e * lanes + run.lane;
      if (run.vectors == 2) {
        store(dst, load(src));
        store(dst + half, load(src + half));
      } else if (run.vectors == 1) {
        store(dst, load(src));
      } else {
        for (int64_t j = 0; j < run.cols; ++j) dst[j] = src[j * step];
      }
    }
  }
}

// out[target][lanes] = sum of weight * in[source][lanes] over the terms of each target.
template <typename scalar_t, int kTerms>
void apply_tap_group(const TapGroup<scalar_t>& group, int64_t terms, const scalar_t* __restrict in,
                     scalar_t* __restrict out) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t n = kTerms > 0 ? kTerms : terms, count = static_cast<int64_t>(group.targets.size());
  const int64_t* targets = group.targets.data();
  const int64_t* sources = group.sources.data();
  const scalar_t* weights = group.weights.data();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* source = sources + i * n;
    const scalar_t* weight = weights + i * n;
    vec w = splat(weight[0]);
    vec acc0 = w * load(in + source[0] * lanes), acc1 = w * load(in + source[0] * lanes + half);
    for (int64_t t = 1; t < n; ++t) {
      w = splat(weight[t]);
      acc0 += w * load(in + source[t] * lanes);
      acc1 += w * load(in + source[t] * lanes + half);
    }
    store(out + targets[i] * lanes, acc0);
    store(out + targets[i] * lanes + half, acc1);
  }
}

template <typename scalar_t>
void apply_taps(const TapTable<scalar_t>& table, const scalar_t* in, scalar_t* out) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  for (const auto& group : table) {
    switch (group.terms) {
      case 0:
        for (const int64_t target : group.targets) {
          std::fill(out + target * lanes, out + (target + 1) * lanes, scalar_t(0));
        }
        break;
      case 1: apply_tap_group<scalar_t, 1>(group, 1, in, out); break;
      case 2: apply_tap_group<scalar_t, 2>(group, 2, in, out); break;
      case 3: apply_tap_group<scalar_t, 3>(group, 3, in, out); break;
      case 4: apply_tap_group<scalar_t, 4>(group, 4, in, out); break;
      default: apply_tap_group<scalar_t, 0>(group, group.terms, in, out); break;
    }
  }
}

// kVectors vectors of one run (read from `src`, written from `value`'s first lane) of a tap group's targets.
template <typename scalar_t, int kTerms, int kVectors>
void interpolate_group(const TapGroup<scalar_t>& group, const int64_t* offset, const scalar_t* src, scalar_t* value) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t count = static_cast<int64_t>(group.targets.size());
  for (int64_t j = 0; j < count; ++j) {
    const int64_t* source = group.sources.data() + j * kTerms;
    const scalar_t* weight = group.weights.data() + j * kTerms;
    scalar_t* target = value + group.targets[j] * lanes;
#pragma GCC unroll 2
    for (int h = 0; h < kVectors; ++h) {
      vec acc = splat(weight[0]) * load(src + offset[source[0]] + h * half);
#pragma GCC unroll 4
      for (int t = 1; t < kTerms; ++t) acc += splat(weight[t]) * load(src + offset[source[t]] + h * half);
      store(target + h * half, acc);
    }
  }
}

// interpolate_run for k = 3 (plan.polar_3): the window's 9 values read once per vector and each sample's taps taken
// from them in registers (PolarTaps<3>'s positions, the plan's weights in the tap table's order), not one read per
// tap (16 for the four diagonal samples, which share the centre and the axes).
template <typename scalar_t, int kVectors>
void interpolate_run_3(const Plan<scalar_t>& plan, const scalar_t* src, scalar_t* value) {
  using vec = typename Simd<scalar_t>::vec;
  using taps = PolarTaps<3>;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const scalar_t* weight = plan.polar_weight.data();
#pragma GCC unroll 2
  for (int h = 0; h < kVectors; ++h) {
    vec x[9];
#pragma GCC unroll 9
    for (int g = 0; g < 9; ++g) x[g] = load(src + plan.grid_offset[g] + h * half);
#pragma GCC unroll 9
    for (int s = 0; s < 9; ++s) {
      const auto tap = [&](int t) __attribute__((always_inline)) {
        return x[taps::kTap[s][t][0] * 3 + taps::kTap[s][t][1]];
      };
      vec acc = splat(weight[s * kPolarTaps]) * tap(0);
#pragma GCC unroll 4
      for (int t = 1; t < kPolarTaps; ++t) {
        if (t < taps::kCount[s]) acc += splat(weight[s * kPolarTaps + t]) * tap(t);
      }
      store(value + s * lanes + h * half, acc);
    }
  }
}

template <typename scalar_t, int kVectors>
void interpolate_run(const TapTable<scalar_t>& table, const int64_t* offset, const scalar_t* src, scalar_t* value) {
  for (const auto& group : table) {
    switch (group.terms) {
      case 1: interpolate_group<scalar_t, 1, kVectors>(group, offset, src, value); break;
      case 2: interpolate_group<scalar_t, 2, kVectors>(group, offset, src, value); break;
      case 3: interpolate_group<scalar_t, 3, kVectors>(group, offset, src, value); break;
      default: interpolate_group<scalar_t, 4, kVectors>(group, offset, src, value); break;
    }
  }
}

// Polar samples interpolated straight from the input where the block's runs take at most two whole vectors (a row of
// 32 positions or two of 16): each sample's taps read from the run at their window offsets (plan.grid_offset) and
// summed in registers, stored once, instead of the k x k window staged (stage_windows) and read back (apply_taps),
// with the same products in the same order. Run after run in lane order, so that a run's spill past its lanes is
// overwritten by the next run's, as in stage_windows; with two vectors in all no run writes past its sample's row of
// kLanes (a second run starts at lane 16 or before). False (nothing done) for other blocks: a small map's many short
// rows would take more vectors here than the staged taps do (with k = 3's shared reads, up to five vectors measured
// no faster than staging). Measured (scripts/bench_onnx_library_ab.py, one thread): ri_densenet40 8% faster at batch
// 1 than staging, and with k = 3's reads shared (interpolate_run_3) 12% more; outputs bit-equal.
template <typename scalar_t>
bool interpolate_runs(const Plan<scalar_t>& plan, const scalar_t* channel_input, const Block& block, scalar_t* value) {
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  int64_t vectors = 0;
  for (int64_t i = 0; i < block.runs; ++i) {
    if (block.run[i].vectors == 0) return false;
    vectors += block.run[i].vectors;
  }
  if (vectors > lanes / half) return false;
  for (const auto& group : plan.sampling) {
    if (group.terms < 1 || group.terms > 4) return false;
  }
  // Run after run in lane order, so that a run's spill past its lanes is overwritten by the next run's.
  for (int64_t i = 0; i < block.runs; ++i) {
    const Run& run = block.run[i];
    const scalar_t* src = channel_input + run.input;
    if (plan.polar_3) {
      if (run.vectors == 2) {
        interpolate_run_3<scalar_t, 2>(plan, src, value + run.lane);
      } else {
        interpolate_run_3<scalar_t, 1>(plan, src, value + run.lane);
      }
    } else if (run.vectors == 2) {
      interpolate_run<scalar_t, 2>(plan.sampling, plan.grid_offset.data(), src, value + run.lane);
    } else {
      interpolate_run<scalar_t, 1>(plan.sampling, plan.grid_offset.data(), src, value + run.lane);
    }
  }
  return true;
}

// value[s][lanes] = sample s of every lane's window, in ring order. Square samples are staged
// straight from the input; polar samples are interpolated from the runs (interpolate_runs) or from the
// staged k x k window.
template <typename scalar_t, bool kUnitStride>
void gather_samples(const Plan<scalar_t>& plan, const scalar_t* channel_input, const Block& block, scalar_t* grid,
                    scalar_t* value) {
  if (plan.single_tap) {
    stage_windows<scalar_t, kUnitStride>(plan, channel_input, block, plan.sample_offset.data(), plan.slots, value);
    return;
  }
  if (kUnitStride && interpolate_runs(plan, channel_input, block, value)) return;
  stage_windows<scalar_t, kUnitStride>(plan, channel_input, block, plan.grid_offset.data(), plan.slots, grid);
  apply_taps(plan.sampling, grid, value);
}

// A comparator network as (lo, hi) pairs: after lo, hi = min, max for every pair in order, the
// values are sorted ascending.
struct Pair {
  int lo, hi;
};

// Batcher's odd-even merge sort for N values: geometry.batcher_comparators, rebuilt at compile time
// so that the common sizes run unrolled with the values in registers. make_plan only uses it for a
// segment whose comparators from Python are exactly these.
// Calls visit(lo, hi, p) for every comparator of the network for n values, in order; p is the stage:
// the comparator belongs to the merge of the two sorted halves of a block of 2p values.
template <typename F>
constexpr void for_each_batcher_pair(int n, const F& visit) {
  int padded = 1;
  while (padded < n) padded *= 2;
  for (int p = 1; p < padded; p *= 2)
    for (int k = p; k >= 1; k /= 2)
      for (int j = k % p; j < padded - k; j += 2 * k)
        for (int i = 0; i < std::min(k, padded - j - k); ++i)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p) && i + j + k < n) visit(i + j, i + j + k, p);
}

template <int N>
constexpr int batcher_count() {
  int count = 0;
  for_each_batcher_pair(N, [&](int, int, int) { ++count; });
  return count;
}

template <int N>
constexpr std::array<Pair, batcher_count<N>()> batcher_network() {
  std::array<Pair, batcher_count<N>()> pairs{};
  int count = 0;
  for_each_batcher_pair(N, [&](int lo, int hi, int) { pairs[count++] = {lo, hi}; });
  return pairs;
}

// The same comparators in the order the unrolled code runs them: depth first, i.e. the network of
// each half of a block (a power of two) entirely before the other half's and before the stage that
// merges them. Only comparators of independent blocks change places, so every value meets the same
// comparators in the same order and the result is bit for bit that of batcher_network; but the first
// half of a window is sorted before the second half is loaded (load_and_sort), so fewer values are
// live at once: measured (A/B in one process, 1 thread) 4-8% off the forward of the global variants
// at the issue's 7x7 shapes, no change at 3x3.
template <int N>
constexpr std::array<Pair, batcher_count<N>()> batcher_depth_first() {
  std::array<Pair, batcher_count<N>()> pairs{};
  std::array<int, batcher_count<N>()> key{};
  int count = 0;
  for_each_batcher_pair(N, [&](int lo, int hi, int p) {
    // Blocks in post-order (by their end, then the smaller first); a stable insertion keeps the order
    // within a block.
    const int this_key = (lo / (2 * p) * (2 * p) + 2 * p) * 256 + 2 * p;
    int at = count++;
    while (at > 0 && key[at - 1] > this_key) {
      key[at] = key[at - 1];
      pairs[at] = pairs[at - 1];
      --at;
    }
    key[at] = this_key;
    pairs[at] = {lo, hi};
  });
  return pairs;
}

// Where the depth-first order splits for N values: the first `half` values (half the padded network)
// are sorted by its first `first` comparators, the remaining ones by the next `second`, and the rest
// merge the two.
template <int N>
struct NetworkSplit {
  static constexpr int padded() {
    int p = 1;
    while (p < N) p *= 2;
    return p;
  }
  static constexpr int half = N > 1 ? padded() / 2 : N;
  static constexpr int first = batcher_count<half>();
  static constexpr int second = N > half ? batcher_count<N - half>() : 0;
};

// The depth-first network reordered for a register file of kVectorRegisters vectors. Within each of its
// three parts (sorting the first half, the second half, merging them) a comparator may run once every
// earlier comparator of either of its values has run, so every value still meets the same comparators
// in the same order and the result is bit for bit the same. Among the comparators that may run, the
// first whose values are both among the kVectorRegisters - 1 most recently used ones (one register
// holds the exchange) runs next, else the first with one of them, else the first: a model of the
// register file under which the independent sub-merges of a merge run one after the other instead of
// stage by stage over all the values, so that fewer values wait in memory.
template <int N>
constexpr std::array<Pair, batcher_count<N>()> register_order() {
  constexpr int count = batcher_count<N>(), held = kVectorRegisters - 1;
  const auto network = batcher_depth_first<N>();
  // Per comparator, the previous comparator of its lo and of its hi value (-1: none).
  std::array<int, count> before_lo{}, before_hi{};
  std::array<int, N> last_of{};
  for (int v = 0; v < N; ++v) last_of[v] = -1;
  for (int c = 0; c < count; ++c) {
    before_lo[c] = last_of[network[c].lo];
    before_hi[c] = last_of[network[c].hi];
    last_of[network[c].lo] = last_of[network[c].hi] = c;
  }
  std::array<Pair, count> order{};
  std::array<bool, count> done{};
  std::array<int, N> used_at{};  // per value, the step of its last use (0: never)
  std::array<bool, N> cached{};
  int cached_count = 0, placed = 0;
  using split = NetworkSplit<N>;
  const int bounds[4] = {0, split::first, split::first + split::second, count};
  for (int part = 0; part < 3; ++part) {
    for (int step = bounds[part]; step < bounds[part + 1]; ++step) {
      int best = -1, best_misses = 3;
      for (int c = bounds[part]; c < bounds[part + 1] && best_misses > 0; ++c) {
        if (done[c] || (before_lo[c] >= 0 && !done[before_lo[c]]) || (before_hi[c] >= 0 && !done[before_hi[c]])) {
          continue;
        }
        const int misses = !cached[network[c].lo] + !cached[network[c].hi];
        if (misses < best_misses) {
          best = c;
          best_misses = misses;
        }
      }
      done[best] = true;
      order[placed++] = network[best];
      for (const int v : {network[best].lo, network[best].hi}) {
        used_at[v] = step + 1;
        if (cached[v]) continue;
        if (cached_count == held) {
          int oldest = -1;
          for (int u = 0; u < N; ++u) {
            if (cached[u] && (oldest < 0 || used_at[u] < used_at[oldest])) oldest = u;
          }
          cached[oldest] = false;
          --cached_count;
        }
        cached[v] = true;
        ++cached_count;
      }
    }
  }
  return order;
}

// A compare-exchange's swap decisions, one per lane: an AVX-512 mask register where there is one,
// else a vector of all-ones/all-zeros lanes.
template <typename vec>
struct SwapMaskOf {
  using type = decltype(vec{} < vec{});
};

// (a, b) = (min, max) with the swap decided by `b < a`: the pair is always permuted (see the file
// comment on NaN). x86 min/max return their second operand when the pair is unordered or equal, so
// min(b, a) is exactly `b < a ? b : a` and max(a, b) is `b < a ? a : b`: two instructions, where GCC
// compiles the portable expression below to a compare and two blends (NEON's min/max would turn a
// NaN into two, so other machines keep that expression).
template <typename vec>
inline void min_max(vec& a, vec& b) {
  const auto swap = b < a;
  const vec lo = swap ? b : a, hi = swap ? a : b;
  a = lo;
  b = hi;
}

#define TIMM_SORTCONV_MIN_MAX(vec, reg, min, max)  \
  inline void min_max(vec& a, vec& b) {             \
    const vec lo = (vec)min((reg)b, (reg)a);        \
    b = (vec)max((reg)a, (reg)b);                   \
    a = lo;                                         \
  }
#if defined(__AVX512F__)
TIMM_SORTCONV_MIN_MAX(vfloat, __m512, _mm512_min_ps, _mm512_max_ps)
TIMM_SORTCONV_MIN_MAX(vdouble, __m512d, _mm512_min_pd, _mm512_max_pd)
#elif defined(__AVX__)
TIMM_SORTCONV_MIN_MAX(vfloat, __m256, _mm256_min_ps, _mm256_max_ps)
TIMM_SORTCONV_MIN_MAX(vdouble, __m256d, _mm256_min_pd, _mm256_max_pd)
#elif defined(__SSE2__)
TIMM_SORTCONV_MIN_MAX(vfloat, __m128, _mm_min_ps, _mm_max_ps)
TIMM_SORTCONV_MIN_MAX(vdouble, __m128d, _mm_min_pd, _mm_max_pd)
#endif
#undef TIMM_SORTCONV_MIN_MAX

// min_max that also returns its swap decisions (unused, and dropped by the compiler, in the forward pass).
template <typename vec>
inline typename SwapMaskOf<vec>::type compare_exchange(vec& a, vec& b) {
  const auto swap = b < a;
  min_max(a, b);
  return swap;
}

template <typename vec>
inline void apply_swap(const typename SwapMaskOf<vec>::type& swap, vec& a, vec& b) {
  const vec lo = swap ? b : a, hi = swap ? a : b;
  a = lo;
  b = hi;
}

#if defined(__AVX512F__)
// With AVX-512 the decisions fit in a 16- or 8-bit mask register.
template <>
struct SwapMaskOf<vfloat> {
  using type = __mmask16;
};
template <>
struct SwapMaskOf<vdouble> {
  using type = __mmask8;
};

inline __mmask16 compare_exchange(vfloat& a, vfloat& b) {
  const __mmask16 swap = _mm512_cmp_ps_mask((__m512)b, (__m512)a, _CMP_LT_OQ);
  min_max(a, b);
  return swap;
}

inline __mmask8 compare_exchange(vdouble& a, vdouble& b) {
  const __mmask8 swap = _mm512_cmp_pd_mask((__m512d)b, (__m512d)a, _CMP_LT_OQ);
  min_max(a, b);
  return swap;
}

inline void apply_swap(__mmask16 swap, vfloat& a, vfloat& b) {
  const vfloat lo = (vfloat)_mm512_mask_blend_ps(swap, (__m512)a, (__m512)b);
  const vfloat hi = (vfloat)_mm512_mask_blend_ps(swap, (__m512)b, (__m512)a);
  a = lo;
  b = hi;
}

inline void apply_swap(__mmask8 swap, vdouble& a, vdouble& b) {
  const vdouble lo = (vdouble)_mm512_mask_blend_pd(swap, (__m512d)a, (__m512d)b);
  const vdouble hi = (vdouble)_mm512_mask_blend_pd(swap, (__m512d)b, (__m512d)a);
  a = lo;
  b = hi;
}
#endif

template <typename vec>
using SwapMask = typename SwapMaskOf<vec>::type;

// Comparators [kFirst, kFirst + sizeof...(I)) of the depth-first network; swaps are indexed like them.
// Always inlined, so that the values stay in the caller's registers (GCC otherwise keeps the larger
// networks out of line and passes the values through memory).
template <int N, bool kRecord, int kFirst = 0, typename vec, size_t... I>
inline __attribute__((always_inline)) void run_network(vec* v, SwapMask<vec>* swaps, std::index_sequence<I...>) {
  static constexpr auto pairs = register_order<N>();
  if (kRecord) {
    ((swaps[kFirst + I] = compare_exchange(v[pairs[kFirst + I].lo], v[pairs[kFirst + I].hi])), ...);
  } else {
    (compare_exchange(v[pairs[kFirst + I].lo], v[pairs[kFirst + I].hi]), ...);
  }
}

// v[i] = sample(i) for i < N, sorted: the second half is loaded once the first half is sorted.
template <int N, bool kRecord, typename vec, typename F>
inline __attribute__((always_inline)) void load_and_sort(vec* v, SwapMask<vec>* swaps, const F& sample) {
  using split = NetworkSplit<N>;
  constexpr int merge = batcher_count<N>() - split::first - split::second;
#pragma GCC unroll 64
  for (int i = 0; i < split::half; ++i) v[i] = sample(i);
  run_network<N, kRecord, 0>(v, swaps, std::make_index_sequence<split::first>{});
#pragma GCC unroll 64
  for (int i = split::half; i < N; ++i) v[i] = sample(i);
  run_network<N, kRecord, split::first>(v, swaps, std::make_index_sequence<split::second>{});
  run_network<N, kRecord, split::first + split::second>(v, swaps, std::make_index_sequence<merge>{});
}

template <int N, typename vec, size_t... I>
inline __attribute__((always_inline)) void replay_reversed(const SwapMask<vec>* swaps, vec* v,
                                                           std::index_sequence<I...>) {
  static constexpr auto pairs = register_order<N>();
  constexpr size_t last = sizeof...(I) - 1;
  (apply_swap(swaps[last - I], v[pairs[last - I].lo], v[pairs[last - I].hi]), ...);
}

// Sorts N consecutive sample rows, one vector of lanes at a time so that the rows fit in registers;
// with kRecord the swap decisions go to swaps[half * count + comparator].
template <typename scalar_t, int N, bool kRecord>
void sort_fixed(scalar_t* value, SwapMask<typename Simd<scalar_t>::vec>* swaps) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>, count = batcher_count<N>();
  for (int64_t h = 0; h < lanes; h += half) {
    vec v[N];
    load_and_sort<N, kRecord>(v, kRecord ? swaps + (h / half) * count : nullptr,
                              [&](int i) { return load(value + i * lanes + h); });
#pragma GCC unroll 64
    for (int i = 0; i < N; ++i) store(value + i * lanes + h, v[i]);
  }
}

// The transpose of sort_fixed's permutation: moves gradients of sorted slots back to their samples.
template <typename scalar_t, int N>
void unsort_fixed(scalar_t* grad, const SwapMask<typename Simd<scalar_t>::vec>* swaps) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>, count = batcher_count<N>();
  for (int64_t h = 0; h < lanes; h += half) {
    vec v[N];
    for (int i = 0; i < N; ++i) v[i] = load(grad + i * lanes + h);
    replay_reversed<N>(swaps + (h / half) * count, v, std::make_index_sequence<count>{});
    for (int i = 0; i < N; ++i) store(grad + i * lanes + h, v[i]);
  }
}

// The segment sizes with an unrolled network: rings (8r) and whole windows (k*k) for k <= 7, the
// ring of k = 9, and the orbits of sorting="c2"/"c4" (2, 4). Other sizes run the comparators from Python
// over rows in memory.
#define TIMM_SORTCONV_FIXED_SIZES(X) X(2) X(4) X(8) X(9) X(16) X(24) X(25) X(32) X(49)

template <int N>
bool same_network(const int32_t* pairs, int64_t count, int64_t start) {
  static constexpr auto network = batcher_network<N>();
  if (count != static_cast<int64_t>(network.size())) return false;
  for (int64_t c = 0; c < count; ++c) {
    if (pairs[2 * c] - start != network[c].lo || pairs[2 * c + 1] - start != network[c].hi) return false;
  }
  return true;
}

bool matches_fixed_network(int64_t size, const int32_t* pairs, int64_t count, int64_t start) {
#define TIMM_SORTCONV_CASE(n) \
  case n:                     \
    return same_network<n>(pairs, count, start);
  switch (size) {
    TIMM_SORTCONV_FIXED_SIZES(TIMM_SORTCONV_CASE)
    default:
      return false;
  }
#undef TIMM_SORTCONV_CASE
}

template <typename scalar_t, bool kRecord>
void sort_segment(const Segment& segment, const int32_t* pairs, scalar_t* value,
                  SwapMask<typename Simd<scalar_t>::vec>* swaps) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  if constexpr (kUnrolledNetworks<scalar_t>) {
    if (segment.fixed) {
#define TIMM_SORTCONV_CASE(n) \
  case n:                     \
    return sort_fixed<scalar_t, n, kRecord>(value + segment.start * lanes, swaps);
      switch (segment.size) { TIMM_SORTCONV_FIXED_SIZES(TIMM_SORTCONV_CASE) }
#undef TIMM_SORTCONV_CASE
    }
  }
  for (int64_t c = 0; c < segment.pairs; ++c) {
    for (int64_t h = 0; h < lanes; h += half) {
      scalar_t* lo = value + pairs[2 * c] * lanes + h;
      scalar_t* hi = value + pairs[2 * c + 1] * lanes + h;
      vec a = load(lo), b = load(hi);
      const auto swap = compare_exchange(a, b);
      if (kRecord) swaps[(h / half) * segment.pairs + c] = swap;
      store(lo, a);
      store(hi, b);
    }
  }
}

template <typename scalar_t>
void unsort_segment(const Segment& segment, const int32_t* pairs, scalar_t* grad,
                    const SwapMask<typename Simd<scalar_t>::vec>* swaps) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  if constexpr (kUnrolledNetworks<scalar_t>) {
    if (segment.fixed) {
#define TIMM_SORTCONV_CASE(n) \
  case n:                     \
    return unsort_fixed<scalar_t, n>(grad + segment.start * lanes, swaps);
      switch (segment.size) { TIMM_SORTCONV_FIXED_SIZES(TIMM_SORTCONV_CASE) }
#undef TIMM_SORTCONV_CASE
    }
  }
  for (int64_t c = segment.pairs - 1; c >= 0; --c) {
    for (int64_t h = 0; h < lanes; h += half) {
      scalar_t* lo = grad + pairs[2 * c] * lanes + h;
      scalar_t* hi = grad + pairs[2 * c + 1] * lanes + h;
      vec a = load(lo), b = load(hi);
      apply_swap(swaps[(h / half) * segment.pairs + c], a, b);
      store(lo, a);
      store(hi, b);
    }
  }
}

// Sorts every segment of value[slots][lanes]; with kRecord the swap decisions are kept in `swaps`
// (two masks per comparator) for unsort_gradients.
template <typename scalar_t, bool kRecord>
void sort_samples(const Plan<scalar_t>& plan, scalar_t* value, SwapMask<typename Simd<scalar_t>::vec>* swaps) {
  for (const auto& segment : plan.segments) {
    if (segment.pairs > 0) {
      sort_segment<scalar_t, kRecord>(segment, plan.comparators.data() + 2 * segment.first_pair, value,
                                      kRecord ? swaps + 2 * segment.first_pair : nullptr);
    }
  }
}

template <typename scalar_t>
void unsort_gradients(const Plan<scalar_t>& plan, scalar_t* grad,
                      const SwapMask<typename Simd<scalar_t>::vec>* swaps) {
  for (const auto& segment : plan.segments) {
    if (segment.pairs > 0) {
      unsort_segment<scalar_t>(segment, plan.comparators.data() + 2 * segment.first_pair, grad,
                               swaps + 2 * segment.first_pair);
    }
  }
}

// Gathering and sorting fused, for the forward pass in float32 with masked loads (AVX-512, AVX2) and
// unit stride: each segment's samples are read straight from the input into registers with masked
// loads (polar: the bilinear taps at compile-time positions, see sort_polar_fixed), sorted there and
// stored once into the panel, instead of being staged first (stage_windows: a store and a reload of
// every window value). Measured against staging, in one process with the two builds taking turns (1
// thread, AVX-512): the forward 4-17% faster at the issue's 7x7 shapes and for square sampling at 3x3.
// Polar sampling with k = 3 and the backward pass (which records the swaps) measured no faster or
// slower, so they gather first (gather_samples: for k = 3, the taps read from the block's runs where
// interpolate_runs can, else from the staged window) and sort after.
#if defined(__AVX512F__)
#define TIMM_SORTCONV_SORT_DIRECT 1
using PieceMask = __mmask16;

inline PieceMask piece_mask(uint32_t bits) { return static_cast<__mmask16>(bits); }

// Lane j of the vector at `offset` from the window corner: p0[offset + j] for the lanes in m0 and
// p1[offset + j] for those in m1 (kTwo: there is a second piece). Masked-off lanes are never read.
template <bool kTwo>
inline __attribute__((always_inline)) vfloat load_pieces(const float* p0, const float* p1, PieceMask m0,
                                                         PieceMask m1, int64_t offset) {
  __m512 v = _mm512_maskz_loadu_ps(m0, p0 + offset);
  if (kTwo) v = _mm512_mask_loadu_ps(v, m1, p1 + offset);
  return (vfloat)v;
}
#elif defined(__AVX2__)
#define TIMM_SORTCONV_SORT_DIRECT 1
using PieceMask = __m256i;

// Lane j set where bit j is.
inline PieceMask piece_mask(uint32_t bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit);
}

// As above; masked-off lanes read as +0, so the two pieces combine with a bitwise or.
template <bool kTwo>
inline __attribute__((always_inline)) vfloat load_pieces(const float* p0, const float* p1, PieceMask m0,
                                                         PieceMask m1, int64_t offset) {
  __m256 v = _mm256_maskload_ps(p0 + offset, m0);
  if (kTwo) v = _mm256_or_ps(v, _mm256_maskload_ps(p1 + offset, m1));
  return (vfloat)v;
}
#endif

#if defined(TIMM_SORTCONV_SORT_DIRECT)
// Whether a vector has a second piece (its mask m1 has a lane set).
#if defined(__AVX512F__)
inline bool has_second(PieceMask m1) { return m1 != 0; }
#else
inline bool has_second(PieceMask m1) { return !_mm256_testz_si256(m1, m1); }
#endif

inline vfloat load_source(const float* p0, const float* p1, PieceMask m0, PieceMask m1, int64_t offset) {
  return has_second(m1) ? load_pieces<true>(p0, p1, m0, m1, offset) : load_pieces<false>(p0, p1, m0, m1, offset);
}

// One vector (kVecLanes lanes) of the N samples from slot `start`: read, sorted, stored to out[i * kLanes].
template <int N>
void sort_direct_fixed(const Plan<float>& plan, int64_t start, const float* p0, const float* p1, PieceMask m0,
                       PieceMask m1, float* out) {
  constexpr int64_t lanes = kLanes<float>;
  const int64_t* offset = plan.sample_offset.data() + start;
  vfloat v[N];
  load_and_sort<N, false>(v, static_cast<SwapMask<vfloat>*>(nullptr),
                          [&](int i) { return load_source(p0, p1, m0, m1, offset[i]); });
#pragma GCC unroll 64
  for (int i = 0; i < N; ++i) store(out + i * lanes, v[i]);
}

// Polar sampling: samples [kStart, kStart + N) interpolated from the input. The tap positions are
// compile-time constants (PolarTaps), so the compiler reads each window value once for all the
// samples that share it (GCC merges identical loads) instead of once per tap.
template <int K, int kStart, int N, bool kTwo>
void sort_polar_fixed(const Plan<float>& plan, const float* p0, const float* p1, PieceMask m0, PieceMask m1,
                      float* out) {
  using taps = PolarTaps<K>;
  constexpr int64_t lanes = kLanes<float>;
  int64_t row[K], col[K];
  for (int i = 0; i < K; ++i) {
    row[i] = plan.grid_offset[i * K];
    col[i] = plan.grid_offset[i];
  }
  const float* weight = plan.polar_weight.data() + kStart * kPolarTaps;
  vfloat v[N];
  load_and_sort<N, false>(v, static_cast<SwapMask<vfloat>*>(nullptr), [&](int i) {
    const int s = kStart + i;
    vfloat acc = splat(weight[i * kPolarTaps])
                 * load_pieces<kTwo>(p0, p1, m0, m1, row[taps::kTap[s][0][0]] + col[taps::kTap[s][0][1]]);
#pragma GCC unroll 4
    for (int t = 1; t < kPolarTaps; ++t) {
      if (t < taps::kCount[s]) {
        acc += splat(weight[i * kPolarTaps + t])
               * load_pieces<kTwo>(p0, p1, m0, m1, row[taps::kTap[s][t][0]] + col[taps::kTap[s][t][1]]);
      }
    }
    return acc;
  });
#pragma GCC unroll 64
  for (int i = 0; i < N; ++i) store(out + i * lanes, v[i]);
}

// The segments of polar rings and windows for k = 5, 7 (slot ranges as geometry.py makes them).
template <bool kTwo>
void sort_polar_segment(const Plan<float>& plan, const Segment& segment, const float* p0, const float* p1,
                        PieceMask m0, PieceMask m1, float* out) {
  const int64_t key = plan.polar_k * 10000 + segment.start * 100 + segment.size;
#define TIMM_SORTCONV_CASE(k, start, size)                                 \
  case k * 10000 + start * 100 + size:                                     \
    return sort_polar_fixed<k, start, size, kTwo>(plan, p0, p1, m0, m1, out);
  switch (key) {
    TIMM_SORTCONV_CASE(5, 0, 1)
    TIMM_SORTCONV_CASE(5, 1, 8)
    TIMM_SORTCONV_CASE(5, 9, 16)
    TIMM_SORTCONV_CASE(5, 0, 25)
    TIMM_SORTCONV_CASE(7, 0, 1)
    TIMM_SORTCONV_CASE(7, 1, 8)
    TIMM_SORTCONV_CASE(7, 9, 16)
    TIMM_SORTCONV_CASE(7, 25, 24)
    TIMM_SORTCONV_CASE(7, 0, 49)
    default:
      TIMM_SORTCONV_CHECK(false, "sort_conv_cpu: no polar segment [", segment.start, ", ",
                          segment.start + segment.size, ") for k = ", plan.polar_k);
  }
#undef TIMM_SORTCONV_CASE
}

// gather_samples + sort_samples of one channel in one pass; false (nothing done) where the plan or
// the block does not allow it (polar sampling other than k = 5, 7, a segment without an unrolled
// network, a vector of three or more pieces).
bool sort_direct(const Plan<float>& plan, const float* channel_input, const Block& block, float* value,
                 bool narrow = false) {
  constexpr int64_t lanes = kLanes<float>, half = kVecLanes<float>;
  if (!plan.direct || !block.direct) return false;
  for (const auto& segment : plan.segments) {
    for (int64_t h = 0; h < (narrow ? 1 : lanes / half); ++h) {
      const VectorSource& source = block.source[h];
      const float* p0 = channel_input + source.base[0];
      const float* p1 = channel_input + source.base[1];
      const PieceMask m0 = piece_mask(source.mask[0]), m1 = piece_mask(source.mask[1]);
      float* out = value + segment.start * lanes + h * half;
      if (plan.polar_k != 0) {
        if (source.mask[1] != 0) {
          sort_polar_segment<true>(plan, segment, p0, p1, m0, m1, out);
        } else {
          sort_polar_segment<false>(plan, segment, p0, p1, m0, m1, out);
        }
        continue;
      }
#define TIMM_SORTCONV_CASE(n)                                           \
  case n:                                                               \
    sort_direct_fixed<n>(plan, segment.start, p0, p1, m0, m1, out); \
    break;
      switch (segment.size) {
        TIMM_SORTCONV_CASE(1)
        TIMM_SORTCONV_FIXED_SIZES(TIMM_SORTCONV_CASE)
        default:
          TIMM_SORTCONV_CHECK(false, "sort_conv_cpu: no unrolled network for ", segment.size, " slots");
      }
#undef TIMM_SORTCONV_CASE
    }
  }
  return true;
}
#endif

template <typename scalar_t>
bool sort_direct(const Plan<scalar_t>&, const scalar_t*, const Block&, scalar_t*, bool = false) {
  return false;
}

// tile[m][lanes] (+)= sum_k w[k * ldw + m] * panel[k][lanes] for m < kRows: `panel` holds `depth`
// rows of kLanes values, `w` is read as depth rows of kRows consecutive values. The sum is taken from zero and
// then added to the tile, as micro_gemm_positions does: a position's output is the same to the last bit whichever
// of the two takes it (which depends on how a call's positions are cut into blocks, and so on its threads).
template <typename scalar_t, int kRows>
void micro_gemm(const scalar_t* panel, int64_t depth, const scalar_t* w, int64_t ldw, scalar_t* tile,
                bool accumulate) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  vec acc0[kRows], acc1[kRows];
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) acc0[m] = acc1[m] = vec{};
  for (int64_t k = 0; k < depth; ++k) {
    const vec p0 = load(panel + k * lanes), p1 = load(panel + k * lanes + half);
    const scalar_t* wk = w + k * ldw;
    for (int m = 0; m < kRows; ++m) {
      const vec wm = splat(wk[m]);
      acc0[m] += wm * p0;
      acc1[m] += wm * p1;
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
    store(tile + m * lanes, accumulate ? load(tile + m * lanes) + acc0[m] : acc0[m]);
    store(tile + m * lanes + half, accumulate ? load(tile + m * lanes + half) + acc1[m] : acc1[m]);
  }
}

// micro_gemm on the first vector of lanes only (kVecLanes): a block whose positions all lie there (the last one of
// a range, at batch 1 often the only part of a block) takes half the products. The other lanes of `tile` are left
// as they are.
template <typename scalar_t, int kRows>
void micro_gemm_narrow(const scalar_t* panel, int64_t depth, const scalar_t* w, int64_t ldw, scalar_t* tile,
                       bool accumulate) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>;
  vec acc[kRows];
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) acc[m] = vec{};
  for (int64_t k = 0; k < depth; ++k) {
    const vec p = load(panel + k * lanes);
    const scalar_t* wk = w + k * ldw;
    for (int m = 0; m < kRows; ++m) acc[m] += splat(wk[m]) * p;
  }
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) store(tile + m * lanes, accumulate ? load(tile + m * lanes) + acc[m] : acc[m]);
}

template <typename scalar_t>
using MicroGemm = void (*)(const scalar_t*, int64_t, const scalar_t*, int64_t, scalar_t*, bool);

template <typename scalar_t, int... kRows>
constexpr std::array<MicroGemm<scalar_t>, sizeof...(kRows)> micro_gemm_table(std::integer_sequence<int, kRows...>) {
  return {&micro_gemm<scalar_t, kRows + 1>...};
}

template <typename scalar_t, int... kRows>
constexpr std::array<MicroGemm<scalar_t>, sizeof...(kRows)> micro_gemm_narrow_table(
    std::integer_sequence<int, kRows...>) {
  return {&micro_gemm_narrow<scalar_t, kRows + 1>...};
}

// Whether a block of `count` positions lies in the first vector of lanes (the micro-GEMMs' `narrow`).
template <typename scalar_t>
inline bool narrow_block(int64_t count) {
  return count <= kVecLanes<scalar_t>;
}

// The register tiles of `rows` output rows: equal tiles of at most kTileRows (64 rows: 6 tiles of 10-11, not 5 of
// 12 and one of 4, which would be load-bound), tile i holding rows [tile_start(rows, i), tile_start(rows, i + 1)).
inline int64_t tile_count(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }

inline int64_t tile_start(int64_t rows, int64_t i) {
  const int64_t tiles = tile_count(rows);
  int64_t m0 = 0;
  for (int64_t j = 0; j < i && j < tiles; ++j) m0 += (rows - m0) / (tiles - j);
  return m0;
}

// The output rows [first, last) of a part of `rows`: register tiles [tiles * part / parts, tiles * (part + 1) /
// parts) (forward_kernel's split of the outputs between threads).
struct RowRange {
  int64_t first_tile, last_tile, first, last;
};

inline RowRange row_range(int64_t rows, int64_t part, int64_t parts) {
  const int64_t tiles = tile_count(rows), a = tiles * part / parts, b = tiles * (part + 1) / parts;
  return {a, b, tile_start(rows, a), tile_start(rows, b)};
}

// tile[rows][lanes] (+)= w^T panel for any number of rows, in register tiles of kTileRows; only the tiles of
// `range` (default: all), tile and w still indexed from row 0; `narrow`: the first vector of lanes only.
template <typename scalar_t>
void gemm_rows(const scalar_t* panel, int64_t depth, const scalar_t* w, int64_t ldw, int64_t rows, scalar_t* tile,
               bool accumulate, const RowRange* range = nullptr, bool narrow = false) {
  static constexpr auto wide = micro_gemm_table<scalar_t>(std::make_integer_sequence<int, kTileRows>{});
  static constexpr auto half = micro_gemm_narrow_table<scalar_t>(std::make_integer_sequence<int, kTileRows>{});
  const auto& table = narrow ? half : wide;
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t tiles = tile_count(rows), last = range != nullptr ? range->last_tile : tiles;
  int64_t i = range != nullptr ? range->first_tile : 0, m0 = range != nullptr ? range->first : 0;
  for (; i < last; ++i) {
    const int64_t m = (rows - m0) / (tiles - i);
    table[m - 1](panel, depth, w + m0, ldw, tile + m0 * lanes, accumulate);
    m0 += m;
  }
}

// gemm_rows with w in the layout of tile_weights: each register tile's depth x m weights contiguous, tile after
// tile. The same products in the same order (the same result to the last bit); the weights of a tile are one
// sequential stream instead of depth rows `ldw` apart, which the hardware prefetches where they come from memory.
template <typename scalar_t>
void gemm_tiles(const scalar_t* panel, int64_t depth, const scalar_t* w, int64_t rows, scalar_t* tile,
                bool accumulate, const RowRange* range = nullptr, bool narrow = false) {
  static constexpr auto wide = micro_gemm_table<scalar_t>(std::make_integer_sequence<int, kTileRows>{});
  static constexpr auto half = micro_gemm_narrow_table<scalar_t>(std::make_integer_sequence<int, kTileRows>{});
  const auto& table = narrow ? half : wide;
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t tiles = tile_count(rows), last = range != nullptr ? range->last_tile : tiles;
  int64_t i = range != nullptr ? range->first_tile : 0, m0 = range != nullptr ? range->first : 0;
  for (; i < last; ++i) {
    const int64_t m = (rows - m0) / (tiles - i);
    table[m - 1](panel, depth, w + m0 * depth, m, tile + m0 * lanes, accumulate);
    m0 += m;
  }
}

// tile[o][p] += sum_k w[k * ldw + o] * panel[k][p] for kPositions positions p and the `outputs` (up to kVectors *
// kVecLanes) rows o: the product with the outputs on the vector lanes and each position's value broadcast, for the
// positions of a block past its last whole vector of lanes, which micro_gemm would take a whole vector for. Rows
// whose kVectors vectors would reach past w's last value (`values` from w on) are read from a copy of their
// `outputs` values; the lanes past `outputs` are never stored.
template <typename scalar_t, int kPositions, int kVectors>
void micro_gemm_positions(const scalar_t* panel, int64_t depth, const scalar_t* w, int64_t ldw, int64_t values,
                          int64_t outputs, scalar_t* tile) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>, width = kVectors * half;
  vec acc[kPositions][kVectors];
#pragma GCC unroll 16
  for (int p = 0; p < kPositions; ++p) {
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) acc[p][v] = vec{};
  }
  const auto step = [&](const scalar_t* wk, const scalar_t* pk) {
    vec wv[kVectors];
    for (int v = 0; v < kVectors; ++v) wv[v] = load(wk + v * half);
    for (int p = 0; p < kPositions; ++p) {
      const vec x = splat(pk[p]);
      for (int v = 0; v < kVectors; ++v) acc[p][v] += x * wv[v];
    }
  };
  const int64_t direct = values < width ? 0 : std::min(depth, (values - width) / ldw + 1);
  for (int64_t k = 0; k < direct; ++k) step(w + k * ldw, panel + k * lanes);
  for (int64_t k = direct; k < depth; ++k) {
    scalar_t row[width] = {};
    std::memcpy(row, w + k * ldw, outputs * sizeof(scalar_t));
    step(row, panel + k * lanes);
  }
  for (int p = 0; p < kPositions; ++p) {
    scalar_t sums[width];
    for (int v = 0; v < kVectors; ++v) store(sums + v * half, acc[p][v]);
    for (int64_t o = 0; o < outputs; ++o) tile[o * lanes + p] += sums[o];
  }
}

template <typename scalar_t>
using MicroGemmPositions = void (*)(const scalar_t*, int64_t, const scalar_t*, int64_t, int64_t, int64_t, scalar_t*);

// The most vectors of outputs micro_gemm_positions takes at `positions` positions: as many sums as micro_gemm keeps
// (2 * kTileRows vectors), and at one position still four (or three) independent chains of multiply-adds.
constexpr int position_vectors(int positions) {
  return kVectorRegisters == 32 ? (positions <= kTileRows / 2 ? 4 : 2) : (positions <= kTileRows / 2 ? 3 : 2);
}
constexpr int kPositionVectors = position_vectors(1);

template <typename scalar_t, int kPositions, int... kVectors>
constexpr std::array<MicroGemmPositions<scalar_t>, sizeof...(kVectors)> micro_gemm_positions_row(
    std::integer_sequence<int, kVectors...>) {
  return {&micro_gemm_positions<scalar_t, kPositions, std::min(kVectors + 1, position_vectors(kPositions))>...};
}

template <typename scalar_t, int... kPositions>
constexpr std::array<std::array<MicroGemmPositions<scalar_t>, kPositionVectors>, sizeof...(kPositions)>
micro_gemm_positions_table(std::integer_sequence<int, kPositions...>) {
  return {micro_gemm_positions_row<scalar_t, kPositions + 1>(std::make_integer_sequence<int, kPositionVectors>{})...};
}

// tile[o][first + p] += sum_k w_o[k] * panel[k][first + p] for the rows o of `range` and the `count` (1 .. kTileRows)
// positions from lane `first`, the outputs on the vector lanes (micro_gemm_positions), w in the layout of
// tile_weights (`rows` rows in all): each register tile's depth x m weights (rows m apart) on the lanes of as many
// vectors as its m outputs take (more than one where a vector holds fewer than kTileRows values: float64, and float32
// with 16-byte vectors), in calls of at most position_vectors.
template <typename scalar_t>
void gemm_tiles_positions(const scalar_t* panel, int64_t depth, const scalar_t* w, int64_t rows, const RowRange& range,
                          scalar_t* tile, int64_t first, int64_t count) {
  static constexpr auto table = micro_gemm_positions_table<scalar_t>(std::make_integer_sequence<int, kTileRows>{});
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t tiles = tile_count(rows), most = position_vectors(static_cast<int>(count));
  for (int64_t i = range.first_tile, m0 = range.first; i < range.last_tile; ++i) {
    const int64_t m = (rows - m0) / (tiles - i);
    for (int64_t j = 0; j < m;) {
      const int64_t outputs = std::min(most * half, m - j), vectors = (outputs + half - 1) / half;
      table[count - 1][vectors - 1](panel + first, depth, w + m0 * depth + j, m, (rows - m0) * depth - j, outputs,
                                    tile + (m0 + j) * lanes + first);
      j += outputs;
    }
    m0 += m;
  }
}

// Whether a block of `count` positions takes its positions past its last whole vector of lanes in gemm_tiles_positions:
// where they are a few (1 .. kTileRows), so that a vector of lanes would be mostly empty.
template <typename scalar_t>
inline bool position_tail(int64_t count) {
  const int64_t tail = count % kVecLanes<scalar_t>;
  return tail != 0 && tail <= kTileRows;
}

// A depth x rows matrix w (rows `ldw` apart) in gemm_tiles' layout, written to `tiled` (depth * rows values).
template <typename scalar_t>
void tile_weights(const scalar_t* w, int64_t depth, int64_t ldw, int64_t rows, scalar_t* tiled) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
    const int64_t m = (rows - m0) / (tiles - i);
    for (int64_t k = 0; k < depth; ++k) {
      for (int64_t j = 0; j < m; ++j) tiled[m0 * depth + k * m + j] = w[k * ldw + m0 + j];
    }
    m0 += m;
  }
}

// grad[s][o] += sum over blocks b < `blocks` and lanes < counts[b] of columns_b[s][lane] * grad_out_t[b * kLanes +
// lane][o] for s < kRows and the kVectors * kVecLanes outputs starting at `grad`, where block b's columns start
// `column_stride` values after block b - 1's; grad_out_t rows have `ldg` entries, grad rows `ldw`. The
// accumulators stay in registers over all the blocks: grad is read and written once per call.
template <typename scalar_t, int kRows, int kVectors>
void micro_gemm_reduce(const scalar_t* columns, int64_t column_stride, const int64_t* counts, int64_t blocks,
                       const scalar_t* grad_out_t, int64_t ldg, scalar_t* grad, int64_t ldw) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  vec acc[kRows][kVectors];
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) {
      acc[m][v] = vec{};
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const scalar_t* block_columns = columns + b * column_stride;
    const scalar_t* block_grad = grad_out_t + b * lanes * ldg;
    for (int64_t lane = 0; lane < counts[b]; ++lane) {
      vec g[kVectors];
      for (int v = 0; v < kVectors; ++v) {
        g[v] = load(block_grad + lane * ldg + v * half);
      }
      for (int m = 0; m < kRows; ++m) {
        const vec c = splat(block_columns[m * lanes + lane]);
        for (int v = 0; v < kVectors; ++v) {
          acc[m][v] += c * g[v];
        }
      }
    }
  }
  for (int m = 0; m < kRows; ++m) {
    for (int v = 0; v < kVectors; ++v) {
      scalar_t* dst = grad + m * ldw + v * half;
      store(dst, load(dst) + acc[m][v]);
    }
  }
}

template <typename scalar_t>
using MicroGemmReduce = void (*)(const scalar_t*, int64_t, const int64_t*, int64_t, const scalar_t*, int64_t,
                                 scalar_t*, int64_t);

template <typename scalar_t, int kVectors, int... kRows>
constexpr std::array<MicroGemmReduce<scalar_t>, sizeof...(kRows)> reduce_table(std::integer_sequence<int, kRows...>) {
  return {&micro_gemm_reduce<scalar_t, kRows + 1, kVectors>...};
}

// grad[slots][outputs_padded] += columns^T-weighted sum over the lanes of `blocks` blocks (the weight
// gradient of one channel and a pass of blocks, see micro_gemm_reduce); `outputs_padded` is a multiple
// of kVecLanes.
template <typename scalar_t>
void gemm_reduce(const scalar_t* columns, int64_t column_stride, int64_t slots, const int64_t* counts,
                 int64_t blocks, const scalar_t* grad_out_t, int64_t outputs_padded, scalar_t* grad) {
  static constexpr auto pairs = reduce_table<scalar_t, 2>(std::make_integer_sequence<int, kTileRows>{});
  static constexpr auto singles = reduce_table<scalar_t, 1>(std::make_integer_sequence<int, kTileRows>{});
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  for (int64_t s0 = 0; s0 < slots; s0 += kTileRows) {
    const int64_t m = std::min<int64_t>(kTileRows, slots - s0);
    int64_t o0 = 0;
    for (; o0 + 2 * half <= outputs_padded; o0 += 2 * half) {
      pairs[m - 1](columns + s0 * lanes, column_stride, counts, blocks, grad_out_t + o0, outputs_padded,
                   grad + s0 * outputs_padded + o0, outputs_padded);
    }
    if (o0 < outputs_padded) {
      singles[m - 1](columns + s0 * lanes, column_stride, counts, blocks, grad_out_t + o0, outputs_padded,
                     grad + s0 * outputs_padded + o0, outputs_padded);
    }
  }
}

}  // namespace

#include "bf16_gemm.h"

namespace {

// A tile row of kLanes outputs rectified (Shape::relu): y < 0 becomes 0, NaN stays NaN, as torch.relu.
template <typename scalar_t>
inline void rectify(scalar_t* row) {
#pragma omp simd
  for (int64_t l = 0; l < kLanes<scalar_t>; ++l) row[l] = row[l] < scalar_t(0) ? scalar_t(0) : row[l];
}

// Copies between a block's lanes and its positions in one channel of (B, channels, out_h, out_w):
// `channel_planes` is that channel's plane of image 0, images `image_stride` apart.
template <typename scalar_t>
void store_lanes(const Plan<scalar_t>& plan, const Block& block, const scalar_t* lanes_in, scalar_t* channel_planes,
                 int64_t image_stride) {
  for (int64_t i = 0; i < block.runs; ++i) {
    const Run& run = block.run[i];
    std::memcpy(channel_planes + run.image * image_stride + run.row * plan.out_w + run.col, lanes_in + run.lane,
                run.cols * sizeof(scalar_t));
  }
}

template <typename scalar_t>
void load_lanes(const Plan<scalar_t>& plan, const Block& block, const scalar_t* channel_planes, int64_t image_stride,
                scalar_t* lanes_out) {
  for (int64_t i = 0; i < block.runs; ++i) {
    const Run& run = block.run[i];
    std::memcpy(lanes_out + run.lane, channel_planes + run.image * image_stride + run.row * plan.out_w + run.col,
                run.cols * sizeof(scalar_t));
  }
}

// The window positions' gradients by_position[k*k][lanes] added to the plane, run by run. The k*k
// shifted read-modify-writes of the plane go column of the window by column, so that consecutive ones
// touch different rows: shifted vectors that partly overlap a store still in flight cannot be
// forwarded and stall.
template <typename scalar_t, bool kUnitStride>
void scatter_runs(const Plan<scalar_t>& plan, const Run* runs, int64_t count, const scalar_t* by_position,
                  scalar_t* grad_channel) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t step = kUnitStride ? 1 : plan.stride_w;
  for (int64_t column = 0; column < plan.kernel_size; ++column) {
    for (int64_t row = 0; row < plan.kernel_size; ++row) {
      const int64_t q = row * plan.kernel_size + column;
      // Square sampling: the gradient of window position q is that of the sample read from it.
      const scalar_t* position_grad = by_position + (plan.single_tap ? plan.position_sample[q] : q) * lanes;
      for (int64_t i = 0; i < count; ++i) {
        const Run& run = runs[i];
        scalar_t* __restrict dst = grad_channel + run.input + plan.grid_offset[q];
        const scalar_t* __restrict src = position_grad + run.lane;
#pragma omp simd
        for (int64_t j = 0; j < run.cols; ++j) {
          dst[j * step] += src[j];
        }
      }
    }
  }
}

#if defined(__AVX512F__)
// scatter_runs for one run in float32 with unit stride, where a window row spans at most 16 values
// more than the run ((k - 1) * dilation <= 16): per window row, the k column gradients of the run's
// lanes are shifted into place in registers and summed, and the row of the plane is updated once,
// three masked vectors wide, instead of k times.
// Measured (A/B in one process, 1 thread): the backward 5-11% faster at B=100, 32->32, 28x28, k=7, 5-8%
// with k=5; with k=3 (64x64 maps) 0-4% slower, so there the runs take scatter_runs. AVX-512 only (its
// two-source permutes have no single AVX2 instruction); the other levels take scatter_runs.
constexpr int64_t kMinRowScatter = 5;

bool row_scatter(const Plan<float>& plan) {
  const int64_t k = plan.kernel_size;
  return k >= kMinRowScatter && (k - 1) * (plan.grid_offset[1] - plan.grid_offset[0]) <= 16;
}

// The rows are addressed from run.input - run.lane, which is never negative: every run but the first
// (lane 0) starts an output row, so its offset is at least that row's index times the padded width,
// and its lane at most the same index times the output width.
void scatter_run_rows(const Plan<float>& plan, const Run& run, const float* by_position, float* grad_channel) {
  const int64_t k = plan.kernel_size, dilation = plan.grid_offset[1] - plan.grid_offset[0];
  const int64_t spread = (k - 1) * dilation;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const uint32_t run_mask = static_cast<uint32_t>(((uint64_t(1) << run.cols) - 1) << run.lane);
  const __mmask16 in0 = static_cast<__mmask16>(run_mask), in1 = static_cast<__mmask16>(run_mask >> 16);
  const uint64_t out_mask = ((uint64_t(1) << (run.cols + spread)) - 1) << run.lane;
  const __mmask16 out[3] = {static_cast<__mmask16>(out_mask), static_cast<__mmask16>(out_mask >> 16),
                            static_cast<__mmask16>(out_mask >> 32)};
  for (int64_t row = 0; row < k; ++row) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    for (int64_t column = 0; column < k; ++column) {
      const int64_t q = row * k + column;
      const float* g = by_position + (plan.single_tap ? plan.position_sample[q] : q) * kLanes<float>;
      const __m512 g0 = _mm512_maskz_loadu_ps(in0, g), g1 = _mm512_maskz_loadu_ps(in1, g + 16);
      // Output lane x of the 48 takes input lane x - shift: index (x - shift + 16) mod 32 of (g0, g1).
      const int shift = static_cast<int>(column * dilation);
      const __m512i index = _mm512_and_si512(_mm512_add_epi32(lane, _mm512_set1_epi32(16 - shift)),
                                             _mm512_set1_epi32(31));
      const __mmask16 shifted = static_cast<__mmask16>(0xFFFFu << shift);
      acc0 = _mm512_add_ps(acc0, _mm512_maskz_permutexvar_ps(shifted, index, g0));
      acc1 = _mm512_add_ps(acc1, _mm512_permutex2var_ps(g0, index, g1));
      acc2 = _mm512_add_ps(acc2, _mm512_maskz_permutexvar_ps(static_cast<__mmask16>(~shifted), index, g1));
    }
    float* dst = grad_channel + (run.input - run.lane) + plan.grid_offset[row * k];
    const __m512 acc[3] = {acc0, acc1, acc2};
    for (int v = 0; v < 3; ++v) {
      if (out[v] == 0) continue;
      const __m512 old = _mm512_maskz_loadu_ps(out[v], dst + 16 * v);
      _mm512_mask_storeu_ps(dst + 16 * v, out[v], _mm512_add_ps(old, acc[v]));
    }
  }
}
#endif

// Adds the block's sample gradients grad_samples[slots][lanes] to the input plane through the taps
// (polar sampling: first summed per window position in grad_grid[k*k][lanes]).
template <typename scalar_t, bool kUnitStride>
void scatter_gradients(const Plan<scalar_t>& plan, const Block& block, const scalar_t* grad_samples,
                       scalar_t* grad_grid, scalar_t* grad_channel) {
  const scalar_t* by_position = grad_samples;
  if (!plan.single_tap) {
    apply_taps(plan.spreading, grad_samples, grad_grid);
    by_position = grad_grid;
  }
#if defined(__AVX512F__)
  if constexpr (kUnitStride && std::is_same<scalar_t, float>::value) {
    if (row_scatter(plan)) {
      for (int64_t i = 0; i < block.runs; ++i) scatter_run_rows(plan, block.run[i], by_position, grad_channel);
      return;
    }
  }
#endif
  scatter_runs<scalar_t, kUnitStride>(plan, block.run, block.runs, by_position, grad_channel);
}

struct Shape {
  int64_t batch, channels, out_channels, groups;
  bool relu = false;  // the output rectified, max(y, 0) (NaN kept), as it is stored: a runtime's node with a ReLU
  // A tensor like the output (scalar_t) added to it before the activation, or nullptr: a runtime's node with the
  // residual Add that alone read its output (the output tiles start from bias + sum instead of the bias).
  const void* sum = nullptr;
  int64_t in_per_group() const { return channels / groups; }
  int64_t out_per_group() const { return out_channels / groups; }
};

// A block's output tile row of channel o started: the bias, plus shape.sum's values at the block's positions.
template <typename scalar_t>
void start_tile_row(const Plan<scalar_t>& plan, const Shape& shape, const Block& block, const scalar_t* bias,
                    int64_t o, scalar_t* row) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  std::fill(row, row + lanes, bias != nullptr ? bias[o] : scalar_t(0));
  if (shape.sum == nullptr) return;
  const int64_t positions = plan.positions(), image_stride = shape.out_channels * positions;
  const scalar_t* planes = static_cast<const scalar_t*>(shape.sum) + o * positions;
  for (int64_t i = 0; i < block.runs; ++i) {
    const Run& run = block.run[i];
    const scalar_t* from = planes + run.image * image_stride + run.row * plan.out_w + run.col;
    scalar_t* to = row + run.lane;
    for (int64_t j = 0; j < run.cols; ++j) to[j] += from[j];
  }
}

// A thread is only started for timm_sortconv_host::kMinWorkPerThread multiply-adds or more: tiny calls (tests,
// small layers) run inline.
int64_t thread_count(int64_t items, int64_t multiply_adds) {
  return std::max<int64_t>(1, std::min<int64_t>({timm_sortconv_host::num_threads(), items,
                                                  multiply_adds / timm_sortconv_host::kMinWorkPerThread}));
}

// Splits `items` into one contiguous range per thread; `fn(thread, first, last)`.
template <typename F>
void for_each_thread(int64_t items, int64_t threads, const F& fn) {
  threads = std::max<int64_t>(1, std::min(threads, items));
  if (threads == 1) {
    fn(0, 0, items);
    return;
  }
  timm_sortconv_host::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      fn(t, items * t / threads, items * (t + 1) / threads);
    }
  });
}

int64_t multiply_adds(const Shape& shape, int64_t positions, int64_t slots) {
  return shape.batch * positions * shape.channels * slots * shape.out_per_group();
}

// How a forward call's work is shared between threads: `ranges` contiguous ranges of the flat output positions,
// each computed in `parts` parts of every group's outputs (row_range). A thread takes at least a whole vector of
// positions. Where the call has fewer blocks (kLanes positions) than the work has threads (a batch of one small
// map: 7 x 7 has one block and a little), the ranges are cut at the even split (`exact`: 7 x 7 on two threads, 25
// + 24 positions) if each range then ends in whole vectors and at most kTileRows positions more (gemm_tiles_positions
// takes those), so that each thread takes only its own positions' samples, and if a group's weights fit in a core's
// L2 (kSplitWeightBytes), since each thread then reads all of them; otherwise the outputs are split too: each part
// gathers and sorts the same samples and multiplies them with its own register tiles of the weight. (The
// sortify-ed resnet18, whose 512 -> 512 layers at 7 x 7 hold 9.4 MB of weights, was 1-2% slower at batch 1 on two
// threads with those layers cut by positions.)
constexpr int64_t kSplitWeightBytes = 1 << 20;

struct ForwardSplit {
  int64_t ranges = 1, parts = 1;
  bool exact = false;
  int64_t threads() const { return ranges * parts; }
};

// Whether `flat` positions cut evenly into `ranges` ranges leave each range whole vectors and at most kTileRows
// positions more.
template <typename scalar_t>
bool even_cuts_fit(int64_t flat, int64_t ranges) {
  for (int64_t range = 0; range < ranges; ++range) {
    const int64_t size = flat * (range + 1) / ranges - flat * range / ranges;
    if (size < kVecLanes<scalar_t> || (size % kVecLanes<scalar_t> != 0 && !position_tail<scalar_t>(size))) return false;
  }
  return true;
}

// The bytes of one group's weights (C/g * slots * O/g values).
template <typename scalar_t>
int64_t group_weight_bytes(const Shape& shape, int64_t slots) {
  return shape.in_per_group() * slots * shape.out_per_group() * static_cast<int64_t>(sizeof(scalar_t));
}

template <typename scalar_t>
ForwardSplit forward_split(const Shape& shape, int64_t positions, int64_t slots, bool split_outputs) {
  constexpr int64_t lanes = kLanes<scalar_t>, vector = kVecLanes<scalar_t>;
  const int64_t wanted = thread_count(std::numeric_limits<int64_t>::max(), multiply_adds(shape, positions, slots));
  const int64_t flat = shape.batch * positions;
  ForwardSplit split;
  split.ranges = std::max<int64_t>(1, std::min(wanted, flat / lanes));
  const int64_t by_vectors = std::min(wanted, flat / vector);
  if (split.ranges < by_vectors && group_weight_bytes<scalar_t>(shape, slots) <= kSplitWeightBytes
      && even_cuts_fit<scalar_t>(flat, by_vectors)) {
    split.ranges = by_vectors;
    split.exact = true;
  }
  if (split_outputs && split.ranges < wanted) {
    split.parts = std::max<int64_t>(1, std::min(wanted / split.ranges, tile_count(shape.out_per_group())));
  }
  return split;
}

// Calls fn(begin, end, rows) once per thread of `split`: its range [begin, end) of the `flat` output positions and
// its register tiles `rows` of each group's `og` outputs. Unless `split.exact`, the ranges begin at multiples of
// `vector` (a vector's lanes), nearest the even split: a range's blocks then fill whole vectors but for its last,
// whose narrow_block takes half the work (196 positions, 2 threads: 96 + 100, 3 blocks and 3 and a narrow one, not 4
// and 4).
template <typename F>
void for_each_forward_part(const ForwardSplit& split, int64_t flat, int64_t og, int64_t vector, const F& fn) {
  const auto bound = [&](int64_t range) {
    if (split.exact) return flat * range / split.ranges;
    return range == split.ranges ? flat : std::min(flat, (flat * range / split.ranges + vector / 2) / vector * vector);
  };
  for_each_thread(split.threads(), split.threads(), [&](int64_t thread, int64_t, int64_t) {
    const int64_t range = thread / split.parts;
    const RowRange rows = row_range(og, thread % split.parts, split.parts);
    fn(bound(range), bound(range + 1), rows);
  });
}

// Calls fn(o) for the outputs o of every group that `rows` holds.
template <typename F>
void for_each_output(const Shape& shape, const RowRange& rows, const F& fn) {
  const int64_t og = shape.out_per_group();
  for (int64_t g = 0; g < shape.groups; ++g) {
    for (int64_t o = g * og + rows.first; o < g * og + rows.last; ++o) fn(o);
  }
}

// Calls fn(thread, first, last) with each thread's range of flat output positions; with
// `whole_images` the ranges begin and end on image boundaries.
template <typename F>
void for_each_thread_range(int64_t batch, int64_t positions, int64_t threads, bool whole_images, const F& fn) {
  const int64_t unit = whole_images ? positions : 1;
  for_each_thread(batch * positions / unit, threads,
                  [&](int64_t thread, int64_t first, int64_t last) { fn(thread, first * unit, last * unit); });
}

// A thread's copy of the input images that its blocks read, [first, first + count) side by side and
// padded, in a buffer reused from image to image; in the backward pass also the gradient of those
// padded images, added to the input gradient (without the padding) as images leave the ring.
//
// The gather of a block reads every channel plane a few rows at a time, and rows of an image not yet
// in L2 came in far slower than one sequential copy brings them; software prefetch of the same rows, a
// block or three ahead, did not help. Measured (A/B in one process, 1 thread): the forward 13-18%
// faster at B=100, 32->32, 28x28, k=7, 9-14% at 14x14, 7-16% with 64x64 maps and k=3 (1.1 MB images),
// 0-5% at 64x64 and k=7; with 2 threads, 10-16% at 28x28. The copy also does the zero padding, so
// the caller need not pad (nor keep a padded input for the backward). Without padding, images are read
// (and their gradient written) in place where they are larger (a 4.3 MB one measured within noise), and
// in the backward pass where the thread's positions do not make up a whole image (with fewer images
// than threads: its gradient would be a whole image per thread; sort_conv2d_cpu pads those calls
// itself). The forward pass copies such a part all the same, only the rows its windows read: one image at
// batch 1 and 2 threads, 32->32 at 28x28, k=7, ran 10% faster copied than read in place (onnxruntime's node).
constexpr int64_t kMaxCopiedImage = int64_t(4) << 20;  // bytes

template <typename scalar_t>
class ImageRing {
 public:
  int64_t first = 0;  // the first image held (or, in place, the first image of the block)

  // For the thread's output positions [begin, end), covered `span` consecutive positions at a time;
  // grad_input: (B, C, src_h, src_w), or nullptr for the forward pass. Only images that those positions
  // read are ever held: in the backward a thread that owns whole images adds into grad_input with no
  // lock, so it must never flush another thread's image.
  ImageRing(const Plan<scalar_t>& plan, const scalar_t* input, scalar_t* grad_input, int64_t batch, int64_t channels,
            int64_t begin, int64_t end, int64_t span)
      : plan_(plan), input_(input), grad_input_(grad_input), batch_(batch), channels_(channels),
        source_size_(channels * plan.src_h * plan.src_w), image_size_(channels * plan.in_h * plan.in_w),
        image_end_((end - 1) / plan.positions() + 1),
        // `span` consecutive positions lie in at most this many images.
        capacity_(std::max<int64_t>(1, std::min(image_end_ - begin / plan.positions(),
                                                (span - 2) / plan.positions() + 2))),
        enabled_(plan.padded() || ((end - begin >= plan.positions() || grad_input == nullptr)
                                   && image_size_ * static_cast<int64_t>(sizeof(scalar_t)) <= kMaxCopiedImage)),
        rows_hi_(plan.in_h) {
    if (!enabled_) return;
    const int64_t positions = plan.positions();
    if (grad_input_ == nullptr && end > begin && begin / positions == (end - 1) / positions
        && end - begin < positions) {
      // A forward thread with part of one image (fewer images than threads) copies only the rows its windows
      // read, and the rows a whole-vector read past a window's last row may reach (zeros there): the other
      // threads' rows stay out of its cache, and they are not copied twice.
      const int64_t window_rows = plan.grid_offset.back() / plan.in_w + 1;
      spill_rows_ = (kLanes<scalar_t> + plan.in_w - 1) / plan.in_w;
      rows_lo_ = (begin % positions) / plan.out_w * plan.stride_h;
      rows_hi_ = std::min(plan.in_h, ((end - 1) % positions) / plan.out_w * plan.stride_h + window_rows + spill_rows_);
      data_.reset(new scalar_t[capacity_ * image_size_]);  // written where read: copy_rows
    } else {
      // Zeros: the padding is never written after this.
      data_.reset(new scalar_t[capacity_ * image_size_]());
    }
    if (grad_input_ != nullptr) grad_.assign(capacity_ * image_size_, scalar_t(0));
  }

  // Image `first`'s padded planes, and its gradient (a block's input offsets count from there).
  const scalar_t* images() const { return enabled_ ? data_.get() : input_ + first * image_size_; }
  scalar_t* grads() { return enabled_ ? grad_.data() : grad_input_ + first * image_size_; }
  // Values readable from images() on (make_block's `readable`).
  int64_t readable() const { return enabled_ ? capacity_ * image_size_ : (batch_ - first) * image_size_; }

  // Makes images [lo, hi] (hi - lo < capacity) available.
  void cover(int64_t lo, int64_t hi) {
    if (!enabled_) {
      first = lo;
      return;
    }
    if (lo >= first && hi < first + count_) return;
    const int64_t next = std::min(capacity_, image_end_ - lo);
    const int64_t kept_lo = std::max(lo, first), kept_hi = std::min(lo + next, first + count_);
    for (int64_t image = first; image < first + count_; ++image) {
      if (image < kept_lo || image >= kept_hi) flush(image, image - first);
    }
    // Images already held move to their new place; the others are copied from the input.
    if (kept_lo < kept_hi) {
      move(data_.get(), kept_lo - first, kept_lo - lo, kept_hi - kept_lo);
      if (!grad_.empty()) move(grad_.data(), kept_lo - first, kept_lo - lo, kept_hi - kept_lo);
    }
    for (int64_t image = lo; image < lo + next; ++image) {
      if (image >= kept_lo && image < kept_hi) continue;
      copy_in(image, image - lo);
      if (!grad_.empty()) std::fill_n(grad_.data() + (image - lo) * image_size_, image_size_, scalar_t(0));
    }
    first = lo;
    count_ = next;
  }

  // Adds the gradient of the images still held to grad_input (at the end of the thread's blocks).
  void finish() {
    for (int64_t slot = 0; slot < count_; ++slot) flush(first + slot, slot);
    count_ = 0;
  }

 private:
  void move(scalar_t* buffer, int64_t from, int64_t to, int64_t images) {
    std::memmove(buffer + to * image_size_, buffer + from * image_size_, images * image_size_ * sizeof(scalar_t));
  }

  // Where row `row` of an image as given (channel * src_h + r) starts in the padded image.
  int64_t padded_offset(int64_t row) const {
    const int64_t channel = row / plan_.src_h, r = row % plan_.src_h;
    return (channel * plan_.in_h + r + plan_.pad_top) * plan_.in_w + plan_.pad_left;
  }

  void copy_in(int64_t image, int64_t slot) {
    const scalar_t* src = input_ + image * source_size_;
    scalar_t* dst = data_.get() + slot * image_size_;
    if (spill_rows_ > 0) {  // a part of one image (the constructor)
      copy_rows(src, dst);
      return;
    }
    if (!plan_.padded()) {
      std::memcpy(dst, src, image_size_ * sizeof(scalar_t));
      return;
    }
    for (int64_t row = 0; row < channels_ * plan_.src_h; ++row) {
      std::memcpy(dst + padded_offset(row), src + row * plan_.src_w, plan_.src_w * sizeof(scalar_t));
    }
  }

  // Rows [rows_lo_, rows_hi_) of every padded plane, the padding in them zeros, and the first spill_rows_ rows of
  // the next plane zeros where they are not copied (a read past the plane's last row lands there).
  void copy_rows(const scalar_t* src, scalar_t* dst) const {
    const int64_t in_h = plan_.in_h, in_w = plan_.in_w, src_w = plan_.src_w, left = plan_.pad_left;
    const int64_t right = in_w - left - src_w;
    for (int64_t channel = 0; channel < channels_; ++channel) {
      scalar_t* plane = dst + channel * in_h * in_w;
      const scalar_t* source = src + channel * plan_.src_h * src_w;
      for (int64_t row = rows_lo_; row < rows_hi_; ++row) {
        scalar_t* to = plane + row * in_w;
        const int64_t r = row - plan_.pad_top;
        if (r < 0 || r >= plan_.src_h) {
          std::fill_n(to, in_w, scalar_t(0));
          continue;
        }
        std::fill_n(to, left, scalar_t(0));
        std::memcpy(to + left, source + r * src_w, src_w * sizeof(scalar_t));
        std::fill_n(to + left + src_w, right, scalar_t(0));
      }
      if (rows_hi_ == in_h && channel + 1 < channels_) {
        std::fill_n(plane + in_h * in_w, std::min(spill_rows_, rows_lo_) * in_w, scalar_t(0));
      }
    }
  }

  void flush(int64_t image, int64_t slot) {
    if (grad_.empty()) return;
    const scalar_t* src = grad_.data() + slot * image_size_;
    scalar_t* dst = grad_input_ + image * source_size_;
    for (int64_t row = 0; row < channels_ * plan_.src_h; ++row) {
      const scalar_t* from = src + padded_offset(row);
      scalar_t* to = dst + row * plan_.src_w;
#pragma omp simd
      for (int64_t x = 0; x < plan_.src_w; ++x) to[x] += from[x];
    }
  }

  const Plan<scalar_t>& plan_;
  const scalar_t* input_;
  scalar_t* grad_input_;
  int64_t batch_, channels_, source_size_, image_size_, image_end_, capacity_;
  bool enabled_;
  int64_t rows_lo_ = 0, rows_hi_, spill_rows_ = 0;  // the padded rows copied (copy_rows; spill_rows_ > 0)
  std::unique_ptr<scalar_t[]> data_;
  std::vector<scalar_t> grad_;
  int64_t count_ = 0;
};

// Makes the images of the output positions [start, stop) available in `ring` and cuts the positions into
// blocks of kLanes (blocks[0, count)), their input offsets counted from the ring's first image; returns count.
template <typename scalar_t, bool kUnitStride>
int64_t cover_pass(const Plan<scalar_t>& plan, ImageRing<scalar_t>& ring, int64_t start, int64_t stop,
                   int64_t channels, std::vector<Block>& blocks) {
  constexpr int64_t lanes = kLanes<scalar_t>;
  const int64_t positions = plan.positions(), count = (stop - start + lanes - 1) / lanes;
  ring.cover(start / positions, (stop - 1) / positions);
  for (int64_t b = 0; b < count; ++b) {
    const int64_t first = start + b * lanes;
    blocks[b] = make_block<scalar_t, kUnitStride>(plan, first, std::min(first + lanes, stop),
                                                  channels * plan.in_h * plan.in_w, ring.first, ring.readable(),
                                                  channels);
  }
  return count;
}

// Input channels whose sorted windows form one panel of the forward product.
inline int64_t panel_channels_of(int64_t channels_per_group, int64_t slots) {
  return std::max<int64_t>(1, std::min(channels_per_group, kPanelSlots / slots));
}

inline int64_t pairs_of(int64_t depth) { return (depth + 1) / 2; }

// Blocks of positions that share one pass over the weights. Every block multiplies with all of a
// group's weights (forward and input gradient) and adds into all of the weight gradient, so with large
// weights (512 -> 512 channels at 3x3: 9.4 MB) one block at a time streams them from L3 or memory
// once per 32 positions and the products wait on it. Taking kPassBlocks blocks per pass, each panel
// still multiplied while it is in L1, reads a chunk of weights once from far and then from L2, and
// the weight gradient sums kPassBlocks times as many positions per visit. Small weights stay in L1/L2
// anyway and keep one block per pass (shorter buffers, the image ring as before).
#ifndef TIMM_SORTCONV_PASS_BLOCKS
#define TIMM_SORTCONV_PASS_BLOCKS 8
#endif
#ifndef TIMM_SORTCONV_PASS_BYTES
#define TIMM_SORTCONV_PASS_BYTES (512 << 10)
#endif
constexpr int64_t kPassBlocks = TIMM_SORTCONV_PASS_BLOCKS;
constexpr int64_t kPassWeightBytes = TIMM_SORTCONV_PASS_BYTES;

template <typename scalar_t>
int64_t blocks_per_pass(const Shape& shape, int64_t slots) {
  return group_weight_bytes<scalar_t>(shape, slots) >= kPassWeightBytes ? kPassBlocks : 1;
}

// weight_packed: the weight as tile_forward_weights writes it, which the float products read; weight_pairs: the
// forward's weights as bfloat16 pair rows (pack_forward_weights), or nullptr to multiply in float32.
template <typename scalar_t, bool kUnitStride>
void forward_kernel(const Plan<scalar_t>& plan, const Shape& shape, const scalar_t* input,
                    const scalar_t* weight_packed, const uint32_t* weight_pairs, const scalar_t* bias,
                    scalar_t* output) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, positions = plan.out_h * plan.out_w, plane = plan.in_h * plan.in_w;
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group();
  const int64_t panel_channels = panel_channels_of(cg, slots);
  const int64_t chunk_pairs = pairs_of(panel_channels * slots);
  [[maybe_unused]] const int64_t group_pairs = (cg / panel_channels) * chunk_pairs + pairs_of((cg % panel_channels) * slots);
  // (the bfloat16 products take a group's outputs whole)
  const ForwardSplit split = forward_split<scalar_t>(shape, positions, slots, weight_pairs == nullptr);
  const int64_t pass_blocks = blocks_per_pass<scalar_t>(shape, slots), span = pass_blocks * lanes;
  for_each_forward_part(split, shape.batch * positions, og, half,
                        [&](int64_t begin, int64_t end, const RowRange& rows) {
    // stage_windows may write a vector past its last row.
    std::vector<scalar_t> panel(panel_channels * slots * lanes + half), grid(slots * lanes + half);
    std::vector<uint32_t> panel_pairs(weight_pairs != nullptr ? chunk_pairs * lanes : 0);
    // The pass's blocks' output tiles, one after the other.
    std::vector<scalar_t> tiles(pass_blocks * shape.out_channels * lanes);
    std::vector<Block> blocks(pass_blocks);
    ImageRing<scalar_t> ring(plan, input, nullptr, shape.batch, shape.channels, begin, end, span);
    for (int64_t start = begin; start < end; start += span) {
      const int64_t stop = std::min(start + span, end);
      const int64_t count = cover_pass<scalar_t, kUnitStride>(plan, ring, start, stop, shape.channels, blocks);
      const scalar_t* images = ring.images();
      for (int64_t b = 0; b < count; ++b) {
        for_each_output(shape, rows, [&](int64_t o) {
          start_tile_row(plan, shape, blocks[b], bias, o, tiles.data() + (b * shape.out_channels + o) * lanes);
        });
      }
      for (int64_t g = 0; g < shape.groups; ++g) {
        for (int64_t c0 = 0; c0 < cg; c0 += panel_channels) {
          const int64_t channels = std::min(panel_channels, cg - c0);
          // Block after block on the same weight chunk: it stays in L2 between them.
          for (int64_t b = 0; b < count; ++b) {
            const Block& block = blocks[b];
            // A block within the first vector of lanes is sorted and multiplied there only (the rest of its
            // columns are not read: store_lanes writes the block's own lanes).
            const bool narrow = narrow_block<scalar_t>(block.count);
            scalar_t* tile = tiles.data() + (b * shape.out_channels + g * og) * lanes;
            for (int64_t ci = 0; ci < channels; ++ci) {
              scalar_t* value = panel.data() + ci * slots * lanes;
              const scalar_t* channel_input = images + (g * cg + c0 + ci) * plane;
              if (!sort_direct(plan, channel_input, block, value, narrow)) {
                gather_samples<scalar_t, kUnitStride>(plan, channel_input, block, grid.data(), value);
                sort_samples<scalar_t, false>(plan, value, static_cast<SwapMask<vec>*>(nullptr));
              }
            }
#if defined(TIMM_SORTCONV_BF16)
            if constexpr (std::is_same<scalar_t, float>::value) {
              if (weight_pairs != nullptr) {
                pack_pair_rows(panel.data(), channels * slots, lanes, lanes, panel_pairs.data());
                gemm_rows_bf16<kTileRows>(panel_pairs.data(), pairs_of(channels * slots),
                                          weight_pairs + (g * group_pairs + c0 / panel_channels * chunk_pairs) * og,
                                          og, og, tile, true);
                continue;
              }
            }
#endif
            // weight_packed holds (groups, C/g, k*k, O/g) values: these channels' slot rows, tiled per panel chunk.
            const scalar_t* chunk = weight_packed + (g * cg + c0) * slots * og;
            // A few positions past the block's last whole vector take their products with the outputs on the
            // lanes (gemm_tiles_positions).
            // (a tail follows at most one whole vector: narrow)
            const int64_t depth = channels * slots, whole = block.count / half * half;
            const bool tail = position_tail<scalar_t>(block.count);
            if (!tail || whole > 0) gemm_tiles(panel.data(), depth, chunk, og, tile, true, &rows, narrow || tail);
            if (tail) gemm_tiles_positions(panel.data(), depth, chunk, og, rows, tile, whole, block.count - whole);
          }
        }
      }
      for (int64_t b = 0; b < count; ++b) {
        for_each_output(shape, rows, [&](int64_t o) {
          if (shape.relu) rectify(tiles.data() + (b * shape.out_channels + o) * lanes);
          store_lanes(plan, blocks[b], tiles.data() + (b * shape.out_channels + o) * lanes, output + o * positions,
                      shape.out_channels * positions);
        });
      }
    }
  });
}

// The forward's weights (weight_packed: groups, C/g * k*k, O/g) as bfloat16 pair rows, chunk by chunk of
// the panels (panel_channels_of), each chunk's depth rounded up to even: per group and chunk,
// pairs_of(depth) rows of O/g pairs.
template <typename scalar_t>
std::vector<uint32_t> pack_forward_weights(const scalar_t* weight_packed, const Shape& shape, int64_t slots) {
  std::vector<uint32_t> out;
#if defined(TIMM_SORTCONV_BF16)
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group(), panel_channels = panel_channels_of(cg, slots);
  for (int64_t g = 0; g < shape.groups; ++g) {
    for (int64_t c0 = 0; c0 < cg; c0 += panel_channels) {
      const int64_t depth = std::min(panel_channels, cg - c0) * slots;
      const scalar_t* rows = weight_packed + (g * cg + c0) * slots * og;
      for (int64_t k = 0; k < depth; k += 2) {
        for (int64_t o = 0; o < og; ++o) {
          out.push_back(bf16_pair(static_cast<float>(rows[k * og + o]),
                                  k + 1 < depth ? static_cast<float>(rows[(k + 1) * og + o]) : 0.f));
        }
      }
    }
  }
#endif
  return out;
}

// The weight (O, C/g * k*k), each channel's k*k values in grid order, repacked for the forward's products
// as (groups, C/g * k*k, O/g) in slot order (slot s of channel c at row c * k*k + s): the output channels of
// one slot side by side. One pass does the slot permutation and the transposition.
template <typename scalar_t>
void pack_by_slot(const scalar_t* src, scalar_t* dst, const Shape& shape, const std::vector<int64_t>& slot_to_grid) {
  const int64_t slots = static_cast<int64_t>(slot_to_grid.size()), cg = shape.in_per_group(),
                og = shape.out_per_group(), row = cg * slots;
  constexpr int64_t kOutputs = 16;
  timm_sortconv_host::parallel_for(0, shape.groups * cg, 16, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end;) {
      const int64_t g = first / cg, last = std::min(end, (g + 1) * cg);
      // kOutputs rows at a time, each read along its channels (a few pages at a time, where a row of a wide layer
      // spans several), each slot's outputs written side by side: a row of 512 channels of 3x3 is 18 KB, and
      // reading every output's row per channel and slot walks a page per value.
      for (int64_t o0 = 0; o0 < og; o0 += kOutputs) {
        const int64_t o1 = std::min(og, o0 + kOutputs);
        for (int64_t gc = first; gc < last; ++gc) {
          const scalar_t* channel = src + g * og * row + (gc % cg) * slots;
          for (int64_t s = 0; s < slots; ++s) {
            const scalar_t* column = channel + slot_to_grid[s];
            scalar_t* to = dst + (gc * slots + s) * og;
            for (int64_t o = o0; o < o1; ++o) to[o] = column[o * row];
          }
        }
      }
      first = last;
    }
  });
}

// pack_by_slot's weights with each panel chunk's rows (forward_kernel's products) in gemm_tiles' layout.
template <typename scalar_t>
void tile_forward_weights(const scalar_t* weight_packed, scalar_t* tiled, const Shape& shape, int64_t slots) {
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group(), panel_channels = panel_channels_of(cg, slots);
  for (int64_t g = 0; g < shape.groups; ++g) {
    for (int64_t c0 = 0; c0 < cg; c0 += panel_channels) {
      const int64_t offset = (g * cg + c0) * slots * og;
      tile_weights(weight_packed + offset, std::min(panel_channels, cg - c0) * slots, og, og, tiled + offset);
    }
  }
}

// The forward of a planned call on raw memory: input (B, C, src_h, src_w), weight_packed as tile_forward_weights
// writes it (unread where weight_pairs is given), weight_pairs (pack_forward_weights) or nullptr, bias (O) or
// nullptr, output (B, O, out_h, out_w).
template <typename scalar_t>
void run_forward(const Plan<scalar_t>& plan, const Shape& shape, const scalar_t* input, const scalar_t* weight_packed,
                 const uint32_t* weight_pairs, const scalar_t* bias, scalar_t* output) {
  if (plan.stride_w == 1) {
    forward_kernel<scalar_t, true>(plan, shape, input, weight_packed, weight_pairs, bias, output);
  } else {
    forward_kernel<scalar_t, false>(plan, shape, input, weight_packed, weight_pairs, bias, output);
  }
}

#if !defined(TIMM_SORTCONV_STANDALONE)
template <typename scalar_t>
at::Tensor pack_by_slot(const at::Tensor& weight, const Shape& shape, const std::vector<int64_t>& slot_to_grid) {
  at::Tensor packed = at::empty({shape.groups, shape.in_per_group() * static_cast<int64_t>(slot_to_grid.size()),
                                 shape.out_per_group()}, weight.options());
  pack_by_slot(weight.data_ptr<scalar_t>(), packed.data_ptr<scalar_t>(), shape, slot_to_grid);
  return packed;
}

// The same weight as the backward's input-gradient products read it: (C, O/g, k*k), per channel the slots
// of each output of its group.
template <typename scalar_t>
at::Tensor pack_by_output(const at::Tensor& weight, const Shape& shape, const std::vector<int64_t>& slot_to_grid) {
  const int64_t slots = static_cast<int64_t>(slot_to_grid.size()), cg = shape.in_per_group(),
                og = shape.out_per_group(), row = cg * slots;
  at::Tensor packed = at::empty({shape.channels, og, slots}, weight.options());
  const scalar_t* src = weight.data_ptr<scalar_t>();
  scalar_t* dst = packed.data_ptr<scalar_t>();
  at::parallel_for(0, shape.channels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t gc = begin; gc < end; ++gc) {
      for (int64_t o = 0; o < og; ++o) {
        const scalar_t* from = src + ((gc / cg) * og + o) * row + (gc % cg) * slots;
        scalar_t* to = dst + (gc * og + o) * slots;
        for (int64_t s = 0; s < slots; ++s) to[s] = from[slot_to_grid[s]];
      }
    }
  });
  return packed;
}

template <typename scalar_t>
at::Tensor forward_impl(const at::Tensor& input, const at::Tensor& weight_slots, const c10::optional<at::Tensor>& bias,
                        const Plan<scalar_t>& plan, const Shape& shape, const std::vector<int64_t>& slot_to_grid,
                        bool bf16) {
  at::Tensor output = at::empty({shape.batch, shape.out_channels, plan.out_h, plan.out_w}, input.options());
  at::Tensor weight_packed = pack_by_slot<scalar_t>(weight_slots, shape, slot_to_grid);
  const std::vector<uint32_t> weight_pairs =
      bf16 ? pack_forward_weights(weight_packed.data_ptr<scalar_t>(), shape, plan.slots) : std::vector<uint32_t>();
  if (!bf16) {  // the float products read each panel chunk's rows in gemm_tiles' layout: a stream per register tile
    at::Tensor tiled = at::empty_like(weight_packed);
    tile_forward_weights<scalar_t>(weight_packed.data_ptr<scalar_t>(), tiled.data_ptr<scalar_t>(), shape, plan.slots);
    weight_packed = tiled;
  }
  const uint32_t* wp = weight_pairs.empty() ? nullptr : weight_pairs.data();
  const bool has_bias = bias.has_value() && bias->defined();
  const auto bias_values = has_bias ? bias->contiguous() : at::Tensor();
  const scalar_t* in = input.data_ptr<scalar_t>();
  const scalar_t* w = weight_packed.data_ptr<scalar_t>();
  const scalar_t* b = has_bias ? bias_values.data_ptr<scalar_t>() : nullptr;
  run_forward(plan, shape, in, w, wp, b, output.data_ptr<scalar_t>());
  return output;
}
#endif

template <typename scalar_t, bool kUnitStride>
void backward_kernel(const Plan<scalar_t>& plan, const Shape& shape, const scalar_t* input,
                     const scalar_t* grad_output, const scalar_t* weight_by_output, scalar_t* grad_input,
                     std::vector<std::vector<scalar_t>>& grad_input_parts,
                     std::vector<std::vector<scalar_t>>& grad_weight_parts, int64_t outputs_padded,
                     int64_t threads, const uint32_t* weight_pairs) {
  using vec = typename Simd<scalar_t>::vec;
  constexpr int64_t lanes = kLanes<scalar_t>, half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, positions = plan.out_h * plan.out_w, plane = plan.in_h * plan.in_w;
  const int64_t cg = shape.in_per_group(), og = shape.out_per_group();
  const bool need_input = grad_input != nullptr || !grad_input_parts.empty();
  const bool need_weight = !grad_weight_parts.empty();
  // A thread owns whole images (so its input-gradient scatter races with nobody) unless there are
  // fewer images than threads; then positions are shared out and each thread has a private copy.
  const bool whole_images = need_input && grad_input_parts.empty();
  // bfloat16 products (weight_pairs set) take one block per pass.
  const bool bf16 = weight_pairs != nullptr;
  const int64_t pass_blocks = bf16 ? 1 : blocks_per_pass<scalar_t>(shape, slots), span = pass_blocks * lanes;
  const int64_t value_stride = slots * lanes + half, swap_count = std::max<int64_t>(1, plan.comparators.size());
  for_each_thread_range(shape.batch, positions, threads, whole_images, [&](int64_t thread, int64_t begin, int64_t end) {
    // Per block of the pass: its output gradient (O rows of lanes), its sorted values of one channel and
    // their swaps. grad_tile_t is, per group, the pass's lanes (block after block) by O/g padded: the
    // layout the weight-gradient micro-GEMM reads.
    std::vector<scalar_t> grad_tile(pass_blocks * shape.out_channels * lanes),
        grad_tile_t(shape.groups * pass_blocks * lanes * outputs_padded);
    std::vector<scalar_t> value(pass_blocks * value_stride), grid(slots * lanes + half), grad_samples(slots * lanes),
        grad_grid(slots * lanes);
    std::vector<SwapMask<vec>> swaps(pass_blocks * swap_count);
    std::vector<Block> blocks(pass_blocks);
    std::vector<int64_t> counts(pass_blocks);
    // bfloat16 products: the block's output gradient as pair rows, per group, for the input gradient
    // (O/g rows of lanes) and for the weight gradient (lanes rows of O/g padded), and one channel's
    // sorted values as pairs of lanes.
    const int64_t og_pairs = pairs_of(og);
    std::vector<uint32_t> grad_pairs(bf16 && need_input ? shape.groups * og_pairs * lanes : 0);
    std::vector<uint32_t> grad_t_pairs(bf16 && need_weight ? shape.groups * (lanes / 2) * outputs_padded : 0);
    std::vector<uint32_t> column_pairs(bf16 ? slots * (lanes / 2) : 0);
    scalar_t* grad_in = grad_input_parts.empty() ? grad_input : grad_input_parts[thread].data();
    scalar_t* grad_weight = need_weight ? grad_weight_parts[thread].data() : nullptr;
    ImageRing<scalar_t> ring(plan, input, need_input ? grad_in : nullptr, shape.batch, shape.channels, begin, end,
                             span);
    for (int64_t start = begin; start < end; start += span) {
      const int64_t stop = std::min(start + span, end);
      const int64_t count = cover_pass<scalar_t, kUnitStride>(plan, ring, start, stop, shape.channels, blocks);
      const scalar_t* images = ring.images();
      scalar_t* grad_images = need_input ? ring.grads() : nullptr;
      std::fill(grad_tile.begin(), grad_tile.end(), scalar_t(0));
      for (int64_t b = 0; b < count; ++b) {
        counts[b] = blocks[b].count;
        for (int64_t o = 0; o < shape.out_channels; ++o) {
          load_lanes(plan, blocks[b], grad_output + o * positions, shape.out_channels * positions,
                     grad_tile.data() + (b * shape.out_channels + o) * lanes);
        }
      }
      if (need_weight) {
        std::fill(grad_tile_t.begin(), grad_tile_t.end(), scalar_t(0));
        for (int64_t g = 0; g < shape.groups; ++g) {
          for (int64_t b = 0; b < count; ++b) {
            scalar_t* rows = grad_tile_t.data() + (g * pass_blocks + b) * lanes * outputs_padded;
            for (int64_t o = 0; o < og; ++o) {
              const scalar_t* from = grad_tile.data() + (b * shape.out_channels + g * og + o) * lanes;
              for (int64_t lane = 0; lane < counts[b]; ++lane) {
                rows[lane * outputs_padded + o] = from[lane];
              }
            }
          }
        }
      }
#if defined(TIMM_SORTCONV_BF16)
      if constexpr (std::is_same<scalar_t, float>::value) {
        for (int64_t g = 0; bf16 && g < shape.groups; ++g) {
          if (need_input) {
            pack_pair_rows(grad_tile.data() + g * og * lanes, og, lanes, lanes, grad_pairs.data() + g * og_pairs * lanes);
          }
          if (need_weight) {
            pack_pair_rows(grad_tile_t.data() + g * lanes * outputs_padded, counts[0], outputs_padded, outputs_padded,
                           grad_t_pairs.data() + g * (lanes / 2) * outputs_padded);
          }
        }
      }
#endif
      for (int64_t channel = 0; channel < shape.channels; ++channel) {
        const int64_t g = channel / cg;
        for (int64_t b = 0; b < count; ++b) {
          gather_samples<scalar_t, kUnitStride>(plan, images + channel * plane, blocks[b], grid.data(),
                                                value.data() + b * value_stride);
          sort_samples<scalar_t, true>(plan, value.data() + b * value_stride, swaps.data() + b * swap_count);
        }
#if defined(TIMM_SORTCONV_BF16)
        if constexpr (std::is_same<scalar_t, float>::value) {
          if (bf16) {
            if (need_weight) {
              pack_column_pairs(value.data(), slots, lanes, counts[0], column_pairs.data());
              gemm_reduce_bf16<kTileRows>(column_pairs.data(), slots, pairs_of(counts[0]),
                                          grad_t_pairs.data() + g * (lanes / 2) * outputs_padded, outputs_padded,
                                          grad_weight + channel * slots * outputs_padded);
            }
            if (!need_input) continue;
            // weight_pairs is (C, O/g pairs, k*k): per channel, its slots' weights two outputs at a time.
            gemm_rows_bf16<kTileRows>(grad_pairs.data() + g * og_pairs * lanes, og_pairs,
                                      weight_pairs + channel * og_pairs * slots, slots, slots, grad_samples.data(),
                                      false);
            unsort_gradients(plan, grad_samples.data(), swaps.data());
            scatter_gradients<scalar_t, kUnitStride>(plan, blocks[0], grad_samples.data(), grad_grid.data(),
                                                     grad_images + channel * plane);
            continue;
          }
        }
#endif
        if (need_weight) {
          gemm_reduce(value.data(), value_stride, slots, counts.data(), count,
                      grad_tile_t.data() + g * pass_blocks * lanes * outputs_padded, outputs_padded,
                      grad_weight + channel * slots * outputs_padded);
        }
        if (!need_input) {
          continue;
        }
        for (int64_t b = 0; b < count; ++b) {
          // weight_by_output is (C, O/g, k*k): for each output of the group, this channel's slots.
          gemm_rows(grad_tile.data() + (b * shape.out_channels + g * og) * lanes, og,
                    weight_by_output + channel * og * slots, slots, slots, grad_samples.data(), false);
          unsort_gradients(plan, grad_samples.data(), swaps.data() + b * swap_count);
          scatter_gradients<scalar_t, kUnitStride>(plan, blocks[b], grad_samples.data(), grad_grid.data(),
                                                   grad_images + channel * plane);
        }
      }
    }
    ring.finish();
  });
}

#if !defined(TIMM_SORTCONV_STANDALONE)
// Adds the threads' private input gradients (with fewer images than threads) into grad_input.
template <typename scalar_t>
void sum_input_parts(const std::vector<std::vector<scalar_t>>& parts, at::Tensor& grad_input) {
  scalar_t* dst = grad_input.data_ptr<scalar_t>();
  for (const auto& part : parts) {
    for (int64_t i = 0; i < grad_input.numel(); ++i) {
      dst[i] += part[i];
    }
  }
}

// The threads' (C, k*k, O/g padded) weight-gradient parts summed into a tensor like `weight` (O, C/g * k*k), slot s
// of each channel at column slot_to_grid[s], channel by channel in parallel: with 512 channels of 3x3 the parts
// hold millions of values.
template <typename scalar_t>
at::Tensor sum_weight_parts(const std::vector<std::vector<scalar_t>>& parts, const at::Tensor& weight,
                            const Shape& shape, int64_t outputs_padded, const std::vector<int64_t>& slot_to_grid) {
  const int64_t slots = static_cast<int64_t>(slot_to_grid.size()), cg = shape.in_per_group(),
                og = shape.out_per_group(), row = cg * slots;
  at::Tensor grad_weight = at::empty_like(weight);
  scalar_t* dst = grad_weight.data_ptr<scalar_t>();
  at::parallel_for(0, shape.channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t channel = begin; channel < end; ++channel) {
      const int64_t g = channel / cg, ci = channel % cg;
      for (int64_t s = 0; s < slots; ++s) {
        for (int64_t o = 0; o < og; ++o) {
          scalar_t sum = 0;
          for (const auto& part : parts) {
            sum += part[(channel * slots + s) * outputs_padded + o];
          }
          dst[(g * og + o) * row + ci * slots + slot_to_grid[s]] = sum;
        }
      }
    }
  });
  return grad_weight;
}

template <typename scalar_t>
std::vector<at::Tensor> backward_impl(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& weight_slots, const Plan<scalar_t>& plan, const Shape& shape,
                                      const std::vector<int64_t>& slot_to_grid, bool need_input_grad,
                                      bool need_weight_grad, bool bf16) {
  constexpr int64_t half = kVecLanes<scalar_t>;
  const int64_t slots = plan.slots, og = shape.out_per_group();
  const int64_t outputs_padded = (og + half - 1) / half * half;
  const int64_t threads = thread_count(shape.batch * plan.positions() / kLanes<scalar_t>,
                                       2 * multiply_adds(shape, plan.positions(), slots));
  const bool private_grad_input = need_input_grad && shape.batch < threads;
  at::Tensor grad_input = need_input_grad ? at::zeros_like(input) : at::Tensor();
  at::Tensor grad_weight;
  if (!need_input_grad && !need_weight_grad) {
    return {grad_input, grad_weight};
  }
  std::vector<std::vector<scalar_t>> grad_input_parts, grad_weight_parts;
  if (private_grad_input) {
    grad_input_parts.assign(threads, std::vector<scalar_t>(input.numel(), scalar_t(0)));
  }
  if (need_weight_grad) {
    grad_weight_parts.assign(threads, std::vector<scalar_t>(shape.channels * slots * outputs_padded, scalar_t(0)));
  }
  const at::Tensor weight_by_output = pack_by_output<scalar_t>(weight_slots, shape, slot_to_grid);
  const scalar_t* in = input.data_ptr<scalar_t>();
  const scalar_t* grad_out = grad_output.data_ptr<scalar_t>();
  const scalar_t* w = weight_by_output.data_ptr<scalar_t>();
  scalar_t* grad_in = need_input_grad && !private_grad_input ? grad_input.data_ptr<scalar_t>() : nullptr;
  // bfloat16 products: weight_by_output as (C, O/g pairs, k*k), the pairs of outputs 2p and 2p + 1.
  std::vector<uint32_t> weight_pairs;
#if defined(TIMM_SORTCONV_BF16)
  if (bf16) {
    const int64_t og_pairs = pairs_of(og);
    weight_pairs.resize(shape.channels * og_pairs * slots);
    for (int64_t c = 0; c < shape.channels; ++c) {
      for (int64_t p = 0; p < og_pairs; ++p) {
        for (int64_t s = 0; s < slots; ++s) {
          const scalar_t* row = w + (c * og + 2 * p) * slots + s;
          weight_pairs[(c * og_pairs + p) * slots + s] =
              bf16_pair(static_cast<float>(row[0]), 2 * p + 1 < og ? static_cast<float>(row[slots]) : 0.f);
        }
      }
    }
  }
#endif
  const uint32_t* wp = weight_pairs.empty() ? nullptr : weight_pairs.data();
  if (plan.stride_w == 1) {
    backward_kernel<scalar_t, true>(plan, shape, in, grad_out, w, grad_in, grad_input_parts, grad_weight_parts,
                                    outputs_padded, threads, wp);
  } else {
    backward_kernel<scalar_t, false>(plan, shape, in, grad_out, w, grad_in, grad_input_parts, grad_weight_parts,
                                     outputs_padded, threads, wp);
  }
  if (private_grad_input) sum_input_parts(grad_input_parts, grad_input);
  if (need_weight_grad) {
    grad_weight = sum_weight_parts(grad_weight_parts, weight_slots, shape, outputs_padded, slot_to_grid);
  }
  return {grad_input, grad_weight};
}

// The call's Shape; `guides`: the guide channels each group of the input carries after the weight's C/g
// (align_conv_kernel.h), which the Shape's channels leave out.
Shape check_tensors(const at::Tensor& input, const at::Tensor& weight_slots, int64_t groups, int64_t kernel_size,
                    int64_t guides = 0) {
  TORCH_CHECK(input.device().is_cpu() && weight_slots.device().is_cpu(), "sort_conv_cpu: tensors must be on the CPU");
  TORCH_CHECK(input.dim() == 4 && input.is_contiguous(),
              "sort_conv_cpu: input must be a contiguous (B, C, H, W) tensor");
  TORCH_CHECK(weight_slots.dim() == 2 && weight_slots.is_contiguous(),
              "sort_conv_cpu: weight must be a contiguous (O, C/groups * k*k) matrix (grid order with slot_to_grid, "
              "else slot order)");
  TORCH_CHECK(input.scalar_type() == weight_slots.scalar_type(), "sort_conv_cpu: input and weight dtypes differ");
  TORCH_CHECK(groups >= 1 && input.size(1) % groups == 0 && weight_slots.size(0) % groups == 0,
              "sort_conv_cpu: groups must divide the channels");
  const int64_t weighted = input.size(1) - guides * groups;
  TORCH_CHECK(guides >= 0 && weight_slots.size(1) * groups == weighted * kernel_size * kernel_size,
              "sort_conv_cpu: weight has ", weight_slots.size(1), " columns, expected (C/groups - ", guides,
              " guides) * k*k");
  return {input.size(0), weighted, weight_slots.size(0), groups};
}

#endif

// Whether this build on this CPU multiplies in bfloat16 (timm_sortconv_cpu::bf16_products).
inline bool bf16_build_and_hardware() {
#if defined(TIMM_SORTCONV_BF16)
  return bf16_hardware();
#else
  return false;
#endif
}

#if !defined(TIMM_SORTCONV_STANDALONE)

// The grid position that each slot's weight comes from: `slot_to_grid` checked to be a permutation of the
// k*k positions, or the identity where the weight is already in slot order (undefined tensor).
inline std::vector<int64_t> slot_order(const at::Tensor& slot_to_grid, int64_t slots) {
  std::vector<int64_t> order(slots);
  if (!slot_to_grid.defined()) {
    for (int64_t s = 0; s < slots; ++s) order[s] = s;
    return order;
  }
  TORCH_CHECK(slot_to_grid.device().is_cpu() && slot_to_grid.dim() == 1 && slot_to_grid.numel() == slots
                  && slot_to_grid.scalar_type() == at::kLong,
              "sort_conv_cpu: slot_to_grid must be ", slots, " int64 grid positions on the CPU, got ",
              slot_to_grid.sizes(), " ", slot_to_grid.scalar_type(), " on ", slot_to_grid.device());
  const auto values = slot_to_grid.contiguous();
  std::vector<bool> seen(slots, false);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t position = values.data_ptr<int64_t>()[s];
    TORCH_CHECK(position >= 0 && position < slots && !seen[position],
                "sort_conv_cpu: slot_to_grid must be a permutation of 0..", slots - 1);
    seen[position] = true;
    order[s] = position;
  }
  return order;
}

// Whether this call multiplies in bfloat16: asked for (a bfloat16 call), float32 and the CPU has it.
template <typename scalar_t>
bool use_bf16_products(const timm_sortconv_cpu::Call& call) {
  return call.bf16_products && std::is_same<scalar_t, float>::value && bf16_build_and_hardware();
}
#endif

}  // namespace

#if !defined(TIMM_SORTCONV_STANDALONE)
namespace timm_sortconv_cpu {

template <typename scalar_t>
at::Tensor forward(const Call& call) {
  const Shape shape = check_tensors(call.input, call.weight_slots, call.groups, call.kernel_size);
  if (call.bias.has_value() && call.bias->defined()) {
    TORCH_CHECK(call.bias->scalar_type() == call.input.scalar_type() && call.bias->numel() == shape.out_channels,
                "sort_conv_cpu: bias must have O entries of the input's dtype");
  }
  const auto plan = make_plan<scalar_t>(call.input, call.tap_offsets, call.tap_weights, call.segments, call.comparators,
                                        call.kernel_size, call.stride_h, call.stride_w, call.dilation_h,
                                        call.dilation_w, call.pad);
  return forward_impl<scalar_t>(call.input, call.weight_slots, call.bias, plan, shape,
                                slot_order(call.slot_to_grid, plan.slots), use_bf16_products<scalar_t>(call));
}

template <typename scalar_t>
std::vector<at::Tensor> backward(const Call& call) {
  const Shape shape = check_tensors(call.input, call.weight_slots, call.groups, call.kernel_size);
  const at::Tensor& grad_output = call.grad_output;
  TORCH_CHECK(grad_output.is_contiguous() && grad_output.scalar_type() == call.input.scalar_type(),
              "sort_conv_cpu: grad_output must be contiguous with the input's dtype");
  const auto plan = make_plan<scalar_t>(call.input, call.tap_offsets, call.tap_weights, call.segments, call.comparators,
                                        call.kernel_size, call.stride_h, call.stride_w, call.dilation_h,
                                        call.dilation_w, call.pad);
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == shape.batch && grad_output.size(1) == shape.out_channels
                  && grad_output.size(2) == plan.out_h && grad_output.size(3) == plan.out_w,
              "sort_conv_cpu: grad_output has the wrong shape");
  return backward_impl<scalar_t>(grad_output, call.input, call.weight_slots, plan, shape,
                                 slot_order(call.slot_to_grid, plan.slots), call.need_input_grad,
                                 call.need_weight_grad, use_bf16_products<scalar_t>(call));
}

}  // namespace timm_sortconv_cpu
#endif
