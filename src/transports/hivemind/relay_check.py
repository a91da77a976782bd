"""Relayed payloads checked against their senders' own digests (between phases 3 and 4 of a round).

With 3 or more peers a part's owner relays the *other* contributors' payloads (``block_runner``): an
insider owner could put anything in their place (its own: each member's merge then leaves *itself*
out). The run's MAC key is every member's, so a MAC proves nothing between members; libp2p does
authenticate each connection's peer id. So once its exchange is over every member sends every
groupmate, directly, one message: the SHA-256 (first 16 bytes) of each of its own payloads of the
parts others own (its *claims*) and of each payload it received of the parts it owns (its
*statements*: what it relayed). Before confirming, each member checks what it merged:

- an owner's statement about my own payload is not my payload's digest: the owner is blamed;
- a payload an owner relayed to me is not what it states it received: the owner is blamed;
- as an owner, a sender's claim is not what it sent me: the sender is blamed;
- a relayed payload that the owner's statement matches but its sender's claim does not: one of the
  two lies, and a third member cannot tell which (``verdict``): the round fails, nobody is blamed.

A failed check fails the round on this member: its merge (which used the payloads) is never
committed, and its report names whom it blames (``blame``: a peer most reports blame is benched).
The message is MACed with the run's key only to keep outsiders out. Its bytes: 16 per part and
contributor, a few KB a round; its time: one more message after the exchange, and SHA-256 over the
payloads a member sends and receives (about 1.8 GB/s here).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from .auth import MAC_BYTES, RunKeys

__all__ = ["DIGEST_BYTES", "RelayChecks", "digests_message", "payload_digest", "verdict"]

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
_CODE = averaging_pb2.PART_FOR_AVERAGING  # in the MAC: these messages are not confirmations

Where = tuple[int, int]
"""A part: (its owner's index in the group, its index among the owner's parts)."""


def payload_digest(payload: torch.Tensor) -> bytes:
    """The first 16 bytes of the SHA-256 of a payload's bytes."""
    raw = payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).digest()[:DIGEST_BYTES]


def _layout(parts: Sequence[int], sender: int) -> tuple[list[Where], list[tuple[int, int]]]:
    """A message's claims (the others' parts) and statements ((part, sender), its own parts)."""
    n = len(parts)
    claims = [(k, p) for k in range(n) if k != sender for p in range(parts[k])]
    statements = [(p, i) for p in range(parts[sender]) for i in range(n) if i != sender]
    return claims, statements


def digests_message(
    parts: Sequence[int],
    me: int,
    *,
    claims: Mapping[Where, bytes],
    seen: Mapping[tuple[int, int, int], bytes],
) -> bytes:
    """My message (``parts``: each owner's number of parts; ``claims``: my payloads' digests;
    ``seen``: (owner, part, sender) -> the digest of what I received); empty if my exchange did not
    finish."""
    mine, stated = _layout(parts, me)
    try:
        return b"".join([claims[w] for w in mine] + [seen[(me, p, i)] for p, i in stated])
    except KeyError:
        return b""


def _read(message: bytes, parts: Sequence[int], sender: int) -> tuple[dict, dict] | None:
    """A groupmate's message as received: (claims, statements), None if its length is wrong."""
    mine, stated = _layout(parts, sender)
    if len(message) != DIGEST_BYTES * (len(mine) + len(stated)):
        return None
    cut = [message[i : i + DIGEST_BYTES] for i in range(0, len(message), DIGEST_BYTES)]
    return dict(zip(mine, cut)), dict(zip(stated, cut[len(mine) :]))


@dataclass(kw_only=True)
class _Checks:
    """One member's checks of what it merged (``verdict``): what it knows, and what they found."""

    parts: Sequence[int]
    me: int
    claims: Mapping[Where, bytes]
    seen: Mapping[tuple[int, int, int], bytes]
    read: dict[int, tuple[dict, dict]] = field(default_factory=dict)
    """The groupmates' valid messages, by index: (claims, statements)."""
    problems: list[str] = field(default_factory=list)
    blamed: set[int] = field(default_factory=set)

    def read_messages(self, messages: Mapping[int, bytes]) -> None:
        """Each groupmate's message; one that is missing or malformed is a problem."""
        for j in range(len(self.parts)):
            if j == self.me:
                continue
            got = _read(messages.get(j, b""), self.parts, j)
            if got is None:
                if messages.get(j):
                    self.blamed.add(j)  # it sent a malformed message itself
                self.problems.append(f"no valid payload digests from groupmate {j}")
            else:
                self.read[j] = got

    def check_owner(self, k: int) -> None:
        """Owner ``k``'s statements: of my own payloads, and of the others' it relayed to me."""
        stated = self.read[k][1]
        for p in range(self.parts[k]):
            if stated[(p, self.me)] != self.claims.get((k, p)):
                self.blamed.add(k)
                what = f"a payload of mine for part {p}"
                self.problems.append(f"owner {k} states {what} I never sent")
            for i in range(len(self.parts)):
                if i in (k, self.me) or self.seen.get((k, p, i)) is None:
                    continue
                self.check_relay(k, p, i)

    def check_relay(self, k: int, p: int, i: int) -> None:
        """Sender ``i``'s payload of part ``p`` as owner ``k`` relayed it to me: what ``k`` states
        it received, and what ``i`` claims it sent."""
        if self.seen[(k, p, i)] != self.read[k][1][(p, i)]:
            self.blamed.add(k)
            what = f"a payload of {i} for part {p}"
            self.problems.append(f"owner {k} relayed {what} that it did not receive")
        elif i in self.read and self.read[i][0][(k, p)] != self.seen[(k, p, i)]:
            self.problems.append(f"owner {k} and sender {i} disagree on part {p}'s payload")

    def check_sender(self, i: int) -> None:
        """Sender ``i``'s claims of the payloads it sent me, as the owner of my parts."""
        claimed = self.read[i][0]
        me = self.me
        bad = [p for p in range(self.parts[me]) if claimed[(me, p)] != self.seen.get((me, p, i))]
        if bad:
            self.blamed.add(i)
            self.problems.append(f"sender {i} claims payloads it did not send me (part {bad[0]})")


