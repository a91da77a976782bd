"""Print, after a benchmark run, each benchmark's time as a ratio of its group's baseline.

In every group the benchmark whose name contains ``baseline`` is the reference (the raw library call
or the bytes-moved floor); the ratios come from one session, side by side, since these machines are
noisy run to run. A benchmark that measures its own ratio (two calls interleaved) puts it in
``extra_info["ratio"]``, printed as is.
"""


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups: dict = {}
    for bench in session.benchmarks:
        if bench:
            groups.setdefault(bench.group, []).append(bench)
    lines = []
    for group, benches in sorted(groups.items(), key=lambda kv: str(kv[0])):
        lines += [f"{group}: {b.name}: {b.extra_info['ratio']}" for b in benches if "ratio" in b.extra_info]
        base = [b for b in benches if "baseline" in b.name]
        if not base:
            continue
        for b in benches:
            ratio_min = b.stats.min / base[0].stats.min
            ratio_med = b.stats.median / base[0].stats.median
            lines.append(
                f"{group}: {b.name}: {b.stats.median * 1e3:.1f} ms median, "
                f"{ratio_med:.2f}x baseline (min {ratio_min:.2f}x)"
            )
    if lines:
        terminalreporter.write_sep("-", "ratios to each group's baseline")
        for line in lines:
            terminalreporter.write_line(line)
