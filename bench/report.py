"""Markdown tables from a bench/run.py result."""

from __future__ import annotations

import json
from pathlib import Path

from bench.run import Q4_FILES


def _fmt(x: float | str | None) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _ratio(a: float | str | None, b: float | str | None) -> str:
    if not a or not b or isinstance(a, str) or isinstance(b, str):
        return "—"
    return f"**{a / b:.2f}x**"


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:,.0f}"


def _cells(result: dict, mode: str) -> dict:
    """{(arch, quant): {cell label: {side: numbers}}} for one pass."""
    out: dict = {}
    for c in result["passes"].get(mode, {}).get("cells", []):
        out.setdefault((c["arch"], c["quant"]), {})[c["cell"]] = dict(c["sides"], _kind=c["kind"])
    return out


def _value(cell: dict | None, side: str) -> float | str | None:
    if not cell or side not in cell:
        return None
    if "error" in cell[side]:
        return "fails"
    key = "decode_tps" if cell["_kind"] == "decode" else "prefill_tps"
    return cell[side][key]


def _table(result: dict, ours: tuple[str, str], peer: tuple[str, str], title: str) -> str:
    """One table: rows arch x quant; ours = (pass, side), peer = (pass, side)."""
    o_cells, p_cells = _cells(result, ours[0]), _cells(result, peer[0])
    labels: list[str] = []
    for cells in (o_cells, p_cells):
        for per_arch in cells.values():
            for label in per_arch:
                if label not in labels:
                    labels.append(label)
    labels.sort(key=lambda s: (s.startswith("decode"), int(s.replace("@", " ").split()[-1])))
    head = ["model", "weights"]
    for label in labels:
        head += [f"{label} {ours[1]}", peer[1], "ratio"]
    head += ["peak MiB mlxc / peer", "KV B/token mlxc / peer"]
    lines = [f"**{title}** (tokens/s; ratio = mlxc / {peer[1]})", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(set(o_cells) | set(p_cells), key=lambda k: (k[0], k[1] != "bf16")):
        oc, pc = o_cells.get(key, {}), p_cells.get(key, {})
        row = [key[0], key[1]]
        for label in labels:
            a, b = _value(oc.get(label), ours[1]), _value(pc.get(label), peer[1])
            row += [_fmt(a), _fmt(b), _ratio(a, b)]
        o_ok = [c[ours[1]] for c in oc.values() if "peak_bytes" in c.get(ours[1], {})]
        p_ok = [c[peer[1]] for c in pc.values() if "peak_bytes" in c.get(peer[1], {})]
        o_any, p_any = (o_ok or [None])[0], (p_ok or [None])[0]
        o_peak = max((c["peak_bytes"] for c in o_ok), default=None)
        p_peak = max((c["peak_bytes"] for c in p_ok), default=None)
        row.append(f"{_mib(o_peak)} / {_mib(p_peak)}")
        kv_o = o_any["kv_bytes_per_token"] if o_any else None
        kv_p = p_any["kv_bytes_per_token"] if p_any else None
        row.append(f"{_fmt(kv_o)} / {_fmt(kv_p)}")
        lines.append("| " + " | ".join(row) + " |")
    dtypes = sorted(
        {
            f"{side}: {c[side]['dtype']}"
            for cells, side in ((o_cells, ours[1]), (p_cells, peer[1]))
            for per in cells.values()
            for c in per.values()
            if side in c
        }
    )
    lines += ["", "Compute dtypes: " + "; ".join(dtypes) + "."]
    errors = sorted(
        {
            f"{side} cannot run {arch} {quant} here: {c[side]['error']}"
            for cells, side in ((o_cells, ours[1]), (p_cells, peer[1]))
            for (arch, quant), per in cells.items()
            for c in per.values()
            if "error" in c.get(side, {})
        }
    )
    lines += [f"`fails`: {e}" for e in errors]
    stalled = sorted(
        f"{side} {arch} {quant} ({_fmt(c[side]['decode_tps'])} tokens/s overall, "
        f"{_fmt(1e3 / c[side]['decode_step_ms_median'])} at its median step, longest step "
        f"{c[side]['decode_step_ms_max']:.0f} ms)"
        for cells, side in ((o_cells, ours[1]), (p_cells, peer[1]))
        for (arch, quant), per in cells.items()
        for c in per.values()
        if _stalled(c.get(side, {}))
    )
    if stalled:
        lines.append(
            "Decode runs with stalls (a mean rate under 0.8x that of the median step: some steps "
            "waited, e.g. on the machine or a compile): " + "; ".join(stalled) + "."
        )
    return "\n".join([*lines, ""])


def _stalled(numbers: dict) -> bool:
    """Whether a decode cell's mean rate is well under its median step's (runs from before the
    per-step times were recorded have none)."""
    median = numbers.get("decode_step_ms_median")
    return bool(median and numbers.get("decode_tps")) and numbers["decode_tps"] < 0.8e3 / median


def markdown(result: dict) -> str:
    m = result["machine"]
    s = result["settings"]
    lines = [
        f"### Benchmark: {m['device'].upper()}, size {result['size']}",
        "",
        (
            f"`{result['command']}` — {m.get('cpu', '')} ({m.get('cpus')} CPUs), "
            f"{m.get('device_info', {}).get('device_name', '')} mlx {m.get('mlx')}, "
            f"mlx-lm {m.get('mlx_lm')}, mlxc {m.get('mlxc')} @ {m.get('commit', '?')}; "
            f"{result['wall_s']:.0f} s."
        ),
        "",
        (
            f"Parameters: {', '.join(f'{a} {n / 1e6:.0f}M' for a, n in result['params'].items())}. "
            f"Random weights, bf16 checkpoints; q4 = 4-bit, group {s['quantization']['group_size']} "
            f"({s['quantization'].get('q4_file', Q4_FILES['each'])}). `prefill N`: N-token prompt, "
            "tokens/s to the first token; `decode@P`: greedy tokens/s after a P-token prompt "
            f"(up to {s['decode_tokens']} tokens). Median of up to {s['repeats']} interleaved "
            "repeats. Peak memory: own weights + the run's extra peak. Prefill chunks: each side's "
            f"default (mlxc {m.get('mlxc_prefill_chunk', '?')}, mlx-lm 2048)."
        ),
        "",
    ]
    passes = result["passes"]
    kv = s.get("kv_quantization")
    for mode in passes if kv else ():
        # Quantised KV against float KV, the same model in the same run.
        side = f"mlxc kv{kv['bits']}"
        title = (
            f"{mode} pass: mlxc on {kv['bits']}-bit KV (`--kv-bits {kv['bits']}`, group "
            f"{kv['group_size']}) vs float KV"
        )
        lines.append(
            _table(result, (mode, side), (mode, "mlxc"), title).replace(
                "ratio = mlxc / mlxc", f"ratio = kv{kv['bits']} / float KV"
            )
        )
    if "gpu" in passes:
        lines.append(_table(result, ("gpu", "mlxc"), ("gpu", "mlx-lm"), "mlxc vs mlx-lm"))
    if "openblas" in passes and "reference" in passes:
        lines.append(
            _table(
                result,
                ("openblas", "mlxc"),
                ("reference", "mlx-lm"),
                "vs mlx-lm as users run it today (mlxc: OpenBLAS, float32; mlx-lm: its "
                "bundled reference BLAS, bf16 weights as loaded)",
            )
        )
    if "openblas" in passes:
        blas = passes["openblas"]["blas"]["name"]
        lines.append(
            _table(
                result,
                ("openblas", "mlxc"),
                ("openblas", "mlx-lm f32"),
                f"kernel level: the same BLAS ({blas}) and float32 weights on both sides",
            )
        )
    if "reference" in passes:
        peer = ("openblas", "mlxc") if "openblas" in passes else ("reference", "mlx-lm")
        if "openblas" in passes:
            lines.append(
                _table(
                    result,
                    ("openblas", "mlxc"),
                    ("reference", "mlxc"),
                    "what the BLAS preload buys mlxc (right: mlxc with MLXC_BLAS=off)",
                ).replace("ratio = mlxc / mlxc", "ratio = with / without")
            )
        elif peer[0] == "reference":
            lines.append(
                _table(result, ("reference", "mlxc"), peer, "no optimised BLAS on either side")
            )
    return "\n".join(lines) + "\n"


def write_results(out: str | Path, result: dict, markdown: str | None) -> None:
    """``OUT.json`` (the result) and ``OUT.md`` (its table) beside each other, the folder made if
    missing; only the JSON where ``markdown`` is None. ``out`` is a path without suffix: a name
    with dots keeps them (``Path.with_suffix`` would replace the part after the last dot)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    if markdown is not None:
        Path(f"{out}.md").write_text(markdown)


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.report RESULT.json``: rewrite RESULT.md from the JSON."""
    import sys

    for path in argv if argv is not None else sys.argv[1:]:
        text = markdown(json.loads(Path(path).read_text()))
        Path(path).with_suffix(".md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
