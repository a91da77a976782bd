"""The averagers of one peer, one per reduce key, size, codec and merge rule: hivemind fixes an averager's
tensors when it starts, and peers meet only with the same codec identity (block size, layout)."""

from __future__ import annotations

from diloco_core import MEAN, Codec, Merge

from .averager import Averager
from .resources import Resources
from .swarm import key_hash

__all__ = ["AveragerPool"]


class AveragerPool:
    """The averagers ``resources`` started for this peer, their names under ``namespace``."""

    def __init__(self, resources: Resources, *, namespace: str) -> None:
        self._res = resources
        self._ns = namespace
        self._averagers: dict[tuple[str, int, str, Merge], Averager] = {}

    def of(self, key: str, *, size: int, codec: Codec, merge: Merge = MEAN) -> Averager:
        """The averager of ``key`` (started on first use: it starts a process)."""
        wire = str(codec.identity)
        ident = (key, size, wire, merge)
        if ident not in self._averagers:
            # p2p handlers of its own; any key, in names the DHT and p2p accept
            rule = "" if merge == MEAN else f"_{merge.rule.value}_{key_hash(repr(merge))}"
            prefix = f"{self._ns}_{key_hash(key)}_{wire}_{size}{rule}"
            self._averagers[ident] = self._res.start_averager(
                size, codec, prefix=prefix, merge=merge
            )
        return self._averagers[ident]
