"""The doctor's self-contained HTML report: the table of ops and a plot embedded as base64 PNG."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; }
th { background: #f0f0f0; } tr.bad td { background: #fde2e2; } code { background: #f4f4f4; padding: 1px 3px; }
"""

_COLUMNS = (
    ("index", "#"), ("phase", "phase"), ("op", "op"), ("module", "module"), ("source", "source"),
    ("input_dtypes", "inputs"), ("output_dtypes", "outputs"), ("casts", "casts"),
    ("max_abs_error", "max abs err"), ("max_rel_error", "max rel err"), ("overflow_fraction", "overflow"),
    ("underflow_fraction", "underflow"), ("nonfinite_outputs", "non-finite out"),
)  # fmt: skip
#: Shown where some op ran in fp8.
_FP8_COLUMNS = (
    ("fp8_format", "fp8"), ("fp8_amax", "input amax"), ("fp8_amax_weight", "weight amax"),
    ("fp8_saturated", "saturated"), ("fp8_flushed", "flushed"), ("fp8_error", "fp8 GEMM err"),
    ("fp8_grad_amax", "grad amax"), ("fp8_grad_saturated", "grad saturated"), ("fp8_grad_flushed", "grad flushed"),
)  # fmt: skip


def plot_png(report: dict[str, Any]) -> bytes:
    """Max relative error per op in execution order; ops holding inf/NaN in red, the first one marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = report["ops"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    finite = [(o["index"], o["max_rel_error"]) for o in ops if o["max_rel_error"] and not o["nonfinite_outputs"]]
    if finite:
        ax.scatter([i for i, _ in finite], [e for _, e in finite], s=14, label="max rel error vs float32")
    bad = [o["index"] for o in ops if o["nonfinite_outputs"]]
    top = max((e for _, e in finite), default=1.0)
    if bad:
        ax.scatter(bad, [top * 2] * len(bad), color="red", marker="x", label="inf/NaN in output")
    first = report["first_nonfinite"]
    if first is not None:
        ax.axvline(first["index"], color="red", linestyle="--", linewidth=1, label=f"first inf/NaN: {first['op']}")
    ax.set_yscale("log")
    ax.set_xlabel("op (execution order; backward rows are parameter gradients)")
    ax.set_ylabel("max relative error")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def render(report: dict[str, Any]) -> str:
    """The whole page, with no external resources."""
    escape = html.escape
    worst = set(report["worst"])
    columns = _COLUMNS + (_FP8_COLUMNS if any(op.get("fp8_format") for op in report["ops"]) else ())
    head = "".join(f"<th>{escape(label)}</th>" for _, label in columns)
    rows = []
    for op in report["ops"]:
        cls = ' class="bad"' if op["nonfinite_outputs"] else ""
        mark = " *" if op["index"] in worst else ""
        cells = "".join(f"<td>{escape(_cell(op[key]))}{mark if key == 'index' else ''}</td>" for key, _ in columns)
        rows.append(f"<tr{cls}>{cells}</tr>")
    first = report["first_nonfinite"]
    suggestion = report["suggestion"]
    summary = "No inf/NaN under autocast." if first is None else (
        f"First inf/NaN: <code>{escape(first['op'])}</code> in module <code>{escape(first['module'] or '(model)')}"
        f"</code> at <code>{escape(first['source'])}</code>."
    )  # fmt: skip
    if suggestion is not None:
        verdict = "fixes it" if suggestion["fixes"] else f"leaves {suggestion['nonfinite_after']} inf/NaN"
        summary += f"<br>Suggestion: <code>{escape(suggestion['code'])}</code> ({verdict}, checked by re-running)."
    image = base64.b64encode(plot_png(report)).decode("ascii")
    title = f"mixprec doctor: {report['target']}"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{_STYLE}</style>"
        f"</head><body><h1>{escape(title)}</h1><p>{escape(report['device'])} autocast, dtype "
        f"{escape(report['dtype'])}, policy {escape(report['policy'])}; backward: {report['backward']}.</p>"
        f"<p>{summary}</p><img alt='max relative error per op' src='data:image/png;base64,{image}'>"
        f"<h2>Ops (* = among the worst)</h2><table><tr>{head}</tr>{''.join(rows)}</table></body></html>\n"
    )


def write_html(report: dict[str, Any], path: Path) -> None:
    path.write_text(render(report), encoding="utf-8")
