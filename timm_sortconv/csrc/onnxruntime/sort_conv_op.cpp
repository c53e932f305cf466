// An onnxruntime custom-operator library: the node timm_sortconv::SortConv2d, the forward of one SC layer, computed
// by the kernels that PyTorch's CPU backend runs (../sort_conv_kernel.h, ../align_conv_kernel.h, built here without
// libtorch: TIMM_SORTCONV_STANDALONE, see ../kernel_support.h). timm_sortconv/onnx/runtime.py builds it; onnxruntime
// loads it with SessionOptions.register_custom_ops_library(path), which calls RegisterCustomOps below. Only
// onnxruntime's C API is used (its header, ../third_party/onnxruntime, no library to link: the functions come through
// the OrtApi table), at ORT_API_VERSION of the header, which every later onnxruntime serves.
//
// The node (timm_sortconv/onnx/fused.py writes it):
//   inputs   X (N, C, H, W) float32; W (O, C/group, k, k) float32, the layer's weight in grid order; B (O,) optional;
//            S (N, O, Ho, Wo) optional, added to the output before the activation (a residual Add merged)
//   output   Y (N, O, Ho, Wo) float32
//   attributes (the geometry as timm_sortconv/ops/geometry.py computes it, which is the only place it is computed)
//     kernel_size k; strides, dilations [h, w]; group; pads [top, left, bottom, right] zeros (ONNX Conv's order);
//     taps T; tap_offsets (k*k * T * 2) ints: per sample (slot order) and tap, (dy, dx) from window pixel k / 2;
//     tap_weights (k*k * T) floats (0: no tap); segments (2 * n) ints: [start, end) slots sorted together;
//     comparators (2 * m) ints: (lo, hi) pairs, segment after segment; slot_to_grid (k*k) ints: the weight's grid
//     position of each slot; sampling, sorting: strings ("align" and "align-channel" choose the aligned kernel);
//     centre, centre_min_size (optional, 0): the input's grid centred first, as timm_sortconv.grid.centre_grid does
//     (read half a pixel on where a strided axis's residue is odd, then cropped by half of it on each side; the
//     output's size is unchanged), so that a centred strided layer is one node; activation (optional string, ""):
//     "Relu" rectifies the output as it is stored, a ReLU that alone read the layer's output merged into the node;
//   the aligned variants' attributes besides (cpu_backend.align_kernel_tables computes them): guides (0 or 1 guide
//     channel after each group's weighted ones, in X only), shared, relative, tiny, fold, dft (k*k * k*k floats),
//     blocks, pairs, fixed (ints), first, energy_pairs, energy_fixed, weight_scale, guide_first (floats).
//
// Per node a timm_sortconv_runtime::Layer (../runtime_layer.h, shared with the OpenVINO extension) holds the
// attributes, the weight packed once where it is a constant initializer (in slot order, each panel chunk's register
// tiles contiguous: tile_forward_weights, which measured 20% faster for ri_resnet18 at batch 1 than the row layout
// PyTorch's path packs per call, the same products in the same order), and the kernel's plan per input size (built
// on first use of a size). The node infers Y's shape, so that onnxruntime
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

#include "../runtime_layer.h"

