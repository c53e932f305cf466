// The kernel for double tensors (a translation unit of its own: see sort_conv_kernel.h), with the
// aligned variants' kernel (align_conv_kernel.h).
#include "sort_conv_kernel.h"
#include "align_conv_kernel.h"

namespace timm_sortconv_cpu {

template at::Tensor forward<double>(const Call&);
template std::vector<at::Tensor> backward<double>(const Call&);
template at::Tensor align_forward<double>(const AlignCall&);
template std::vector<at::Tensor> align_backward<double>(const AlignCall&);

}  // namespace timm_sortconv_cpu
