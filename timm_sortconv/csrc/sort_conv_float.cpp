// The kernel for float tensors (a translation unit of its own: see sort_conv_kernel.h), with the
// aligned variants' kernel (align_conv_kernel.h).
#include "sort_conv_kernel.h"
#include "align_conv_kernel.h"

namespace timm_sortconv_cpu {

template at::Tensor forward<float>(const Call&);
template std::vector<at::Tensor> backward<float>(const Call&);
template at::Tensor align_forward<float>(const AlignCall&);
template std::vector<at::Tensor> align_backward<float>(const AlignCall&);

bool bf16_products() { return bf16_build_and_hardware(); }

}  // namespace timm_sortconv_cpu
