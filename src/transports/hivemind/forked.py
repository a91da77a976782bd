"""How a peer forks its processes (its DHT, its averagers) and how each starts: one fork at a time,
and each child leaves with its parent, gives back the copy of its parent's tensors it inherited, and
runs at its niceness.

hivemind's averager is a forked process (``DecentralizedAverager`` is a
``multiprocessing.Process``), and a round's averager is forked when the first round asks for it:
after the model, its gradients, the inner optimizer's state, the global copy, the reduce buffer and
the residuals exist. The child never reads them (its values travel through the shared buffer and the
pipe), but it maps them, so every page the trainer writes afterwards is copied for the trainer and
the child keeps the old one: measured 20 (fp32) to 28.5 (int4) bytes per parameter in the child
(docs/results.md, "Scale").

So the parent lists its large private CPU tensor storages as it forks (``forking``: the tensors its
Python objects reach, and their gradients), and the child, first thing (``start_child``), hands
their pages back to the kernel with ``madvise(MADV_DONTNEED)``: the pages wholly inside each
storage. The child reads zeros there from then on (it never reads them); the parent's pages are
untouched. Shared-memory storages (an averager's own buffer) and small ones (a codec's tables) are
kept. The list is made in the parent because walking every object from the child would write each
one's reference count there, copying the pages of the whole Python heap (about 50 MiB a child,
measured).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator

import torch

from .orphan import leave_with_parent

__all__ = ["MIN_BYTES", "forking", "release_inherited", "start_child"]

logger = logging.getLogger(__name__)

MIN_BYTES = 1 << 16
"""Smaller storages are kept (a codec's tables; a 5M-parameter model has matrices of 640 KiB)."""
_MADV_DONTNEED = 4  # linux/mman.h
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
"""Only these types: a subclass (a DTensor) may hold no storage of its own."""

# Held while a DHT or averager process is forked. multiprocessing makes the pipe that tells a parent
# its child exited (the sentinel) just before forking; a fork from another thread in between copies
# that pipe into a second child, and the first child's join() then waits out hivemind's 5 s shutdown
# grace period for a child that has long exited (several transports in one process: tests).
_FORK_LOCK = threading.Lock()
_large: list[torch.UntypedStorage] = []
"""The parent's large private storages as it forks, held: no other thread of the parent can free one
(and its pages be reused) between the list and the fork. A child gives their pages back."""


def _storages() -> list[torch.UntypedStorage]:
    """Every large private CPU storage this process's Python objects reach, once each."""
    found: dict[int, torch.UntypedStorage] = {}
    objects = gc.get_objects()
    # picked without a Python loop (0.06 s a fork at 400k objects, against 0.1 s)
    tensors = list(itertools.compress(objects, map(_PLAIN.__contains__, map(type, objects))))
    del objects
    for obj in tensors:
        grad = obj.grad if obj.is_leaf and obj.requires_grad else None
        for t in (obj, grad):
            if t is None or t.device.type != "cpu" or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() >= MIN_BYTES and not storage.is_shared():
                found[storage.data_ptr()] = storage
    return list(found.values())


@contextlib.contextmanager
def forking(*, walk: bool = True) -> Iterator[None]:
    """Around a peer's fork of a DHT or averager process: one at a time, the parent's large tensors
    listed (and held until the fork is done) for the child to give back (``walk``; else none)."""
    global _large
    with _FORK_LOCK:
        try:
            _large = _storages() if walk else []
        except Exception as e:  # noqa: BLE001 - what is not given back costs memory, never the run
            logger.warning("a forked process will keep the tensors it inherits: %r", e)
            _large = []
        try:
            yield
        finally:
            _large = []


def release_inherited() -> int:
    """In a child forked under ``forking``: give back the pages of the parent's large tensors it
    will never read. Returns the bytes given back (0 where this is not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    released = 0
    for storage in _large:
        address, nbytes = storage.data_ptr(), storage.nbytes()
        # the pages wholly inside the storage: never a neighbour's
        first = -(-address // page) * page
        end = (address + nbytes) // page * page
        if end > first and madvise(first, end - first, _MADV_DONTNEED) == 0:
            released += end - first
    logger.debug("gave back %.1f MiB of the parent's tensors", released / 2**20)
    return released


def start_child(*, niceness: int, cleanup: Callable[[], None]) -> None:
    """First thing in a peer's forked process: it exits with its parent (running ``cleanup``: its
    socket files), gives back the parent's tensors it inherited, and adds ``niceness`` to its
    own."""
    leave_with_parent(cleanup=cleanup)
    release_inherited()
    os.nice(niceness)
