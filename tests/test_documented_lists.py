"""The documented policies hold the lists of the documents they transcribe.

The op lists are parsed here from the seed documents themselves (000: the
torch.cpu.amp reference, 001: the torch.cuda.amp reference, 002: the XPU AMP
guide), so that these tests follow the documents, not a copy of the tables.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import mixprec
from mixprec.policies import _resolve

#: The reference documents: ``../shared/seeds`` beside the checkout (where CI puts them).
SEEDS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "seeds"
DOCUMENTS = {"CPU_DOCUMENTED": "000_*.txt", "CUDA_DOCUMENTED": "001_*.txt", "XPU": "002_*.txt"}
if not SEEDS.is_dir():  # a clone with nothing beside it: the comparison needs the documents themselves
    pytest.skip(
        f"the seed documents are not beside this checkout ({SEEDS} is missing); "
        "they are the specification the documented policies are compared with",
        allow_module_level=True,
    )

_HEADING = re.compile(r"Ops that (?:can autocast to `+(\w+)`+|promote to the widest input type)")
_ITEM = re.compile(r"^,?\s*(`+)([^`]+)\1\s*,?$")  # ``conv1d``, / `conv1d` / , `conv2d`
_PREFER = re.compile(r"Prefer ``(\w+)`` over ``(\w+)``")  # 001: the banned op and its safe alternative
_TABLE_RULE = re.compile(r"^[|\s]+|[|\s]+$")  # 001 is wrapped in a two-column table

#: Names of the docs that torch 2.13 no longer has (only deprecation stubs that raise remain).
REMOVED = ("eig", "lstsq", "matrix_rank", "solve", "symeig")


def _document(policy: str) -> str:
    found = sorted(SEEDS.glob(DOCUMENTS[policy]))
    if len(found) != 1:
        pytest.fail(f"the seed document {DOCUMENTS[policy]} for {policy}: expected one file in {SEEDS}, found {found}")
    (path,) = found
    return path.read_text()


def _sections(text: str) -> dict[str, list[str]]:
    """``{heading dtype or 'promote': [op names]}``: the items listed under each "Ops that ..." heading.

    A section's list is the run of lines that hold a single backticked name; it
    ends at the first other line after it started (prose before it is skipped).
    """
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    started = False
    for raw in text.splitlines():
        line = _TABLE_RULE.sub("", raw)
        heading = _HEADING.search(line)
        if heading:
            current = sections.setdefault(heading.group(1) or "promote", [])
            started = False
        elif current is not None and line:
            item = _ITEM.match(line)
            if item:
                current.append(item.group(2).strip())
                started = True
            elif started:
                current = None
    return sections


def _category(section: str) -> str:
    return {"float32": "fp32", "promote": "promote"}.get(section, "lower_precision_fp")


def _documented(policy: str) -> dict[str, set[str]]:
    """``{op: {categories the document lists it under}}``, the banned op included."""
    text = _document(policy)
    found: dict[str, set[str]] = {}
    for section, ops in _sections(text).items():
        for op in ops:
            found.setdefault(op, set()).add(_category(section))
    for _safe, banned in _PREFER.findall(text):
        found.setdefault(banned, set()).add("banned")
    return found


DOCUMENTED = {policy: _documented(policy) for policy in DOCUMENTS}
CASES = [
    pytest.param(policy, op, categories, id=f"{policy}-{op}")
    for policy, ops in DOCUMENTED.items()
    for op, categories in sorted(ops.items())
]


@pytest.mark.parametrize(("policy", "op", "categories"), CASES)
def test_documented_op_sits_in_its_documented_category(policy: str, op: str, categories: set[str]) -> None:
    assert len(categories) == 1, f"the document lists {op} under several categories: {sorted(categories)}"
    assert getattr(mixprec.policies, policy).category(op) == next(iter(categories))


def _torch_has(name: str) -> bool:
    """Whether torch 2.13 has the op: as an ATen op, or as a Python function the docs name."""
    if not name.startswith("__") and hasattr(torch.ops.aten, name):
        return True
    return name not in REMOVED and any(
        callable(getattr(namespace, name, None)) for namespace in (torch.Tensor, torch.nn.functional)
    )


@pytest.mark.parametrize(("policy", "op", "categories"), CASES)
def test_resolver_reaches_every_documented_op_torch_has(policy: str, op: str, categories: set[str]) -> None:
    table = getattr(mixprec.policies, policy)
    if _torch_has(op):
        assert _resolve.callables(op), f"torch has {op} but no callable reaches it"
        assert all(table.category(func) == table.category(op) for func in _resolve.callables(op))
    else:
        assert op in REMOVED, f"{op} is neither an ATen op nor a Python function in torch"
        assert op in table.table, f"{op} was dropped from {policy}; removed ops stay as documented"


@pytest.mark.parametrize("op", REMOVED)
def test_removed_ops_are_gone_from_torch_and_kept_in_the_cpu_documented_table(op: str) -> None:
    assert not hasattr(torch.ops.aten, op)
    assert op in DOCUMENTED["CPU_DOCUMENTED"]
    stub = getattr(torch, op, None)
    if stub is not None:  # torch keeps a stub that says the op was removed
        with pytest.raises(RuntimeError, match="removed"):
            stub(torch.eye(2), torch.eye(2)) if op in ("lstsq", "solve") else stub(torch.eye(2))
    assert mixprec.policies.CPU_DOCUMENTED.category(op) == "fp32"


@pytest.mark.parametrize("policy", DOCUMENTS)
def test_every_document_lists_its_sections(policy: str) -> None:
    sections = _sections(_document(policy))
    expected = {"CPU_DOCUMENTED": {"bfloat16", "float32", "promote"},
                "CUDA_DOCUMENTED": {"float16", "float32", "promote"},
                "XPU": {"bfloat16", "float16", "float32", "promote"}}[policy]
    assert set(sections) == expected
    assert all(sections.values()), {s: len(ops) for s, ops in sections.items()}


def test_cuda_document_bans_binary_cross_entropy_with_advice() -> None:
    ((safe, banned),) = _PREFER.findall(_document("CUDA_DOCUMENTED"))
    assert mixprec.policies.CUDA_DOCUMENTED.category(banned) == "banned"
    assert safe in mixprec.policies.CUDA_DOCUMENTED.advice(banned)


#: What a table may hold beyond its document: XPU reads the guide's second
#: ``conv_transpose1d`` as ``conv_transpose2d`` (see policies/xpu.py).
_READINGS = {"XPU": {"conv_transpose2d"}}


@pytest.mark.parametrize("policy", DOCUMENTS)
def test_table_holds_nothing_its_document_does_not_list(policy: str) -> None:
    extra = set(getattr(mixprec.policies, policy).table) - set(DOCUMENTED[policy])
    assert extra == _READINGS.get(policy, set())


def test_xpu_guide_names_conv_transpose1d_twice_and_never_conv_transpose2d() -> None:
    lower = _sections(_document("XPU"))["bfloat16"]
    assert lower.count("conv_transpose1d") == 2
    assert "conv_transpose2d" not in lower
