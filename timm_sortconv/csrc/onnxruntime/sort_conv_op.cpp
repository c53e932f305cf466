// An onnxruntime custom-operator library: the node timm_sortconv::SortConv2d, the forward of one SC layer, computed
// by the kernels that PyTorch's CPU backend runs (../sort_conv_kernel.h, ../align_conv_kernel.h, built here without
// libtorch: TIMM_SORTCONV_STANDALONE, see ../kernel_support.h). timm_sortconv/onnx/runtime.py builds it; onnxruntime
// loads it with SessionOptions.register_custom_ops_library(path), which calls RegisterCustomOps below. Only
// onnxruntime's C API is used (its header, ../third_party/onnxruntime, no library to link: the functions come through
// the OrtApi table), at ORT_API_VERSION of the header, which every later onnxruntime serves.
//
// The node (timm_sortconv/onnx/fused.py writes it):
//   inputs   X (N, C, H, W) float32; W (O, C/group, k, k) float32, the layer's weight in grid order; B (O,) optional
//   output   Y (N, O, Ho, Wo) float32
//   attributes (the geometry as timm_sortconv/ops/geometry.py computes it, which is the only place it is computed)
//     kernel_size k; strides, dilations [h, w]; group; pads [top, left, bottom, right] zeros (ONNX Conv's order);
//     taps T; tap_offsets (k*k * T * 2) ints: per sample (slot order) and tap, (dy, dx) from window pixel k / 2;
//     tap_weights (k*k * T) floats (0: no tap); segments (2 * n) ints: [start, end) slots sorted together;
//     comparators (2 * m) ints: (lo, hi) pairs, segment after segment; slot_to_grid (k*k) ints: the weight's grid
//     position of each slot; sampling, sorting: strings ("align" and "align-channel" choose the aligned kernel);
//     centre, centre_min_size (optional, 0): the input's grid centred first, as timm_sortconv.grid.centre_grid does
//     (read half a pixel on where a strided axis's residue is odd, then cropped by half of it on each side; the
//     output's size is unchanged), so that a centred strided layer is one node;
//   the aligned variants' attributes besides (cpu_backend.align_kernel_tables computes them): guides (0 or 1 guide
//     channel after each group's weighted ones, in X only), shared, relative, tiny, fold, dft (k*k * k*k floats),
//     blocks, pairs, fixed (ints), first, energy_pairs, energy_fixed, weight_scale, guide_first (floats).
//
// Per node the kernel state holds the attributes, the weight packed once where it is a constant initializer (in slot
// order, each panel chunk's register tiles contiguous: tile_forward_weights, which measured 20% faster for
// ri_resnet18 at batch 1 than the row layout PyTorch's path packs per call, the same products in the same order), and
// the kernel's plan per input size (built on first use of a size). The node infers Y's shape, so that onnxruntime
// plans the memory after it as after a convolution. Compute runs the kernel's forward on onnxruntime's intra-op
// thread pool (KernelContext_ParallelFor), split into as many parts as the session's threads: the library reads them
// from the session configuration entry kThreadsKey (timm_sortconv.onnx.session sets it to the session's
// intra_op_num_threads; the C API does not tell a kernel its pool's size); without it, the machine's hardware threads
// (parts beyond the pool's threads then run one after another).
#define TIMM_SORTCONV_STANDALONE 1

#include <onnxruntime_c_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../sort_conv_kernel.h"
#include "../align_conv_kernel.h"

