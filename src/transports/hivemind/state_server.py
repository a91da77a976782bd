"""State for joiners: the snapshot a peer serves (its broadcast values, the run state ``attach`` was given, its state
tag) and the download of another peer's snapshot, on joining or when re-syncing from its group."""

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diloco_core.transport import TransportError

from .checks import check_tensor, valid_state
from .donor_choice import Offer, choose, offer_of
from .resources import Resources
from .state_tag import Tag

logger = logging.getLogger(__name__)

OFFER_SECONDS = 15.0
"""The longest a look at the donors' offers waits for them (a donor answers once it has read the
requester's presence record from the DHT: at most 10 s)."""

State = tuple[dict, list[torch.Tensor]]
"""(msgpack-able meta, tensors): what a peer serves and a joiner downloads."""


def broadcast_values(downloaded: State, index: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The values of broadcast #``index`` in a downloaded state, checked against the local tensors."""
    meta, got = downloaded
    counts = meta["broadcasts"]
    if index >= len(counts) or counts[index] != len(like):
        raise TransportError(
            f"hivemind broadcast #{index}: the peers' state holds no matching broadcast ({counts})"
        )
    values = got[sum(counts[:index]) : sum(counts[: index + 1])]
    try:
        for t, v in zip(like, values):
            check_tensor(v, shape=t.shape, dtype=t.dtype, what=f"broadcast #{index}")
    except ValueError as e:
        raise TransportError(
            f"hivemind broadcast #{index}: peers' values do not fit: {e}"
        ) from None
    return values


def rounds_of(state: State) -> int:
    """The rounds a served state has committed (-1: it tracks none)."""
    tag = state[0].get("tag")
    return tag[0] if tag is not None else -1


class StateServer:
    """Peers serve a snapshot taken at each broadcast and at the start of each all-reduce (a point between
    rounds), plus the run state ``attach`` was given; a joiner serves nothing until it holds the run's state."""

    def __init__(
        self,
        *,
        joining: bool,
        resources: Resources,
        lock: threading.RLock,
        tags: Callable[[], dict],
    ) -> None:
        """``tags()``: the state tags to serve (called under ``lock``, which guards the snapshot too)."""
        self.joining = joining
        self.shared: list[list[torch.Tensor]] = []  # the tensors of every broadcast, in call order
        self.extra_fn: Callable[[], State | None] | None = None
        """The run state to serve beside the broadcasts (``RunState.snapshot``: tensors that are the
        server's to keep); None from it: keep serving the last snapshot."""
        self.frozen: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        """Held around a snapshot, before the lock: the run state changes no round meanwhile (``RunState.lock``)."""
        self.downloaded: State | None = None
        # ``downloaded`` was loaded: its meta kept, its tensors dropped (``loaded``)
        self._in_place = False
        self.averager: Any = (
            None  # the 1-value averager that serves the snapshot (it never averages)
        )
        self._snapshot: State = ({"ready": False}, [])
        self._wanted: threading.Event | None = None  # a snapshot is asked for (``snapshot_soon``)
        self.claims: Callable[[], dict[bytes, int]] = dict
        """Per peer id, the rounds its presence record declares (``swarm.Swarm.others``; set by
        ``TrackedState``)."""
        self._named: set[tuple[bytes, str]] = set()  # refused donors already named, with why
        self._res = resources
        self._lock = lock
        self._tags = tags

    def take_snapshot(self) -> None:
        if self.joining and self.downloaded is None:
            return  # a joiner serves nothing until it holds the run's state
        # Values, run state and tags from one moment: no round is applied (frozen) nor committed (lock) meanwhile.
        with self.frozen, self._lock:
            extra = self.extra_fn() if self.extra_fn is not None else ({}, [])
            # the run state cannot be served now (a reduce in flight): keep the last snapshot
            if extra is None:
                return
            extra_meta, extra = extra
            # the last snapshot's copies go before the new ones are made (a download that holds them
            # keeps its own reference): one copy of the state at a time, not two
            self._snapshot = ({"ready": False}, [])
            # the run state's tensors are already copies of their own (``RunState.snapshot``)
            tensors = [t.detach().clone() for group in self.shared for t in group] + list(extra)
            counts = [len(g) for g in self.shared]
            meta = {
                "ready": True,
                "broadcasts": counts,
                "extra": extra_meta,
                "num_tensors": len(tensors),
            }
            meta.update(self._tags())
            self._snapshot = (meta, tensors)
            # donors: the newest state first
            if rounds_of(self._snapshot) >= 0 and self.averager is not None:
                self.averager.state_sharing_priority = float(rounds_of(self._snapshot))

    def snapshot_soon(self) -> None:
        """Take a snapshot in a thread of its own (started on first use): a reduce that just committed asks
        for one, and must not wait for the training thread, which may be waiting for that reduce."""
        if self._wanted is None:
            self._wanted = threading.Event()
            threading.Thread(target=self._snapshots, name="hivemind-snapshots", daemon=True).start()
        self._wanted.set()

    def _snapshots(self) -> None:
        assert self._wanted is not None
        while not self._res.closed:
            if self._wanted.wait(0.2):
                self._wanted.clear()
                try:
                    self.take_snapshot()
                except Exception:  # a bug: say it, keep serving the last snapshot
                    logger.exception("hivemind: taking a snapshot of the run's state failed")

    def serve(self) -> State:
        with self._lock:
            return self._snapshot

    def download(self, timeout: float) -> State:
        """A whole, well-formed, credible state (``donor_choice``: the one the most donors serve)
        within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.take(timeout=max(1.0, deadline - time.monotonic()))
            if got is not None:
                return got
            if time.monotonic() + 1.0 > deadline:
                run = self._res.config.run_id
                raise TransportError(
                    f"hivemind: no peer of run {run!r} served its state within {timeout:g}s "
                    "(are initial_peers right, and do all peers use the same secret?)"
                )
            time.sleep(1.0)

    def take(
        self,
        *,
        timeout: float,
        accept: Callable[[Offer], bool] = lambda o: True,
        floor: int | None = None,
    ) -> State | None:
        """One look at the donors: what each serves (``Donors.offers``), the state that
        ``donor_choice.choose`` picks (fitting ``accept``; ``floor``: the rounds of the group state
        this peer catches up to), downloaded whole from one donor that offered it and checked; None
        if no donor serves one that fits. Refused donors are named, once each."""
        wait = min(timeout, OFFER_SECONDS)
        try:
            metas = self._res.wait(self.averager.offers(wait), wait + 5)
        except Exception as e:  # a timeout: try again
            if self._res.closed:
                raise TransportError("hivemind transport was closed during a state download") from e
            return None
        offers = {p: offer_of(p, m) for p, m in metas.items()}
        offers = {p: o for p, o in offers.items() if o is not None}
        choice = choose(offers.values(), claims=self._claims(), floor=floor, accept=accept)
        self._name(choice.refused)
        # A download once begun may take a payload exchange's time (``averaging_timeout``), however
        # little of ``timeout`` is left: a 150M model's state (1.2 GB, 10 s at 1 Gbit/s) was cut
        # short by a re-sync's window of ``matchmaking_time``, and refused as malformed.
        timeout = max(timeout, self._res.config.averaging_timeout)
        for peer in choice.donors:
            start = time.monotonic()
            got = self._load_from(peer, timeout)
            if got is None or not valid_state(*got):
                self._name([(peer, "its state is malformed or cut short")])
            elif offer_of(peer, got[0]) == offers[peer]:
                size = sum(t.numel() * t.element_size() for t in got[1])
                took = time.monotonic() - start
                logger.info(
                    "took %.3f GB of state from %s in %.1f s", size / 1e9, peer.hex()[-8:], took
                )
                return got
            else:  # it committed a round since (or serves another state than it offered)
                logger.debug("peer %s served another state than it offered", peer.hex()[-8:])
        return None

    def _load_from(self, peer: bytes, timeout: float) -> Any:
        try:
            return self._res.wait(self.averager.load_from(peer, timeout), timeout + 5)
        except Exception as e:
            if self._res.closed:
                raise TransportError("hivemind transport was closed during a state download") from e
            return None

    def _claims(self) -> dict[bytes, int]:
        """Per peer, the rounds its presence declares (``claims``), this peer's own included."""
        claims = dict(self.claims())
        with self._lock:
            tag = self._tags().get("tag")
        if tag is not None:
            claims[b""] = tag[0]  # this peer (no peer id is empty; the others' records omit it)
        return claims

    def _name(self, refused: Iterable[tuple[bytes, str]]) -> None:
        for peer, why in refused:
            if (peer, why) not in self._named:  # one line per donor and reason
                self._named.add((peer, why))
                name = peer.hex()[-8:]
                logger.warning("hivemind: refused the state peer %s serves: %s", name, why)

    def loaded(self, meta: dict) -> None:
        """The downloaded state whose meta is ``meta`` is in place (a joiner's, or a re-sync's): keep the
        meta, drop the tensors (a copy of the global params and momentum, held for nothing until now);
        a broadcast or load after this downloads again."""
        self.downloaded = (meta, [])
        self._in_place = True

    def _held(self, timeout: float) -> State:
        """The downloaded state, downloaded now if there is none or only its meta is left."""
        if self.downloaded is None or self._in_place:
            self.downloaded = self.download(timeout)
            self._in_place = False
        return self.downloaded

    def load_state(self, timeout: float) -> State | None:
        """The run state a peer served (downloaded on joining); None on the swarm's first peer."""
        if not self.joining:
            return None
        meta, tensors = self._held(timeout)
        skip = sum(meta["broadcasts"])
        return meta["extra"], tensors[skip:]

    def broadcast(self, tensors: list[torch.Tensor], timeout: float) -> None:
        """Make ``tensors`` the run's values: kept on the swarm's first peer, downloaded on a joiner."""
        index = len(self.shared)
        if self.joining:
            deadline = time.monotonic() + timeout
            self._held(timeout)
            while (
                index >= len(self.downloaded[0]["broadcasts"]) and time.monotonic() + 1.0 < deadline
            ):
                # the donor has not made this broadcast yet (it may still be starting)
                time.sleep(1.0)
                self.downloaded = self.download(deadline - time.monotonic())
            torch._foreach_copy_(tensors, broadcast_values(self.downloaded, index, tensors))
            self.averager.allow_state_sharing = True
        self.shared.append(tensors)
        self.take_snapshot()

    def download_successor(
        self,
        tag: Tag,
        timeout: float,
        stop: Callable[[], bool],
        ready: Callable[[], bool] | None = None,
    ) -> State | None:
        """The state the group commits next after the state tagged ``tag`` (its previous tag is
        ``tag``), waited for within ``timeout`` seconds; failing that, the state tagged ``tag``
        itself; None if no peer served either, or once ``stop()``. A state two or more rounds
        (reduces) on is returned as soon as it comes: the swarm went on (a peer stalled for rounds)
        and nobody serves that successor any more. It is taken as a joiner takes the run's (``take``:
        credible, the most donors): its history cannot be checked against ``tag``, and the
        groupmates' tag check at the next round keeps another chain from being averaged in. A state
        at or below ``tag``'s round, or one round on from another previous tag, is never returned.
        Only the donors' offers are read until one fits (a whole state is downloaded once).
        ``ready()``: a peer has committed a round after ``tag`` (its presence says so): after a
        first look, the next waits for it (before: a download every second while the group
        finished its round, ~30 of them)."""
        deadline = time.monotonic() + timeout
        want, tries = tag, 0
        while not stop():
            if tries == 0 or ready is None or ready():
                tries += 1
                got = self.take(
                    timeout=max(1.0, deadline - time.monotonic()),
                    accept=lambda o: o.prev == want or o.rounds > want[0] + 1,
                    floor=want[0],
                )
                if got is not None:
                    return (
                        got  # the round the group is finishing, or a later one (the swarm went on)
                    )
            if time.monotonic() + 1.0 > deadline:
                break
            time.sleep(1.0)
        if stop():
            return None
        return self.take(timeout=5.0, accept=lambda o: o.tag == want, floor=want[0])  # as it is now
