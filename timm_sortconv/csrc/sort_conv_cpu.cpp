// Python bindings of the fused Sorting Convolution for CPU (the kernel: sort_conv_kernel.h).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "sort_conv_cpu.h"

namespace {

using timm_sortconv_cpu::Call;

// The weight as the kernel reads it, (O, C/g * k*k): a 4-D (O, C/g, k, k) weight, which must be in grid order
// (with slot_to_grid), is that matrix in memory; taking it here spares the caller a reshape from Python.
at::Tensor weight_matrix(const at::Tensor& weight, const c10::optional<at::Tensor>& slot_to_grid) {
  if (weight.dim() != 4) return weight;
  TORCH_CHECK(slot_to_grid.has_value(), "sort_conv_cpu: a 4-D weight is in grid order and needs slot_to_grid");
  return weight.reshape({weight.size(0), -1});
}

// The backward's (grad_input, grad_weight) with grad_weight in the shape of the weight the caller gave.
std::vector<at::Tensor> in_weight_shape(std::vector<at::Tensor> grads, const at::Tensor& weight) {
  if (grads.size() > 1 && grads[1].defined() && weight.dim() == 4) grads[1] = grads[1].view(weight.sizes());
  return grads;
}

at::Tensor sort_conv_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& tap_offsets,
                             const at::Tensor& tap_weights, const at::Tensor& segments, const at::Tensor& comparators,
                             int64_t kernel_size, int64_t stride_h, int64_t stride_w, int64_t dilation_h,
                             int64_t dilation_w, int64_t groups, int64_t pad_left, int64_t pad_right, int64_t pad_top,
                             int64_t pad_bottom, const c10::optional<at::Tensor>& slot_to_grid) {
  const at::Tensor weight_slots = weight_matrix(weight, slot_to_grid);
  const Call call{input,       weight_slots, slot_to_grid.value_or(at::Tensor()), bias,       tap_offsets, tap_weights,
                  segments,    comparators,  kernel_size,  stride_h,   stride_w,    dilation_h,  dilation_w,
                  groups,      {pad_left, pad_right, pad_top, pad_bottom}};
  if (input.scalar_type() == at::kBFloat16) {
    // Sampled and sorted in float32 from the bfloat16 input; products in bfloat16 where the CPU has them.
    Call wide = call;
    wide.input = input.to(at::kFloat);
    wide.weight_slots = weight_slots.to(at::kFloat);
    if (bias.has_value() && bias->defined()) wide.bias = bias->to(at::kFloat);
    wide.bf16_products = true;
    return timm_sortconv_cpu::forward<float>(wide).to(at::kBFloat16);
  }
  at::Tensor output;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "sort_conv_forward",
                             [&] { output = timm_sortconv_cpu::forward<scalar_t>(call); });
  return output;
}

std::vector<at::Tensor> sort_conv_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& weight, const at::Tensor& tap_offsets,
                                           const at::Tensor& tap_weights, const at::Tensor& segments,
                                           const at::Tensor& comparators, int64_t kernel_size, int64_t stride_h,
                                           int64_t stride_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
                                           bool need_input_grad, bool need_weight_grad, int64_t pad_left,
                                           int64_t pad_right, int64_t pad_top, int64_t pad_bottom,
                                           const c10::optional<at::Tensor>& slot_to_grid) {
  const at::Tensor weight_slots = weight_matrix(weight, slot_to_grid);
  const Call call{input,       weight_slots, slot_to_grid.value_or(at::Tensor()), c10::nullopt, tap_offsets,
                  tap_weights, segments,     comparators,  kernel_size,  stride_h,     stride_w,    dilation_h,
                  dilation_w,  groups,       {pad_left, pad_right, pad_top, pad_bottom},           grad_output,
                  need_input_grad,           need_weight_grad};
  if (input.scalar_type() == at::kBFloat16) {
    Call wide = call;
    wide.input = input.to(at::kFloat);
    wide.weight_slots = weight_slots.to(at::kFloat);
    wide.grad_output = grad_output.to(at::kFloat);
    wide.bf16_products = true;
    std::vector<at::Tensor> result = timm_sortconv_cpu::backward<float>(wide);
    for (auto& grad : result) {
      if (grad.defined()) grad = grad.to(at::kBFloat16);
    }
    return in_weight_shape(result, weight);
  }
  std::vector<at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "sort_conv_backward",
                             [&] { result = timm_sortconv_cpu::backward<scalar_t>(call); });
  return in_weight_shape(result, weight);
}

