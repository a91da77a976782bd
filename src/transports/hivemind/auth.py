"""Authentication of a hivemind run: keys derived from the secret, the run's DHT records MACed, joins checked.

From ``(run_id, secret)`` scrypt derives a master key (``KDF``: about 0.1-0.25 s per guess, the point:
DHT key ids and RPC names, which any DHT node and any connected libp2p peer sees, come from it, so
every guess of the secret costs an attacker a scrypt). From the master key, two independent keys:

- ``namespace``: the prefix of every DHT key and RPC name of the run. Not a credential: libp2p's
  identify protocol tells any connected peer the protocol names a peer serves;
- ``mac_key``: HMAC-SHA256 of
  - every DHT record the run stores under its own keys (``RecordAuth``): (key id, subkey, value,
    expiration) MACed, records without a valid MAC rejected on store and on get. A replayed record
    keeps its expiration: it can neither outlive nor replace a newer one;
  - the join token a peer sends with its matchmaking request (``join_token``: the averager's prefix and
    the sender's peer id, which libp2p authenticates): a leader turns away a follower without one, and
    every groupmate checks every member's token before sending anything;
  - a round's confirmation (``confirm_mac``), so that nobody outside the group fills a peer's
    confirmation boxes.

Records under other keys are not ours to judge: passed through unchanged (another run may share the DHT).
"""

import dataclasses
import functools
import hashlib
import hmac
import logging
import math
import secrets
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.auth import AuthorizerBase

from .dht_auth import MemberAuthorizer
from .reduce_number import Number, number_or_none

__all__ = ["KDF", "RecordAuth", "RunKeys", "derive_keys", "generate_secret", "run_keys"]

logger = logging.getLogger(__name__)

SALT = b"diloco/hivemind/auth/v1"
"""Fixed per project; the run_id is appended, so that no table is worth computing for all runs at once."""
KDF = {"n": 2**16, "r": 8, "p": 1}
"""scrypt's cost: 64 MiB and 0.24 s per guess on the 2-core machine this was measured on (docs/wan.md)."""
MAC_BYTES = 32
SHORT_SECRET = 16
"""A secret shorter than this is warned about (a generated one has 32 characters)."""


@dataclasses.dataclass(frozen=True)
class RunKeys:
    namespace: str
    mac_key: bytes = dataclasses.field(repr=False)

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists give the same message)."""
        h = hmac.new(self.mac_key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(struct.pack(">Q", len(part)) + part)
        return h.digest()

    def join_token(self, prefix: str, peer_id: bytes) -> bytes:
        return self.mac(b"join", prefix.encode(), peer_id)

    def join_ok(self, prefix: str, peer_id: bytes, token: object) -> bool:
        return isinstance(token, bytes) and hmac.compare_digest(
            token, self.join_token(prefix, peer_id)
        )

    def confirm_mac(self, group_id: bytes, sender: bytes, code: int, digest: bytes) -> bytes:
        return self.mac(b"confirm", group_id, sender, str(code).encode(), digest)

    @property
    def presence_key(self) -> str:
        """The DHT key under which every peer of the run declares itself (``swarm.Swarm``)."""
        return f"{self.namespace}_peers"

    def record_validator(self, raw_keys: Iterable[str]) -> RecordValidatorBase:
        """The DHT validator of the run's records under ``raw_keys`` (a seam: tests model attackers with it)."""
        return RecordAuth(self, raw_keys)

    def dht_authorizer(self) -> AuthorizerBase:
        """The DHT's authorizer: its requests and responses MACed, members only (``dht_auth``; a seam too)."""
        return MemberAuthorizer(self)


@functools.lru_cache(maxsize=16)
def derive_keys(run_id: str, secret: str) -> RunKeys:
    """The run's keys (cached: a process with several peers of one run pays the KDF once)."""
    salt = SALT + b"\0" + run_id.encode()
    master = hashlib.scrypt(secret.encode(), salt=salt, maxmem=2**28, dklen=32, **KDF)
    namespace = "diloco_" + hmac.new(master, b"namespace", hashlib.sha256).hexdigest()[:40]
    return RunKeys(
        namespace=namespace, mac_key=hmac.new(master, b"dht-mac", hashlib.sha256).digest()
    )


