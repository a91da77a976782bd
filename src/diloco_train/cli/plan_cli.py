"""``diloco plan``: predicted compute utilization and time per 1,000 steps for each H and overlap mode, and the
smallest H that keeps utilization above a target (the model: ``plan``; checked against measured runs by
``bench/time_to_loss.py``, docs/results.md)."""

from __future__ import annotations

import argparse
import re

from diloco_core import CODECS, Codec, DiLoCoConfig, MergeRule, codec_for
from diloco_core.codecs.names import codec_of

from ..memory import MEASURED, TRAINING, memory
from ..plan import MODES, Link, Row, ddp_seconds, plan, sync_bytes
from ..routes import TRANSPORTS, route

__all__ = ["PLAN_EXAMPLE", "configure_plan_parser", "plan_main"]

PLAN_EXAMPLE = (
    "e.g. diloco plan --params 150m --step-s 0.4 --link-mbit 1000 --latency-ms 20 --workers 8"
)

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def _count(text: str) -> int:
    """A parameter count: ``150e6``, ``150m``, ``1.1b``."""
    scale = _SUFFIX.get(text[-1:].lower(), 1.0)
    number = text[:-1] if scale != 1.0 else text
    try:
        value = round(float(number) * scale)
    except (ValueError, OverflowError):  # OverflowError: inf
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count (e.g. 150e6, 150m, 1.1b)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected at least 1 parameter")
    return value


def _steps(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: every H must be >= 1")
    return tuple(sorted(set(values)))


def configure_plan_parser(p: argparse.ArgumentParser) -> None:
    """The options of ``diloco plan`` on its subparser."""
    p.add_argument(
        "--params", type=_count, required=True, help="parameters of the model (150e6, 150m, 1.1b)"
    )
    p.add_argument(
        "--step-s",
        type=float,
        required=True,
        help="measured seconds of one inner step on one worker",
    )
    p.add_argument(
        "--link-mbit", type=float, required=True, help="each worker's link rate in Mbit/s"
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="one-way latency from one worker to another in ms (default 0)",
    )
    p.add_argument(
        "--transport",
        default="torch",
        choices=TRANSPORTS,
        help="how a sync travels: its bytes and round trips (default torch)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        help="hivemind: workers behind NAT, which reach each other through a relay (default 0)",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="every worker's traffic shares the one link (one queue)",
    )
    p.add_argument(
        "--burst-kb",
        type=float,
        default=0.0,
        help="a token-bucket link's burst in KiB (tc tbf; default 0)",
    )
    p.add_argument("--workers", type=int, default=4, help="workers averaging (default 4)")
    p.add_argument(
        "--codec",
        default="int4",
        choices=sorted(CODECS),
        help="pseudo-gradient wire (default int4)",
    )
    wire = DiLoCoConfig()  # the trainer's [diloco] defaults, one home
    p.add_argument(
        "--codec-block",
        type=int,
        default=wire.codec_block,
        help="values per scale of the wire (default %(default)s)",
    )
    p.add_argument(
        "--codec-density",
        type=float,
        default=wire.codec_density,
        help="topk: share of each block sent (default %(default)s)",
    )
    p.add_argument(
        "--codec-value-bits",
        type=int,
        default=wire.codec_value_bits,
        help="topk: bits per value sent, 2 or 4 (default %(default)s)",
    )
    p.add_argument(
        "--inner-steps",
        type=_steps,
        default=(1, 2, 5, 10, 20, 50, 100, 200, 500),
        metavar="H,H,...",
    )
    p.add_argument(
        "--fragments", type=int, default=4, help="streaming: fragments per round (default 4)"
    )
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=1,
        help="streaming: steps a fragment's sync hides behind",
    )
    p.add_argument("--target", type=float, default=0.9, help="utilization to keep (default 0.9)")


def _codec(args: argparse.Namespace) -> Codec:
    """The wire ``--codec`` names with its settings, checked as the trainer checks its ``[diloco]`` section
    (``DiLoCoConfig``: sign's block, topk's density at its block, value bits for every codec); a bad one is
    named by its flag."""
    settings = {
        f"codec_{k}": getattr(args, f"codec_{k}") for k in ("block", "density", "value_bits")
    }
    try:
        return codec_of(DiLoCoConfig(codec=args.codec, **settings))
    except ValueError as e:
        raise ValueError(
            re.sub(r"\bcodec_(\w+)=", lambda m: f"--codec-{m[1].replace('_', '-')}=", str(e))
        ) from None


def _check(args: argparse.Namespace) -> None:
    checks = (
        ("--step-s", args.step_s, args.step_s > 0, "> 0"),
        ("--link-mbit", args.link_mbit, args.link_mbit >= 0, ">= 0 (0: no limit)"),
        ("--latency-ms", args.latency_ms, args.latency_ms >= 0, ">= 0"),
        ("--burst-kb", args.burst_kb, args.burst_kb >= 0, ">= 0"),
        ("--workers", args.workers, args.workers >= 2, ">= 2"),
        ("--clients", args.clients, 0 <= args.clients < args.workers, "in [0, --workers - 1]"),
        ("--fragments", args.fragments, args.fragments >= 1, ">= 1"),
        ("--overlap-steps", args.overlap_steps, args.overlap_steps >= 0, ">= 0"),
        ("--target", args.target, 0 < args.target <= 1, "in (0, 1]"),
    )
    for name, value, ok, valid in checks:
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid: expected {valid}")


