"""Membership of a torch.distributed group: every rank proves that it holds the run's secret, or none starts.

Anyone who reaches the rendezvous (torchrun's TCPStore, ``MASTER_ADDR:MASTER_PORT``) can register as a
rank, and a rank is an insider: its payloads are averaged. With a secret set, ``prove_membership`` runs
right after the group forms, before any other collective, so a process without the secret is refused
before it can send a payload:

1. hello: every rank sends every other rank, directly (point-to-point), ``MAGIC``, whether it holds a
   secret, and a fresh random nonce;
2. proof (when every rank holds a secret): every rank sends every other rank
   ``HMAC(key, sender, receiver, receiver's nonce, sender's nonce)``, and checks the one it received from
   each rank against its own nonce. A proof binds the receiver's fresh nonce (no replay from an earlier
   group) and both ranks (no reflection), and it travels on the two ranks' own connection, so a failure
   names the rank that failed.

Any problem is one ``TransportError`` on every rank, naming each rank that failed and why (no secret, a
different secret, not a diloco process, silent past the timeout); no rank trains or averages. The key is
scrypt's of the secret (``KDF``: a proof seen on the wire costs a guesser one scrypt per guess). Every
rank takes part even without a secret (only the hello), so that a rank with one and a rank without one
are a clear error rather than two different collectives paired.

What this does not do: encrypt or authenticate the traffic after the check (an attacker on the network
path, or one that rewrites the rendezvous's keys as the group forms, can still read or alter payloads),
or stop an insider: a process holding the secret is a member (robust aggregation bounds its influence).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from diloco_core.transport import TransportError

from .group import TorchDistConfig

__all__ = ["KDF", "SECRET_ENV", "membership_key", "prove_membership", "read_secret"]

logger = logging.getLogger(__name__)

SECRET_ENV = "DILOCO_TORCH_SECRET"
"""The environment variable that holds the secret when ``[transport]`` names none (torchrun passes it on)."""
MAGIC = b"diloco/torch/auth/v1"
"""The first bytes of a hello: a rank that sends anything else is not this version of diloco."""
KDF = {"n": 2**16, "r": 8, "p": 1}
"""scrypt's cost, as hivemind's (docs/wan.md): 64 MiB per guess, paid once per process at the start."""
NONCE = 32
MAC = 32
SHORT_SECRET = 16
"""A secret shorter than this is warned about (``secrets.token_urlsafe(24)`` has 32 characters)."""
_HELLO = len(MAGIC) + 1 + NONCE
NOT_DILOCO = "is not a diloco member (its first message is not diloco's membership check)"
NO_PROOF = "did not prove the run's secret (another secret, or not a member of this run)"


def read_secret(
    *, secret: str | None, secret_file: str | None, environ: Mapping[str, str]
) -> str | None:
    """The run's secret: ``secret``, else ``secret_file``'s content (a file only its owner may read), else the
    ``SECRET_ENV`` variable of ``environ``; None if there is none."""
    if secret is not None and secret_file is not None:
        raise ValueError(
            "[transport] secret and secret_file are both set: expected at most one of them"
        )
    if secret_file is not None:
        return _from_file(secret_file)
    if secret is None:
        secret = environ.get(SECRET_ENV) or None
    return secret


def _from_file(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise ValueError(f"[transport] secret_file={path!r} cannot be read: {e.strerror}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"[transport] secret_file={path!r} is open to other users (mode {stat.S_IMODE(mode):o}): expected a "
            f"file only its owner may read or write (chmod 600 {path})"
        )
    if not text:
        raise ValueError(f"[transport] secret_file={path!r} is empty: expected the run's secret")
    return text


@functools.lru_cache(maxsize=4)
def _derive(secret: str) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=MAGIC, maxmem=2**28, dklen=32, **KDF)


def membership_key(config: TorchDistConfig) -> bytes | None:
    """The key this rank proves membership with, from ``config``'s secret (``read_secret``, the environment
    this process's); None: no secret, no proof."""
    secret = read_secret(secret=config.secret, secret_file=config.secret_file, environ=os.environ)
    if secret is None:
        return None
    if len(secret) < SHORT_SECRET:
        logger.warning(
            "the torch transport's secret has %d characters (< %d): a short secret can be guessed; use a long "
            "random one (python -c 'import secrets; print(secrets.token_urlsafe(24))')",
            len(secret),
            SHORT_SECRET,
        )
    return _derive(secret)


def _proof(key: bytes, *, sender: int, receiver: int, nonces: tuple[bytes, bytes]) -> bytes:
    """The proof ``sender`` owes ``receiver``: ``nonces`` are (receiver's, sender's)."""
    return hmac.new(
        key, struct.pack(">QQ", sender, receiver) + nonces[0] + nonces[1], hashlib.sha256
    ).digest()


