"""plan-memory: liveness over the joint graph and a static arena plan.

Requires: the training-step graph (after insert-optimizer).
Ensures: the graph is unchanged; ctx.results["memory_plan"] holds a `MemoryPlan`: every value
  classified as persistent (parameters and optimizer state), saved (a forward value read by the
  backward pass) or transient, its size in bytes, its live interval, and a first-fit offset in one
  static arena for the non-persistent values (values whose lifetimes do not overlap share bytes).
  Graph attributes record the totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from mexc.arena import live_peak, place
from mexc.ir import Graph, Op, Value
from mexc.ops import op_def
from mexc.pass_manager import PassContext
from mexc.types import Kind, TensorType


def type_bytes(t: TensorType) -> int:
    """Storage of a value: int8 mantissas plus one int32 per exponent, int32 accumulators, ..."""
    n = t.numel
    if t.kind is Kind.MX:
        groups = t.shape[0] if t.exp is not None and t.exp.value == "axis0" and t.shape else 1
        return n + 4 * groups
    if t.kind is Kind.ACC:
        groups = t.shape[0] if t.exp is not None and t.exp.value == "axis0" and t.shape else 1
        return 4 * n + 4 * groups
    if t.kind is Kind.IDX:
        return n
    if t.kind is Kind.I16:
        return 2 * n
    if t.kind is Kind.I64:
        return 8 * n
    return 4 * n


@dataclass(frozen=True)
class Slot:
    value: Value
    kind: str  # "persistent" | "saved" | "transient"
    nbytes: int
    start: int  # position of the defining node
    end: int  # position of the last use
    offset: int  # arena offset (persistent values: offset in the state area)
    alias_of: Value | None = None  # computed in place over this value's bytes


@dataclass(frozen=True)
class MemoryPlan:
    slots: tuple[Slot, ...]
    persistent_bytes: int
    saved_bytes: int
    arena_bytes: int  # peak of the non-persistent arena (saved + transient, first-fit)
    param_count: int
    saved_elements: int

    def by_kind(self, kind: str) -> int:
        return sum(s.nbytes for s in self.slots if s.kind == kind)


def _positions(g: Graph) -> dict[int, int]:
    dag = nx.DiGraph()
    for n in g.nodes:
        dag.add_node(n.id)
        for v in n.inputs:
            dag.add_edge(v.node, n.id)
    order = list(nx.topological_sort(dag))
    listed = [n.id for n in g.nodes]
    assert set(order) == set(listed), "graph edges refer to unknown nodes"
    return {nid: i for i, nid in enumerate(listed)}


def _in_place_roots(
    g: Graph,
    pos: dict[int, int],
    last_use: dict[Value, int],
    in_arena: set[Value],
    over: Mapping[Value, Value],
) -> dict[Value, Value]:
    """Results of in-place ops (OpDef.in_place) that may reuse their input's bytes -> the value
    owning them. A view (OpDef.view) shares its input's bytes for as long as either lives (values
    are never written after their node); any other in-place op only where no value sharing its
    input's bytes is read after it."""
    roots: dict[Value, Value] = {}
    group_end: dict[Value, int] = {}  # root -> the last read of any value on its bytes
    for n in g.nodes:
        d = op_def(n.op)
        for i in range(len(n.types)):
            res = n.result(i)
            if res in over:  # a backend's rule: its own input, any size that holds the result
                src = over[res]
                fits = type_bytes(g.type_of(src)) >= type_bytes(n.types[i])
            elif i == 0 and d.in_place and n.inputs:
                src = n.inputs[0]
                fits = type_bytes(g.type_of(src)) == type_bytes(n.type)
            else:
                continue
            if src not in in_arena or res not in in_arena or not fits:
                continue
            root = roots.get(src, src)
            end = max(group_end.get(root, last_use[src]), last_use[src])
            if (d.view and res not in over) or end == pos[n.id]:
                roots[res] = root
                group_end[root] = max(end, last_use.get(res, pos[n.id]))
    return roots


