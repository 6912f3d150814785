"""The op lists of PyTorch's "Automatic Mixed Precision package - torch.cuda.amp" reference, exactly as documented."""

LOWER_PRECISION_FP = (
    "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d",
    "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear",
    "matmul", "mm", "mv", "prelu",
)

FP32 = (
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
    "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
    "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
    "gelu", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
    "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
)

PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cat", "cross", "dot", "equal", "stack",
    "tensordot",
)

BANNED = ("binary_cross_entropy",)

TABLE = {
    "lower_precision_fp": LOWER_PRECISION_FP,
    "fp32": FP32,
    "promote": PROMOTE,
    "banned": BANNED,
}
