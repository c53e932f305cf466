// The kernel for float tensors (a translation unit of its own: see sort_conv_kernel.h).
#include "sort_conv_kernel.h"

namespace timm_sortconv_cpu {

template at::Tensor forward<float>(const Call&);
template std::vector<at::Tensor> backward<float>(const Call&);

bool bf16_products() { return bf16_build_and_hardware(); }

}  // namespace timm_sortconv_cpu
