"""The time-to-loss benchmark: how soon each method reaches DDP's final eval loss over a slow link.

Not part of the test run. Two gloo workers (``diloco torchrun --nproc-per-node=2``, one torch thread each on
this 2-core machine) train the trainer's tiny model on the embedded corpus, batch 16 x 64 bytes, with the same
seeds, each method on the same link:

- ``ddp``: DDP, fp32 gradients, ``--steps`` steps. Its final eval loss (per seed) is the **target**.
- every other method runs up to ``--cap`` x ``--steps`` steps (its learning-rate schedule over that many) and is
  stopped at its first eval (every 10 steps) at or below the target: a method that needs more steps pays for
  them. ``ddp-int8``: DDP with int8 gradients and error feedback. ``diloco``: the trainer's DiLoCo defaults
  (H = 10, int4 pseudo-gradients, a DDP warm start for a twelfth of the steps on the rounds' codec, int4);
  ``diloco-warm-fp32`` (the defaults before 9e2fa7e: the warm start's gradients in fp32), ``diloco-fp32`` (fp32
  rounds and warm start), ``eager`` and the ``-warm-fp32`` variants of eager, streaming (P = 2, tau = 1) and
  sign rounds change one thing each.

Links: ``100mbit`` and ``1gbit`` are ``bench/shaped_link.sh RATE`` (one ``tc tbf`` queue shared by both
workers in both directions; root) or with ``--simulated`` the simulated link at half the rate (what one queue
leaves each of two workers, docs/overlap.md); ``free`` is plain loopback (compute alone, nearly).
``inproc-100mbit``: 4 in-process workers (``diloco train``, threads on the 2 cores), each behind its own
simulated 100 Mbit/s link, with their own target (4-worker DDP's final eval loss).

Time to target = the training loop's seconds (``time_s``) at that eval, less the evals' own seconds
(``eval_s``). The prediction (``diloco_train.plan``, the model behind ``diloco plan``) takes each run's
measured mean step compute (``compute_s``), its measured bytes per sync and the link's rate, and gives the
seconds to the same step. A run already finished in ``--out`` is read, not rerun.

    sudo true; PYTHONPATH=src python bench/time_to_loss.py --out runs/ttl            # 3 seeds, about 2 hours
    PYTHONPATH=src python bench/time_to_loss.py --out runs/ttl --seeds 2 --links 100mbit,1gbit,free \
        --methods diloco,diloco-warm-fp32,eager                                      # a subset (ddp always)
    PYTHONPATH=src python bench/time_to_loss.py --quick --out runs/ttl-quick        # under 10 min
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_train.plan import Link, Method, ddp_seconds, exposed

HERE = Path(__file__).resolve().parent
EVAL_EVERY = 10

# name -> (trainer settings, sync method of its rounds (None: DDP))
FP32_WARM = "train.ddp_wire_dtype=fp32"  # the warm start's wire before 9e2fa7e made it the rounds' codec
METHODS: dict[str, tuple[list[str], Method | None]] = {
    "ddp": (["train.mode=ddp"], None),
    "ddp-int8": (["train.mode=ddp", "train.ddp_wire_dtype=int8"], None),
    "diloco": (["train.mode=diloco"], Method("blocking", 10)),
    "diloco-warm-fp32": (["train.mode=diloco", FP32_WARM], Method("blocking", 10)),
    "diloco-fp32": (["train.mode=diloco", "diloco.codec=fp32"], Method("blocking", 10)),
    "sign-warm-fp32": (["train.mode=diloco", "diloco.codec=sign", FP32_WARM], Method("blocking", 10)),
    "eager": (["train.mode=diloco", "diloco.overlap=eager"], Method("eager", 10)),
    "eager-warm-fp32": (["train.mode=diloco", "diloco.overlap=eager", FP32_WARM], Method("eager", 10)),
    "streaming-warm-fp32": (
        ["train.mode=diloco", "diloco.overlap=streaming", "diloco.fragments=2", "diloco.overlap_steps=1", FP32_WARM],
        Method("streaming", 10, fragments=2, overlap_steps=1),
    ),
}
RATES = {"100mbit": 100.0, "1gbit": 1000.0, "free": 0.0, "inproc-100mbit": 100.0}
TBF_BURST = 512 * 1024  # bytes: shaped_link.sh's tbf "burst 512kb"
INPROC = "inproc-"  # 4 in-process workers, each behind its own simulated link (their own DDP target)
PLAN = {  # link -> methods (the full benchmark)
    "100mbit": list(METHODS),
    "1gbit": ["ddp", "ddp-int8", "diloco", "diloco-warm-fp32", "eager"],
    "free": ["ddp", "diloco", "diloco-warm-fp32", "eager"],
    "inproc-100mbit": ["ddp", "diloco", "diloco-warm-fp32", "eager"],
}
QUICK = {"100mbit": ["ddp", "diloco", "eager"], "free": ["diloco"]}


@dataclass(frozen=True)
class Curve:
    """One run's evals: step, loss and training seconds (evals left out)."""

    steps: list[int]
    losses: list[float]
    seconds: list[float]
    finished: bool

    def reach(self, target: float) -> int | None:
        """Index of the first eval at or below ``target`` (None: never)."""
        return next((i for i, v in enumerate(self.losses) if v <= target + 1e-12), None)


