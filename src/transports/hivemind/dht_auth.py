"""``MemberAuthorizer``: the run's DHT answers members only, and members hear only members.

hivemind's DHT lets any node that reaches a peer join its routing table, be asked to keep the run's records
and be asked for them. A non-member node that joins and then stops answering made every DHT lookup wait out
its request timeout: the presence lookup came back empty and a round averaged alone (both peers, then their
states differed and a round's work was lost), and matchmaking found no group (issue 29: a node joining and
leaving every 6 s, 8 rounds alone in 48 s). It could also make every honest node store whatever it sent
under keys of its choosing (20,000 x 1 KB records with a 10-year expiry: +28-30 MB per node).

So every DHT request and response carries an HMAC-SHA256 with the run's MAC key (``auth.RunKeys``): a
request without a valid one is not served (the handler never runs: nothing stored, the sender not added to
the routing table), and a response without one is taken as no response (the node is dropped from the
routing table). A non-member then never becomes a node that members route through. The MAC covers the whole
message (its ``signature`` field empty), a nonce and a time: a request more than ``MAX_SKEW`` seconds from
this node's clock is refused, a response must echo its request's nonce. libp2p already encrypts and
authenticates the channel: the MAC decides membership, not secrecy.
"""

from __future__ import annotations

import hmac
import secrets
from typing import TYPE_CHECKING, Any

from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from .throttle import Throttle

if TYPE_CHECKING:
    from .auth import RunKeys

__all__ = ["MAX_SKEW", "MemberAuthorizer"]

MAX_SKEW = 300.0
"""Seconds a request's time may differ from the receiver's clock (hivemind's DHT time is the wall clock)."""


def _mac(keys: RunKeys, label: bytes, message: Any) -> bytes:
    return keys.mac(b"dht", label, message.SerializeToString(deterministic=True))


class MemberAuthorizer(AuthorizerBase):
    """Signs this node's DHT requests and responses with the run's key; refuses others' without it."""

    def __init__(self, keys: RunKeys) -> None:
        self.keys = keys
        self.refused = Throttle(
            "refused DHT requests without the run's key (a node that is not a peer of the run)"
        )

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(8)
        auth.signature = b""
        auth.signature = _mac(self.keys, b"request", request)

    async def validate_request(self, request: Any) -> bool:
        auth = request.auth
        signature = auth.signature
        auth.signature = b""
        try:
            ok = hmac.compare_digest(signature, _mac(self.keys, b"request", request))
        finally:
            auth.signature = signature
        ok = ok and abs(auth.time - get_dht_time()) <= MAX_SKEW
        if not ok:
            self.refused.tick()
        return ok

    async def sign_response(self, response: Any, request: Any) -> None:
        auth = response.auth
        auth.nonce, auth.signature = request.auth.nonce, b""
        auth.signature = _mac(self.keys, b"response", response)

    async def validate_response(self, response: Any, request: Any) -> bool:
        auth = response.auth
        signature = auth.signature
        auth.signature = b""
        try:
            ok = hmac.compare_digest(signature, _mac(self.keys, b"response", response))
        finally:
            auth.signature = signature
        return ok and auth.nonce == request.auth.nonce
