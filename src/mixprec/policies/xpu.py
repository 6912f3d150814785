"""XPU policy: the op lists of Intel's "Auto Mixed Precision (AMP) on GPU" guide for `torch.xpu.amp`.

The guide names ``conv_transpose1d`` twice and never ``conv_transpose2d``; the
second mention is read as ``conv_transpose2d`` (see docs/policy_tables.md).
"""

LOWER_PRECISION_FP = (
    "conv1d", "conv2d", "conv3d", "_convolution", "convolution", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "prelu", "addmm", "addmv", "addr", "linear", "matmul",
    "mm", "mv", "bmm", "baddbmm", "addbmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_gru_cell", "gru_cell",
)

FP32 = (
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "log_softmax", "nll_loss",
    "nll_loss2d", "nll_loss_nd", "cross_entropy_loss", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2",
    "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "reciprocal", "pow", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "dist", "pdist", "cdist", "renorm",
)

PROMOTE = (
    "cat", "stack", "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)

TABLE = {
    "lower_precision_fp": LOWER_PRECISION_FP,
    "fp32": FP32,
    "promote": PROMOTE,
}