def read(run_dir: Path) -> tuple[list[dict], Curve]:
    """A run's records and curve (read while it runs too: a last line not yet whole is left for the next read)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    records = [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]
    evals = [r for r in records if r["type"] == "eval" and r["step"] > 0]
    spent, seconds = 0.0, []
    for r in evals:
        spent += r.get("eval_s", 0.0)
        seconds.append(r["time_s"] - spent)
    finished = any(r["type"] == "summary" for r in records) or (run_dir / "reached.json").is_file()
    return records, Curve(
        steps=[r["step"] for r in evals], losses=[r["loss"] for r in evals], seconds=seconds, finished=finished
    )


def command(*, name: str, method: str, link: str, seed: int, steps: int, args: argparse.Namespace) -> list[str]:
    sets = [
        "transport.kind=torch",
        f"train.seed={seed}",
        f"train.steps={steps}",
        "train.batch_size=16",
        f"train.eval_every={EVAL_EVERY}",
        "train.eval_batches=8",
        "train.checkpoint_every=0",
        f"train.runs_dir={json.dumps(str(args.out))}",
        *METHODS[method][0],
    ]
    rate = RATES[link]
    if link.startswith(INPROC):
        sets = [x for x in sets if x != "transport.kind=torch"] + ["train.workers=4", f"transport.link_mbit={rate:g}"]
        cmd = [sys.executable, "-m", "diloco_train.cli", "train", "-q", "--name", name]
        return cmd + [x for s in sets for x in ("--set", s)]
    if rate and args.simulated:
        sets.append(f"transport.link_mbit={rate / 2:g}")
    cmd = [sys.executable, "-m", "diloco_train.cli", "torchrun", "--standalone", "--nproc-per-node=2"]
    cmd += ["train", "-q", "--name", name]
    for s in sets:
        cmd += ["--set", s]
    if rate and not args.simulated:
        cmd = [str(HERE / "shaped_link.sh"), f"{rate:g}mbit", *cmd]
    return cmd


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _stop(proc: subprocess.Popen, *, grace: float = 60.0) -> None:
    """SIGTERM the run's process group and wait until it and every process below it is gone (SIGKILL after
    ``grace``): the launcher's shell exits first and its workers after it, and the next timed run must not share
    the cores with them. shaped_link.sh's trap removes its network namespace."""
    left = _descendants(proc.pid) | {proc.pid}
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while left:
        proc.poll()  # reap the launcher itself
        sig = signal.SIGKILL if time.monotonic() > deadline else 0
        for pid in list(left):
            try:
                os.kill(pid, sig)
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    left.discard(pid)  # a zombie: done, its parent reaps it
            except (ProcessLookupError, FileNotFoundError):
                left.discard(pid)
        time.sleep(0.2)


