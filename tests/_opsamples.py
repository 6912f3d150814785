"""Sample calls of the ops mixprec's tables list, from torch's OpInfo database or written by hand.

Shared by the differential fuzzing (``test_differential``), the compiled fuzzing (``test_compiled``) and the
check of ``explain`` against execution (``test_explain``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import mixprec

POLICIES = ("CPU", "CUDA", "XPU", "CPU_DOCUMENTED", "CUDA_DOCUMENTED")
UNLISTED = (
    "add", "mul", "sub", "div", "tanh", "sigmoid", "relu", "gelu", "silu", "sin", "abs", "neg", "maximum",
    "where", "clamp", "mean", "sqrt", "var", "std", "amax", "erf", "hardtanh", "leaky_relu",
)
# Table ops no program can call on this CPU build, and why.
UNREACHABLE = {
    "__matmul__": "a Python operator spelling (documented lists); it reaches aten::matmul, which is drawn",
    "__pow__": "a Python operator spelling; it reaches aten::pow, which is drawn",
    "__rtruediv__": "a Python operator spelling; it reaches aten::div, which is drawn",
    "cudnn_convolution": "cuDNN kernels only",
    "_cudnn_rnn": "cuDNN kernels only",
    "cudnn_convolution_transpose": "cuDNN kernels only",
    "_thnn_fused_gru_cell": "CUDA kernels only",
    "_thnn_fused_lstm_cell": "CUDA kernels only",
    "_scaled_dot_product_flash_attention": "CUDA kernels only (CPU has _scaled_dot_product_flash_attention_for_cpu)",
    "symeig": "removed from torch",
    "mkldnn_rnn_layer": "its 16 arguments are a oneDNN RNN's internals; nn.LSTM reaches it in test_cpu_opinfo",
    "_native_multi_head_attention": "nn.MultiheadAttention's fast path; test_cpu_opinfo reaches it",
    "nll_loss_nd": "no kernel of its own: nll_loss reaches it through cross_entropy_loss",
    "poisson": "samples from its input: no gradient, no dtype to compare beyond the input's",
    "_grid_sampler_2d_cpu_fallback": "reached through grid_sampler_2d on shapes oneDNN refuses",
    "fake_quantize_per_tensor_affine": "quantization aware training, float32 only in torch's own kernels",
}


def _r(*shape: int, low: float = -2, high: float = 2) -> torch.Tensor:
    return torch.empty(shape).uniform_(low, high)


# Hand-written samples for table ops without an OpInfo under their ATen name: (args, kwargs) in float32.
HAND: dict[str, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "_convolution": lambda: ((_r(1, 2, 5, 5), _r(3, 2, 3, 3), _r(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                              False, False, True, True), {}),
    "convolution": lambda: ((_r(1, 2, 5, 5), _r(3, 2, 3, 3), _r(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
    "conv_tbc": lambda: ((_r(5, 1, 2), _r(3, 2, 4), _r(4), 1), {}),
    "_addmm_activation": lambda: ((_r(3), _r(2, 4), _r(4, 3)), {"use_gelu": False}),
    "chain_matmul": lambda: (([_r(2, 3), _r(3, 4), _r(4, 2)],), {}),
    "gru_cell": lambda: ((_r(2, 3), _r(2, 4), _r(12, 3), _r(12, 4), _r(12), _r(12)), {}),
    "lstm_cell": lambda: ((_r(2, 3), [_r(2, 4), _r(2, 4)], _r(16, 3), _r(16, 4), _r(16), _r(16)), {}),
    "rnn_tanh_cell": lambda: ((_r(2, 3), _r(2, 4), _r(4, 3), _r(4, 4), _r(4), _r(4)), {}),
    "rnn_relu_cell": lambda: ((_r(2, 3), _r(2, 4), _r(4, 3), _r(4, 4), _r(4), _r(4)), {}),
    "cross_entropy_loss": lambda: ((_r(4, 5), torch.tensor([0, 2, 4, 1])), {}),
    "nll_loss2d": lambda: ((_r(2, 3, 4, 4).log_softmax(1), torch.randint(0, 3, (2, 4, 4))), {}),
    "multilabel_margin_loss_forward": lambda: ((_r(2, 4), torch.tensor([[1, 3, -1, 0], [0, -1, 2, 1]]), 1), {}),
    "reflection_pad1d": lambda: ((_r(1, 2, 5), [2, 1]), {}),
    "reflection_pad2d": lambda: ((_r(1, 2, 5, 5), [2, 1, 1, 2]), {}),
    "replication_pad1d": lambda: ((_r(1, 2, 5), [2, 1]), {}),
    "replication_pad2d": lambda: ((_r(1, 2, 5, 5), [2, 1, 1, 2]), {}),
    "replication_pad3d": lambda: ((_r(1, 2, 3, 3, 3), [1, 1, 1, 1, 1, 1]), {}),
    "upsample_nearest1d": lambda: ((_r(1, 2, 4), [8]), {}),
    "upsample_nearest2d": lambda: ((_r(1, 2, 4, 4), [8, 6]), {}),
    "upsample_nearest3d": lambda: ((_r(1, 2, 3, 3, 3), [6, 6, 4]), {}),
    "_upsample_nearest_exact1d": lambda: ((_r(1, 2, 4), [7]), {}),
    "_upsample_nearest_exact2d": lambda: ((_r(1, 2, 4, 4), [7, 5]), {}),
    "_upsample_nearest_exact3d": lambda: ((_r(1, 2, 3, 3, 3), [5, 6, 4]), {}),
    "upsample_linear1d": lambda: ((_r(1, 2, 4), [7], False), {}),
    "upsample_bilinear2d": lambda: ((_r(1, 2, 4, 4), [7, 5], True), {}),
    "upsample_bicubic2d": lambda: ((_r(1, 2, 4, 4), [7, 5], False), {}),
    "_upsample_bicubic2d_aa": lambda: ((_r(1, 2, 8, 8), [5, 3], False), {}),
    "_upsample_bilinear2d_aa": lambda: ((_r(1, 2, 8, 8), [5, 3], False), {}),
    "upsample_trilinear3d": lambda: ((_r(1, 2, 3, 3, 3), [5, 4, 4], False), {}),
    "grid_sampler": lambda: ((_r(1, 2, 4, 4), _r(1, 3, 3, 2, low=-1, high=1), 0, 0, False), {}),
    "inverse": lambda: ((_r(3, 3) + 4 * torch.eye(3),), {}),
    "orgqr": lambda: (torch.geqrf(_r(4, 3)), {}),
    "_lu_with_info": lambda: ((_r(3, 3) + 4 * torch.eye(3),), {}),
    "frobenius_norm": lambda: ((_r(3, 4), [0, 1]), {}),
    "nuclear_norm": lambda: ((_r(3, 4),), {}),
    "col2im": lambda: ((_r(1, 8, 4), [3, 3], [2, 2], [1, 1], [0, 0], [1, 1]), {}),
    "adaptive_max_pool1d": lambda: ((_r(1, 2, 8), [3]), {}),
    "adaptive_max_pool2d": lambda: ((_r(1, 2, 8, 8), [3, 3]), {}),
    "adaptive_max_pool3d": lambda: ((_r(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "batch_norm": lambda: ((_r(2, 3, 4), _r(3), _r(3), None, None, True, 0.1, 1e-5, False), {}),
    "instance_norm": lambda: ((_r(2, 3, 4), _r(3), _r(3), None, None, True, 0.1, 1e-5, False), {}),
    "cdist": lambda: ((_r(3, 4), _r(5, 4)), {}),
    "cosine_embedding_loss": lambda: ((_r(3, 4), _r(3, 4), torch.tensor([1.0, -1.0, 1.0])), {}),
    "ctc_loss": lambda: ((_r(6, 2, 4).log_softmax(2), torch.randint(1, 4, (2, 3)), [6, 6], [3, 2]), {}),
    "dropout": lambda: ((_r(3, 4), 0.5, True), {}),
    "einsum": lambda: (("ij,jk->ik", [_r(2, 3), _r(3, 4)]), {}),
    "fractional_max_pool2d": lambda: ((_r(1, 2, 8, 8), [2, 2], [4, 4], torch.rand(1, 2, 2)), {}),
    "fractional_max_pool3d": lambda: ((_r(1, 2, 6, 6, 6), [2, 2, 2], [3, 3, 3], torch.rand(1, 2, 3)), {}),
    "huber_loss": lambda: ((_r(3, 4), _r(3, 4)), {}),
    "kl_div": lambda: ((_r(3, 4).log_softmax(1), _r(3, 4).softmax(1)), {}),
    "margin_ranking_loss": lambda: ((_r(4), _r(4), torch.tensor([1.0, -1.0, 1.0, -1.0])), {}),
    "max_pool3d": lambda: ((_r(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "max_unpool2d": lambda: ((*torch.nn.functional.max_pool2d(_r(1, 2, 4, 4), 2, return_indices=True), [4, 4]), {}),
    "max_unpool3d": lambda: ((*torch.nn.functional.max_pool3d(_r(1, 2, 4, 4, 4), 2, return_indices=True),
                              [4, 4, 4], [2, 2, 2], [0, 0, 0]), {}),
    "poisson_nll_loss": lambda: ((_r(3, 4), _r(3, 4, low=0, high=3), True, False, 1e-8, 1), {}),
    "tensordot": lambda: ((_r(2, 3, 4), _r(4, 3, 5), [1, 2], [1, 0]), {}),
    "linalg_matrix_sqrth": lambda: ((_spd(3),), {}),  # torch 2.14 and later
}


def _spd(n: int) -> torch.Tensor:
    """A symmetric positive definite matrix."""
    a = _r(n, n)
    return a @ a.T + n * torch.eye(n)


@functools.cache
def _opinfos() -> dict[str, list[Any]]:
    from torch.testing._internal.common_methods_invocations import op_db

    found: dict[str, list[Any]] = {}
    for info in op_db:
        for name in {info.aten_name, info.name, info.name.replace(".", "_"), info.name.rpartition(".")[2]}:
            if name:
                found.setdefault(name, []).append(info)
    return found


def table_names() -> list[str]:
    names: set[str] = set()
    for attr in POLICIES:
        names |= {n.split("::")[-1].split(".")[0] for n in getattr(mixprec.policies, attr).table}
    return sorted(names)


@functools.cache
def drawable() -> tuple[str, ...]:
    """Every op a program may call: the tables' ops that exist and are reachable here, and unlisted ones."""
    ops = [n for n in table_names() if n not in UNREACHABLE and hasattr(torch.ops.aten, n)]
    return tuple(sorted(set(ops) | set(UNLISTED)))


