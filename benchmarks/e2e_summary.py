"""Summarize several ``benchmarks/e2e_gateway.py`` JSON runs into the docs/performance.md table.

Per (transport, image, c): medians over the runs of each gateway's req/s, p50, p99, CPU ms/request and
peak RSS, the req/s ratio mmgate/smg of each run, and the idle RSS of each gateway (median over runs).

Run:  python benchmarks/e2e_summary.py bench-out/e2e-final-1.json bench-out/e2e-final-2.json bench-out/e2e-final-3.json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from bench_report import SIZES, render_table


def summarize(paths: list[str]) -> str:
    runs = [json.load(open(p)) for p in paths]  # noqa: SIM115 - short-lived
    cells: dict[tuple[str, str, int], dict[str, list[dict[str, Any]]]] = {}
    idle: dict[str, list[float]] = {}
    loads = []
    for run in runs:
        loads.append(run["env"].get("loadavg_at_start"))
        for phase in run["phases"]:
            for name, mb in phase.get("idle_rss_mb", {}).items():
                idle.setdefault(name, []).append(mb)
            for c in phase["cells"]:
                key = (phase["transport"], c["image"], c["concurrency"])
                cells.setdefault(key, {}).setdefault(c["gateway"], []).append(c)
    med = statistics.median
    rows = []
    for key in sorted(cells, key=lambda k: (k[0], SIZES[k[1]], k[2])):
        m, s = cells[key]["mmgate"], cells[key]["smg"]
        ratios = [a["rps"] / b["rps"] for a, b in zip(m, s, strict=True)]
        rows.append([*key, med(x["rps"] for x in m), med(x["rps"] for x in s),
                     f"**{med(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)})",
                     med(x["p50_ms"] for x in m), med(x["p50_ms"] for x in s),
                     med(x["p99_ms"] for x in m), med(x["p99_ms"] for x in s),
                     med(x["cpu_ms_per_request"] for x in m), med(x["cpu_ms_per_request"] for x in s),
                     med(x["peak_rss_mb"] for x in m), med(x["peak_rss_mb"] for x in s),
                     med(a["cpu_ms_per_request"] / b["cpu_ms_per_request"] for a, b in zip(m, s, strict=True)),
                     med(x.get("main_thread_cpu_ms_per_request", float("nan")) for x in m),
                     med(a["p50_ms"] / b["p50_ms"] for a, b in zip(m, s, strict=True)),
                     med(a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in zip(m, s, strict=True))])
    table = render_table(["transport", "image", "c", "mmgate req/s", "smg req/s", "req/s mmgate/smg (each run)",
                          "mmgate p50 ms", "smg p50 ms", "mmgate p99 ms", "smg p99 ms", "mmgate CPU ms/req",
                          "smg CPU ms/req", "mmgate RSS MB", "smg RSS MB", "CPU/req mmgate/smg",
                          "mmgate loop CPU ms/req", "p50 mmgate/smg", "RSS mmgate/smg"], rows)
    idle_line = "idle RSS MB (median over runs and transports): " + ", ".join(
        f"{n} {med(v):.0f}" for n, v in idle.items())
    return f"{table}\n\n{idle_line}\nload average at each start: {loads}"


if __name__ == "__main__":
    print(summarize(sys.argv[1:]))
