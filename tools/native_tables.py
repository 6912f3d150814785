"""What the installed torch's native autocast covers, against mixprec's default tables.

    python tools/native_tables.py            # run it in each release's venv: .nox/tests-2-15/bin/python ...

For each device it prints the ops torch registers at the Autocast key and the ops the default table lists
for this release, and what differs: the input for a new release's entry in ``RELEASES``
(``src/mixprec/policies/cpu.py``, ``cuda.py``). For each op torch adds, it prints the dtypes the op gives
under native autocast for low- and high-precision inputs, which tell its category: CPU ops run on CPU
tensors; CUDA ops run on fake CUDA tensors, which reach the AutocastCUDA kernels on a machine with no GPU.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _fake_cuda(dtype: torch.dtype) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    meta = torch.randn(4, 4, dtype=torch.float32, device="meta").to(dtype)
    return mode, FakeTensor(mode, meta, torch.device("cuda", 0))


def _probe(device_type: str, name: str) -> str:
    """``low -> dtype, high -> dtype`` for a one-matrix call of ``aten::name`` under native autocast."""
    op = getattr(torch.ops.aten, name, None)
    if op is None or "default" not in op.overloads():
        return "no default overload to probe"
    low_dtype = torch.bfloat16 if device_type == "cpu" else torch.float16
    found = []
    for given in (low_dtype, torch.float32):
        try:
            if device_type == "cpu":
                spd = torch.randn(4, 4, dtype=torch.float64)
                x = (spd @ spd.T + torch.eye(4, dtype=torch.float64)).to(given)
                with torch.autocast("cpu", dtype=low_dtype):
                    found.append(f"{given} -> {op.default(x).dtype}")
            else:
                mode, x = _fake_cuda(given)
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", low_dtype)
                try:
                    with mode:
                        found.append(f"{given} -> {op.default(x).dtype}")
                finally:
                    torch.set_autocast_enabled("cuda", False)
        except Exception as error:  # an op that takes other inputs: read its category off torch's source
            found.append(f"{given} -> {type(error).__name__}")
    return ", ".join(found)


def main() -> int:
    from mixprec import _compat
    from mixprec.engine import _tables

    print(f"torch {torch.__version__}; mixprec's tables for torch {_compat.table_release()}")
    differs = False
    for device_type in ("cpu", "cuda"):
        key = _tables.autocast_key(device_type)
        if key is None:
            print(f"{device_type}: no Autocast key")
            continue
        torch_ops, table = _tables.native_difference(device_type, key)
        print(f"{device_type}: {len(torch_ops)} ops at {key}, {len(table)} in the default table")
        for name in sorted(torch_ops - table):
            differs = True
            print(f"  torch adds {name}: {_probe(device_type, name)}")
        for name in sorted(table - torch_ops):
            differs = True
            print(f"  torch does not register {name}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