namespace {

constexpr const char* kDomain = "timm_sortconv";
constexpr const char* kOpName = "SortConv2d";
constexpr const char* kThreadsKey = "custom_op.SortConv2d.intra_op_num_threads";
// Plans (a few kilobytes each) kept per node, one per input size.
constexpr size_t kMaxPlans = 64;

const OrtApi* g_api = nullptr;

// A failed call of the C API as an exception (its message), the status released.
void check_status(OrtStatus* status) {
  if (status == nullptr) return;
  std::string message = g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  throw std::runtime_error(message);
}

// Whether a call of the C API succeeded; a failure's status is released (an attribute the node lacks).
bool succeeded(OrtStatus* status) {
  if (status == nullptr) return true;
  g_api->ReleaseStatus(status);
  return false;
}

bool read_attribute(const OrtKernelInfo* info, const char* name, int64_t* value) {
  return succeeded(g_api->KernelInfoGetAttribute_int64(info, name, value));
}

bool read_attribute(const OrtKernelInfo* info, const char* name, float* value) {
  return succeeded(g_api->KernelInfoGetAttribute_float(info, name, value));
}

// A scalar attribute the node must have (`kind` names its type in the error).
template <typename T>
T required_attribute(const OrtKernelInfo* info, const char* name, const char* kind) {
  T value{};
  if (!read_attribute(info, name, &value)) {
    timm_sortconv_host::fail("timm_sortconv::SortConv2d: the node has no ", kind, " attribute '", name, "'");
  }
  return value;
}

int64_t int_attribute(const OrtKernelInfo* info, const char* name) {
  return required_attribute<int64_t>(info, name, "int");
}

std::vector<int64_t> ints_attribute(const OrtKernelInfo* info, const char* name, size_t expected_size = 0) {
  size_t size = 0;
  OrtStatus* status = g_api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (status != nullptr) {
    g_api->ReleaseStatus(status);
    timm_sortconv_host::fail("timm_sortconv::SortConv2d: the node has no ints attribute '", name, "'");
  }
  std::vector<int64_t> values(size);
  if (size > 0) check_status(g_api->KernelInfoGetAttributeArray_int64(info, name, values.data(), &size));
  TIMM_SORTCONV_CHECK(expected_size == 0 || values.size() == expected_size, "timm_sortconv::SortConv2d: attribute '",
                      name, "' has ", values.size(), " values, expected ", expected_size);
  return values;
}

std::vector<float> floats_attribute(const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  OrtStatus* status = g_api->KernelInfoGetAttributeArray_float(info, name, nullptr, &size);
  if (status != nullptr) {
    g_api->ReleaseStatus(status);
    timm_sortconv_host::fail("timm_sortconv::SortConv2d: the node has no floats attribute '", name, "'");
  }
  std::vector<float> values(size);
  if (size > 0) check_status(g_api->KernelInfoGetAttributeArray_float(info, name, values.data(), &size));
  return values;
}

int64_t int_attribute_or(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  return read_attribute(info, name, &value) ? value : fallback;
}

float float_attribute(const OrtKernelInfo* info, const char* name) {
  return required_attribute<float>(info, name, "float");
}

std::string string_attribute(const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  succeeded(g_api->KernelInfoGetAttribute_string(info, name, nullptr, &size));  // the size, where it has one
  std::string value(size, '\0');
  if (size > 0) check_status(g_api->KernelInfoGetAttribute_string(info, name, &value[0], &size));
  if (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

std::vector<double> doubles_attribute(const OrtKernelInfo* info, const char* name) {
  const auto values = floats_attribute(info, name);
  return std::vector<double>(values.begin(), values.end());
}

// A tensor's element type and dimensions.
struct TensorInfo {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
  int64_t numel() const {
    int64_t n = 1;
    for (const int64_t d : dims) n *= d;
    return n;
  }
};

TensorInfo tensor_info(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check_status(g_api->GetTensorTypeAndShape(value, &info));
  TensorInfo result;
  size_t count = 0;
  OrtStatus* status = g_api->GetTensorElementType(info, &result.type);
  if (status == nullptr) status = g_api->GetDimensionsCount(info, &count);
  if (status == nullptr) {
    result.dims.resize(count);
    status = g_api->GetDimensions(info, result.dims.data(), count);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  check_status(status);
  return result;
}

const float* float_data(const OrtValue* value) {
  void* data = nullptr;
  check_status(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  return static_cast<const float*>(data);
}

// The pool of kernel_support.h on onnxruntime's intra-op threads: each of `count` tasks is one item of
// KernelContext_ParallelFor, in as many batches (the kernel sizes its tasks for the threads itself).
struct OrtPool {
  struct Thunk {
    void (*task)(void*, int64_t);
    void* state;
  };

  static void run(void* context, int64_t count, void (*task)(void*, int64_t), void* state) {
    Thunk thunk{task, state};
    check_status(g_api->KernelContext_ParallelFor(
        static_cast<const OrtKernelContext*>(context),
        [](void* opaque, size_t i) {
          const Thunk& t = *static_cast<const Thunk*>(opaque);
          t.task(t.state, static_cast<int64_t>(i));
        },
        static_cast<size_t>(count), static_cast<size_t>(count), &thunk));
  }
};

// timm_sortconv::grid.centre_grid_residues: the residue of one axis that the centring takes away (0: none).
int64_t centre_residue(int64_t size, int64_t kernel_size, int64_t stride, int64_t pad, int64_t dilation,
                       int64_t min_size) {
  const int64_t span = size + 2 * pad - dilation * (kernel_size - 1) - 1;
  if (stride == 1 || span < 0) return 0;
  const int64_t excess = span % stride;
  return size - excess < min_size ? 0 : excess;
}

class SortConvKernel {
 public:
  SortConvKernel(const OrtKernelInfo* info, int64_t threads) : threads_(threads) {
    kernel_size_ = int_attribute(info, "kernel_size");
    TIMM_SORTCONV_CHECK(kernel_size_ >= 1 && kernel_size_ <= 15, "timm_sortconv::SortConv2d: kernel_size ",
                        kernel_size_, " is outside 1..15");
    const int64_t slots = kernel_size_ * kernel_size_;
    group_ = int_attribute(info, "group");
    TIMM_SORTCONV_CHECK(group_ >= 1, "timm_sortconv::SortConv2d: group must be >= 1");
    const auto strides = ints_attribute(info, "strides", 2), dilations = ints_attribute(info, "dilations", 2);
    const auto pads = ints_attribute(info, "pads", 4);  // top, left, bottom, right
    strides_ = {strides[0], strides[1]};
    dilations_ = {dilations[0], dilations[1]};
    pad_ = {pads[1], pads[3], pads[0], pads[2]};  // the kernel's left, right, top, bottom
    centre_ = int_attribute_or(info, "centre", 0) != 0;
    centre_min_size_ = int_attribute_or(info, "centre_min_size", 1);
    taps_ = int_attribute(info, "taps");
    TIMM_SORTCONV_CHECK(taps_ >= 1, "timm_sortconv::SortConv2d: taps must be >= 1");
    tap_offsets_ = ints_attribute(info, "tap_offsets", static_cast<size_t>(slots * taps_ * 2));
    const auto weights = floats_attribute(info, "tap_weights");
    TIMM_SORTCONV_CHECK(static_cast<int64_t>(weights.size()) == slots * taps_, "timm_sortconv::SortConv2d: ",
                        "tap_weights has ", weights.size(), " values, expected k*k*taps = ", slots * taps_);
    tap_weights_.assign(weights.begin(), weights.end());
    segments_ = ints_attribute(info, "segments");
    TIMM_SORTCONV_CHECK(!segments_.empty() && segments_.size() % 2 == 0,
                        "timm_sortconv::SortConv2d: segments must be [start, end) pairs");
    const auto comparators = ints_attribute(info, "comparators");
    TIMM_SORTCONV_CHECK(comparators.size() % 2 == 0, "timm_sortconv::SortConv2d: comparators must be pairs");
    for (const int64_t slot : comparators) {
      TIMM_SORTCONV_CHECK(slot >= 0 && slot < slots, "timm_sortconv::SortConv2d: a comparator's slot ", slot,
                          " is outside 0..", slots - 1);
      comparators_.push_back(static_cast<int32_t>(slot));
    }
    slot_to_grid_ = ints_attribute(info, "slot_to_grid", static_cast<size_t>(slots));
    std::vector<bool> seen(slots, false);
    for (const int64_t position : slot_to_grid_) {
      TIMM_SORTCONV_CHECK(position >= 0 && position < slots && !seen[position],
                          "timm_sortconv::SortConv2d: slot_to_grid must be a permutation of 0..", slots - 1);
      seen[position] = true;
    }
    const std::string sorting = string_attribute(info, "sorting");
    aligned_ = sorting == "align" || sorting == "align-channel";
    if (aligned_) {
      align_.guides = int_attribute_or(info, "guides", 0);
      align_.shared = int_attribute(info, "shared") != 0;
      align_.relative = float_attribute(info, "relative");
      align_.tiny = float_attribute(info, "tiny");
      align_.fold = doubles_attribute(info, "fold");
      align_.dft = doubles_attribute(info, "dft");
      align_.blocks = ints_attribute(info, "blocks");
      align_.pairs = ints_attribute(info, "pairs");
      align_.fixed = ints_attribute(info, "fixed");
      align_.first = doubles_attribute(info, "first");
      align_.energy_pairs = doubles_attribute(info, "energy_pairs");
      align_.energy_fixed = doubles_attribute(info, "energy_fixed");
      align_.weight_scale = doubles_attribute(info, "weight_scale");
      align_.guide_first = doubles_attribute(info, "guide_first");
      TIMM_SORTCONV_CHECK(comparators_.empty(), "timm_sortconv::SortConv2d: an aligned node sorts nothing");
    }
    // The plan of a small input checks the tables once, here, where a bad node fails at session creation.
    plan_for(kernel_size_ * dilations_[0], kernel_size_ * dilations_[1], false);

    // A constant weight (an initializer) is packed once for all calls (the aligned kernel's per plan: its tables
    // depend on the plan).
    int is_constant = 0;
    const OrtValue* weight = nullptr;
    check_status(g_api->KernelInfoGetConstantInput_tensor(info, 1, &is_constant, &weight));
    if (is_constant != 0 && weight != nullptr) {
      const TensorInfo w = tensor_info(weight);
      check_weight(w);
      weight_shape_ = w.dims;
      constant_weight_.assign(float_data(weight), float_data(weight) + w.numel());
      if (!aligned_) {
        packed_weight_.resize(w.numel());
        pack(constant_weight_.data(), w.dims, packed_weight_.data());
      }
    }
  }

  void compute(OrtKernelContext* context) {
    size_t inputs = 0;
    check_status(g_api->KernelContext_GetInputCount(context, &inputs));
    const OrtValue* x_value = nullptr;
    const OrtValue* w_value = nullptr;
    const OrtValue* b_value = nullptr;
    check_status(g_api->KernelContext_GetInput(context, 0, &x_value));
    check_status(g_api->KernelContext_GetInput(context, 1, &w_value));
    if (inputs > 2) check_status(g_api->KernelContext_GetInput(context, 2, &b_value));
    const TensorInfo x = tensor_info(x_value), w = tensor_info(w_value);
    TIMM_SORTCONV_CHECK(x.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && x.dims.size() == 4,
                        "timm_sortconv::SortConv2d: X must be a 4-D float32 tensor (N, C, H, W)");
    check_weight(w);
    const int64_t batch = x.dims[0], channels = x.dims[1], out_channels = w.dims[0];
    const int64_t guides = aligned_ ? align_.guides : 0;
    TIMM_SORTCONV_CHECK(channels % group_ == 0 && (w.dims[1] + guides) * group_ == channels,
                        "timm_sortconv::SortConv2d: X has ", channels, " channels, W expects ",
                        (w.dims[1] + guides) * group_, " (", w.dims[1], " per group and ", guides,
                        " guide, group = ", group_, ")");
    const float* bias = nullptr;
    if (b_value != nullptr) {
      const TensorInfo b = tensor_info(b_value);
      TIMM_SORTCONV_CHECK(b.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && b.numel() == out_channels,
                          "timm_sortconv::SortConv2d: B must hold ", out_channels, " float32 values");
      bias = float_data(b_value);
    }

    const timm_sortconv_host::Pool pool{threads_, context, &OrtPool::run};
    const timm_sortconv_host::PoolScope scope(&pool);
    const float* input = float_data(x_value);
    int64_t height = x.dims[2], width = x.dims[3];
    std::vector<float> centred;
    if (centre_) input = centre(input, batch * channels, height, width, centred);
    // With fewer images than threads each thread would copy whole images to read a part of each (the kernel pads
    // while copying): the input is padded once here instead, as cpu_backend.py does for PyTorch.
    const bool pad_here = batch < threads_ && std::any_of(pad_.begin(), pad_.end(), [](int64_t p) { return p > 0; });
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
    const std::shared_ptr<PlanState> state = plan_for(height, width, pad_here);
    const Plan<float>& plan = state->plan;

    const std::array<int64_t, 4> out_dims{batch, out_channels, plan.out_h, plan.out_w};
    OrtValue* y_value = nullptr;
    check_status(g_api->KernelContext_GetOutput(context, 0, out_dims.data(), out_dims.size(), &y_value));
    void* y_data = nullptr;
    check_status(g_api->GetTensorMutableData(y_value, &y_data));
    if (batch == 0 || out_channels == 0) return;
    float* out = static_cast<float*>(y_data);
    const Shape shape{batch, channels - guides * group_, out_channels, group_};
    const bool constant = !constant_weight_.empty() && weight_shape_ == w.dims;

    if (aligned_) {
      std::vector<float> packed_here;
      const float* packed = nullptr;
      if (constant) {
        std::lock_guard<std::mutex> guard(state->lock);
        if (state->packed.empty()) {
          state->packed.resize(w.numel());
          harmonic_weight_into<float>(plan, state->tables, shape, constant_weight_.data(), slot_to_grid_, true,
                                      state->packed.data());
        }
        packed = state->packed.data();
      } else {
        packed_here.resize(w.numel());
        harmonic_weight_into<float>(plan, state->tables, shape, float_data(w_value), slot_to_grid_, true,
                                    packed_here.data());
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
      packed_here.resize(w.numel());
      pack(float_data(w_value), w.dims, packed_here.data());
      packed = packed_here.data();
    }
    run_forward<float>(plan, shape, input, packed, nullptr, bias, out, true);
  }

 private:
  // A plan per input size, with the aligned kernel's tables (they depend on the plan) and its harmonic weight.
  struct PlanState {
    Plan<float> plan;
    AlignTables<float> tables;
    std::mutex lock;
    std::vector<float> packed;
  };

  void check_weight(const TensorInfo& w) const {
    TIMM_SORTCONV_CHECK(w.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && w.dims.size() == 4 &&
                            w.dims[2] == kernel_size_ && w.dims[3] == kernel_size_,
                        "timm_sortconv::SortConv2d: W must be a float32 (O, C/group, k, k) tensor with k = ",
                        kernel_size_);
    TIMM_SORTCONV_CHECK(w.dims[0] % group_ == 0, "timm_sortconv::SortConv2d: group ", group_,
                        " does not divide W's ", w.dims[0], " output channels");
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

  int64_t threads_;
  int64_t kernel_size_ = 0, group_ = 1, taps_ = 0, centre_min_size_ = 1;
  bool centre_ = false, aligned_ = false;
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

// OrtCustomOp's callbacks. Errors never cross the C API as exceptions: they become an OrtStatus.
OrtStatus* error_status(const char* message) { return g_api->CreateStatus(ORT_RUNTIME_EXCEPTION, message); }

// An int or ints attribute of the node being shape-inferred.
std::vector<int64_t> inferred_ints(const OrtShapeInferContext* context, const char* name, OrtOpAttrType type,
                                   size_t count) {
  const OrtOpAttr* attribute = nullptr;
  check_status(g_api->ShapeInferContext_GetAttribute(context, name, &attribute));
  TIMM_SORTCONV_CHECK(attribute != nullptr, "timm_sortconv::SortConv2d: the node has no attribute '", name, "'");
  std::vector<int64_t> values(count);
  size_t bytes = 0;
  check_status(g_api->ReadOpAttr(attribute, type, values.data(), count * sizeof(int64_t), &bytes));
  TIMM_SORTCONV_CHECK(bytes == count * sizeof(int64_t), "timm_sortconv::SortConv2d: attribute '", name, "' has ",
                      bytes / sizeof(int64_t), " values, expected ", count);
  return values;
}

// A symbolic size that no other size shares: onnxruntime takes two sizes of one name to be equal.
std::string unknown_size_name() {
  static std::atomic<int64_t> count{0};
  return "timm_sortconv_size_" + std::to_string(count++);
}

// Y's shape from X's and W's: (N, O, Ho, Wo), N symbolic as X's; a size unknown where an input's is. With the shapes
// known, onnxruntime plans the memory of the nodes after this one as for a convolution.
void infer_output_shape(const OrtShapeInferContext* context) {
  OrtTensorTypeAndShapeInfo* x_info = nullptr;
  OrtTensorTypeAndShapeInfo* w_info = nullptr;
  check_status(g_api->ShapeInferContext_GetInputTypeShape(context, 0, &x_info));
  std::vector<int64_t> x(4, -1), w(4, -1);
  std::vector<const char*> symbols(4, "");
  size_t rank = 0;
  OrtStatus* status = g_api->GetDimensionsCount(x_info, &rank);
  if (status == nullptr && rank == 4) status = g_api->GetDimensions(x_info, x.data(), 4);
  if (status == nullptr && rank == 4) status = g_api->GetSymbolicDimensions(x_info, symbols.data(), 4);
  const std::string batch_symbol = symbols[0] != nullptr ? symbols[0] : "";
  check_status(status);  // (the context owns the inputs' infos)
  TIMM_SORTCONV_CHECK(rank == 4, "timm_sortconv::SortConv2d: X must be 4-D (N, C, H, W), got ", rank, " dimensions");
  check_status(g_api->ShapeInferContext_GetInputTypeShape(context, 1, &w_info));
  status = g_api->GetDimensionsCount(w_info, &rank);
  if (status == nullptr && rank == 4) status = g_api->GetDimensions(w_info, w.data(), 4);
  check_status(status);
  TIMM_SORTCONV_CHECK(rank == 4, "timm_sortconv::SortConv2d: W must be 4-D (O, C/group, k, k)");

  const int64_t k = inferred_ints(context, "kernel_size", ORT_OP_ATTR_INT, 1)[0];
  const auto strides = inferred_ints(context, "strides", ORT_OP_ATTR_INTS, 2);
  const auto dilations = inferred_ints(context, "dilations", ORT_OP_ATTR_INTS, 2);
  const auto pads = inferred_ints(context, "pads", ORT_OP_ATTR_INTS, 4);  // top, left, bottom, right
  std::vector<int64_t> y{x[0], w[0], -1, -1};
  for (int axis = 0; axis < 2; ++axis) {
    const int64_t size = x[2 + axis];
    if (size < 0) continue;
    const int64_t span = size + pads[axis] + pads[2 + axis] - dilations[axis] * (k - 1) - 1;
    TIMM_SORTCONV_CHECK(span >= 0 && strides[axis] >= 1, "timm_sortconv::SortConv2d: X's ", axis ? "width " : "height ",
                        size, " is smaller than the dilated kernel");
    y[2 + axis] = span / strides[axis] + 1;
  }
  // A size not known is named, by X's batch symbol or a name of its own (a -1 would read as a size).
  std::string names[4];
  const char* y_symbols[4];
  for (int i = 0; i < 4; ++i) {
    if (y[i] < 0) names[i] = i == 0 && !batch_symbol.empty() ? batch_symbol : unknown_size_name();
    y_symbols[i] = names[i].c_str();
  }
  OrtTensorTypeAndShapeInfo* y_info = nullptr;
  check_status(g_api->CreateTensorTypeAndShapeInfo(&y_info));
  status = g_api->SetTensorElementType(y_info, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (status == nullptr) status = g_api->SetDimensions(y_info, y.data(), 4);
  if (status == nullptr) status = g_api->SetSymbolicDimensions(y_info, y_symbols, 4);
  if (status == nullptr) status = g_api->ShapeInferContext_SetOutputTypeShape(context, 0, y_info);
  g_api->ReleaseTensorTypeAndShapeInfo(y_info);
  check_status(status);
}

struct SortConvOp : OrtCustomOp {
  int64_t threads;

  explicit SortConvOp(int64_t threads_) : OrtCustomOp{}, threads(threads_) {
    version = ORT_API_VERSION;
    GetName = [](const OrtCustomOp*) { return kOpName; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
    GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 3; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t index) {
      return index == 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info,
                        void** kernel) -> OrtStatus* {
      try {
        *kernel = new SortConvKernel(info, static_cast<const SortConvOp*>(op)->threads);
        return nullptr;
      } catch (const std::exception& error) {
        return error_status(error.what());
      }
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) -> OrtStatus* {
      try {
        static_cast<SortConvKernel*>(kernel)->compute(context);
        return nullptr;
      } catch (const std::exception& error) {
        return error_status(error.what());
      }
    };
    KernelDestroy = [](void* kernel) { delete static_cast<SortConvKernel*>(kernel); };
    InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatus* {
      try {
        infer_output_shape(context);
        return nullptr;
      } catch (const std::exception& error) {
        return error_status(error.what());
      }
    };
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 1; };
  }
};

// The session's threads for the op: kThreadsKey if the options hold it, else the machine's hardware threads (as many
// as onnxruntime's default pool, or more: extra parts then run one after another).
int64_t configured_threads(const OrtSessionOptions* options) {
  int has = 0;
  OrtStatus* status = g_api->HasSessionConfigEntry(options, kThreadsKey, &has);
  if (status == nullptr && has != 0) {
    char value[32] = {0};
    size_t size = sizeof(value);
    status = g_api->GetSessionConfigEntry(options, kThreadsKey, value, &size);
    if (status == nullptr) {
      const long long threads = std::strtoll(value, nullptr, 10);
      if (threads >= 1) return threads;
    }
  }
  if (status != nullptr) g_api->ReleaseStatus(status);
  return std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
}

// Every registration's op and domain live as long as the library: a session may outlive its options.
std::mutex g_registry_lock;
std::vector<std::unique_ptr<SortConvOp>> g_ops;

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // (cannot report: an onnxruntime older than these headers)
  g_api = api;
  try {
    std::lock_guard<std::mutex> guard(g_registry_lock);
    g_ops.push_back(std::make_unique<SortConvOp>(configured_threads(options)));
    OrtCustomOpDomain* domain = nullptr;
    check_status(api->CreateCustomOpDomain(kDomain, &domain));
    check_status(api->CustomOpDomain_Add(domain, g_ops.back().get()));
    check_status(api->AddCustomOpDomain(options, domain));
    return nullptr;
  } catch (const std::exception& error) {
    return api->CreateStatus(ORT_FAIL, error.what());
  }
}
