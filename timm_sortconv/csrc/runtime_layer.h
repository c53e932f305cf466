// One SC layer's forward in a runtime without libtorch: what the onnxruntime operator (onnxruntime/sort_conv_op.cpp)
// and the OpenVINO extension (openvino/sort_conv_extension.cpp) share. A runtime reads the node's attributes
// (timm_sortconv/onnx/fused.py writes them; cpu_backend.align_kernel_tables computes the aligned ones) into a
// LayerAttributes, builds a Layer from them (every table is checked there, so a bad node fails when the runtime
// loads it), and calls forward with the tensors' data; the kernels are those PyTorch's CPU backend runs
// (sort_conv_kernel.h, align_conv_kernel.h, built with TIMM_SORTCONV_STANDALONE), on the thread pool the caller
// installs (kernel_support.h's PoolScope; none: the calling thread).
//
// Per layer it keeps the weight packed once where the runtime says it is constant, and per input size the kernel's
// plan (with the aligned kernel's tables and harmonic weight, which depend on the plan).
#pragma once

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "sort_conv_kernel.h"
#include "align_conv_kernel.h"

// (Inside the kernels' anonymous namespace: the layer holds their types, which have internal linkage.)
namespace {
namespace timm_sortconv_runtime {

// The node's attributes, by their ONNX names (fused.py's module docstring and onnxruntime/sort_conv_op.cpp's header).
struct LayerAttributes {
  int64_t kernel_size = 0, group = 1, taps = 0, centre = 0, centre_min_size = 1;
  std::vector<int64_t> strides{1, 1}, dilations{1, 1}, pads{0, 0, 0, 0};  // pads: top, left, bottom, right
  std::vector<int64_t> tap_offsets, segments, comparators, slot_to_grid;
  std::vector<float> tap_weights;
  std::string sampling, sorting;
  std::string activation;  // "" or "Relu": the output rectified (a ReLU after the layer, merged into the node)
  // The aligned variants' (sorting "align", "align-channel").
  int64_t guides = 0, shared = 1;
  float relative = 0.f, tiny = 0.f;
  std::vector<float> fold, dft, first, energy_pairs, energy_fixed, weight_scale, guide_first;
  std::vector<int64_t> blocks, pairs, fixed;
};

// timm_sortconv.grid.centre_grid_residues for one axis: the residue the centring takes away (0: none).
inline int64_t centre_residue(int64_t size, int64_t kernel_size, int64_t stride, int64_t pad, int64_t dilation,
                              int64_t min_size) {
  const int64_t span = size + 2 * pad - dilation * (kernel_size - 1) - 1;
  if (stride == 1 || span < 0) return 0;
  const int64_t excess = span % stride;
  return size - excess < min_size ? 0 : excess;
}

// The output's size along an axis of `size` (-1: not known, then -1) with `pads` zeros in all; the centring keeps it.
inline int64_t output_size(int64_t size, int64_t kernel_size, int64_t stride, int64_t pads, int64_t dilation) {
  if (size < 0) return -1;
  const int64_t span = size + pads - dilation * (kernel_size - 1) - 1;
  TIMM_SORTCONV_CHECK(span >= 0 && stride >= 1, "timm_sortconv::SortConv2d: X's side of ", size,
                      " is smaller than the dilated kernel");
  return span / stride + 1;
}

inline std::vector<double> widened(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

class Layer {
 public:
  explicit Layer(const LayerAttributes& a) {
    kernel_size_ = a.kernel_size;
    TIMM_SORTCONV_CHECK(kernel_size_ >= 1 && kernel_size_ <= 15, "timm_sortconv::SortConv2d: kernel_size ",
                        kernel_size_, " is outside 1..15");
    const int64_t slots = kernel_size_ * kernel_size_;
    group_ = a.group;
    TIMM_SORTCONV_CHECK(group_ >= 1, "timm_sortconv::SortConv2d: group must be >= 1");
    TIMM_SORTCONV_CHECK(a.strides.size() == 2 && a.dilations.size() == 2 && a.pads.size() == 4,
                        "timm_sortconv::SortConv2d: strides and dilations take 2 values, pads 4");
    strides_ = {a.strides[0], a.strides[1]};
    dilations_ = {a.dilations[0], a.dilations[1]};
    pad_ = {a.pads[1], a.pads[3], a.pads[0], a.pads[2]};  // the kernel's left, right, top, bottom
    centre_ = a.centre != 0;
    centre_min_size_ = a.centre_min_size;
    taps_ = a.taps;
    TIMM_SORTCONV_CHECK(taps_ >= 1, "timm_sortconv::SortConv2d: taps must be >= 1");
    TIMM_SORTCONV_CHECK(static_cast<int64_t>(a.tap_offsets.size()) == slots * taps_ * 2,
                        "timm_sortconv::SortConv2d: tap_offsets has ", a.tap_offsets.size(), " values, expected ",
                        slots * taps_ * 2);
    tap_offsets_ = a.tap_offsets;
    TIMM_SORTCONV_CHECK(static_cast<int64_t>(a.tap_weights.size()) == slots * taps_, "timm_sortconv::SortConv2d: ",
                        "tap_weights has ", a.tap_weights.size(), " values, expected k*k*taps = ", slots * taps_);
    tap_weights_ = widened(a.tap_weights);
    segments_ = a.segments;
    TIMM_SORTCONV_CHECK(!segments_.empty() && segments_.size() % 2 == 0,
                        "timm_sortconv::SortConv2d: segments must be [start, end) pairs");
    TIMM_SORTCONV_CHECK(a.comparators.size() % 2 == 0, "timm_sortconv::SortConv2d: comparators must be pairs");
    for (const int64_t slot : a.comparators) {
      TIMM_SORTCONV_CHECK(slot >= 0 && slot < slots, "timm_sortconv::SortConv2d: a comparator's slot ", slot,
                          " is outside 0..", slots - 1);
      comparators_.push_back(static_cast<int32_t>(slot));
    }
    slot_to_grid_ = a.slot_to_grid;
    TIMM_SORTCONV_CHECK(static_cast<int64_t>(slot_to_grid_.size()) == slots,
                        "timm_sortconv::SortConv2d: slot_to_grid must have k*k values");
    std::vector<bool> seen(slots, false);
    for (const int64_t position : slot_to_grid_) {
      TIMM_SORTCONV_CHECK(position >= 0 && position < slots && !seen[position],
                          "timm_sortconv::SortConv2d: slot_to_grid must be a permutation of 0..", slots - 1);
      seen[position] = true;
    }
    TIMM_SORTCONV_CHECK(a.activation.empty() || a.activation == "Relu", "timm_sortconv::SortConv2d: activation '",
                        a.activation, "' is not one of '' (none) and 'Relu'");
    relu_ = a.activation == "Relu";
    aligned_ = a.sorting == "align" || a.sorting == "align-channel";
    if (aligned_) {
      TIMM_SORTCONV_CHECK(comparators_.empty(), "timm_sortconv::SortConv2d: an aligned node sorts nothing");
      align_.guides = a.guides;
      align_.shared = a.shared != 0;
      align_.relative = a.relative;
      align_.tiny = a.tiny;
      align_.fold = widened(a.fold);
      align_.dft = widened(a.dft);
      align_.blocks = a.blocks;
      align_.pairs = a.pairs;
      align_.fixed = a.fixed;
      align_.first = widened(a.first);
      align_.energy_pairs = widened(a.energy_pairs);
      align_.energy_fixed = widened(a.energy_fixed);
      align_.weight_scale = widened(a.weight_scale);
      align_.guide_first = widened(a.guide_first);
    } else {
      TIMM_SORTCONV_CHECK(a.guides == 0, "timm_sortconv::SortConv2d: guide channels need sorting 'align'");
    }
    // The plan of a small input checks the tables once, here, where a bad node fails when the runtime loads it.
    plan_for(kernel_size_ * dilations_[0], kernel_size_ * dilations_[1], false);
  }

  int64_t guides() const { return aligned_ ? align_.guides : 0; }

  // Y's dimensions from X's and W's (-1 where not known).
  std::array<int64_t, 4> output_dims(const std::vector<int64_t>& x, const std::vector<int64_t>& w) const {
    return {x[0], w[0], output_size(x[2], kernel_size_, strides_[0], pad_[2] + pad_[3], dilations_[0]),
            output_size(x[3], kernel_size_, strides_[1], pad_[0] + pad_[1], dilations_[1])};
  }

  // S (added to Y before the activation: a residual) must have Y's shape `y`; one check for every runtime.
  static void check_sum(const std::vector<int64_t>& s, const std::array<int64_t, 4>& y) {
    if (s == std::vector<int64_t>(y.begin(), y.end())) return;
    std::string given;
    for (size_t i = 0; i < s.size(); ++i) given += (i ? ", " : "") + std::to_string(s[i]);
    TIMM_SORTCONV_CHECK(false, "timm_sortconv::SortConv2d: S must have Y's shape (", y[0], ", ", y[1], ", ", y[2], ", ",
                        y[3], "), not (", given, ")");
  }

  // A weight that stays the same for every call (an initializer), packed once.
  void set_constant_weight(const float* weight, const std::vector<int64_t>& dims) {
    check_weight(dims);
    weight_shape_ = dims;
    constant_weight_.assign(weight, weight + numel(dims));
    if (!aligned_) {
      packed_weight_.resize(constant_weight_.size());
      pack(constant_weight_.data(), dims, packed_weight_.data());
    }
  }

  // Y (output_dims(x_dims, w_dims), all known) of X (N, C, H, W), W (O, C/group, k, k), B (O, or nullptr) and S (a
  // tensor like Y added to it before the activation, or nullptr), with `threads` the threads of the pool the caller
  // installed (1: none).
  void forward(const float* input, const std::vector<int64_t>& x, const float* weight, const std::vector<int64_t>& w,
               const float* bias, const float* sum, float* out, int64_t threads) {
    TIMM_SORTCONV_CHECK(x.size() == 4, "timm_sortconv::SortConv2d: X must be 4-D (N, C, H, W)");
    check_weight(w);
    const int64_t batch = x[0], channels = x[1], out_channels = w[0];
    TIMM_SORTCONV_CHECK(channels % group_ == 0 && (w[1] + guides()) * group_ == channels,
                        "timm_sortconv::SortConv2d: X has ", channels, " channels, W expects ",
                        (w[1] + guides()) * group_, " (", w[1], " per group and ", guides(), " guide, group = ",
                        group_, ")");
    int64_t height = x[2], width = x[3];
    std::vector<float> centred;
    if (centre_) input = centre(input, batch * channels, height, width, centred);
    // With fewer images than threads each thread copies (and pads) the whole images it reads a part of: images up
    // to kMaxCopiedImage stay in the cache that way, and the gathers from the copy are faster than from the input
    // (32 -> 32 channels at 28 x 28, k = 7, one image, 2 threads: 10% in onnxruntime). Larger ones are padded once
    // here instead and read in place, as cpu_backend.py does for PyTorch.
    const bool pad_here = batch < threads && std::any_of(pad_.begin(), pad_.end(), [](int64_t p) { return p > 0; })
                          && channels * height * width * static_cast<int64_t>(sizeof(float)) > kMaxCopiedImage;
    std::vector<float> padded;
    if (pad_here) {
      const int64_t h = height + pad_[2] + pad_[3], wd = width + pad_[0] + pad_[1];
      padded.assign(batch * channels * h * wd, 0.f);
      timm_sortconv_host::parallel_for(0, batch * channels, 1, [&](int64_t begin, int64_t end) {
        for (int64_t plane = begin; plane < end; ++plane) {
          for (int64_t row = 0; row < height; ++row) {
            std::memcpy(padded.data() + (plane * h + row + pad_[2]) * wd + pad_[0],
                        input + (plane * height + row) * width, width * sizeof(float));
          }
        }
      });
      input = padded.data();
      height = h;
      width = wd;
    }
    TIMM_SORTCONV_CHECK(height >= 1 && width >= 1, "timm_sortconv::SortConv2d: X has an empty image");
    if (batch == 0 || out_channels == 0) return;
    const std::shared_ptr<PlanState> state = plan_for(height, width, pad_here);
    const Plan<float>& plan = state->plan;
    const Shape shape{batch, channels - guides() * group_, out_channels, group_, relu_, sum};
    const bool constant = !constant_weight_.empty() && weight_shape_ == w;
    if (aligned_) {
      std::vector<float> packed_here;
      const float* packed = nullptr;
      const auto harmonic = [&](const float* from, std::vector<float>& to) {
        std::vector<float> rows(numel(w));
        harmonic_weight_into<float>(plan, state->tables, shape, from, slot_to_grid_, true, rows.data());
        to.resize(rows.size());
        tile_forward_weights<float>(rows.data(), to.data(), shape, kernel_size_ * kernel_size_);
      };
      if (constant) {
        std::lock_guard<std::mutex> guard(state->lock);
        if (state->packed.empty()) harmonic(constant_weight_.data(), state->packed);
        packed = state->packed.data();
      } else {
        harmonic(weight, packed_here);
        packed = packed_here.data();
      }
      if (plan.stride_w == 1) {
        align_forward_kernel<float, true>(plan, state->tables, shape, input, packed, bias, out);
      } else {
        align_forward_kernel<float, false>(plan, state->tables, shape, input, packed, bias, out);
      }
      return;
    }
    const float* packed = packed_weight_.data();
    std::vector<float> packed_here;
    if (!constant) {
      packed_here.resize(numel(w));
      pack(weight, w, packed_here.data());
      packed = packed_here.data();
    }
    run_forward<float>(plan, shape, input, packed, nullptr, bias, out);
  }

 private:
  // A plan per input size, with the aligned kernel's tables (they depend on the plan) and its harmonic weight.
  struct PlanState {
    Plan<float> plan;
    AlignTables<float> tables;
    std::mutex lock;
    std::vector<float> packed;
  };

  static int64_t numel(const std::vector<int64_t>& dims) {
    int64_t n = 1;
    for (const int64_t d : dims) n *= d;
    return n;
  }

  void check_weight(const std::vector<int64_t>& w) const {
    TIMM_SORTCONV_CHECK(w.size() == 4 && w[2] == kernel_size_ && w[3] == kernel_size_,
                        "timm_sortconv::SortConv2d: W must be a float32 (O, C/group, k, k) tensor with k = ",
                        kernel_size_);
    TIMM_SORTCONV_CHECK(w[0] % group_ == 0, "timm_sortconv::SortConv2d: group ", group_, " does not divide W's ",
                        w[0], " output channels");
  }

  // `planes` images of height x width centred as timm_sortconv.grid.centre_grid does (the node's `centre`): per
  // strided axis read half a pixel on where its residue is odd (rows first, then columns, each the mean of two
  // neighbours), then cropped by half the residue on each side. Returns `input` where nothing is to be done, else the
  // centred images in `buffer`; height and width become the centred ones.
  const float* centre(const float* input, int64_t planes, int64_t& height, int64_t& width,
                      std::vector<float>& buffer) const {
    const int64_t rows = centre_residue(height, kernel_size_, strides_[0], pad_[2], dilations_[0], centre_min_size_);
    const int64_t columns = centre_residue(width, kernel_size_, strides_[1], pad_[0], dilations_[1],
                                           centre_min_size_);
    if (rows == 0 && columns == 0) return input;
    const int64_t half_r = rows % 2, half_c = columns % 2, crop_r = rows / 2, crop_c = columns / 2;
    const int64_t h = height - rows, wd = width - columns, in_h = height, in_w = width;
    buffer.resize(planes * h * wd);
    timm_sortconv_host::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
      for (int64_t plane = begin; plane < end; ++plane) {
        const float* image = input + plane * in_h * in_w;
        float* to = buffer.data() + plane * h * wd;
        for (int64_t i = 0; i < h; ++i) {
          const float* top = image + (i + crop_r) * in_w + crop_c;
          const float* below = top + half_r * in_w;
          for (int64_t j = 0; j < wd; ++j) {
            // (a + b) * 0.5 along the rows, then along the columns, as the Python rule's two steps compute it
            const float left = half_r ? (top[j] + below[j]) * 0.5f : top[j];
            const float right = half_r ? (top[j + half_c] + below[j + half_c]) * 0.5f : top[j + half_c];
            to[i * wd + j] = half_c ? (left + right) * 0.5f : left;
          }
        }
      }
    });
    height = h;
    width = wd;
    return buffer.data();
  }

