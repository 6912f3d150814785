"""CPU default policy: what torch 2.13's native CPU autocast does.

Two parts, merged into ``TABLE``:

* The kernels registered for the AutocastCPU dispatch key, one by one
  (``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")``).
  ``_convolution`` is registered there only for its deprecated 12-argument form.
* ``COMPOSITE_*``: C++ composites that mixprec cannot look inside. Natively,
  autocast sits in the dispatcher, so a composite such as ``aten::tensordot``
  is cast where it calls a listed op (``mm``); mixprec intercepts only the
  outer Python call, which would otherwise run uncast. Each composite is listed
  under the category that reproduces native when applied at the outer call:
  the inner listed op decides the native result, and what the composite does
  around it (views, reshapes, permutes; for the RNNs, steps that natively run
  in the autocast dtype too) gives the same bits after an early cast. Inputs
  on which native takes another path are named per entry.
  tests/test_cpu_opinfo.py checks every entry against native, dtype and bits.

``UNLISTED_COMPOSITES`` names the composites for which no category at the
outer call reproduces native (the path taken depends on the inputs, or ops of
several categories decide the result), with the reason; they stay unlisted
and run uncast. It is documentation: the policy is ``TABLE``. A composite whose
path depends on its inputs can instead be ported to Python op for op
(``mixprec._ports``: ``aten::pad``, ``lstm_cell``, ``gru_cell``, ``gru``,
``linalg_matrix_power``), and then matches native on every path.
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

# C++ composites whose native result is that of an inner lower_precision_fp op.
COMPOSITE_LOWER_PRECISION_FP = (
    # matmul under another name.
    "linalg_matmul",
    # A chain of mm calls. Native checks that all inputs share one dtype before
    # the first mm, so inputs of mixed dtypes raise natively and run here.
    "linalg_multi_dot",
    # Deprecated; multi_dot. A single matrix is returned as a copy, uncast, natively.
    "chain_matmul",
    # Permute and reshape both operands, then one mm. Natively a contraction
    # whose free dimensions both have size 1 (a full contraction to one element)
    # goes to dot, unlisted, instead of mm. Inputs of mixed dtypes raise
    # natively and run here.
    "tensordot",
    # Elman RNNs: every step is linear + add + tanh/relu, all in the autocast
    # dtype natively too (the hidden state is the output of a cast linear).
    "rnn_tanh", "rnn_relu", "rnn_tanh_cell", "rnn_relu_cell",
    # nn.LSTM: natively mkldnn_rnn_layer (listed) runs the whole layer, for
    # bfloat16 autocast and float32/bfloat16 inputs. Not reproduced where native
    # leaves that path: with proj_size or a packed sequence, or float16 inputs,
    # native runs the cell loop with a float32 cell state (float32 or mixed
    # outputs); under float16 autocast oneDNN has no LSTM on most CPUs and native raises.
    "lstm",
)

# C++ composites whose native result is that of an inner fp32 op.
COMPOSITE_FP32 = (
    # F.nll_loss: reshapes, then nll_loss or nll_loss2d.
    "nll_loss_nd",
)

# C++ composites that natively reach cat (promote) with all their tensor inputs.
# Only the error case differs from running uncast: cat promotes types itself,
# but native autocast raises for inputs in the other lower-precision dtype.
COMPOSITE_PROMOTE = (
    "concat", "concatenate", "hstack", "vstack", "row_stack", "dstack", "column_stack",
    "_chunk_cat",
)

UNLISTED_COMPOSITES = {
    "inner": "tensordot over the last dimension, but its common 1-D case is dot (unlisted) and "
    "a 0-d operand is mul: float32 stays float32 natively in both.",
    "einsum": "bmm only for a pairwise contraction; elementwise, outer-product, diagonal and "
    "transpose equations, and a final pair without a contraction (mul against a float32 "
    "operand), stay float32 natively. Listing it would compute e.g. the rotary-embedding "
    "outer product einsum('i,j->ij', positions, inv_freq) in bfloat16.",
    "cov": "the mean is subtracted in float32 before the lower-precision mm; casting the input "
    "first subtracts in bfloat16 and loses the data to cancellation when the mean is large.",
    "corrcoef": "cov, then division by the standard deviations: as cov.",
    "linalg_pinv": "svd or eigh (fp32) then matmul (lower): no single category.",
    "bilinear": "_trilinear accumulates lower-precision bmm results into a float32 output.",
    "gru": "only with a packed sequence (the dense overload is ported): ATen's packed layers run "
    "GRU cells whose linears are cast natively; mixprec runs the packed call uncast.",
    "roll": "reaches cat for non-empty inputs, as do fft_fftshift, fft_ifftshift, gradient, "
    "diff with prepend/append, combinations, cartesian_prod of 2+ tensors, matrix_exp of "
    "larger matrices and isin of larger inputs. Only the error differs: native raises for an "
    "input in the other lower-precision dtype (float16 under bfloat16). Not reproduced, as "
    "native does not reach cat for every input and the raise is an artefact of the inner cat.",
}

# Where a listed composite still differs from native, by input.
COMPOSITE_EXCEPTIONS = {
    "tensordot": "natively a full contraction to one element goes to dot (unlisted) and stays "
    "float32; mixprec casts it.",
    "lstm": "natively mkldnn_rnn_layer runs the layer only for bfloat16 autocast without proj_size "
    "or packed input; elsewhere native runs the cell loop with a float32 cell state (float32 or "
    "mixed outputs), and under float16 autocast oneDNN raises on most CPUs. mixprec casts the "
    "whole layer to the autocast dtype.",
}

TABLE = {
    "lower_precision_fp": LOWER_PRECISION_FP + COMPOSITE_LOWER_PRECISION_FP,
    "fp32": FP32 + COMPOSITE_FP32,
    "promote": PROMOTE + COMPOSITE_PROMOTE,
}
