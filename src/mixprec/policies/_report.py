"""docs/policy_tables.md, rendered from the policy tables.

Regenerate with ``python -m mixprec.policies._report > docs/policy_tables.md``; a test
checks that the committed file matches.
"""

from __future__ import annotations

import importlib

import mixprec.policies as policies
from mixprec import _compat
from mixprec.policies import Category, Policy

#: The release whose native tables the document lists (the others are listed as differences from 2.13's).
SHOWN = _compat.NEWEST

_COMPARISONS = (("CPU", "CPU_DOCUMENTED"), ("CUDA", "CUDA_DOCUMENTED"))
_NOTES = {
    "XPU": "The guide names `conv_transpose1d` twice and never `conv_transpose2d`; "
    "the table reads the second mention as `conv_transpose2d`.",
}


def _ops(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names)) or "none"


def _listing(policy: Policy) -> list[str]:
    lines = [f"### {policy.name}", ""]
    for category in Category:
        ops = policy.ops(category.value)
        if ops:
            lines.append(f"- **{category.value}** ({len(ops)}): {_ops(list(ops))}")
    if policy.name in _NOTES:
        lines += ["", _NOTES[policy.name]]
    return [*lines, ""]


def _difference(default: Policy, documented: Policy) -> list[str]:
    names = sorted(set(default.table) | set(documented.table))
    only_default = [n for n in names if n not in documented.table]
    only_documented = [n for n in names if n not in default.table]
    moved = [
        f"`{n}`: {documented.table[n].value} in the docs, {default.table[n].value} in torch {SHOWN}"
        for n in names
        if n in default.table and n in documented.table and default.table[n] is not documented.table[n]
    ]
    lines = [f"### {default.name} vs {documented.name}", ""]
    lines.append(f"- Listed by torch {SHOWN} only: {_ops(only_default)}")
    lines.append(f"- Listed by the docs only: {_ops(only_documented)}")
    lines.append("- In another category:" + ("" if moved else " none"))
    lines += [f"  - {m}" for m in moved]
    return [*lines, ""]


#: How a table applies, and where mixprec's kernels differ from torch's on purpose.
_BEHAVIOUR = (
    "Under a device's default policy with native compute, mixprec registers no kernel: torch's own "
    "autocast runs, so the result is native's, bit for bit. Torch registers some ops for a few "
    "overloads only (`softmax.int`, `_convolution.deprecated`); where a policy keeps an op's "
    "category, torch's registrations decide overload by overload.",
    "An op a policy moves, adds or removes gets a mixprec kernel at the device's Autocast key, for "
    "all its functional overloads (an `aten::op.overload` entry: that overload only). `out=` and "
    "in-place overloads are never autocast. A removed op falls through, as an unlisted op does "
    "natively: a composite such as `einsum` decomposes, and the listed ops it reaches are cast.",
    "A banned op raises only when an eligible tensor (floating, on the device, not float64) is among "
    "its inputs; torch's CUDA ban raises for any input.",
    "mixprec's kernels keep a weight's cast in one of two caches (docs/design.md, \"The cast caches\"). "
    "For an op a region's policy or compute changes: mixprec's own, kept inside a mixprec region (whose exit "
    "clears it), never under `no_grad` (a copy made there has no autograd history), and recast when the "
    "weight's version counter moves. For an op run as torch runs it (in a plain `torch.autocast` region "
    "through mixprec's kernels too): a mirror of torch's own cache, with torch's rules, so such a region "
    "casts a weight as often as native does.",
)


def _divergences() -> list[str]:
    lines = ["## How the tables apply", ""]
    lines += [f"- {text}" for text in _BEHAVIOUR]
    return [*lines, ""]


def _shown(name: str) -> Policy:
    """A built-in policy as it is on the release the document shows (documented lists: as they are)."""
    return Policy.from_lists(name, policies.lists(name, SHOWN), base=name)


def _releases() -> list[str]:
    lines = ["## Per torch release", ""]
    lines.append(
        "`CPU` and `CUDA` follow the installed torch: each supported release has its own table, "
        "written as its difference from torch 2.13's in the policy's data module "
        "(`src/mixprec/policies/cpu.py`, `cuda.py`). `mixprec.explain()` and `mixprec policy show` name the "
        "release a table describes."
    )
    lines.append("")
    for name in policies.NATIVE:
        module = importlib.import_module(f"mixprec.policies.{policies.BUILTIN[name]}")
        lines += [f"### {name}", ""]
        for release, change in module.RELEASES.items():
            parts = [f"adds {category} {_ops(list(ops))}" for category, ops in change.items() if category != "removed"]
            if change.get("removed"):
                parts.append(f"does not list {_ops(list(change['removed']))}")
            lines.append(f"- torch {release}: " + ("; ".join(parts) if parts else "as 2.13"))
        lines.append("")
    return lines


def render() -> str:
    """The whole of docs/policy_tables.md."""
    lines = [
        "# The policy tables",
        "",
        "Generated from `src/mixprec/policies/` by `python -m mixprec.policies._report`; do not edit.",
        "",
        "`CPU` and `CUDA` reproduce the installed torch's native autocast, one table per supported",
        f"release (torch {_compat.OLDEST} to {_compat.NEWEST}); the tables below are torch {SHOWN}'s, and",
        "\"Per torch release\" says how the others differ. `CPU_DOCUMENTED` and `CUDA_DOCUMENTED` hold the",
        "lists of the torch.cpu.amp and torch.cuda.amp references; `XPU` is the XPU AMP guide's list.",
        "",
        "Each is a starting point: `Policy.with_ops` / `without_ops` derive a changed policy,",
        "`Policy.from_file` reads one from TOML, and `mixprec.explain(op)` says which table an op's",
        "category comes from (see [Policies](policies.md)).",
        "",
        "## Where the defaults and the documented lists differ",
        "",
    ]
    for default, documented in _COMPARISONS:
        lines += _difference(_shown(default), _shown(documented))
    lines += _divergences()
    lines += _releases()
    lines += [f"## The tables (torch {SHOWN})", ""]
    for name in policies.BUILTIN:
        lines += _listing(_shown(name))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
