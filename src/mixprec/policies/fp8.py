"""FP8 policy: the CUDA default with the matmul family in fp8.

``linear``, ``mm``, ``addmm`` and ``matmul`` run their GEMMs in fp8 (``Category.FP8``: e4m3 inputs and
weights, e5m2 gradients, tensorwise dynamic scaling by default) wherever their shapes allow it; a call fp8
cannot run (sizes not multiples of 16, a 3-D second operand, a scaled ``addmm``) runs in the region's dtype,
as ``lower_precision_fp``. Every other op is as in ``cuda.py``, release by release. It runs on CPU too, for
the numerics (``torch._scaled_mm``; slower than bfloat16 there).
"""

from mixprec.policies.cuda import RELEASES as _CUDA_RELEASES
from mixprec.policies.cuda import TABLE as _CUDA_TABLE

FP8 = ("addmm", "linear", "matmul", "mm")

TABLE = {category: tuple(op for op in ops if op not in FP8) for category, ops in _CUDA_TABLE.items()}
TABLE["fp8"] = FP8

#: As ``cuda.RELEASES``, less the fp8 ops (which no release moves out of the matmul family).
RELEASES = {
    release: {category: tuple(op for op in ops if op not in FP8) for category, ops in change.items()}
    for release, change in _CUDA_RELEASES.items()
}