namespace {

constexpr const char* kDomain = "timm_sortconv";
constexpr const char* kOpName = "SortConv2d";
constexpr const char* kThreadsKey = "custom_op.SortConv2d.intra_op_num_threads";
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

// The node's attributes as the layer takes them (the optional ones at their defaults where the node has none).
timm_sortconv_runtime::LayerAttributes read_attributes(const OrtKernelInfo* info) {
  timm_sortconv_runtime::LayerAttributes a;
  a.kernel_size = int_attribute(info, "kernel_size");
  a.group = int_attribute(info, "group");
  a.strides = ints_attribute(info, "strides", 2);
  a.dilations = ints_attribute(info, "dilations", 2);
  a.pads = ints_attribute(info, "pads", 4);
  a.centre = int_attribute_or(info, "centre", 0);
  a.centre_min_size = int_attribute_or(info, "centre_min_size", 1);
  a.taps = int_attribute(info, "taps");
  a.tap_offsets = ints_attribute(info, "tap_offsets");
  a.tap_weights = floats_attribute(info, "tap_weights");
  a.segments = ints_attribute(info, "segments");
  a.comparators = ints_attribute(info, "comparators");
  a.slot_to_grid = ints_attribute(info, "slot_to_grid");
  a.sorting = string_attribute(info, "sorting");
  a.activation = string_attribute(info, "activation");  // (optional: "" where the node has none)
  if (a.sorting == "align" || a.sorting == "align-channel") {
    a.guides = int_attribute_or(info, "guides", 0);
    a.shared = int_attribute(info, "shared");
    a.relative = float_attribute(info, "relative");
    a.tiny = float_attribute(info, "tiny");
    for (const auto& [name, values] : {std::pair<const char*, std::vector<float>*>{"fold", &a.fold}, {"dft", &a.dft},
                                      {"first", &a.first}, {"energy_pairs", &a.energy_pairs},
                                      {"energy_fixed", &a.energy_fixed}, {"weight_scale", &a.weight_scale},
                                      {"guide_first", &a.guide_first}}) {
      *values = floats_attribute(info, name);
    }
    a.blocks = ints_attribute(info, "blocks");
    a.pairs = ints_attribute(info, "pairs");
    a.fixed = ints_attribute(info, "fixed");
  }
  return a;
}

class SortConvKernel {
 public:
  SortConvKernel(const OrtKernelInfo* info, int64_t threads) : threads_(threads), layer_(read_attributes(info)) {
    // A constant weight (an initializer) is packed once for all calls.
    int is_constant = 0;
    const OrtValue* weight = nullptr;
    check_status(g_api->KernelInfoGetConstantInput_tensor(info, 1, &is_constant, &weight));
    if (is_constant != 0 && weight != nullptr) {
      const TensorInfo w = tensor_info(weight);
      check_float(w, "W");
      layer_.set_constant_weight(float_data(weight), w.dims);
    }
  }

  void compute(OrtKernelContext* context) {
    size_t inputs = 0;
    check_status(g_api->KernelContext_GetInputCount(context, &inputs));
    const OrtValue* x_value = nullptr;
    const OrtValue* w_value = nullptr;
    const OrtValue* b_value = nullptr;
    const OrtValue* s_value = nullptr;
    check_status(g_api->KernelContext_GetInput(context, 0, &x_value));
    check_status(g_api->KernelContext_GetInput(context, 1, &w_value));
    if (inputs > 2) check_status(g_api->KernelContext_GetInput(context, 2, &b_value));
    if (inputs > 3) check_status(g_api->KernelContext_GetInput(context, 3, &s_value));
    const TensorInfo x = tensor_info(x_value), w = tensor_info(w_value);
    check_float(x, "X");
    check_float(w, "W");
    TIMM_SORTCONV_CHECK(x.dims.size() == 4 && w.dims.size() == 4,
                        "timm_sortconv::SortConv2d: X must be (N, C, H, W) and W (O, C/group, k, k)");
    const float* bias = nullptr;
    if (b_value != nullptr) {
      const TensorInfo b = tensor_info(b_value);
      TIMM_SORTCONV_CHECK(b.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && b.numel() == w.dims[0],
                          "timm_sortconv::SortConv2d: B must hold ", w.dims[0], " float32 values");
      bias = float_data(b_value);
    }
    const std::array<int64_t, 4> out_dims = layer_.output_dims(x.dims, w.dims);
    const float* sum = nullptr;
    if (s_value != nullptr) {
      const TensorInfo s = tensor_info(s_value);
      check_float(s, "S");
      timm_sortconv_runtime::Layer::check_sum(s.dims, out_dims);
      sum = float_data(s_value);
    }
    OrtValue* y_value = nullptr;
    check_status(g_api->KernelContext_GetOutput(context, 0, out_dims.data(), out_dims.size(), &y_value));
    void* y_data = nullptr;
    check_status(g_api->GetTensorMutableData(y_value, &y_data));
    const timm_sortconv_host::Pool pool{threads_, context, &OrtPool::run};
    const timm_sortconv_host::PoolScope scope(&pool);
    layer_.forward(float_data(x_value), x.dims, float_data(w_value), w.dims, bias, sum, static_cast<float*>(y_data),
                   threads_);
  }

 private:
  static void check_float(const TensorInfo& tensor, const char* name) {
    TIMM_SORTCONV_CHECK(tensor.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "timm_sortconv::SortConv2d: ", name,
                        " must be float32");
  }

  int64_t threads_;
  timm_sortconv_runtime::Layer layer_;
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
    y[2 + axis] = timm_sortconv_runtime::output_size(x[2 + axis], k, strides[axis], pads[axis] + pads[2 + axis],
                                                     dilations[axis]);
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
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t index) {
      return index >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
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