def run(cmd: list[str], *, run_dir: Path, target: float | None) -> None:
    """Run ``cmd`` to its end, or until an eval at or below ``target``: then stop it (its process group)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            if target is None:
                continue
            _, curve = read(run_dir)
            at = curve.reach(target)
            if at is not None:
                (run_dir / "reached.json").write_text(json.dumps({"step": curve.steps[at], "target": target}))
                return
        if proc.returncode != 0:
            raise SystemExit(f"{run_dir.name}: exit status {proc.returncode}: {' '.join(cmd)}")
    finally:
        _stop(proc)  # stopped at the target, or an error here; after a normal end: nothing left
        proc.wait()


def predict(records: list[dict], *, upto: int, method: Method | None, link: Link, workers: int = 2) -> float:
    """Seconds the model predicts for this run's steps up to ``upto``: each step its mean measured compute, each
    DDP step (its own, a warm start's) its gradient reduce, each sync of a round (a streaming fragment's too)
    what the link time of its measured bytes leaves unhidden (``diloco_train.plan``)."""
    steps = [r for r in records if r["type"] == "step" and r["step"] <= upto]
    rounds = [r for r in records if r["type"] == "round" and r["step"] <= upto]
    step_s = statistics.fmean(r["compute_s"] for r in steps)
    at_rounds = {r["step"] for r in rounds}

    def carried(r: dict) -> int:  # a full-duplex link of its own carries the busier direction; a shared one all
        return r["bytes_sent"] if link.shared else max(r["bytes_sent"], r["bytes_received"])

    ddp = [r for r in steps if r["bytes_sent"] and r["step"] not in at_rounds]  # DDP's own, a warm start's
    total = (len(steps) - len(ddp)) * step_s
    total += sum(ddp_seconds(step_s=step_s, grad_bytes=carried(r), link=link, workers=workers) for r in ddp)
    hidden_s = method.hidden_steps() * step_s if method else 0.0
    idle_s = method.steps_between_syncs() * step_s if method else 0.0
    for r in rounds:
        total += exposed(link.seconds(carried(r), workers=workers, idle_s=idle_s), hidden_s=hidden_s)
        if method is not None and method.mode == "blocking":  # the round's own arithmetic, as measured
            total += max(0.0, r["round_s"] - r["comm_s"])
    return total


def link_of(name: str, *, simulated: bool) -> Link:
    """The model's view of a link: the shaped link is one queue for both workers; the simulated one (at half
    the rate) gives each worker its own."""
    rate = RATES[name]
    if name.startswith(INPROC):
        return Link(mbit=rate)
    if simulated and rate:
        return Link(mbit=rate / 2)
    return Link(mbit=rate, shared=True, burst_bytes=TBF_BURST)


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """Run (or read back) every seed, link and method; per run its curve, time and steps to target, bytes to
    target and the prediction."""
    plan = QUICK if args.quick else PLAN
    results: dict[str, dict] = {}
    for seed in args.seeds:
        targets: dict[bool, float] = {}  # per world (2 gloo workers, 4 in-process): DDP's final eval loss
        for link, methods in plan.items():
            if args.links and link not in args.links:
                continue
            world = link.startswith(INPROC)
            for method in methods:
                if args.methods and method not in args.methods and method != "ddp":  # ddp: the target
                    continue
                name = f"{link}-{method}-s{seed}"
                run_dir = args.out / name
                ddp = method == "ddp"
                _, curve = read(run_dir)
                if not curve.finished and args.report:
                    continue
                if not ddp and world not in targets:
                    raise SystemExit(
                        f"--links: {link} needs DDP's target: name a link of its world that runs ddp first"
                    )
                if not curve.finished:
                    if run_dir.exists():
                        import shutil

                        shutil.rmtree(run_dir)
                    steps = args.steps if ddp else round(args.cap * args.steps)
                    cmd = command(name=name, method=method, link=link, seed=seed, steps=steps, args=args)
                    print(f"== {name}", file=sys.stderr, flush=True)
                    t0 = time.perf_counter()
                    run(cmd, run_dir=run_dir, target=None if ddp else targets.get(world))
                    print(f"   {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
                records, curve = read(run_dir)
                if ddp and world not in targets:
                    targets[world] = curve.losses[-1]
                target = targets[world]
                at = curve.reach(target)
                model = {
                    "method": METHODS[method][1],
                    "link": link_of(link, simulated=args.simulated),
                    "workers": 4 if world else 2,
                }
                predicted = [predict(records, upto=step, **model) for step in curve.steps]
                row = {
                    "seed": seed,
                    "link": link,
                    "method": method,
                    "target": target,
                    "curve": vars(curve) | {"predicted": predicted},
                }
                if at is not None:
                    step = curve.steps[at]
                    row |= {
                        "step": step,
                        "seconds": curve.seconds[at],
                        "predicted": predicted[at],
                        "bytes": sum(r["bytes_sent"] for r in records if r["type"] == "step" and r["step"] <= step),
                        "compute_s": sum(r["compute_s"] for r in records if r["type"] == "step" and r["step"] <= step),
                    }
                results[name] = row
    return results


def _ms(values: list[float]) -> str:
    """Mean (spread max - min) of ``values``; thousands without an exponent."""

    def f(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    if not values:
        return "-"
    mean = statistics.fmean(values)
    return f"{f(mean)} ({f(max(values) - min(values))})" if len(values) > 1 else f(mean)


def table(results: dict[str, dict], args: argparse.Namespace) -> str:
    """Per link and method, over seeds: mean (spread max - min)."""
    lines = [
        f"2 gloo workers, tiny model, batch 16 x 64, DDP {args.steps} steps (the target: its final eval loss, "
        f"per seed), the others up to {args.cap:g}x; seeds {args.seeds}; "
        + ("simulated links (half rate each)" if args.simulated else "shaped links (tc tbf, one queue)"),
        "",
        (
            "| link | method | reached | time to target s | vs DDP (same link) | vs DDP at 100 Mbit/s | vs its own, "
            "free link | steps | MB sent | utilization | predicted s | prediction error |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plan = QUICK if args.quick else PLAN
    for link, methods in plan.items():
        for method in methods:
            rows = [r for r in results.values() if r["link"] == link and r["method"] == method]
            if not rows:
                continue
            done = [r for r in rows if "seconds" in r]
            ratio, ratio100, free, err = [], [], [], []
            for r in done:
                for base_link, out in ((link, ratio), ("100mbit" if not link.startswith(INPROC) else link, ratio100)):
                    base = results.get(f"{base_link}-ddp-s{r['seed']}")
                    if base and "seconds" in base:
                        out.append(r["seconds"] / base["seconds"])
                alone = results.get(f"free-{method}-s{r['seed']}")
                if alone and "seconds" in alone and not link.startswith(INPROC):
                    free.append(r["seconds"] / alone["seconds"])
                err.append(100 * (r["predicted"] / r["seconds"] - 1))
            lines.append(
                f"| {link} | {method} | {len(done)}/{len(rows)} | {_ms([r['seconds'] for r in done])} | "
                f"{_ms(ratio)} | {_ms(ratio100)} | {_ms(free)} | {_ms([r['step'] for r in done])} | "
                f"{_ms([r['bytes'] / 1e6 for r in done])} | "
                f"{_ms([100 * r['compute_s'] / r['seconds'] for r in done])}% | "
                f"{_ms([r['predicted'] for r in done])} | {_ms(err)}% |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path: Path) -> None:
    """Eval loss against training seconds, one panel per link; seed 0's curves measured (solid) and predicted
    (dashed), the target dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    links = list(dict.fromkeys(r["link"] for r in results.values()))
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        seed = min(r["seed"] for r in results.values())
        for r in results.values():
            if r["link"] == link and r["seed"] == seed:
                c = r["curve"]
                (line,) = ax.plot(c["seconds"], c["losses"], label=r["method"], lw=1)
                ax.plot(c["predicted"], c["losses"], color=line.get_color(), lw=0.8, ls="--")
                target = r["target"]
        ax.axhline(target, color="grey", ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(target - 0.1, target + 0.8)
        ax.set_title(f"{link} (seed {seed})")
        ax.set_xlabel("training seconds (log)")
        ax.set_ylabel("eval loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="1 seed, 100 DDP steps, 3 methods (under 10 minutes)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=400, help="DDP's steps: its final eval loss is the target")
    p.add_argument("--cap", type=float, default=2.0, help="the other methods' step cap, a multiple of --steps")
    p.add_argument("--simulated", action="store_true", help="the simulated link instead of tc (no root needed)")
    p.add_argument("--links", default="", help=f"comma-separated, of {list(RATES)} (default: all)")
    p.add_argument("--report", action="store_true", help="run nothing: the table of the runs finished in --out")
    p.add_argument("--methods", default="", help="comma-separated, of the plan's methods (default: all; ddp always)")
    args = p.parse_args(argv)
    args.seeds = [0] if args.quick else [int(x) for x in args.seeds.split(",")]
    if args.quick:
        args.steps = 100
    args.links = [x for x in args.links.split(",") if x]
    args.methods = [x for x in args.methods.split(",") if x]
    if set(args.methods) - set(METHODS):
        p.error(f"--methods: {sorted(set(args.methods) - set(METHODS))} invalid, expected some of {list(METHODS)}")
    if set(args.links) - set(RATES):
        p.error(f"--links: {sorted(set(args.links) - set(RATES))} invalid, expected some of {list(RATES)}")
    if not args.simulated and os.geteuid() != 0:
        p.error("shaped links need root (ip netns, tc): run as root or with --simulated")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = measure(args)
    text = table(results, args) + f"\nthis invocation took {time.perf_counter() - t0:.0f} s\n"
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "time_to_loss.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
