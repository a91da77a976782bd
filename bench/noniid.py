"""Honest workers on different data: does the default (robust) merge leave an honest worker out,
and does it cost the global model anything against the plain mean?

Not part of the test run. 4 in-process workers, each on its own domain of the standard library
source the trainer reads by default, split by package family (``DOMAINS``):

- ``encodings``: the codecs package (mostly charmap tables);
- ``net``: networking, concurrency and data formats (asyncio, concurrent, email, html, http, json,
  logging, multiprocessing, urllib, wsgiref, xml, xmlrpc);
- ``tools``: tooling and GUIs (ctypes, curses, distutils, ensurepip, idlelib, importlib, lib2to3,
  pydoc_data, tkinter, turtledemo, unittest, venv);
- ``modules``: the rest (the top-level modules, re, collections, zoneinfo, tomllib, dbm, ...).

Each domain's documents go to train or validation by the trainer's own hash rule; its training
tokens are cut to the smallest domain's length, so worker r's shard (``Corpus.shard``) is domain r
exactly, and the run's validation set is every domain's, cut to the same length (the trainer's eval
weighs them alike). Every run is the trainer's default run but for ``--steps`` (160: 14 rounds of
H = 10 after the DDP warm start, about 6 minutes a run on the shared 2-core machine),
``diloco.merge`` and ``--set``; the final global model is also evaluated on each domain's
validation tokens. Each
round's merge is recorded (``merges.jsonl`` in the run folder): the contributions' norms and
cosines, who was left out, and whether the result differs from the plain mean of those kept (the
rule bounded a contribution: "clipped").

    python bench/noniid.py --out runs/noniid      # robust (default) and mean, seeds 0, 1, 2
    python bench/noniid.py --out runs/noniid --rules robust --seeds 0

A run already finished in ``--out`` is read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Self

import torch

from diloco_core import merge as merge_module
from diloco_train import launch, worker
from diloco_train.data.corpus import Corpus
from diloco_train.data.documents import digest, is_val, stdlib_root, stdlib_source
from diloco_train.report.plot import read_metrics
from diloco_train.run_config import build_config
from diloco_train.train import train

NET = "asyncio concurrent email html http json logging multiprocessing urllib wsgiref xml xmlrpc"
TOOLS = "ctypes curses distutils ensurepip idlelib importlib lib2to3 pydoc_data tkinter turtledemo"
TOOLS += " unittest venv"
DOMAINS: dict[str, frozenset[str] | None] = {
    "encodings": frozenset({"encodings"}),
    "net": frozenset(NET.split()),
    "tools": frozenset(TOOLS.split()),
    "modules": None,  # the rest
}


def domain_of(name: str) -> str:
    """The domain of a standard library document (its path relative to the library's root)."""
    top = name.split("/")[0] if "/" in name else ""
    return next((d for d, tops in DOMAINS.items() if tops is not None and top in tops), "modules")


def domain_corpus(val_fraction: float = 0.05) -> tuple[Corpus, dict[str, torch.Tensor]]:
    """The corpus whose shard r (of 4) is domain r's training tokens; each domain's validation."""
    docs, vocab, _ = stdlib_source(stdlib_root())
    train_docs: dict[str, list] = {d: [] for d in DOMAINS}
    val_docs: dict[str, list] = {d: [] for d in DOMAINS}
    for name, data in docs:
        if data:
            split = val_docs if is_val(name, val_fraction) else train_docs
            split[domain_of(name)].append((name, data))

    def tokens(found: list) -> torch.Tensor:
        found.sort(key=lambda d: digest(d[0]))  # as the trainer orders them
        return torch.frombuffer(bytearray(b"".join(data for _, data in found)), dtype=torch.uint8)

    trains = {d: tokens(found) for d, found in train_docs.items()}
    vals = {d: tokens(found) for d, found in val_docs.items()}
    n_train = min(t.numel() for t in trains.values())
    n_val = min(t.numel() for t in vals.values())
    corpus = Corpus(
        train=torch.cat([t[:n_train] for t in trains.values()]),
        val=torch.cat([v[:n_val] for v in vals.values()]),
        vocab_size=vocab,
        train_names=tuple(n for found in train_docs.values() for n, _ in found),
        val_names=tuple(n for found in val_docs.values() for n, _ in found),
    )
    return corpus, vals


def verdicts(merges: list[dict], workers: int) -> dict:
    """A run's merge accounting: rounds, rounds that left an honest worker out (every worker here is
    honest), rounds whose result the rule bounded, the most rounds one worker was left out of."""
    rounds = [m for m in merges if m["k"] == workers]
    left = [m for m in rounds if m["left_out"]]
    clipped = [m for m in rounds if m["clipped"]]
    per_worker: dict[str, int] = {}
    for m in left:
        for who in m["left_out"]:
            per_worker[who] = per_worker.get(who, 0) + 1
    return {
        "rounds": len(rounds),
        "left_out_rounds": len(left),
        "clipped_rounds": len(clipped),
        "most_left_out": max(per_worker.values(), default=0),
    }


class Recorder:
    """Wraps ``Merge.of`` for one run: writes each round's merge (``judged`` set) to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path, self.original = path, merge_module.Merge.of

    def __enter__(self) -> Self:
        self.path.unlink(missing_ok=True)
        original, path = self.original, self.path

        def of(merge, payloads, *, codec, out, scratch=None, start=0, who=()):
            kw = {"codec": codec, "out": out, "scratch": scratch, "start": start, "who": who}
            left_out = original(merge, payloads, **kw)
            if merge.judged is None:
                return left_out
            n = merge.judged - start
            names = list(who) or [str(i) for i in range(len(payloads))]
            gone = {o.who for o in left_out}
            rows = [codec.decode(p, torch.empty(out.numel()))[:n] for p in payloads]
            rows = torch.stack(rows).double()
            kept = [p for p, name in zip(payloads, names) if name not in gone]
            plain = codec.mean_of(kept, torch.empty_like(out))[:n]
            gram = rows @ rows.T
            norms = gram.diagonal().sqrt()
            record = {
                "k": len(payloads),
                "norms": norms.tolist(),
                "cosines": (gram / (norms[:, None] * norms[None, :])).tolist(),
                "left_out": sorted(gone),
                "clipped": not torch.equal(out[:n], plain),
            }
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            return left_out

        merge_module.Merge.of = of
        return self

    def __exit__(self, *exc) -> None:
        merge_module.Merge.of = self.original


def run(args: argparse.Namespace, *, rule: str, seed: int, corpus: Corpus, vals: dict) -> dict:
    """One run (read back if finished): its final eval, overall and per domain, and its merges."""
    run_dir = Path(args.out) / f"{rule}-s{seed}"
    result = run_dir / "noniid.json"
    if result.is_file():
        return json.loads(result.read_text())
    overrides = [
        "train.workers=4",
        f"train.steps={args.steps}",
        f"train.seed={seed}",
        f"train.eval_every={args.steps}",
        "train.checkpoint_every=0",
        f"train.runs_dir={json.dumps(str(args.out))}",
        f"diloco.merge={rule}",
        *args.set,
    ]
    config = build_config(overrides=overrides)
    finals: list[dict[str, float]] = []
    evaluate = worker.evaluate

    def per_domain(model, val, config, device):
        finals.append({d: evaluate(model, v, config, device) for d, v in vals.items()})
        return evaluate(model, val, config, device)

    load = launch.load_corpus
    launch.load_corpus, worker.evaluate = (lambda _: corpus), per_domain
    try:
        with Recorder(run_dir.parent / f".{run_dir.name}-merges.jsonl") as rec:
            train(config, run_dir, show_progress=False)
        merges = [json.loads(line) for line in rec.path.read_text().splitlines()]
        rec.path.replace(run_dir / "merges.jsonl")
    finally:
        launch.load_corpus, worker.evaluate = load, evaluate
    summary = next(r for r in read_metrics(run_dir) if r["type"] == "summary")
    row = {"rule": rule, "seed": seed, "eval": summary["eval_after"], "domains": finals[-1]}
    row |= verdicts(merges, workers=4)
    result.write_text(json.dumps(row))
    return row


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    p.add_argument("--out", default="runs/noniid")
    p.add_argument("--steps", type=int, default=160, help="inner steps per worker (train.steps)")
    p.add_argument("--rules", default="robust,mean", help="diloco.merge values; the last: baseline")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--set", action="append", default=[], help="a trainer override, key=value")
    args = p.parse_args(argv)
    corpus, vals = domain_corpus()
    rules = args.rules.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [run(args, rule=r, seed=s, corpus=corpus, vals=vals) for s in seeds for r in rules]
    base = {r["seed"]: r for r in rows if r["rule"] == rules[-1]}
    names = " | ".join(DOMAINS)
    print(f"| rule | seed | eval | {names} | rounds left out | clipped | most of one worker |")
    print("|---" * (len(DOMAINS) + 6) + "|")
    worst = 0.0
    for r in rows:
        rel = {d: r["domains"][d] / base[r["seed"]]["domains"][d] - 1 for d in DOMAINS}
        if r["rule"] != rules[-1]:
            worst = max(worst, *rel.values())
        cells = " | ".join(f"{r['domains'][d]:.4f} ({rel[d]:+.2%})" for d in DOMAINS)
        print(
            f"| {r['rule']} | {r['seed']} | {r['eval']:.4f} | {cells} "
            f"| {r['left_out_rounds']}/{r['rounds']} | {r['clipped_rounds']}/{r['rounds']} "
            f"| {r['most_left_out']} |"
        )
    judged = [r for r in rows if r["rule"] != rules[-1]]
    left = sum(r["left_out_rounds"] for r in judged)
    total = sum(r["rounds"] for r in judged) or 1
    print(f"worst domain against {rules[-1]}: {worst:+.2%} (target: <= +0.5%)")
    share = f"{left}/{total} = {left / total:.1%}"
    print(f"rounds that left an honest worker out: {share} (target: <= 2%)")
    print(f"spread of the final eval over seeds: {statistics.pstdev(r['eval'] for r in rows):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