timm_sortconv_cpu::AlignCall align_call(const at::Tensor& input, const at::Tensor& weight,
                                        const at::Tensor& slot_to_grid, const at::Tensor& weight_scale,
                                        const at::Tensor& guide_first,
                                        const c10::optional<at::Tensor>& bias, const at::Tensor& tap_offsets,
                                        const at::Tensor& tap_weights, const at::Tensor& segments,
                                        const at::Tensor& fold, const at::Tensor& dft,
                                        const at::Tensor& blocks, const at::Tensor& pairs, const at::Tensor& first,
                                        const at::Tensor& energy_pairs, const at::Tensor& fixed,
                                        const at::Tensor& energy_fixed, bool shared,
                                        double relative, double tiny, int64_t kernel_size, int64_t stride_h,
                                        int64_t stride_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
                                        int64_t pad_left, int64_t pad_right, int64_t pad_top, int64_t pad_bottom,
                                        int64_t guides) {
  const at::Tensor no_comparators = at::empty({0, 2}, at::kInt);
  return {Call{input, weight, slot_to_grid, bias, tap_offsets, tap_weights, segments, no_comparators,
               kernel_size, stride_h, stride_w, dilation_h, dilation_w, groups,
               {pad_left, pad_right, pad_top, pad_bottom}},
          fold, dft, blocks, pairs, first, energy_pairs, fixed, energy_fixed, weight_scale, guide_first, shared,
          relative, tiny, guides};
}

at::Tensor align_forward(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& slot_to_grid,
                         const at::Tensor& weight_scale, const at::Tensor& guide_first,
                         const c10::optional<at::Tensor>& bias, const at::Tensor& tap_offsets,
                         const at::Tensor& tap_weights, const at::Tensor& segments, const at::Tensor& fold,
                         const at::Tensor& dft, const at::Tensor& blocks, const at::Tensor& pairs,
                         const at::Tensor& first, const at::Tensor& energy_pairs, const at::Tensor& fixed,
                         const at::Tensor& energy_fixed, bool shared, double relative,
                         double tiny, int64_t kernel_size, int64_t stride_h, int64_t stride_w, int64_t dilation_h,
                         int64_t dilation_w, int64_t groups, int64_t pad_left, int64_t pad_right, int64_t pad_top,
                         int64_t pad_bottom, int64_t guides) {
  const auto align = align_call(input, weight, slot_to_grid, weight_scale, guide_first, bias, tap_offsets,
                                tap_weights, segments, fold, dft, blocks, pairs, first, energy_pairs, fixed,
                                energy_fixed, shared, relative, tiny, kernel_size, stride_h, stride_w, dilation_h,
                                dilation_w, groups, pad_left, pad_right, pad_top, pad_bottom, guides);
  at::Tensor output;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "align_forward",
                             [&] { output = timm_sortconv_cpu::align_forward<scalar_t>(align); });
  return output;
}