class _Exchange:
    """Point-to-point rounds with every other rank of ``group``, under one deadline; ``failed``: why each rank
    that failed did."""

    def __init__(self, group: dist.ProcessGroup | None, *, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.peers = [r for r in range(dist.get_world_size(group)) if r != self.rank]
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.failed: dict[int, str] = {}
        backend = str(dist.get_backend(group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _wait(self, work: Any, *, owner: int | None, silent: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=max(0.0, self.deadline - time.monotonic())))
        except RuntimeError as e:
            why = (
                silent
                if "timed out" in str(e).lower()
                else f"closed its connection (it refused the group, or died: {e})"
            )
            for r in self.peers if owner is None else [owner]:
                self.failed.setdefault(r, why)

    def round(
        self, messages: dict[int, bytes], *, size: int, check: Callable[[int, bytes], str | None]
    ) -> None:
        """Send ``messages[r]`` to each peer r and receive ``size`` bytes from each, which ``check(r, message)``
        judges (a reason, or None). A gloo send ends only once its peer posted the receive: sends are waited for
        (so that a refused member still gets this rank's message) except to a peer that sent nothing or
        something other than diloco's (a non-member may never take it: it is not waited for)."""
        sends = {
            r: torch.tensor(list(m), dtype=torch.uint8, device=self.device)
            for r, m in messages.items()
        }
        recvs = {r: torch.zeros(size, dtype=torch.uint8, device=self.device) for r in self.peers}
        ops = [dist.P2POp(dist.isend, t, self._global(r), self.group) for r, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, self._global(r), self.group) for r, t in recvs.items()]
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # gloo: one work per message, so a silent rank is named
            sent, received = list(zip(sends, works)), list(zip(recvs, works[len(sends) :]))
        else:  # NCCL coalesces them: which rank failed is not known
            sent, received = [], [(None, w) for w in works]
        for owner, work in received:
            self._wait(work, owner=owner, silent=f"sent nothing within {self.timeout:g}s")
        mute = set(self.failed)
        for r, t in recvs.items():
            why = None if r in self.failed else check(r, bytes(t.cpu().tolist()))
            if why is not None:
                self.failed[r] = why
                if why == NOT_DILOCO:
                    mute.add(r)
        for owner, work in sent:
            if owner not in mute:
                self._wait(
                    work,
                    owner=owner,
                    silent=f"took nothing from this rank within {self.timeout:g}s",
                )


def prove_membership(
    key: bytes | None, *, timeout: float, group: dist.ProcessGroup | None = None
) -> None:
    """Check that every rank of ``group`` holds the key this rank holds (or that none holds one): a collective
    every rank must call once the group is formed, before any other. ``TransportError`` within ``timeout``
    seconds naming every rank that failed, on every rank."""
    exchange = _Exchange(group, timeout=timeout)
    if not exchange.peers:
        return
    me = exchange.rank
    nonce = secrets.token_bytes(NONCE)
    nonces = {}

    def hello(r: int, message: bytes) -> str | None:
        if not message.startswith(MAGIC):
            return NOT_DILOCO
        if bool(message[len(MAGIC)]) != (key is not None):
            return (
                "has no secret set"
                if key is not None
                else "has a secret set, and this rank has none"
            )
        nonces[r] = message[len(MAGIC) + 1 :]
        return None

    def proof(r: int, message: bytes) -> str | None:
        assert key is not None
        want = _proof(key, sender=r, receiver=me, nonces=(nonce, nonces[r]))
        ok = hmac.compare_digest(message, want)
        return None if ok else NO_PROOF

    exchange.round(
        dict.fromkeys(exchange.peers, MAGIC + bytes([key is not None]) + nonce),
        size=_HELLO,
        check=hello,
    )
    if key is not None and not exchange.failed:
        proofs = {
            r: _proof(key, sender=me, receiver=r, nonces=(nonces[r], nonce)) for r in exchange.peers
        }
        exchange.round(proofs, size=MAC, check=proof)
    if exchange.failed:
        raise TransportError(
            _refusal(exchange.failed, rank=me, peers=len(exchange.peers), secret=key is not None)
        )


def _refusal(failed: dict[int, str], *, rank: int, peers: int, secret: bool) -> str:
    reasons = "; ".join(f"rank {r} {why}" for r, why in sorted(failed.items()))
    hint = ""
    if peers > 1 and len(failed) == peers and all(why == NO_PROOF for why in failed.values()):
        hint = " (every other rank failed: this rank's own secret is likely the one that differs)"
    elif not secret and any(why.startswith("has a secret") for why in failed.values()):
        hint = f" (set {SECRET_ENV} or [transport] secret_file on every rank)"
    return (
        f"torch.distributed group refused by rank {rank}: {reasons}{hint}; the run does not start and nothing "
        "was averaged (docs/lan.md, 'Members only')"
    )
