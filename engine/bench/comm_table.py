"""The readable table of ``polis bench comm`` (engine.bench.comm): one line per scheme.

Columns: the seeds run, replica-update bytes per trained sample, the reduction against int8 every step,
the other wire bytes per sample (activations, tokens, control), the final held-out accuracy
(mean over seeds) with its gap to dense fp32 at the last eval and averaged over the evals,
versions per minute on loopback and over the ``--wan`` profile, and whether the row meets
the issue's target; under a row that changes the activation encoding, its other wire bytes and
accuracy against the ``act_fp32`` row. It knows the row fields ``comm.run`` writes and nothing else.
"""

from __future__ import annotations

from typing import Any, TextIO


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any], out: TextIO) -> None:
    wan = result.get("wan")
    seeds = result.get("seeds") or [0]
    print(f"{result['versions']} versions per run, seeds {','.join(map(str, seeds))}"
          + (" (contended: wall clock not comparable)" if result.get("contended") else ""), file=out)
    header = (f"{'scheme':<28} {'seeds':>5} {'upd B/sample':>12} {'vs int8':>8} {'other B/s':>10} {'acc':>6} "
              f"{'gap':>6} {'mean gap':>8} {'v/min':>6}" + (f" {wan[:10] + ' v/min':>16}" if wan else "") + "  target")
    print(header, file=out)
    for r in result["rows"]:
        red = r.get("update_reduction_vs_int8_every_step")
        line = (f"{r['scheme']:<28} {len(r.get('seeds') or [0]):>5} {r['update_bytes_per_sample']:>12.1f} "
                f"{(f'{red:.3g}x' if red else '-'):>8} "
                f"{r['other_wire_bytes_per_sample']:>10.0f} {r['accuracy_final']:>6.3f} "
                f"{_fmt(r.get('accuracy_gap_points_vs_dense'), '+.1f'):>6} "
                f"{_fmt(r.get('accuracy_gap_points_vs_dense_mean'), '+.1f'):>8} "
                f"{_fmt(r.get('versions_per_min'), '.0f'):>6}")
        if wan:
            line += f" {_fmt((r.get('wan') or {}).get('versions_per_min'), '.1f'):>16}"
        print(line + ("  met" if r.get("meets_target") else "  -"), file=out)
        if r.get("other_wire_reduction_vs_act_fp32") is not None:
            reduction = r["other_wire_reduction_vs_act_fp32"]
            print(f"{'':<28} activations: {reduction:.3g}x fewer other bytes than act_fp32, "
                  f"gap {_fmt(r.get('accuracy_gap_points_vs_act_fp32'), '+.1f')} / mean "
                  f"{_fmt(r.get('accuracy_gap_points_vs_act_fp32_mean'), '+.1f')} (16x within 5 points: "
                  f"{'met' if r.get('meets_activation_target') else 'not met'})", file=out)
    if result.get("weight_deltas"):
        from engine.bench.weight_stream import format_table

        print(format_table(result["weight_deltas"]), file=out)
