"""Relayed parts that cannot be substituted (issue 44, item 2): an insider owning a part can neither
relay payloads that are not its groupmates' (block codecs) nor return a mean of its own making (casts:
every member merges every part from the senders' payloads). The check (relay_check.py) fails the
round on every honest member, blames the owner, and the round is retried without it."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
from hivemind.p2p import PeerID
from threads import in_threads
from world import FAST

from diloco_core import Merge, MergeRule, TransportError, codec_for
from transports.hivemind import HivemindConfig, HivemindFaults, HivemindTransport
from transports.hivemind.relay_check import digests_message, verdict

pytest.importorskip("hivemind")

PARTS = [2, 3, 1, 2]
"""Parts per owner, 4 members."""


def _digest(rng: random.Random) -> bytes:
    return rng.randbytes(16)


def _views(parts, *, relay=None, claim=None, state=None):
    """Each member's (claims, seen, message) for payloads with random digests: ``relay(k, p, i, m)``
    is what owner k relays to m of sender i's payload (its digest), ``claim(i, w)`` what i claims for
    part w, ``state(k, p, i, m)`` what owner k states to m it received from i (default: the truth)."""
    rng = random.Random(0)
    n = len(parts)
    real = {(k, p, i): _digest(rng) for k in range(n) for p in range(parts[k]) for i in range(n)}
    views = []
    for m in range(n):
        claims = {(k, p): real[(k, p, m)] for k in range(n) if k != m for p in range(parts[k])}
        seen = {(m, p, i): real[(m, p, i)] for p in range(parts[m]) for i in range(n) if i != m}
        for k in range(n):
            for p in range(parts[k]):
                for i in range(n):
                    if k not in (m, i) and i != m:
                        got = real[(k, p, i)] if relay is None else relay(k, p, i, m, real)
                        seen[(k, p, i)] = got
        views.append((claims, seen))
    messages = []  # messages[j][m]: what j sends m
    for j in range(n):
        claims, seen = views[j]
        by_receiver = {}
        for m in range(n):
            c = {w: (d if claim is None else claim(j, w, m, d)) for w, d in claims.items()}
            s = {key: (d if state is None else state(key, m, d, real)) for key, d in seen.items()}
            by_receiver[m] = digests_message(parts, j, claims=c, seen=s)
        messages.append(by_receiver)
    return [
        verdict({j: messages[j][m] for j in range(n) if j != m}, parts, m, claims=views[m][0], seen=views[m][1])
        for m in range(n)
    ]


def test_honest_relays_pass_the_check():
    assert all(v == ([], frozenset()) for v in _views(PARTS))


def test_an_owner_relaying_its_own_payload_in_place_of_the_others_is_blamed_by_every_member():
    insider = 3

    def relay(k, p, i, m, real):
        return real[(k, p, k)] if k == insider else real[(k, p, i)]

    for m, (problems, blamed) in enumerate(_views(PARTS, relay=relay)):
        if m != insider:
            assert blamed == {insider} and problems, (m, problems)


def test_an_owner_whose_statements_match_its_substitution_is_blamed_by_the_senders():
    """It states to everyone that it received what it relayed: each sender sees a statement about
    its own payload that it never sent."""
    insider = 1

    def relay(k, p, i, m, real):
        return b"x" * 16 if k == insider else real[(k, p, i)]

    def state(key, m, d, real):
        return b"x" * 16 if key[0] == insider else d

    for m, (_, blamed) in enumerate(_views(PARTS, relay=relay, state=state)):
        if m != insider:
            assert blamed == {insider}, m


def test_a_sender_lying_about_its_payload_frames_no_owner():
    """A consistent lie: its claims differ from what it sent. The owners blame it; the members that
    merged its relayed payload cannot tell the owner from the sender: the round fails, nobody blamed."""
    liar = 2

    def claim(j, w, m, d):
        return b"y" * 16 if j == liar else d

    views = _views(PARTS, claim=claim)
    for m, (problems, blamed) in enumerate(views):
        if m != liar:
            assert problems and blamed == {liar} and PARTS[m] > 0, (m, problems, blamed)


def test_a_malformed_message_is_blamed_and_an_empty_one_is_not():
    claims = {(k, p): b"a" * 16 for k in range(1, 4) for p in range(PARTS[k])}
    problems, blamed = verdict({1: b"", 2: b"short", 3: b""}, PARTS, 0, claims=claims, seen={})
    assert blamed == {2} and len(problems) == 3


N = 4096
INSIDER = 3
PART = 512


def _values(rank: int) -> torch.Tensor:
    shared = torch.randn(N, generator=torch.Generator().manual_seed(0))
    return shared + 0.1 * torch.randn(N, generator=torch.Generator().manual_seed(10 + rank))


def _peers(faults: HivemindFaults, name: str) -> list[HivemindTransport]:
    cfg = {"run_id": f"{name}-{os.getpid()}", "secret": "s", **FAST, "target_group_size": 4}
    # small parts: every member owns some (hivemind gives a small vector's one part to the first)
    peers = [HivemindTransport(HivemindConfig(**cfg), part_size_bytes=PART)]
    for r in range(1, 4):
        config = HivemindConfig(**cfg, initial_peers=peers[0].join_addresses)
        insider = faults if r == INSIDER else None
        peers.append(HivemindTransport(config, faults=insider, part_size_bytes=PART))
    return peers


def _insider_run(faults: HivemindFaults, wire: str, caplog) -> None:
    """3 rounds among 4 peers, the last an insider owner: in a round where the three honest peers commit
    together (the last such; under load a round may form smaller groups) they commit the robust merge of
    their own values only, every one the same bits; and the insider is named."""
    caplog.set_level(logging.WARNING, logger="transports.hivemind")
    peers = _peers(faults, f"relays-{wire}")
    merge = Merge(rule=MergeRule.ROBUST)
    rounds: list[list] = []
    try:
        for _ in range(3):
            results: list = [None] * 4

            def body(rank: int, results: list = results) -> None:
                x = _values(rank)
                try:
                    r = peers[rank].all_reduce([x], codec=codec_for(wire), merge=merge).wait(60)
                    results[rank] = (r.num_contributors, [o.who for o in r.left_out], x)
                except TransportError as e:
                    results[rank] = e

            in_threads(body, 4, timeout=120, what="hivemind peers")
            rounds.append(results)
    finally:
        for p in peers:
            p.close()
    codec = codec_for(wire)  # the honest peers' payloads, decoded: what their merge averages
    decoded = [codec.decode(codec.encode(_values(r)), torch.empty(N)) for r in range(3)]
    honest_mean = torch.stack(decoded).mean(0)
    summary = [[r if isinstance(r, TransportError) else r[:2] for r in results] for results in rounds]
    together = [res[:3] for res in rounds if all(isinstance(r, tuple) and r[0] == 3 and not r[1] for r in res[:3])]
    assert together, summary
    last = together[-1]
    assert all(torch.equal(r[2], last[0][2]) for r in last)
    assert torch.allclose(last[0][2], honest_mean, atol=5e-3), (last[0][2] - honest_mean).abs().max()
    for (
        results
    ) in rounds:  # whatever committed (a round may form smaller groups), nobody's merge left an honest peer out
        for r in results[:3]:
            assert isinstance(r, TransportError) or not r[1], summary
    named = [r.getMessage() for r in caplog.records if "failed its part exchange" in r.getMessage()]
    assert named and all("relayed payloads failed their check" in line for line in named), named
    insider = PeerID.from_base58(peers[INSIDER].join_addresses[0].split("/p2p/")[-1]).to_bytes().hex()[-8:]
    assert all(insider in line for line in named), (insider, named)


@pytest.mark.timeout(420)
def test_an_insider_owner_substituting_its_own_payload_int4_is_named_and_left_out(caplog):
    faults = HivemindFaults(relay_payloads=lambda others, own: [own] * len(others))
    _insider_run(faults, "int4", caplog)


@pytest.mark.timeout(420)
def test_an_insider_owner_returning_minus_100x_fp16_is_named_and_left_out(caplog):
    faults = HivemindFaults(reducer_sends_mean=lambda t: t * -100)
    _insider_run(faults, "fp16", caplog)


@pytest.mark.timeout(180)
def test_a_member_whose_merge_left_itself_out_says_so_in_one_warning_line(caplog):
    """3 peers, the third's values 1e4 times the others': its own merge leaves it out, and it says so
    (a strong signal of an owner's substitution, or of its own values being off); the others do not."""
    caplog.set_level(logging.WARNING, logger="transports.hivemind.attempts")
    cfg = {"run_id": f"left-me-out-{os.getpid()}", "secret": "s", **FAST, "target_group_size": 3}
    peers = [HivemindTransport(HivemindConfig(**cfg))]
    merge = Merge(rule=MergeRule.ROBUST)
    results: list = [None] * 3
    try:
        for _ in range(2):
            peers.append(HivemindTransport(HivemindConfig(**cfg, initial_peers=peers[0].join_addresses)))

        def body(rank: int) -> None:
            x = _values(rank) * (1e4 if rank == 2 else 1.0)
            results[rank] = peers[rank].all_reduce([x], codec=codec_for("int8"), merge=merge).wait(60)

        in_threads(body, 3, timeout=120, what="hivemind peers")
    finally:
        for p in peers:
            p.close()
    assert all(len(r.left_out) == 1 for r in results), results
    said = [r.getMessage() for r in caplog.records if "left this peer's own contribution out" in r.getMessage()]
    assert len(said) == 1, said


def test_a_forged_digest_is_named_in_hivemind_s_parts_of_the_default_model_among_four():
    """The case as it happened: the trainer's default model, int4, 4 members, merged part by part
    as hivemind's block runner cuts them (the cut at the digest's square): the insider named in
    its part."""
    from diloco_core.guard import ContributionGuard
    from diloco_train.model import ModelConfig, count_parameters
    from transports.hivemind.block_runner import values_per_part

    codec, numel = codec_for("int4"), count_parameters(ModelConfig())
    guard = ContributionGuard(codec, norm_clip=None, numel=numel, compare=False)
    total, layout = numel + guard.tail_size, guard.controls
    size = values_per_part(codec, 2**19, values=total, members=4)
    assert (layout.digest_at + layout.block) % size == 0  # a cut between the digest and its square
    seeds = [torch.Generator().manual_seed(i) for i in range(4)]
    flats = [torch.randn(total, generator=g) * 1e-3 for g in seeds]
    for f in flats:
        guard.mark(f, excluded=False, norm=1.0, global_flat=torch.zeros(numel))
    flats[3][layout.digest_at : layout.digest_at + layout.block] = 3.5
    merge = Merge(rule=MergeRule.ROBUST, judged=numel, controls=layout)
    named = []
    for lo in range(0, total, size):
        hi = min(total, lo + size)
        payloads = [codec.encode(f[lo:hi].clone()) for f in flats]
        out = torch.empty(hi - lo)
        named += [o.who for o in merge.of(payloads, codec=codec, out=out, start=lo)]
    assert named == ["3"]  # the contributor's index, as the merge names it
