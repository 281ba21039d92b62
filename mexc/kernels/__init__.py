"""Numpy reference kernels of every layer, forward and backward, integer only.

Every kernel takes MX values (mexc.mx.MX); rounding kernels take a RoundCtx and a base rounding
site id `tid` (site j uses ctx.key(tid + j)). The recipes are in docs/layers.md.
"""

from mexc.kernels.activation import (
    hardsigmoid_backward,
    hardsigmoid_forward,
    hardswish_backward,
    hardswish_forward,
    relu6_backward,
    relu6_cap,
    relu6_forward,
    relu_backward,
    relu_forward,
    sigmoid_backward,
    sigmoid_forward,
    silu_backward,
    silu_forward,
)
from mexc.kernels.conv import (
    conv2d_accumulate,
    conv2d_backward_input,
    conv2d_backward_weight,
    conv2d_forward,
)
from mexc.kernels.elementwise import (
    add_forward,
    concat_forward,
    dropout_backward,
    dropout_forward,
    factor_view,
    grad_sum,
    mul_backward_factor,
    mul_forward,
)
from mexc.kernels.linear import (
    bias_backward,
    linear_accumulate,
    linear_backward_input,
    linear_backward_weight,
    linear_forward,
)
from mexc.kernels.loss import softmax_ce_backward, softmax_ce_forward
from mexc.kernels.norm import (
    BatchNormSaved,
    batchnorm_affine,
    batchnorm_backward,
    batchnorm_forward_eval,
    batchnorm_forward_train,
    batchnorm_update_running,
)
from mexc.kernels.pool import (
    avgpool2d_backward,
    avgpool2d_forward,
    global_avgpool_backward,
    global_avgpool_forward,
    maxpool2d_backward,
    maxpool2d_forward,
)
from mexc.kernels.quantize import quantize, quantize_channels

__all__ = [
    "BatchNormSaved",
    "add_forward",
    "sigmoid_backward",
    "sigmoid_forward",
    "silu_backward",
    "silu_forward",
    "hardsigmoid_backward",
    "hardsigmoid_forward",
    "concat_forward",
    "factor_view",
    "mul_backward_factor",
    "mul_forward",
    "hardswish_backward",
    "hardswish_forward",
    "avgpool2d_backward",
    "avgpool2d_forward",
    "batchnorm_affine",
    "batchnorm_backward",
    "batchnorm_forward_eval",
    "batchnorm_forward_train",
    "batchnorm_update_running",
    "bias_backward",
    "conv2d_backward_input",
    "conv2d_backward_weight",
    "conv2d_accumulate",
    "conv2d_forward",
    "dropout_backward",
    "dropout_forward",
    "global_avgpool_backward",
    "global_avgpool_forward",
    "grad_sum",
    "linear_backward_input",
    "linear_backward_weight",
    "linear_accumulate",
    "linear_forward",
    "maxpool2d_backward",
    "maxpool2d_forward",
    "quantize",
    "quantize_channels",
    "relu6_backward",
    "relu6_cap",
    "relu6_forward",
    "relu_backward",
    "relu_forward",
    "softmax_ce_backward",
    "softmax_ce_forward",
]

from mexc.kernels.transformer import (  # noqa: E402
    LayerNormSaved,
    add_broadcast_forward,
    add_broadcast_param_grad,
    gelu_backward,
    gelu_forward,
    layernorm_backward,
    layernorm_forward,
    matmul_backward,
    matmul_forward,
    mean_tokens_backward,
    mean_tokens_forward,
    scale_backward,
    scale_forward,
    softmax_backward,
    softmax_forward,
    softmax_prob_exp,
)

__all__ += [
    "LayerNormSaved",
    "add_broadcast_forward",
    "add_broadcast_param_grad",
    "gelu_backward",
    "gelu_forward",
    "layernorm_backward",
    "layernorm_forward",
    "matmul_backward",
    "matmul_forward",
    "mean_tokens_backward",
    "mean_tokens_forward",
    "scale_backward",
    "scale_forward",
    "softmax_backward",
    "softmax_forward",
    "softmax_prob_exp",
]
