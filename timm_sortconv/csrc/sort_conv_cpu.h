// The interface between the Python bindings (sort_conv_cpu.cpp) and the kernel (sort_conv_kernel.h),
// which is compiled once per dtype in its own translation unit.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <vector>

// Hidden: several builds of the extension (one per instruction-set level) may be loaded in one process.
namespace timm_sortconv_cpu __attribute__((visibility("hidden"))) {

// The arguments of one forward or backward call, as Python gives them (see the bindings).
struct Call {
  // weight_slots: (O, C/g * k*k), each channel's k*k weights in grid (row-major) order where slot_to_grid
  // is given (slot s multiplies grid position slot_to_grid[s]; the kernel permutes while it repacks the
  // weights, which it does anyway), else already in slot order.
  at::Tensor input, weight_slots, slot_to_grid;
  c10::optional<at::Tensor> bias;
  at::Tensor tap_offsets, tap_weights, segments, comparators;
  int64_t kernel_size, stride_h, stride_w, dilation_h, dilation_w, groups;
  std::array<int64_t, 4> pad;  // left, right, top, bottom zeros around the input
  at::Tensor grad_output;      // backward only
  bool need_input_grad = false, need_weight_grad = false;
  // The call was in bfloat16: multiply the sorted windows, weights and gradients in bfloat16 (float32
  // sums) where the CPU can (bf16_products()); the tensors above are float32 either way.
  bool bf16_products = false;
};

// An aligned call (sorting="align", "align-channel": align_conv_kernel.h): `call` with the weight (O, C/g * k*k) in
// grid order as weight_slots, its slot order (slot_to_grid) and no comparators, and the tables of
// cpu_backend._AlignTables.
struct AlignCall {
  Call call;
  at::Tensor fold;          // (k*k, k*k) float64: folded samples <- samples (slot order)
  at::Tensor dft;           // (k*k, k*k) float64: harmonic rows <- folded samples, block diagonal
  at::Tensor blocks;        // (n, 2) int64: (start, size) of dft's diagonal blocks
  at::Tensor pairs;         // (pairs, 3) int64: the rows of Re S_m and Im S_m, and m
  at::Tensor first;         // (pairs,) float64: 1 / N for the pairs with m = 1, else 0
  at::Tensor energy_pairs;  // (pairs,) float64: 2 / N^2
  at::Tensor fixed;         // (fixed, 2) int64: the other rows, and m where one is a ring's Nyquist term (else 0)
  at::Tensor energy_fixed;  // (fixed,) float64: 1 / N^2 for a Nyquist row, else 0
  at::Tensor weight_scale;  // (k*k,) float64: 1 / |row|^2 of dft @ fold, the weight's harmonic rows' scale
  at::Tensor guide_first;   // (3, k*k) float64: c_re, c_im as sums over a guide's samples (slot order) and each
                            // ring's squared-mean weight in E (cpu_backend._guide_first), or empty
  bool shared = true;       // one orientation per group ("align"), else per channel
  double relative = 0, tiny = 0;  // alignment.RELATIVE, alignment.TINY
  // Guide channels after each group's C/g weighted ones (0 or 1, "align" only; checks.guide_channels): read for the
  // orientation, not multiplied. The input has (C/g + guides) * groups channels; its gradient covers them all.
  int64_t guides = 0;
};

// Whether this build on this CPU multiplies in bfloat16 (AVX-512 BF16).
bool bf16_products();

template <typename scalar_t>
at::Tensor forward(const Call& call);

// (grad_input of the unpadded input, grad_weight in the weight's order: grid order where slot_to_grid is
// given, else slot order); either undefined where not needed.
template <typename scalar_t>
std::vector<at::Tensor> backward(const Call& call);

template <typename scalar_t>
at::Tensor align_forward(const AlignCall& align);

// (grad_input of the unpadded input, grad of the weight (O, C/g * k*k) in grid order); either undefined where not
// needed.
template <typename scalar_t>
std::vector<at::Tensor> align_backward(const AlignCall& align);

extern template at::Tensor forward<float>(const Call&);
extern template at::Tensor forward<double>(const Call&);
extern template std::vector<at::Tensor> backward<float>(const Call&);
extern template std::vector<at::Tensor> backward<double>(const Call&);
extern template at::Tensor align_forward<float>(const AlignCall&);
extern template at::Tensor align_forward<double>(const AlignCall&);
extern template std::vector<at::Tensor> align_backward<float>(const AlignCall&);
extern template std::vector<at::Tensor> align_backward<double>(const AlignCall&);

}  // namespace timm_sortconv_cpu