def recommend(rows: list[Row], *, target: float) -> dict[str, Row | None]:
    """Per mode, the smallest H whose utilization is at least ``target`` (None: no H listed reaches it)."""
    return {
        m: next((r for r in rows if r.mode == m and r.utilization >= target), None) for m in MODES
    }


def _print_memory(params: int, *, transport: str, wire: str) -> None:
    """A worker's memory (``diloco_train.memory``: measured slopes, not a model of every buffer)."""
    held = memory(params, transport=transport, wire=wire)
    training = held.training / 1e9
    per_param = TRAINING[0]
    line = f"\nmemory per worker: training {training:,.2f} GB ({per_param:g} B/param"
    line += " at batch 2 x 64)"
    if held.diloco is None:
        measured = ", ".join(w for t, w in MEASURED if t == transport)
        print(f"{line}; DiLoCo's for {wire} on {transport}: not measured (measured: {measured})")
        return
    print(
        f"{line}, DiLoCo {held.diloco / 1e9:,.2f} GB more ({wire} on {transport}, bench/scale.py), "
        f"{held.total / 1e9:,.2f} GB in all; DiLoCo's part is host memory with "
        "diloco.global_device = cpu (the default)"
    )


def plan_main(args: argparse.Namespace) -> int:
    _check(args)
    codec = _codec(args)
    link = Link(
        mbit=args.link_mbit,
        latency_ms=args.latency_ms,
        shared=args.shared,
        burst_bytes=args.burst_kb * 1024,
    )
    rows = plan(
        params=args.params,
        step_s=args.step_s,
        link=link,
        workers=args.workers,
        codec=codec,
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        transport=args.transport,
        clients=args.clients,
    )
    sync = route(
        args.params, codec, transport=args.transport, workers=args.workers, clients=args.clients
    )
    grad = sync_bytes(args.params, "fp32", workers=args.workers, rule=MergeRule.MEAN)
    ddp = ddp_seconds(step_s=args.step_s, grad_bytes=grad, link=link, workers=args.workers)
    # non-default
    wire = args.codec if codec.identity == codec_for(args.codec).identity else str(codec.identity)
    where = (
        "one link shared by every worker" if args.shared else "each worker its own full-duplex link"
    )
    rate = f"{args.link_mbit:g} Mbit/s" if args.link_mbit else "no rate limit"
    sync_s = link.seconds(sync.bytes_out, workers=args.workers, latencies=sync.latencies)
    print(
        f"diloco plan (predicted, not measured): {args.params:,} parameters, "
        f"{args.step_s:g} s per step, {rate} ({where}), latency {args.latency_ms:g} ms, "
        f"{args.workers} workers, {wire} pseudo-gradients on {args.transport}\n"
        f"a round sends {sync.bytes_out / 1e6:,.2f} MB out of the busiest worker and waits for "
        f"{sync.latencies} one-way latencies: {sync_s:.3f} s on the link; DDP (fp32 gradients "
        f"every step, {grad / 1e6:,.1f} MB): {1000 * ddp:,.0f} s per 1,000 steps, utilization "
        f"{100 * args.step_s / ddp:.1f}%\n"
    )
    head = f"| H | {' | '.join(f'{m} util | {m} s/1k' for m in MODES)} |"
    print(head + "\n|" + "---|" * (1 + 2 * len(MODES)))
    for h in args.inner_steps:
        cells = [r for r in rows if r.inner_steps == h]
        text = [
            f"{100 * r.utilization:.1f}% | {r.seconds_per_1000:,.0f}"
            if r.utilization == r.utilization
            else "n/a | n/a"
            for r in cells
        ]
        print(f"| {h} | " + " | ".join(text) + " |")
    _print_memory(args.params, transport=args.transport, wire=wire)
    print(f"\nsmallest H with utilization >= {100 * args.target:g}%:")
    for mode, row in recommend(rows, target=args.target).items():
        found = (
            f"H = {row.inner_steps} ({100 * row.utilization:.1f}%)"
            if row
            else "none of the H listed"
        )
        print(f"  {mode}: {found}")
    print(
        f"\nassumptions: streaming in {args.fragments} fragments (at most H), each hidden behind "
        f"{args.overlap_steps} step(s) (at most H / fragments; n/a: overlap_steps >= H, which the trainer refuses); "
        "eager hides a round behind the next H steps; bytes and one-way latencies as the transport "
        "carries a sync (diloco_train.routes; DDP: a ring). Not modelled: the round's arithmetic "
        "outside the reduce (add it to --step-s / H), stragglers, TCP ramp-up, a DDP warm start. Loss per step is "
        "not predicted: larger H costs loss (docs/trainer.md)."
    )
    return 0
