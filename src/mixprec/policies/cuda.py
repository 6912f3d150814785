"""CUDA default policy: what native CUDA autocast does, release by release.

``TABLE`` is torch 2.13's: the lists of ATen's ``autocast_mode.h`` (shared by
CUDA and XPU in torch) plus the CUDA-only registrations (cuDNN convolutions,
cuDNN's RNN in float16 whatever the region's dtype, the binary_cross_entropy ban). ``RELEASES`` says how each other
supported release differs from it.
"""

LOWER_PRECISION_FP = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)

#: cuDNN's RNN (LSTM, GRU, RNN) runs in float16 whatever the region's dtype: torch's kernel casts its input,
#: states and weights to float16 (aten/src/ATen/cudnn/AutocastRNN.cpp; seen on an H200 with torch 2.11: an
#: nn.LSTM under bfloat16 autocast returns float16). Registered by builds with cuDNN only.
FP16 = ("_cudnn_rnn",)

FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)

FP32_SET_OPT_DTYPE = (
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum",
)

FP32_APPEND_DTYPE = ("norm",)

PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)

BANNED = ("binary_cross_entropy",)

TABLE = {
    "lower_precision_fp": LOWER_PRECISION_FP,
    "fp32": FP32,
    "fp32_set_opt_dtype": FP32_SET_OPT_DTYPE,
    "fp32_append_dtype": FP32_APPEND_DTYPE,
    "promote": PROMOTE,
    "banned": BANNED,
    "fp16": FP16,
}

#: How each supported release's native CUDA autocast differs from 2.13's ``TABLE``: ops it adds, by
#: category, and ops it does not register (``"removed"``). Read off each release's AutocastCUDA
#: registrations and the added ops' behaviour on fake CUDA tensors (``tools/native_tables.py``);
#: tests/test_compat.py checks the installed release's table against its kernels.
RELEASES = {
    "2.10": {"removed": ("rms_norm",)},
    "2.11": {"removed": ("rms_norm",)},
    "2.12": {},
    "2.13": {},
    "2.14": {"fp32": ("linalg_matrix_sqrth",)},
    "2.15": {"fp32": ("linalg_matrix_sqrth",)},
}

#: Ops only some builds register (cuDNN's), so a build without them still matches the table.
BUILD_DEPENDENT = ("_cudnn_rnn",)
