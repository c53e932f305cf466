// An OpenVINO extension: the ONNX node timm_sortconv::SortConv2d (timm_sortconv/onnx/fused.py writes it) as an
// OpenVINO operation whose evaluate runs the package's kernels (../runtime_layer.h: the same layer as the onnxruntime
// operator, built here without libtorch). timm_sortconv/onnx/openvino.py builds it against the headers and library of
// the openvino wheel; core.add_extension(path) loads it (OPENVINO_CREATE_EXTENSIONS below), and the ONNX frontend then
// converts each node into the operation (convert: its attributes read by name, the optional ones at their defaults),
// so that the fused file runs in OpenVINO as it runs in onnxruntime with the library registered.
//
// OpenVINO's CPU plugin runs an operation of an extension through its evaluate, called on one of its threads; the
// kernel's parallel loops run as TBB tasks in the arena of that thread (the plugin's, which INFERENCE_NUM_THREADS
// sizes), as the plugin's own nodes do.
#define TIMM_SORTCONV_STANDALONE 1

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/node_context.hpp>
#include <openvino/frontend/onnx/extension/conversion.hpp>
#include <openvino/op/constant.hpp>
#include <openvino/op/op.hpp>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "../runtime_layer.h"

namespace {

// The pool of kernel_support.h as TBB tasks in the calling thread's arena.
struct TbbPool {
  static void run(void*, int64_t count, void (*task)(void*, int64_t), void* state) {
    tbb::parallel_for(int64_t(0), count, [&](int64_t i) { task(state, i); });
  }
};

class SortConv2d : public ov::op::Op {
 public:
  OPENVINO_OP("SortConv2d", "timm_sortconv");

  SortConv2d() = default;
  SortConv2d(const ov::OutputVector& inputs, timm_sortconv_runtime::LayerAttributes attributes)
      : Op(inputs), attributes_(std::move(attributes)) {
    constructor_validate_and_infer_types();
  }

  void validate_and_infer_types() override {
    const auto& x = get_input_partial_shape(0);
    const auto& w = get_input_partial_shape(1);
    if (x.rank().is_dynamic() || w.rank().is_dynamic() || attributes_.kernel_size == 0) {
      set_output_type(0, get_input_element_type(0), ov::PartialShape::dynamic(4));
      return;
    }
    std::vector<int64_t> xs(4, -1), ws(4, -1);
    for (size_t i = 0; i < 4; ++i) {
      if (x[i].is_static()) xs[i] = x[i].get_length();
      if (w[i].is_static()) ws[i] = w[i].get_length();
    }
    ov::PartialShape y(std::vector<ov::Dimension>(4));
    y[0] = x[0];
    y[1] = w[0];
    const auto& a = attributes_;
    for (int axis = 0; axis < 2; ++axis) {
      const int64_t size = timm_sortconv_runtime::output_size(xs[2 + axis], a.kernel_size, a.strides[axis],
                                                              a.pads[axis] + a.pads[2 + axis], a.dilations[axis]);
      y[2 + axis] = size < 0 ? ov::Dimension::dynamic() : ov::Dimension(size);
    }
    set_output_type(0, get_input_element_type(0), y);
  }

  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& inputs) const override {
    return std::make_shared<SortConv2d>(inputs, attributes_);
  }

  bool visit_attributes(ov::AttributeVisitor& visitor) override {
    auto& a = attributes_;
    visitor.on_attribute("kernel_size", a.kernel_size);
    visitor.on_attribute("group", a.group);
    visitor.on_attribute("strides", a.strides);
    visitor.on_attribute("dilations", a.dilations);
    visitor.on_attribute("pads", a.pads);
    visitor.on_attribute("centre", a.centre);
    visitor.on_attribute("centre_min_size", a.centre_min_size);
    visitor.on_attribute("taps", a.taps);
    visitor.on_attribute("tap_offsets", a.tap_offsets);
    visitor.on_attribute("tap_weights", a.tap_weights);
    visitor.on_attribute("segments", a.segments);
    visitor.on_attribute("comparators", a.comparators);
    visitor.on_attribute("slot_to_grid", a.slot_to_grid);
    visitor.on_attribute("sampling", a.sampling);
    visitor.on_attribute("sorting", a.sorting);
    visitor.on_attribute("activation", a.activation);
    visitor.on_attribute("guides", a.guides);
    visitor.on_attribute("shared", a.shared);
    visitor.on_attribute("relative", a.relative);
    visitor.on_attribute("tiny", a.tiny);
    for (const auto& [name, values] : {std::pair<const char*, std::vector<float>*>{"fold", &a.fold}, {"dft", &a.dft},
                                      {"first", &a.first}, {"energy_pairs", &a.energy_pairs},
                                      {"energy_fixed", &a.energy_fixed}, {"weight_scale", &a.weight_scale},
                                      {"guide_first", &a.guide_first}}) {
      visitor.on_attribute(name, *values);
    }
    visitor.on_attribute("blocks", a.blocks);
    visitor.on_attribute("pairs", a.pairs);
    visitor.on_attribute("fixed", a.fixed);
    return true;
  }

  bool has_evaluate() const override { return get_input_element_type(0) == ov::element::f32; }

  bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
    timm_sortconv_runtime::Layer& layer = this->layer();
    const auto dims = [](const ov::Tensor& tensor) {
      const ov::Shape shape = tensor.get_shape();
      return std::vector<int64_t>(shape.begin(), shape.end());
    };
    const std::vector<int64_t> x = dims(inputs[0]), w = dims(inputs[1]);
    const auto y = layer.output_dims(x, w);
    outputs[0].set_shape(ov::Shape(y.begin(), y.end()));
    const float* bias = inputs.size() > 2 && inputs[2] ? inputs[2].data<const float>() : nullptr;
    const float* sum = nullptr;
    if (inputs.size() > 3 && inputs[3]) {
      timm_sortconv_runtime::Layer::check_sum(dims(inputs[3]), y);
      sum = inputs[3].data<const float>();
    }
    const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
    const timm_sortconv_host::Pool pool{threads, nullptr, &TbbPool::run};
    const timm_sortconv_host::PoolScope scope(&pool);
    layer.forward(inputs[0].data<const float>(), x, inputs[1].data<const float>(), w, bias, sum,
                  outputs[0].data<float>(), threads);
    return true;
  }

 private:
  // The layer, made on first use (the attributes are complete only once the frontend has visited them), with the
  // weight packed once where it is a constant of the model.
  timm_sortconv_runtime::Layer& layer() const {
    std::lock_guard<std::mutex> guard(lock_);
    if (!layer_) {
      layer_ = std::make_unique<timm_sortconv_runtime::Layer>(attributes_);
      const auto constant = ov::as_type_ptr<ov::op::v0::Constant>(input_value(1).get_node_shared_ptr());
      if (constant && constant->get_element_type() == ov::element::f32) {
        const ov::Shape shape = constant->get_shape();
        layer_->set_constant_weight(constant->get_data_ptr<float>(), std::vector<int64_t>(shape.begin(), shape.end()));
      }
    }
    return *layer_;
  }

  timm_sortconv_runtime::LayerAttributes attributes_;
  mutable std::mutex lock_;
  mutable std::unique_ptr<timm_sortconv_runtime::Layer> layer_;
};

// An attribute of the ONNX node, or `fallback` where the node has none (or an empty list, which the frontend does not
// read as one). The frontend holds ONNX floats as doubles.
template <typename T>
T attribute(const ov::frontend::NodeContext& node, const char* name, const T& fallback) {
  try {
    return node.has_attribute(name) ? node.get_attribute<T>(name) : fallback;
  } catch (const ov::Exception&) {
    return fallback;
  }
}

std::vector<float> floats(const ov::frontend::NodeContext& node, const char* name) {
  const auto values = attribute<std::vector<double>>(node, name, {});
  return std::vector<float>(values.begin(), values.end());
}

// The ONNX frontend's conversion of a timm_sortconv::SortConv2d node.
ov::OutputVector convert(const ov::frontend::NodeContext& node) {
  using Ints = std::vector<int64_t>;
  using Floats = std::vector<float>;
  timm_sortconv_runtime::LayerAttributes a;
  a.kernel_size = attribute<int64_t>(node, "kernel_size", 0);
  a.group = attribute<int64_t>(node, "group", 1);
  a.strides = attribute<Ints>(node, "strides", {1, 1});
  a.dilations = attribute<Ints>(node, "dilations", {1, 1});
  a.pads = attribute<Ints>(node, "pads", {0, 0, 0, 0});
  a.centre = attribute<int64_t>(node, "centre", 0);
  a.centre_min_size = attribute<int64_t>(node, "centre_min_size", 1);
  a.taps = attribute<int64_t>(node, "taps", 0);
  a.tap_weights = floats(node, "tap_weights");
  a.sampling = attribute<std::string>(node, "sampling", "");
  a.sorting = attribute<std::string>(node, "sorting", "");
  a.activation = attribute<std::string>(node, "activation", "");
  a.guides = attribute<int64_t>(node, "guides", 0);
  a.shared = attribute<int64_t>(node, "shared", 1);
  a.relative = static_cast<float>(attribute<double>(node, "relative", 0.0));
  a.tiny = static_cast<float>(attribute<double>(node, "tiny", 0.0));
  for (const auto& [name, values] : {std::pair<const char*, Ints*>{"tap_offsets", &a.tap_offsets},
                                    {"segments", &a.segments}, {"comparators", &a.comparators},
                                    {"slot_to_grid", &a.slot_to_grid}, {"blocks", &a.blocks}, {"pairs", &a.pairs},
                                    {"fixed", &a.fixed}}) {
    *values = attribute<Ints>(node, name, {});
  }
  for (const auto& [name, values] : {std::pair<const char*, Floats*>{"fold", &a.fold}, {"dft", &a.dft},
                                    {"first", &a.first}, {"energy_pairs", &a.energy_pairs},
                                    {"energy_fixed", &a.energy_fixed}, {"weight_scale", &a.weight_scale},
                                    {"guide_first", &a.guide_first}}) {
    *values = floats(node, name);
  }
  timm_sortconv_runtime::Layer check(a);  // a bad node fails here, when OpenVINO reads the model
  ov::OutputVector inputs;
  for (size_t i = 0; i < node.get_input_size(); ++i) inputs.push_back(node.get_input(static_cast<int>(i)));
  return std::make_shared<SortConv2d>(inputs, std::move(a))->outputs();
}

}  // namespace

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>(
    {std::make_shared<ov::OpExtension<SortConv2d>>(),
     std::make_shared<ov::frontend::onnx::ConversionExtension>("SortConv2d", "timm_sortconv", convert)}));
