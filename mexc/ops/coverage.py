"""The op x backend coverage table of docs/ops.md, generated from the registry.

    python -m mexc.ops.coverage > docs/ops.md

tests/unit/test_op_registry.py fails when docs/ops.md differs from this output.
"""

from __future__ import annotations

from mexc.ir import Op
from mexc.ops import REGISTRY
from mexc.ops.registry import DEFINED_IN, OpDef

BACKENDS = ("reference", "llvm", "cuda", "c")


def _role(d: OpDef) -> str:
    if d.boundary:
        return "boundary"
    if d.fused is not None:
        return "frontend, fused"
    if d.compaction:  # fused into its product; alone, derive-backward's (a computed weight's)
        return "pass-internal" if d.reference is None else "backward"
    if d.op is Op.ALL_REDUCE:
        return "data parallel"
    if d.vjp is not None or d.no_grad:
        return "forward"
    return "optimizer" if d.updates_state else "backward"


def table() -> str:
    lines = [
        "# Ops and backends",
        "",
        "Generated from the op registry (`mexc/ops`) by `python -m mexc.ops.coverage`; do not",
        "edit. Each op is defined once, in the family module named in the second-last column.",
        "*forward* ops come from the frontend or, fused with their compaction, from",
        "fuse-products (*frontend, fused* ops never reach a backend; `compact`, fused into its",
        "product, does alone only as a computed weight's gradient); *backward* ops come from",
        "derive-backward, *optimizer* ops from",
        "insert-optimizer, *data parallel* ones from shard-batch. llvm and cuda share the TIR",
        "lowering. A backend without an op refuses the model with an error that names the node.",
        "*split* says whether a data-parallel worker can run the op on its rows of the batch",
        '(`OpDef.data_parallel`, docs/distributed.md); "-" where the op never reads the batch.',
        "",
        "| op | role | " + " | ".join(BACKENDS) + " | split | defined in | what it computes |",
        "|---|---|" + "---|" * len(BACKENDS) + "---|---|---|",
    ]
    for op, d in REGISTRY.items():
        if _role(d) in ("pass-internal", "frontend, fused"):
            marks = ["-"] * len(BACKENDS)
        else:
            marks = ["yes" if d.supports(b) else "no" for b in BACKENDS]
        batchless = d.boundary or d.updates_state or _role(d) == "data parallel"
        split = "yes" if d.may_split else "no"
        marks.append("-" if batchless and split == "no" else split)
        lines.append(
            f"| `{op.value}` | {_role(d)} | "
            + " | ".join(marks)
            + f" | `{DEFINED_IN[op]}` | {d.doc} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
