"""The graph pass: apply an autocast policy to an aten-level FX graph.

``apply_policy(gm, policy, dtype)`` takes a GraphModule traced without autocast
(from ``torch.export`` or ``make_fx``) and returns a new one in which every op
runs in the dtype its policy category asks for, with as few casts as the rules
allow. See :func:`apply_policy`.
"""

from mixprec.graph._apply import apply_policy, cast_nodes

__all__ = ["apply_policy", "cast_nodes"]
