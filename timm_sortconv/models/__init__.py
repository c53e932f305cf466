"""timm models built on Sorting Convolution; importing this package registers them with timm.

* :mod:`.scnn`: the paper's MNIST networks ``scnn_{s,p}_{gs,rs}_{3,5,7}`` and ``scnn_baseline_{3,5,7}``, and
  ``scnn_p_rs_7_canon``, ``scnn_p_c2_7_canon`` (each digit turned to its principal axis first) and
  ``scnn_p_rs_7_blur`` (blurred input and pooling: invariant to turns of a scene's parts);
* :mod:`.ri_vgg`, :mod:`.ri_resnet`, :mod:`.ri_densenet`: ``ri_vgg16``, ``ri_resnet18``, ``ri_densenet40``
  and their plain-convolution twins ``ri_vgg16_baseline``, ``ri_resnet18_baseline``,
  ``ri_densenet40_baseline``, for 128x128 inputs.
"""
from ._conv import ConvNormAct, fixed_variant_args, get_conv_layer
from .ri_densenet import *
from .ri_resnet import *
from .ri_vgg import *
from .scnn import *
