"""The op lists of PyTorch's "Automatic Mixed Precision package - torch.cpu.amp" reference, exactly as documented.

Names the installed torch no longer has (``symeig``, ``eig``, ``lstsq``, ...)
stay in the table; they simply match no callable.
"""

LOWER_PRECISION_FP = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "baddbmm", "addmm", "addbmm", "linear",
    "_convolution",
)

FP32 = (
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "batch_norm", "dropout",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "gelu", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_trilinear3d", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "instance_norm", "grid_sampler", "polar", "multinomial",
    "poisson", "fmod", "prod", "quantile", "nanquantile", "stft", "cdist", "cross", "cumprod",
    "cumsum", "diag", "diagflat", "histc", "logcumsumexp", "searchsorted", "trace", "tril", "triu",
    "vander", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "dot",
    "inverse", "lu_solve", "matrix_rank", "orgqr", "ormqr", "pinverse", "vdot", "im2col",
    "col2im", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "elu", "hardshrink", "hardsigmoid", "hardswish", "log_sigmoid", "prelu",
    "selu", "celu", "softplus", "softshrink", "group_norm", "smooth_l1_loss", "mse_loss",
    "ctc_loss", "kl_div", "multilabel_margin_loss", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2",
    "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "conv_tbc", "linalg_matrix_norm",
    "linalg_cond", "linalg_matrix_rank", "linalg_solve", "linalg_cholesky", "linalg_svdvals",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "glu", "cummax",
    "cummin", "eig", "geqrf", "lstsq", "_lu_with_info", "lu_unpack", "qr", "solve", "svd",
    "symeig", "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd",
    "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)

PROMOTE = ("cat", "stack", "index_copy")

TABLE = {
    "lower_precision_fp": LOWER_PRECISION_FP,
    "fp32": FP32,
    "promote": PROMOTE,
}
