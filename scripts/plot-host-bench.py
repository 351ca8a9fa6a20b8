#!/usr/bin/env python3
"""The plot of scripts/bench-host.sh's (or bench-netns.sh's) tables as an SVG on stdout: the
ratio epcomm / by hand against T (log scale), one line per engine and rank count, with the
targets (0.8 at T >= 128, 1.0 at T = 1). Reads the Markdown tables from stdin; plain Python."""
import math
import re
import sys

W, H, L, R, T, B = 640, 360, 60, 150, 20, 40


def series(text):
    """{(engine, ranks): [(T, ratio)]} from the tables' rows (engine from the title line)."""
    out, engine = {}, "?"
    for line in text.splitlines():
        if line.startswith("gloo") or " ranks over MPI" in line:
            engine = "gloo" if line.startswith("gloo") else "MPI"
            if "without the all_to_allv" in line:
                engine += " (send/recv only)"
        m = re.match(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*[\d.]+\s*\|\s*[\d.]+\s*\|\s*([\d.]+)\s*\|", line)
        if m:
            t, r, ratio = int(m[1]), int(m[2]), float(m[3])
            out.setdefault((engine, r), []).append((t, ratio))
    return out


def main():
    data = series(sys.stdin.read())
    ts = sorted({t for pts in data.values() for t, _ in pts}) or [1, 4096]
    top = max([1.6] + [r for pts in data.values() for _, r in pts])
    lx = lambda t: L + (W - L - R) * (math.log2(t) - math.log2(ts[0])) / max(  # noqa: E731
        1e-9, math.log2(ts[-1]) - math.log2(ts[0]))
    ly = lambda v: H - B - (H - T - B) * v / top  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(W - R + L) / 2}" y="{H - 8}" text-anchor="middle">T (tokens per rank)</text>',
           f'<text x="14" y="{(H - B + T) / 2}" transform="rotate(-90 14 {(H - B + T) / 2})" '
           'text-anchor="middle">epcomm / by hand (lower is better)</text>']
    for t in ts:
        svg.append(f'<text x="{lx(t)}" y="{H - B + 14}" text-anchor="middle">{t}</text>')
    v = 0.0
    while v <= top + 1e-9:
        svg.append(f'<text x="{L - 6}" y="{ly(v) + 4}" text-anchor="end">{v:.1f}</text>')
        svg.append(f'<line x1="{L}" y1="{ly(v)}" x2="{W - R}" y2="{ly(v)}" stroke="#eee"/>')
        v += 0.2 if top <= 2 else 0.5
    for target, label in ((1.0, "1.0 (target at T=1)"), (0.8, "0.8 (target at T>=128)")):
        svg.append(f'<line x1="{L}" y1="{ly(target)}" x2="{W - R}" y2="{ly(target)}" '
                   'stroke="gray" stroke-dasharray="4 3"/>')
        svg.append(f'<text x="{W - R + 4}" y="{ly(target) + 4}" fill="gray">{label}</text>')
    for i, ((engine, ranks), pts) in enumerate(sorted(data.items())):
        c = colors[i % len(colors)]
        pts = sorted(pts)
        path = " ".join(f"{lx(t):.1f},{ly(r):.1f}" for t, r in pts)
        svg.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        for t, r in pts:
            svg.append(f'<circle cx="{lx(t):.1f}" cy="{ly(r):.1f}" r="3" fill="{c}"/>')
        svg.append(f'<text x="{W - R + 4}" y="{T + 40 + 14 * i}" fill="{c}">{engine}, R={ranks}</text>')
    svg.append("</svg>")
    print("\n".join(svg))


if __name__ == "__main__":
    main()
