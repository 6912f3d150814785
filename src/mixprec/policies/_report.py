"""docs/policies.md, rendered from the policy tables.

Regenerate with ``python -m mixprec.policies._report > docs/policies.md``; a test
checks that the committed file matches.
"""

from __future__ import annotations

import mixprec.policies as policies
from mixprec.policies._policy import Category, Policy

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
        f"`{n}`: {documented.table[n].value} in the docs, {default.table[n].value} in torch 2.13"
        for n in names
        if n in default.table and n in documented.table and default.table[n] is not documented.table[n]
    ]
    lines = [f"### {default.name} vs {documented.name}", ""]
    lines.append(f"- Listed by torch 2.13 only: {_ops(only_default)}")
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
    "mixprec's kernels reuse a weight's cast only inside a mixprec region (whose exit clears the cache), "
    "never under `no_grad` (a copy made there has no autograd history), and recast a weight whose version "
    "counter moved. In a plain `torch.autocast` region through mixprec's kernels each use is cast anew.",
)


def _divergences() -> list[str]:
    lines = ["## How the tables apply", ""]
    lines += [f"- {text}" for text in _BEHAVIOUR]
    return [*lines, ""]


def render() -> str:
    """The whole of docs/policies.md."""
    lines = [
        "# Autocast policies",
        "",
        "Generated from `src/mixprec/policies/` by `python -m mixprec.policies._report`; do not edit.",
        "",
        "`CPU` and `CUDA` reproduce torch 2.13's native autocast; `CPU_DOCUMENTED` and",
        "`CUDA_DOCUMENTED` hold the lists of the torch.cpu.amp and torch.cuda.amp references;",
        "`XPU` is the XPU AMP guide's list.",
        "",
        "Each is a starting point: `Policy.with_ops` / `without_ops` derive a changed policy,",
        "`Policy.from_file` reads one from TOML, and `mixprec.explain(op)` says which table an op's",
        "category comes from (see the README's tour).",
        "",
        "## Where the defaults and the documented lists differ",
        "",
    ]
    for default, documented in _COMPARISONS:
        lines += _difference(getattr(policies, default), getattr(policies, documented))
    lines += _divergences()
    lines += ["## The tables", ""]
    for name in policies.BUILTIN:
        lines += _listing(getattr(policies, name))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