def _runs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        torch._C._jit_resolve_packet(f"aten::{name}", *args, **kwargs)
        with torch.no_grad():
            getattr(torch.ops.aten, name)(*args, **kwargs)
    except Exception:
        return False
    return True


def _convert(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            if dtype.is_floating_point:
                return value.to(dtype)
            return (value * 3).round().to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_convert(v, dtype) for v in value)
    return value


@functools.cache
def samples(name: str, dtype: torch.dtype) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]:
    """Up to three calls of ``aten::<name>`` with inputs in ``dtype`` that run with autocast off."""
    torch.manual_seed(0)
    found: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    for info in _opinfos().get(name, []):
        if dtype not in info.supported_dtypes("cpu"):
            continue
        # The OpInfo's own generator, closed below: ``info.sample_inputs`` wraps it in an iterator whose
        # reference cycle keeps it suspended until a garbage collection, which then runs its no_grad exit at
        # any later moment (inside a make_fx trace, it records torch.set_grad_enabled calls).
        generated = iter(info.sample_inputs_func(info, "cpu", dtype, False))
        try:
            for sample in generated:
                args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
                if _runs(name, args, kwargs):
                    found.append((args, kwargs))
                if len(found) == 3:
                    return tuple(found)
        except Exception:
            continue
        finally:
            getattr(generated, "close", lambda: None)()
    if not found and name in HAND:
        args, kwargs = HAND[name]()
        args, kwargs = _convert(args, dtype), _convert(kwargs, dtype)
        if _runs(name, args, kwargs):
            found.append((args, kwargs))
    return tuple(found)


