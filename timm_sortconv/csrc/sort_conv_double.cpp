// The kernel for double tensors (a translation unit of its own: see sort_conv_kernel.h).
#include "sort_conv_kernel.h"

namespace timm_sortconv_cpu {

template at::Tensor forward<double>(const Call&);
template std::vector<at::Tensor> backward<double>(const Call&);

}  // namespace timm_sortconv_cpu
