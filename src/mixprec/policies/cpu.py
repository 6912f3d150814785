"""CPU default policy: what native CPU autocast does, release by release.

``TABLE`` is torch 2.13's; ``RELEASES`` says how each other supported release
differs from it.

The ops that have a kernel at the AutocastCPU dispatch key
(``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")``),
by category. Torch registers some of them for a few overloads only
(``_convolution.deprecated``, ``conv1d`` and ``conv1d.padding``); mixprec
follows torch's registrations overload by overload for every op whose category
a policy leaves as it is here (``mixprec.engine._tables``). Composites such as
``tensordot`` or ``einsum`` are not listed: they decompose below the Autocast
key, and the listed ops they reach are cast there, as natively.
"""

LOWER_PRECISION_FP = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm",
    "linear", "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "_native_multi_head_attention", "_addmm_activation",
)

FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
    "_grid_sampler_2d_cpu_fallback", "polar", "prod", "quantile", "nanquantile", "stft", "cdist",
    "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse",
    "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
    "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
    "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn",
    "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn",
    "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_matrix_rank", "linalg_solve",
    "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
    "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
    "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd",
    "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)

PROMOTE = ("stack", "cat", "index_copy")

TABLE = {
    "lower_precision_fp": LOWER_PRECISION_FP,
    "fp32": FP32,
    "promote": PROMOTE,
}

#: How each supported release's native CPU autocast differs from 2.13's ``TABLE``: ops it adds, by
#: category, and ops it no longer registers (``"removed"``). Read off each release's AutocastCPU
#: registrations and the added ops' behaviour (``tools/native_tables.py``); tests/test_compat.py checks
#: the installed release's table against its kernels. A release with no entry has 2.13's table.
RELEASES = {
    "2.10": {},
    "2.11": {},
    "2.12": {},
    "2.13": {},
    "2.14": {"fp32": ("linalg_matrix_sqrth",), "removed": ("cholesky", "qr")},
    "2.15": {"fp32": ("linalg_matrix_sqrth",), "removed": ("cholesky", "qr")},
}
