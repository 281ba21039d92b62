# ruff: noqa: E501  (the report lines are long on purpose: one row per measurement)
"""Slopes from results.jsonl, between the smallest and the largest batch measured: python analyze.py [results.jsonl]"""

from __future__ import annotations

import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results.jsonl")
rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
# a model measured again on newer code (rows tagged with two commits or more): only the rows
# of its last commit
codes: dict = defaultdict(list)
for r in rows:
    if r.get("code") and r["code"] not in codes[r["model"]]:
        codes[r["model"]].append(r["code"])
rows = [r for r in rows if len(codes[r["model"]]) < 2 or r.get("code") == codes[r["model"]][-1]]
groups: dict = defaultdict(list)
for r in rows:
    groups[(r["model"], r.get("target", "llvm"), r["batch"], r["who"])].append(r)

MiB, KiB = 1 << 20, 1024


def med(xs):
    return st.median(xs) if xs else float("nan")


models = sorted({(r["model"], r.get("target", "llvm")) for r in rows if r["who"] == "mexc"})
for model, target in models:
    bs = sorted({b for (m, t, b, w) in groups if m == model and t == target and w == "mexc"})
    if len(bs) < 2:
        continue
    b1, b2 = bs[0], bs[-1]
    out = {}
    for b in (b1, b2):
        mx = groups[(model, target, b, "mexc")]
        warm = mx[1:] if len(mx) > 1 else mx  # the first process at a batch compiled cold
        fp = groups[(model, "llvm", b, "fp32")]
        out[b] = {
            "alloc": med([r["report"]["allocated_bytes"] for r in warm]) / KiB,
            "planned": med(
                [
                    r["report"]["planned_persistent_bytes"] + r["report"]["planned_arena_bytes"]
                    for r in warm
                ]
            )
            / KiB,
            "formula": med([r["report"]["formula_int_bytes"] for r in warm]) / KiB,
            "m_hwm": med([r["hwm_total"] for r in warm]),
            "m_hwm_steps": med([r["hwm_steps"] for r in warm]),
            "m_rss_c": med([r["rss_compiled"] for r in warm]),
            "m_runs": [r["hwm_total"] for r in warm],
            "m_cold_hwm": mx[0]["hwm_total"] if len(mx) > 1 else None,
            "fp_peak": med([r["fp32"]["peak_bytes"] for r in fp]) / KiB,
            "fp_persist": med([r["fp32"]["persistent_bytes"] for r in fp]) / KiB,
            "fp_hwm": med([r["hwm_total"] for r in fp]),
            "fp_runs": [r["hwm_total"] for r in fp],
            "step_s": med([r["step_s"] for r in warm]),
            "compile_s": med([r["compile_s"] for r in warm]),
            "cold_compile_s": mx[0]["compile_s"] if len(mx) > 1 else None,
        }
    d = b2 - b1
    s = {
        k: (out[b2][k] - out[b1][k]) / d
        for k in (
            "alloc",
            "planned",
            "formula",
            "m_hwm",
            "m_hwm_steps",
            "fp_peak",
            "fp_hwm",
        )
    }
    print(f"== {model} ({target})  B={b1},{b2}")
    for b in (b1, b2):
        o = out[b]
        print(
            f"  B={b:4d} alloc {o['alloc'] / 1024:8.2f} MiB  planned {o['planned'] / 1024:8.2f}  formula {o['formula'] / 1024:8.2f}"
            f" | FP32 prof peak {o['fp_peak'] / 1024:8.2f} MiB (persist {o['fp_persist'] / 1024:.2f})  ratio {o['alloc'] / o['fp_peak']:.3f}"
        )
        print(
            f"         mexc HWM {o['m_hwm'] / 1024:8.1f} MiB runs {o['m_runs']} steps-HWM {o['m_hwm_steps'] / 1024:8.1f} cold-HWM {o['m_cold_hwm']}"
            f" | FP32 HWM {o['fp_hwm'] / 1024:8.1f} runs {o['fp_runs']}"
        )
        print(
            f"         compile {o['compile_s']:.1f}s (cold {o['cold_compile_s']}) step {o['step_s'] * 1000:.1f} ms"
        )
    print(
        f"  slope KiB/sample: alloc {s['alloc']:8.1f}  planned {s['planned']:8.1f}  formula {s['formula']:8.1f}"
        f"  FP32 prof {s['fp_peak']:8.1f}  ratio {s['alloc'] / s['fp_peak'] if s['fp_peak'] else float('nan'):.3f}"
    )
    print(
        f"  slope KiB/sample: mexc HWM {s['m_hwm']:8.1f} (steps-HWM {s['m_hwm_steps']:8.1f})  FP32 HWM {s['fp_hwm']:8.1f}"
        f"  ratio {s['m_hwm'] / s['fp_hwm'] if s['fp_hwm'] else float('nan'):.3f}   RSS/alloc {s['m_hwm'] / s['alloc'] if s['alloc'] else float('nan'):.2f}"
    )
    print(
        f"  fixed (intercept at B=0) KiB: alloc {out[b1]['alloc'] - b1 * s['alloc']:.0f}  FP32 prof {out[b1]['fp_peak'] - b1 * s['fp_peak']:.0f}"
        f"  mexc HWM {out[b1]['m_hwm'] - b1 * s['m_hwm']:.0f}  FP32 HWM {out[b1]['fp_hwm'] - b1 * s['fp_hwm']:.0f}"
    )