def generate_secret() -> str:
    """A strong random secret for a run started without one (32 URL-safe characters, 192 bits)."""
    return secrets.token_urlsafe(24)


def run_keys(run_id: str, secret: str | None, *, joining: bool) -> tuple[RunKeys, dict[str, str]]:
    """The run's keys, and the settings a joiner needs besides this peer's addresses: the secret, if this peer
    generated it (the swarm's first peer, started without one). A joiner without the secret is an error."""
    generated: dict[str, str] = {}
    if secret is None:
        if joining:
            raise ValueError(
                "secret=None is invalid for a peer that joins (initial_peers given): expected the run's secret "
                "(a first peer started without one generated it and printed it in its join command)"
            )
        secret = generated["secret"] = generate_secret()
        logger.warning(
            "hivemind run %r has no secret: generated one; every joiner needs it (join_settings)",
            run_id,
        )
    elif len(secret) < SHORT_SECRET:
        logger.warning(
            "hivemind run %r: the secret has %d characters (< %d): a short secret can be guessed; use a long random "
            "one (leave it unset and the first peer generates one)",
            run_id,
            len(secret),
            SHORT_SECRET,
        )
    return derive_keys(run_id, secret), generated


class Gathered(NamedTuple):
    """A groupmate's matchmaking data, as ``unwrap_gather`` read it (None where malformed)."""

    token: bytes | None
    data: Any
    """Its state tag (rounds) or None."""
    arrived: float | None
    """When it began matchmaking, on its clock (DHT time): the group's arrival spread sets the grace window."""
    number: Number | None = None
    """Its reduce number (``reduce_number``): which call of an untracked key it contributes to; None on tracked."""


def wrap_gather(token: bytes, data: Any, *, arrived: float, number: Number | None = None) -> list:
    """What a peer sends with its matchmaking request: its join token, its data (the state tag or None), when
    it arrived and its reduce number (None on a tracked key)."""
    return [token, data, arrived, number]


def unwrap_gather(serializer: Any, gathered: bytes) -> Gathered:
    """A groupmate's matchmaking data (msgpack, checked); all None if malformed."""
    try:
        token, data, arrived, number = serializer.loads(serializer.loads(gathered)[2])
    except Exception:  # noqa: BLE001 - malformed: no token, so not a peer of the run
        return Gathered(None, None, None)
    if not isinstance(token, bytes):
        return Gathered(None, None, None)
    ok = isinstance(arrived, float) and math.isfinite(arrived)
    return Gathered(token, data, arrived if ok else None, number_or_none(number))


def averager_keys(prefix: str) -> list[str]:
    """The DHT keys an averager of ``prefix`` stores under: matchmaking (its group bits are always empty:
    no ``initial_group_bits``) and the declaration of the state it serves."""
    return [f"{prefix}.0b", f"{prefix}.all_averagers"]


class RecordAuth(RecordValidatorBase):
    """MACs the values stored under the run's keys and rejects those without a valid MAC (see the module)."""

    def __init__(self, keys: RunKeys, raw_keys: Iterable[str]) -> None:
        self.keys = keys
        """The run's keys: validators merge only with one of the same run."""
        self._ids = {DHTID.generate(source=k).to_bytes() for k in raw_keys}

    @property
    def key_ids(self) -> frozenset[bytes]:
        """The DHT ids of the keys it protects."""
        return frozenset(self._ids)

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        return self.keys.mac(
            b"record", record.key, record.subkey, value, struct.pack(">d", record.expiration_time)
        )

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._ids:
            return record.value
        return record.value + self._mac(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._ids:
            return True  # not the run's: not ours to judge
        value, tag = record.value[:-MAC_BYTES], record.value[-MAC_BYTES:]
        return len(record.value) > MAC_BYTES and hmac.compare_digest(tag, self._mac(record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-MAC_BYTES] if record.key in self._ids else record.value

    @property
    def priority(self) -> int:
        return 20  # validated first (before any validator that reads the value), signed last

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Keys added later (an averager per reduce key) join this validator's."""
        if not isinstance(other, RecordAuth) or other.keys != self.keys:
            return False
        self._ids |= other.key_ids
        return True