@dataclass(frozen=True)
class StorageRules:
    """Where a backend stores values otherwise than plan-memory's default (the C step's:
    mexc.backends.c.emit.storage_rules): the planner is the same."""

    sizes: Mapping[Value, int] = field(default_factory=dict)  # bytes (0: never stored)
    read_at: Mapping[Value, int] = field(default_factory=dict)  # value -> a later reader's id
    # result -> an input whose bytes it takes where that input's bytes die at its node
    over: Mapping[Value, Value] = field(default_factory=dict)


def plan(g: Graph, rules: StorageRules | None = None, estimate: bool = False) -> MemoryPlan:
    """The memory plan of g, with a backend's storage rules. estimate: arena_bytes is the live
    peak (no placement is lower) and no value has an offset: a cheap way to compare storage
    choices."""
    rules = rules or StorageRules()
    pos = _positions(g)
    head = next((pos[n.id] for n in g.nodes if op_def(n.op).loss_head), len(g.nodes))
    last_use: dict[Value, int] = {}
    backward_reads: set[Value] = set()
    for n in g.nodes:
        for v in n.inputs:
            last_use[v] = max(last_use.get(v, 0), pos[n.id])
            if pos[n.id] > head and pos[v.node] <= head:
                backward_reads.add(v)
    end = len(g.nodes)
    for _, v in g.outputs:
        last_use[v] = end
    for v, reader in rules.read_at.items():
        last_use[v] = max(last_use.get(v, 0), pos[reader])
    slots: list[Slot] = []
    arena_items = []
    state_offset = 0
    params = 0
    saved_elems = 0
    for n in g.nodes:
        for i, t in enumerate(n.types):
            v = n.result(i)
            size = rules.sizes.get(v, type_bytes(t))
            if n.op in (Op.PARAM, Op.STATE):
                slots.append(Slot(v, "persistent", size, pos[n.id], end, state_offset))
                state_offset += (size + 15) // 16 * 16
                params += t.numel if n.op is Op.PARAM else 0
                continue
            if n.op is Op.INPUT or op_def(n.op).updates_state:
                continue  # the batch lives in the caller's buffer; updates write state in place
            if v not in last_use or size == 0:
                continue  # never read (e.g. BN dx of layer one) or never stored: no bytes
            kind = "saved" if v in backward_reads and n.op not in (Op.LABEL,) else "transient"
            if kind == "saved":
                saved_elems += t.numel
            start, stop = pos[n.id], last_use.get(v, pos[n.id])
            arena_items.append((start, stop, size, v))
            slots.append(Slot(v, kind, size, start, stop, -1))
    roots = _in_place_roots(g, pos, last_use, {v for *_, v in arena_items}, rules.over)
    merged: dict[Value, tuple[int, int, int]] = {}
    for start, stop, size, v in arena_items:
        r = roots.get(v, v)
        a, b, sz = merged.get(r, (start, stop, size))
        merged[r] = (min(a, start), max(b, stop), max(sz, size))
    items = [(a, b, sz, r) for r, (a, b, sz) in merged.items()]
    offsets: Mapping[Any, int]
    if estimate:
        offsets, peak = {r: -1 for r in merged}, live_peak(items, 16)
    else:
        offsets, peak = place(items)
    slots = [
        s
        if s.kind == "persistent"
        else Slot(
            s.value,
            s.kind,
            s.nbytes,
            s.start,
            s.end,
            offsets[roots.get(s.value, s.value)],
            roots.get(s.value),
        )
        for s in slots
    ]
    return MemoryPlan(
        tuple(slots),
        sum(s.nbytes for s in slots if s.kind == "persistent"),
        sum(s.nbytes for s in slots if s.kind == "saved" and s.alias_of is None),
        peak,
        params,
        saved_elems,
    )


def plan_memory(g: Graph, ctx: PassContext) -> Graph:
    """Compute the memory plan and record its totals as graph attributes."""
    mp = plan(g)
    ctx.results["memory_plan"] = mp
    return g.with_attrs(
        mem_persistent=mp.persistent_bytes, mem_saved=mp.saved_bytes, mem_arena=mp.arena_bytes
    )