def verdict(
    messages: Mapping[int, bytes],
    parts: Sequence[int],
    me: int,
    *,
    claims: Mapping[Where, bytes],
    seen: Mapping[tuple[int, int, int], bytes],
) -> tuple[list[str], frozenset[int]]:
    """What this member's checks found (one line each) and whom it blames (group indices), from the
    groupmates' ``messages`` (by index; missing or empty: that groupmate's exchange failed)."""
    checks = _Checks(parts=parts, me=me, claims=claims, seen=seen)
    checks.read_messages(messages)
    for k in checks.read:  # the parts owner k relayed to me
        checks.check_owner(k)
    for i in checks.read:  # the payloads senders sent me, as the owner
        checks.check_sender(i)
    return checks.problems, frozenset(checks.blamed)


class RelayChecks:
    """The digests' handler and exchange of ``averager.Averager`` (a mixin: hivemind serves its
    ``rpc_*`` methods)."""

    keys: RunKeys
    _relay_digests: OrderedDict[bytes, dict]
    """Per group id: the messages received ({peer: bytes}) and an event set on each."""

    async def rpc_relay_digests(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        buffer = request.tensor_part.buffer
        body, tag = buffer[:-MAC_BYTES], buffer[-MAC_BYTES:]
        mac = self.keys.confirm_mac(request.group_id, context.remote_id.to_bytes(), _CODE, body)
        if len(buffer) < MAC_BYTES or not hmac.compare_digest(tag, mac):
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        box = self._digests_box(request.group_id)
        box["got"].setdefault(context.remote_id, body)  # its first message counts
        box["event"].set()
        return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)

    def _digests_box(self, group_id: bytes) -> dict:
        if group_id not in self._relay_digests:
            self._relay_digests[group_id] = {"got": {}, "event": asyncio.Event()}
            while len(self._relay_digests) > 16:  # a peer only ever needs its latest groups
                self._relay_digests.popitem(last=False)
        return self._relay_digests[group_id]

    async def _exchange_digests(
        self,
        peer_ids: Sequence[Any],
        group_id: bytes,
        *,
        mine: bytes,
        deadline: float,
        failed: Collection[Any] = (),
    ) -> dict[int, bytes]:
        """Send every groupmate ``mine``; return theirs by group index, waiting until ``deadline``
        (monotonic) for those not in ``failed`` (seen failing: they may never send)."""
        others = [p for p in peer_ids if p != self.peer_id]
        mac = self.keys.confirm_mac(group_id, self.peer_id.to_bytes(), _CODE, mine)
        msg = averaging_pb2.AveragingData(
            code=_CODE, group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=mine + mac)
        )
        left = max(0.1, deadline - time.monotonic())

        async def send(peer: Any) -> None:
            try:
                stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                await asyncio.wait_for(stub.rpc_relay_digests(msg), left)
            except Exception as e:  # noqa: BLE001 - a lost peer: the confirmation fails the round
                logger.debug("relay digests to %s failed: %r", peer, e)

        sends = [asyncio.create_task(send(p)) for p in others]
        box = self._digests_box(group_id)
        waited = [p for p in others if p not in failed]
        try:
            while not all(p in box["got"] for p in waited) and time.monotonic() < deadline:
                box["event"].clear()
                try:
                    await asyncio.wait_for(box["event"].wait(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.gather(*sends, return_exceptions=True)
            got = dict(box["got"])
            self._relay_digests.pop(group_id, None)
        return {peer_ids.index(p): body for p, body in got.items() if p in others}

    async def _check_relays(self, runner: Any, group: bytes, *, error: Any, deadline: float) -> Any:
        """The check of a block runner's relays (see the module docstring): the round's error (a
        string), if any; whom this member blames is added to ``runner.blamed``."""
        parts = list(runner.tensor_part_container.num_parts_by_peer)
        peer_ids = runner.ordered_peer_ids
        failed = runner.blamed
        until = deadline
        me = runner.me
        claims = runner.claims
        seen = runner.seen
        mine = b"" if error else digests_message(parts, me, claims=claims, seen=seen)
        exchange = self._exchange_digests
        messages = await exchange(peer_ids, group, mine=mine, failed=failed, deadline=until)
        if error is not None:
            return error
        problems, blamed = verdict(messages, parts, me, claims=claims, seen=seen)
        if not problems:
            return None
        runner.blamed.update(peer_ids[i] for i in blamed)
        logger.warning("relayed payloads failed their check: %s", "; ".join(problems[:3]))
        return f"relayed payloads failed their check: {'; '.join(problems[:3])}"