std::vector<at::Tensor> align_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                       const at::Tensor& weight, const at::Tensor& slot_to_grid,
                                       const at::Tensor& weight_scale, const at::Tensor& guide_first,
                                       const at::Tensor& tap_offsets,
                                       const at::Tensor& tap_weights, const at::Tensor& segments,
                                       const at::Tensor& fold, const at::Tensor& dft, const at::Tensor& blocks,
                                       const at::Tensor& pairs, const at::Tensor& first,
                                       const at::Tensor& energy_pairs, const at::Tensor& fixed,
                                       const at::Tensor& energy_fixed, bool shared,
                                       double relative, double tiny, int64_t kernel_size, int64_t stride_h,
                                       int64_t stride_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
                                       bool need_input_grad, bool need_weight_grad, int64_t pad_left,
                                       int64_t pad_right, int64_t pad_top, int64_t pad_bottom, int64_t guides) {
  auto align = align_call(input, weight, slot_to_grid, weight_scale, guide_first, c10::nullopt, tap_offsets,
                          tap_weights, segments, fold, dft, blocks, pairs, first, energy_pairs, fixed, energy_fixed,
                          shared, relative, tiny, kernel_size, stride_h, stride_w, dilation_h, dilation_w, groups,
                          pad_left, pad_right, pad_top, pad_bottom, guides);
  align.call.grad_output = grad_output;
  align.call.need_input_grad = need_input_grad;
  align.call.need_weight_grad = need_weight_grad;
  std::vector<at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "align_backward",
                             [&] { result = timm_sortconv_cpu::align_backward<scalar_t>(align); });
  return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused Sorting Convolution on CPU (gather + sorting network + micro-GEMM)";
  namespace py = pybind11;
  m.def("forward", &sort_conv_forward,
        "SC forward; the input is padded with pad_* zeros on each side; the weight is in grid order where "
        "slot_to_grid (slot s multiplies grid position slot_to_grid[s]) is given, else in slot order; a 4-D "
        "(O, C/groups, k, k) weight is in grid order",
        py::arg("input"), py::arg("weight_slots"), py::arg("bias"), py::arg("tap_offsets"), py::arg("tap_weights"),
        py::arg("segments"), py::arg("comparators"), py::arg("kernel_size"), py::arg("stride_h"),
        py::arg("stride_w"), py::arg("dilation_h"), py::arg("dilation_w"), py::arg("groups"),
        py::arg("pad_left") = 0, py::arg("pad_right") = 0, py::arg("pad_top") = 0, py::arg("pad_bottom") = 0,
        py::arg("slot_to_grid") = py::none());
  // The weight may come in grid order with its slot order (slot_to_grid) instead of reordered by the caller.
  m.attr("takes_slot_to_grid") = true;
  // ... and the 4-D weight itself (the weight gradient then comes back 4-D).
  m.attr("takes_4d_weight") = true;
  m.def("bf16_products", &timm_sortconv_cpu::bf16_products,
        "whether bfloat16 calls multiply in bfloat16 on this CPU (AVX-512 BF16); float32 products otherwise");
  m.def("backward", &sort_conv_backward,
        "SC backward; returns (grad_input of the unpadded input, grad_weight in the weight's order and shape)",
        py::arg("grad_output"),
        py::arg("input"), py::arg("weight_slots"), py::arg("tap_offsets"), py::arg("tap_weights"),
        py::arg("segments"), py::arg("comparators"), py::arg("kernel_size"), py::arg("stride_h"),
        py::arg("stride_w"), py::arg("dilation_h"), py::arg("dilation_w"), py::arg("groups"),
        py::arg("need_input_grad"), py::arg("need_weight_grad"), py::arg("pad_left") = 0, py::arg("pad_right") = 0,
        py::arg("pad_top") = 0, py::arg("pad_bottom") = 0, py::arg("slot_to_grid") = py::none());
  // The aligned variants (align_conv_kernel.h): the kernel takes the weight to the harmonic basis of
  // alignment.harmonic_tables itself.
  m.def("align_forward", &align_forward,
        "aligned SC forward; the weight (O, C/groups * k*k) is in grid order (slot s at grid position "
        "slot_to_grid[s]), the tables those of cpu_backend._AlignTables; `guides` channels (0 or 1) after each "
        "group's C/groups join the orientation only",
        py::arg("input"), py::arg("weight"), py::arg("slot_to_grid"), py::arg("weight_scale"),
        py::arg("guide_first"), py::arg("bias"), py::arg("tap_offsets"), py::arg("tap_weights"),
        py::arg("segments"), py::arg("fold"), py::arg("dft"), py::arg("blocks"), py::arg("pairs"), py::arg("first"),
        py::arg("energy_pairs"), py::arg("fixed"), py::arg("energy_fixed"), py::arg("shared"), py::arg("relative"),
        py::arg("tiny"),
        py::arg("kernel_size"), py::arg("stride_h"), py::arg("stride_w"), py::arg("dilation_h"),
        py::arg("dilation_w"), py::arg("groups"), py::arg("pad_left") = 0, py::arg("pad_right") = 0,
        py::arg("pad_top") = 0, py::arg("pad_bottom") = 0, py::arg("guides") = 0);
  m.def("align_backward", &align_backward,
        "aligned SC backward; returns (grad_input of the unpadded input, grad of the weight in grid order)",
        py::arg("grad_output"), py::arg("input"), py::arg("weight"), py::arg("slot_to_grid"),
        py::arg("weight_scale"), py::arg("guide_first"), py::arg("tap_offsets"),
        py::arg("tap_weights"), py::arg("segments"), py::arg("fold"), py::arg("dft"), py::arg("blocks"),
        py::arg("pairs"), py::arg("first"), py::arg("energy_pairs"), py::arg("fixed"), py::arg("energy_fixed"),
        py::arg("shared"), py::arg("relative"), py::arg("tiny"), py::arg("kernel_size"), py::arg("stride_h"),
        py::arg("stride_w"), py::arg("dilation_h"), py::arg("dilation_w"), py::arg("groups"),
        py::arg("need_input_grad"), py::arg("need_weight_grad"), py::arg("pad_left") = 0, py::arg("pad_right") = 0,
        py::arg("pad_top") = 0, py::arg("pad_bottom") = 0, py::arg("guides") = 0);
  // The aligned calls take the guide channels of checks.guide_channels (`guides`, after the padding).
  m.attr("align_takes_guides") = true;
  // ... and the weight in grid order with its slot order, taken to the harmonic basis by the kernel, and a guide's
  // orientation as sums over its samples (guide_first).
  m.attr("align_takes_grid_weight") = true;
}
