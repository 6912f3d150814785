"""mixprec.autocast("cuda") against native torch.autocast("cuda") over torch's OpInfo and ModuleInfo databases.

The CPU comparison (``tests/test_cpu_opinfo.py``) on the GPU: every OpInfo whose CUDA dtypes include float32
and every ModuleInfo, under float16 and bfloat16, with every overload torch registers at AutocastCUDA given a
mixprec kernel, so mixprec's Python kernels run, not torch's. Outputs must be native's, bit for bit, or raise
what native raises. Native runs twice: a case whose two native runs differ (some CUDA kernels are
nondeterministic) is compared within float32 tolerance, or by dtypes and shapes only if native is not even
close to itself; ops that return uninitialised memory are compared by dtype and shape, as on CPU.
"""

from __future__ import annotations

import pytest
import torch

from test_cpu_opinfo import (
    LAST_BITS_NONDETERMINISTIC,
    LOW,
    MODULES,
    OP_DB,
    _check,
    _key,
    _module_cases,
    _op_cases,
    _uninitialised,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("error::mixprec.MixprecWarning"),
]

_CUDA_BUILD = torch.version.cuda is not None
#: The OpInfos with float32 support on CUDA (read from a CUDA build's database; on a CPU build, the CPU's).
OPS = {_key(o): o for o in OP_DB if torch.float32 in o.supported_dtypes("cuda" if _CUDA_BUILD else "cpu")}


@pytest.mark.parametrize("autocast_dtype", LOW.values(), ids=LOW.keys())
@pytest.mark.parametrize("key", sorted(OPS))
def test_op_matches_native_on_the_gpu(key: str, autocast_dtype: torch.dtype, device: str) -> None:
    opinfo = OPS[key]
    if torch.float32 not in opinfo.supported_dtypes(device):
        pytest.skip(f"{key} has no float32 on {device}")
    values = "none" if _uninitialised(opinfo) else "close" if key in LAST_BITS_NONDETERMINISTIC else "bits"
    _check(key, _op_cases(opinfo, autocast_dtype, device), autocast_dtype, values, device, calibrate=True)


@pytest.mark.parametrize("autocast_dtype", LOW.values(), ids=LOW.keys())
@pytest.mark.parametrize("key", sorted(MODULES))
def test_module_matches_native_on_the_gpu(key: str, autocast_dtype: torch.dtype, device: str) -> None:
    _check(key, _module_cases(MODULES[key], autocast_dtype, device), autocast_dtype, "bits", device, calibrate=True)
