"""``diloco doctor``: a run's network checked before the run, from the same options as
``diloco train`` (a join command with ``doctor`` for ``train``). One line per check; exit status 0
only if a run would work."""

from __future__ import annotations

import argparse
import sys

DOCTOR_EXAMPLE = """e.g. a joiner's command, with doctor for train:
  diloco doctor --set transport.kind=hivemind --set 'transport.secret_file="wan.secret"' \\
    --set 'transport.initial_peers=["/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."]'"""


def doctor_main(args: argparse.Namespace) -> int:
    from transports import diagnose

    from ..run_config import build_config

    config = build_config(args.config, args.overrides)
    findings = diagnose(config.transport)
    if findings is None:
        kind = config.transport.get("kind", "inprocess")
        print(f"transport.kind={kind!r}: no network to check")
        return 0
    for f in findings:
        print(f"{'FAIL' if not f.ok else 'warn' if f.warn else 'ok  '} {f.line}")
    failed = sum(not f.ok for f in findings)
    verdict = (
        "a run would start" if not failed else f"{failed} check(s) failed: a run would not work"
    )
    if not failed and any(f.warn for f in findings):
        verdict += " (fix the warnings: a peer joining later may need them)"
    print(f"diloco doctor: {verdict}", file=sys.stderr)
    return 0 if not failed else 1