  // The weight (O, C/g, k, k) in grid order, packed as the forward reads it (pack_by_slot, then tiled:
  // tile_forward_weights).
  void pack(const float* weight, const std::vector<int64_t>& dims, float* packed) const {
    const Shape shape{1, dims[1] * group_, dims[0], group_};
    std::vector<float> by_slot(dims[0] * dims[1] * kernel_size_ * kernel_size_);
    pack_by_slot<float>(weight, by_slot.data(), shape, slot_to_grid_);
    tile_forward_weights<float>(by_slot.data(), packed, shape, kernel_size_ * kernel_size_);
  }

  std::shared_ptr<PlanState> plan_for(int64_t height, int64_t width, bool padded) {
    const auto key = std::make_tuple(height, width, padded);
    std::lock_guard<std::mutex> guard(plans_lock_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    PlanTables tables;
    tables.tap_offsets = tap_offsets_.data();
    tables.tap_weights = tap_weights_.data();
    tables.taps = taps_;
    tables.segments = segments_.data();
    tables.segment_count = static_cast<int64_t>(segments_.size() / 2);
    tables.comparators = comparators_.data();
    tables.comparator_count = static_cast<int64_t>(comparators_.size() / 2);
    const std::array<int64_t, 4> pad = padded ? std::array<int64_t, 4>{0, 0, 0, 0} : pad_;
    auto state = std::make_shared<PlanState>();
    state->plan = make_plan<float>(tables, height, width, kernel_size_, strides_[0], strides_[1], dilations_[0],
                                   dilations_[1], pad);
    if (aligned_) state->tables = make_align_tables<float>(align_, state->plan);
    if (plans_.size() >= kMaxPlans) plans_.clear();  // a graph run at ever new sizes keeps the last few
    plans_.emplace(key, state);
    return state;
  }

  // Plans (a few kilobytes each) kept per layer, one per input size.
  static constexpr size_t kMaxPlans = 64;

  int64_t kernel_size_ = 0, group_ = 1, taps_ = 0, centre_min_size_ = 1;
  bool centre_ = false, aligned_ = false, relu_ = false;
  std::array<int64_t, 2> strides_{1, 1}, dilations_{1, 1};
  std::array<int64_t, 4> pad_{0, 0, 0, 0};
  std::vector<int64_t> tap_offsets_, segments_, slot_to_grid_;
  std::vector<double> tap_weights_;
  std::vector<int32_t> comparators_;
  AlignTableValues align_;
  std::vector<int64_t> weight_shape_;
  std::vector<float> constant_weight_, packed_weight_;
  std::mutex plans_lock_;
  std::map<std::tuple<int64_t, int64_t, bool>, std::shared_ptr<PlanState>> plans_;
};

}  // namespace timm_sortconv_runtime
}  // namespace
