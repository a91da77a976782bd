"""Scale, first measurement (issue 47): where DiLoCo's memory per parameter goes.

The trainer's Llama (``diloco_train.model``) at the sizes asked for (``SIZES``: 0.9M, 5.1M, 20.0M
and 151.8M parameters, the ``150m`` preset), AdamW, batch 2 x 64 tokens of random data, one torch
thread per worker, H = 5 inner steps, 8 outer rounds, through the library API (``DiLoCo``) on each
transport with 2 workers:

- ``inprocess``: one process, 2 worker threads on one ``InProcessGroup``;
- ``torch``: 2 processes in a gloo group over 127.0.0.1 (``create_transport({"kind": "torch"})``);
- ``hivemind``: 2 peers on 127.0.0.1, the second joining the first (each with its DHT, p2pd and
  averager processes).

and without DiLoCo (``baseline``: the same model, optimizer, batch and steps, ``inner.step()``; one
process, with 1 worker, or with 2 worker threads, the in-process runs' baseline).

Measured per worker process, from the end of outer round 3 to the end of training:

- peak PSS of its process tree (the process and every descendant: hivemind's averagers, DHT and
  p2pd), summed from ``/proc/<pid>/smaps_rollup`` every ``SAMPLE_SECONDS`` by this process (shared
  memory counts once across the tree: PSS splits a shared page between the processes that map it);
- peak RSS of the worker process itself, exact: its ``VmHWM``, reset (``/proc/<pid>/clear_refs``)
  when round 3 ends, read by the worker when it stops training;
- the account: every tensor storage reachable from the ``DiLoCo`` objects (and so their transport),
  each once, minus the model's parameters, gradients and the inner optimizer's state, by component
  (``tensor_account``; ``COMPONENTS``), read once training ended (what stays held between rounds;
  what a round allocates and frees is in docs/results.md, "Scale", read from the code);
- in each child process (hivemind's), its own copies of the worker's tensors: its pages at their
  addresses that it alone maps (``exclusive_bytes``: what a forked child keeps of its parent).

DiLoCo's bytes per parameter: the slope, between the sizes run (least squares over more than two),
of (DiLoCo peak - baseline peak),
per worker (the in-process figures are per process, divided by its 2 workers), so that fixed costs
cancel; its fixed part: the intercept (``slope_of``). The table's headline peak is the tree's PSS
less its mapped files (``Pss_Anon + Pss_Shmem``: the share of libtorch's pages moves with whatever
else maps them); whole PSS and VmHWM have slopes of their own. One configuration runs at a time.

    PYTHONPATH=src python bench/scale.py run --out /tmp/scale.jsonl            # every configuration
    PYTHONPATH=src python bench/scale.py run --out /tmp/scale.jsonl --transports torch --codecs int4
    PYTHONPATH=src python bench/scale.py table /tmp/scale.jsonl               # the tables, markdown
    PYTHONPATH=src python bench/scale.py plot /tmp/scale.jsonl --to docs/scale.png  # log-log

Not part of the test run (tests/test_scale_bench.py tests the accounting). Every child process is
stopped and every temp folder removed, whatever happens; every wait is bounded.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    "1m": {"preset": "tiny"},
    "5m": {
        "vocab_size": 4096,
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 640,
    },
    "20m": {
        "vocab_size": 4096,
        "hidden_size": 512,
        "num_layers": 5,
        "num_heads": 8,
        "num_kv_heads": 8,
        "intermediate_size": 1376,
    },
    "150m": {"preset": "150m"},
}
"""Each size's ``ModelConfig`` fields: the trainer's ``tiny`` preset (918,656 parameters at its vocab
of 256), 5,114,112 and 20,010,496 parameters at a vocab of 4096, and the ``150m`` preset
(151,800,576 at 32000)."""
BATCH, SEQ_LEN = 2, 64
INNER_STEPS, ROUNDS, AFTER = 5, 8, 3
"""H, the outer rounds each worker trains, and the rounds after which memory is measured."""
MAX_STEPS = 4 * INNER_STEPS * ROUNDS
"""A bound on a worker's steps (a hivemind peer alone in a round still counts it)."""
SAMPLE_SECONDS = 0.02
TIMEOUT = 1800.0
"""Seconds a configuration may take, start to end; then its processes are killed (a 150m one takes
several minutes)."""
WAIT = 180.0
"""Seconds a worker waits for the others at a barrier, and a reduce for its group."""
TRANSPORTS = ("inprocess", "torch", "hivemind")
CODECS = ("fp32", "int4")
SRC = Path(__file__).resolve().parents[1] / "src"

COMPONENTS: list[tuple[str, str]] = [
    ("outer momentum", r"momentum_buffer"),
    ("error-feedback residual", r"feedback\._kept"),
    ("error-feedback next residual", r"feedback\._next"),
    ("error-feedback payload", r"feedback\._payload"),
    ("state served to joiners", r"_snapshot"),
    ("state downloaded on joining", r"\.downloaded"),
    ("averager buffer (shared memory)", r"_averaged_tensors"),
    ("reduce buffer", r"\.reduce\.|\.grad$"),
    ("global copy", r"_global\.|\.flat$|\.param$|\.views\["),
    ("codec workspace", r"_workspace"),
    ("transport buffers", r"transport"),
]
"""(component, a regex on a path to a storage): a storage is the first component any of its paths
matches, in this order; else "other"."""


# -- accounting (pure: tests/test_scale_bench.py) -------------------------------------------------


@dataclass
class Held:
    """One tensor storage: its bytes, the component it belongs to, the paths it was reached by."""

    nbytes: int
    paths: list[str] = field(default_factory=list)
    component: str = "other"


def component_of(paths: Sequence[str]) -> str:
    """The first of ``COMPONENTS`` whose regex matches one of ``paths``; "other" if none."""
    for name, pattern in COMPONENTS:
        if any(re.search(pattern, p) for p in paths):
            return name
    return "other"


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
)


def _children(obj: Any) -> Iterable[tuple[str, Any]]:
    """(path suffix, value) of what ``obj`` holds: container items, instance attributes."""
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(list(obj.items())):
            if _is_tensor(k):
                yield f"[key {i}]", k
            name = f"[{k!r}]" if isinstance(k, (str, int)) else f"[{i}]"
            yield name, v
        return
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        yield from ((f"[{i}]", v) for i, v in enumerate(list(obj)))
        return
    try:
        attrs = dict(vars(obj))
    except TypeError:
        attrs = {}
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and slot not in attrs and hasattr(obj, slot):
            attrs[slot] = getattr(obj, slot)
    yield from ((f".{k}", v) for k, v in attrs.items())


def _readable(obj: Any) -> list[tuple[str, Any]]:
    """``_children(obj)``; none where its attributes cannot be read (an object not entered)."""
    try:
        return list(_children(obj))
    except Exception:  # noqa: BLE001 -- whatever a property raises
        return []


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _storage_key(t: Any) -> tuple[str, int]:
    s = t.untyped_storage()
    return str(t.device), s.data_ptr()


def tensor_account(
    roots: dict[str, Any], *, skip: Iterable[Any] = (), limit: int = 300_000
) -> dict[tuple[str, int], Held]:
    """Every tensor storage reachable from ``roots`` (breadth first: the first path is a shortest
    one), each once, with the paths it was reached by (up to 4) and its component. Not entered:
    the objects in ``skip`` (the model, the inner optimizer), and tensors sharing a storage with a
    tensor in ``skip`` (its parameters, gradients, optimizer state) are not counted. At most
    ``limit`` objects."""
    skip = list(skip)
    skipped_ids = {id(s) for s in skip}
    excluded = {_storage_key(t) for t in _skipped_tensors(skip)}
    seen: set[int] = set(skipped_ids)
    held: dict[tuple[str, int], Held] = {}
    queue = collections.deque((name, obj) for name, obj in roots.items())
    visited = 0
    while queue and visited < limit:
        path, obj = queue.popleft()
        if isinstance(obj, (_LEAVES, _OPAQUE)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        visited += 1
        if _is_tensor(obj):
            _hold(held, obj, path, excluded)
            if getattr(obj, "grad", None) is not None:
                queue.append((f"{path}.grad", obj.grad))
            continue
        queue.extend((path + suffix, child) for suffix, child in _readable(obj))
    for h in held.values():
        h.component = component_of(h.paths)
    return held


def _skipped_tensors(skip: Sequence[Any]) -> list[Any]:
    """The tensors of the skipped objects: a module's parameters, their gradients and buffers; an
    optimizer's state tensors."""
    out = []
    for obj in skip:
        if hasattr(obj, "parameters") and hasattr(obj, "buffers"):
            params = list(obj.parameters())
            out += params + [p.grad for p in params if p.grad is not None] + list(obj.buffers())
        if hasattr(obj, "state") and hasattr(obj, "param_groups"):
            out += [v for s in obj.state.values() for v in s.values() if _is_tensor(v)]
    return out


def _hold(held: dict, t: Any, path: str, excluded: set) -> None:
    if t.device.type == "meta":
        return
    key = _storage_key(t)
    if key in excluded or key[1] == 0:
        return
    h = held.setdefault(key, Held(t.untyped_storage().nbytes()))
    if len(h.paths) < 4:
        h.paths.append(path)


def by_component(held: dict[Any, Held]) -> dict[str, int]:
    """Bytes per component, largest first."""
    out: dict[str, int] = collections.Counter()
    for h in held.values():
        out[h.component] += h.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def slope_of(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the line through two (parameters, bytes) points: bytes per parameter
    and the fixed bytes; with more points, the least-squares line."""
    if len({x for x, _ in points}) < 2:
        raise ValueError("a slope needs points at two sizes at least")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


# -- memory of a process tree ---------------------------------------------------------------------


ROLLUP = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Rss", "Private_Dirty")


def rollup(pid: int) -> dict[str, int]:
    """The ``ROLLUP`` fields of ``/proc/<pid>/smaps_rollup``, in bytes ({}: gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ROLLUP:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s descendants, from /proc (each process's parent)."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parents[int(stat[stat.rindex(")") + 2 :].split()[1])].append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        kids = [k for p in frontier for k in parents.get(p, [])]
        found += kids
        frontier = kids
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def status_kib(pid: int | str, name: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (VmHWM, VmRSS); 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- one worker process ---------------------------------------------------------------------------


def _model_config(size: str) -> Any:
    from diloco_train.model import ModelConfig

    return ModelConfig(**SIZES[size]).resolved()


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _barrier(folder: Path, name: str, *, ranks: int, rank: int) -> None:
    """Wait (at most ``WAIT`` seconds) until every rank has reached ``name``."""
    (folder / f"{name}.{rank}").touch()
    deadline = time.monotonic() + WAIT
    while sum((folder / f"{name}.{r}").exists() for r in range(ranks)) < ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: not every rank arrived within {WAIT:g} s")
        time.sleep(0.05)


def train(spec: dict, *, rank: int, transport: Any, out: dict) -> None:
    """One worker: the model, AdamW, DiLoCo over ``transport`` (None: the baseline, no DiLoCo), and
    ``ROUNDS`` outer rounds of ``INNER_STEPS`` steps; what the account needs goes in ``out``."""
    import torch
    import torch.nn.functional as F

    from diloco_core import DiLoCo, DiLoCoConfig
    from diloco_train.model import Llama

    folder = Path(spec["dir"])
    model = Llama(_model_config(spec["size"]), generator=torch.Generator().manual_seed(0))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = None
    if transport is not None:
        timeout = getattr(transport, "own_timeout", None) or WAIT
        config = DiLoCoConfig(inner_steps=INNER_STEPS, codec=spec["codec"], reduce_timeout=timeout)
        dl = DiLoCo(model, inner, transport, config)
    _barrier(folder, "ready", ranks=spec["ranks"], rank=rank)
    data = torch.Generator().manual_seed(100 + rank)
    vocab = _model_config(spec["size"]).vocab_size
    rounds, steps, losses, start = 0, 0, [], time.perf_counter()
    while rounds < ROUNDS and steps < MAX_STEPS:
        tokens = torch.randint(vocab, (BATCH, SEQ_LEN + 1), generator=data)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if dl is None:
            inner.step()
        else:
            dl.step()
        inner.zero_grad(set_to_none=True)
        steps += 1
        losses.append(loss.item())
        now = dl.round if dl is not None else steps // INNER_STEPS
        if now != rounds:
            rounds = now
            _write(folder / f"progress.{rank}", str(rounds))
    seconds = time.perf_counter() - start
    out.update(model=model, inner=inner, diloco=dl, transport=transport)
    out["result"] = {"rank": rank, "rounds": rounds, "steps": steps, "seconds": seconds}
    out["result"] |= {"params": sum(p.numel() for p in model.parameters())}
    out["result"] |= {"loss_first": losses[0], "loss_last": losses[-1]}


def _in_threads(spec: dict, transports: list[Any]) -> list[dict]:
    """``train`` on one thread per rank of this process; the first error raised again."""
    outs: list[dict] = [{} for _ in transports]
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            train(spec, rank=spec["first_rank"] + i, transport=transports[i], out=outs[i])
        except BaseException as e:  # noqa: BLE001 -- raised again on the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(outs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a worker thread did not finish within {TIMEOUT:g} s")
    return outs


def _transports(spec: dict) -> list[Any]:
    """This process's transports (one per worker thread; None for the baseline)."""
    kind = spec["transport"]
    if kind == "baseline":
        return [None] * spec["threads"]
    if kind == "inprocess":
        from transports import InProcessGroup

        group = InProcessGroup(spec["threads"])
        return [group.transport(r) for r in range(spec["threads"])]
    if kind == "torch":
        from transports import create_transport

        return [create_transport({"kind": "torch", "timeout": WAIT})]
    from transports.hivemind import HivemindConfig, HivemindTransport

    config = HivemindConfig(
        run_id=spec["run_id"],
        secret="scale-bench",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=spec.get("initial_peers", []),
        target_group_size=2,
        matchmaking_time=10.0,
        averaging_timeout=WAIT / 2,
    )
    transport = HivemindTransport(config)
    _write(Path(spec["dir"]) / f"addr.{spec['first_rank']}", json.dumps(transport.join_addresses))
    return [transport]


def worker(spec: dict) -> int:
    """One worker process: train, report its peak RSS since round ``AFTER`` and its account."""
    import torch

    torch.set_num_threads(1)
    folder = Path(spec["dir"])
    transports = _transports(spec)
    try:
        outs = _in_threads(spec, transports)
        hwm = status_kib("self", "VmHWM") * 1024
        for o in outs:
            _write(folder / f"progress.{o['result']['rank']}", "done")
        result = {"workers": [o["result"] for o in outs], "vmhwm": hwm}
        dls = {f"rank{o['result']['rank']}": o["diloco"] for o in outs if o["diloco"] is not None}
        if dls:
            skip = [x for o in outs for x in (o["model"], o["inner"])]
            held = tensor_account(dls, skip=skip)
            result["account"] = by_component(held)
            big = sorted(held.values(), key=lambda h: -h.nbytes)[:12]
            result["storages"] = [[h.component, h.nbytes, h.paths[:2]] for h in big]
            ranges = _ranges(outs, held)
            kids = descendants(os.getpid())
            result["children"] = {f"{pid} {_comm(pid)}": _copies(pid, ranges) for pid in kids}
        _write(folder / f"result.{spec['first_rank']}.json", json.dumps(result))
        for o in outs[1:]:
            (folder / f"done.{o['result']['rank']}").touch()
        _barrier(folder, "done", ranks=spec["ranks"], rank=spec["first_rank"])
    finally:
        for t in transports:
            if t is not None:
                t.close()
        if spec["transport"] == "torch":
            import torch.distributed as dist

            if dist.is_initialized():  # the transport destroys the default group it made
                dist.destroy_process_group()
    return 0


def _ranges(outs: list[dict], held: dict[tuple[str, int], Held]) -> list[tuple[int, int, str]]:
    """(address, bytes, what) of every storage the workers' models, inner optimizers and DiLoCos
    hold now, each once."""
    found: dict[int, tuple[int, int, str]] = {}
    for o in outs:
        for p in o["model"].parameters():
            s = p.untyped_storage()
            found.setdefault(s.data_ptr(), (s.data_ptr(), s.nbytes(), "model parameters"))
        for state in o["inner"].state.values():
            for t in (v for v in state.values() if v.dim() > 0):
                s = t.untyped_storage()
                found.setdefault(s.data_ptr(), (s.data_ptr(), s.nbytes(), "AdamW moments"))
    for (_, ptr), h in held.items():
        found.setdefault(ptr, (ptr, h.nbytes, h.component))
    return list(found.values())


def _copies(pid: int, ranges: Sequence[tuple[int, int, str]]) -> dict[str, int]:
    """``exclusive_bytes`` of ``pid`` in ``ranges``, and its Private_Dirty in all."""
    return exclusive_bytes(pid, ranges) | {"Private_Dirty": rollup(pid).get("Private_Dirty", 0)}


def exclusive_bytes(pid: int, ranges: Sequence[tuple[int, int, str]]) -> dict[str, int]:
    """Bytes of ``pid``'s pages in each (address, bytes, what) range that are present and mapped by
    ``pid`` alone (``/proc/<pid>/pagemap``, bits 63 and 56). In a process forked from the one whose
    tensors the ranges are: its own copies of what its parent held there at the fork and wrote
    since (copy-on-write). {} if unreadable."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    out: dict[str, int] = collections.Counter()
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            for start, nbytes, what in ranges:
                first, last = start // page, (start + nbytes - 1) // page
                f.seek(first * 8)
                entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
                mine = (entries >> np.uint64(63)) & (entries >> np.uint64(56)) & np.uint64(1)
                out[what] += int(mine.sum()) * page
    except (OSError, ValueError):
        return {}
    return dict(out)


# -- one configuration ----------------------------------------------------------------------------


@dataclass
class Watched:
    """A worker process, its ranks, and the peaks of its tree seen since its ranks' round AFTER."""

    proc: subprocess.Popen
    ranks: list[int]
    peak: dict[str, int] = field(default_factory=dict)
    tree: list[int] = field(default_factory=list)
    at_peak: dict[str, dict[str, int]] = field(default_factory=dict)
    """Each process's rollup at the sample where the tree's PSS was largest."""
    cleared: bool = False
    samples: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(spec: dict, folder: Path, env: dict[str, str]) -> subprocess.Popen:
    rank = spec["first_rank"]
    out_path, err_path = folder / f"worker{rank}.out", folder / f"worker{rank}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        return subprocess.Popen(
            [sys.executable, __file__, "worker", json.dumps(spec)],
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
        )


def _progress(folder: Path, ranks: Sequence[int]) -> tuple[int, bool]:
    """(the least round the ranks reached, whether all are done)."""
    rounds, done = [], []
    for r in ranks:
        try:
            text = (folder / f"progress.{r}").read_text()
        except OSError:
            text = "0"
        done.append(text == "done")
        rounds.append(ROUNDS if text == "done" else int(text))
    return min(rounds), all(done)


def _sample(w: Watched, folder: Path, tick: int) -> None:
    """One sample of ``w``'s tree while its ranks are between round AFTER and done; the VmHWM reset
    as they pass round AFTER."""
    rounds, done = _progress(folder, w.ranks)
    if rounds < AFTER or done or w.proc.poll() is not None:
        return
    if not w.cleared:
        w.cleared = True
        for pid in [w.proc.pid, *descendants(w.proc.pid)]:
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
    if tick % 25 == 0 or not w.tree:
        w.tree = [w.proc.pid, *descendants(w.proc.pid)]
    total: dict[str, int] = collections.Counter()
    each = {}
    for pid in w.tree:
        got = rollup(pid)
        each[f"{pid} {_comm(pid)}"] = got
        for k, v in got.items():
            total[k] += v
    total["Pss_Mem"] = total.get("Pss_Anon", 0) + total.get("Pss_Shmem", 0)
    w.samples += 1
    for k, v in total.items():  # each figure's own peak
        w.peak[k] = max(v, w.peak.get(k, 0))
    w.peak["processes"] = max(len(w.tree), w.peak.get("processes", 0))
    if total["Pss"] >= w.peak["Pss"]:
        w.at_peak = each


def _stop(w: Watched) -> None:
    """Kill ``w``'s process and its descendants, one by one by pid, if still running."""
    if w.proc.poll() is None:
        for pid in [*descendants(w.proc.pid), w.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        w.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _specs(transport: str, *, codec: str, size: str, workers: int, folder: Path) -> list[dict]:
    base = {"transport": transport, "codec": codec, "size": size, "dir": str(folder)}
    if transport in ("inprocess", "baseline"):
        return [base | {"threads": workers, "first_rank": 0, "ranks": workers}]
    return [base | {"threads": 1, "first_rank": r, "ranks": workers} for r in range(workers)]


def measure(transport: str, *, codec: str, size: str, workers: int = 2) -> dict:
    """One configuration: its workers' peaks and accounts (``transport`` "baseline": no DiLoCo;
    ``workers`` threads in one process)."""
    folder = Path(tempfile.mkdtemp(prefix=f"scale-{transport}-"))
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(folder)}
    env |= {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["WORLD_SIZE"] = str(workers)
    specs = _specs(transport, codec=codec, size=size, workers=workers, folder=folder)
    watched: list[Watched] = []
    start = time.monotonic()
    try:
        for spec in specs:
            spec["run_id"] = f"scale-{os.getpid()}-{int(start)}"
            if transport == "hivemind" and spec["first_rank"] > 0:
                spec["initial_peers"] = _addresses(folder, watched[0])
            rank_env = env | {"RANK": str(spec["first_rank"])}
            proc = _start(spec, folder, rank_env)
            first = spec["first_rank"]
            watched.append(Watched(proc, list(range(first, first + spec["threads"]))))
        tick = 0
        while any(w.proc.poll() is None for w in watched):
            if time.monotonic() - start > TIMEOUT:
                raise TimeoutError(f"{transport} {codec} {size}: not done within {TIMEOUT:g} s")
            for w in watched:
                _sample(w, folder, tick)
            tick += 1
            time.sleep(SAMPLE_SECONDS)
        return _collect(watched, folder, transport=transport, codec=codec, size=size) | {
            "seconds": time.monotonic() - start
        }
    except BaseException:
        for w in watched:
            err = folder / f"worker{w.ranks[0]}.err"
            if err.is_file():
                tail = err.read_text()[-3000:]
                print(f"--- worker {w.ranks[0]} stderr (tail)\n{tail}", file=sys.stderr)
        raise
    finally:
        for w in watched:
            _stop(w)
        shutil.rmtree(folder, ignore_errors=True)


def _addresses(folder: Path, first: Watched) -> list[str]:
    deadline = time.monotonic() + WAIT
    path = folder / f"addr.{first.ranks[0]}"
    while not path.is_file():
        if time.monotonic() > deadline or first.proc.poll() is not None:
            raise RuntimeError(f"the first hivemind peer printed no address within {WAIT:g} s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def _collect(watched: list[Watched], folder: Path, **config: str) -> dict:
    processes = []
    for w in watched:
        if w.proc.returncode != 0:
            err = (folder / f"worker{w.ranks[0]}.err").read_text()[-3000:]
            raise RuntimeError(f"worker {w.ranks[0]} exited {w.proc.returncode}:\n{err}")
        result = json.loads((folder / f"result.{w.ranks[0]}.json").read_text())
        processes.append(result | {"peak": w.peak, "at_peak": w.at_peak, "samples": w.samples})
    params = processes[0]["workers"][0]["params"]
    out = config | {"params": params}
    return out | {"processes": processes, "workers_per_process": len(watched[0].ranks)}


# -- tables ---------------------------------------------------------------------------------------


MIB = 2**20


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def per_worker(record: dict, key: str = "Pss") -> float:
    """A record's peak per worker: its processes' mean peak (``key``: a rollup field, or "vmhwm"),
    divided by the workers of a process."""
    peaks = [p["vmhwm"] if key == "vmhwm" else p["peak"][key] for p in record["processes"]]
    return _mean(peaks) / record["workers_per_process"]


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per (transport, codec, size): peaks per worker (mean over repeats), the baseline's of
    as many workers per process, and the slope and fixed part of the difference per transport and
    codec (PSS and VmHWM), with the account per worker per parameter."""

    def key(r: dict) -> tuple:
        return r["transport"], r["codec"], r["size"], r["workers_per_process"]

    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    rows = []
    for (transport, codec, size, wpp), rs in groups.items():
        if transport == "baseline":
            continue
        base = groups.get(("baseline", "fp32", size, wpp))
        if not base:
            continue
        row = {"transport": transport, "codec": codec, "size": size, "params": rs[0]["params"]}
        for k in FIGURES:
            row[f"{k}_each"] = [per_worker(r, k) for r in rs]
            row[f"base_{k}_each"] = [per_worker(r, k) for r in base]
            row[k], row[f"base_{k}"] = _mean(row[f"{k}_each"]), _mean(row[f"base_{k}_each"])
        row["repeats"], row["base_repeats"] = len(rs), len(base)
        accounts = [p["account"] for r in rs for p in r["processes"] if "account" in p]
        names = dict.fromkeys(c for a in accounts for c in a)  # every process's components
        row["account"] = {c: _mean([a.get(c, 0) for a in accounts]) / wpp for c in names}
        rows.append(row)
    for row in rows:
        same = [r for r in rows if (r["transport"], r["codec"]) == (row["transport"], row["codec"])]
        for k in FIGURES:
            points = [(r["params"], r[k] - r[f"base_{k}"]) for r in same]
            if len({x for x, _ in points}) >= 2:
                row[f"slope_{k}"], row[f"fixed_{k}"] = slope_of(points)
                row[f"slopes_{k}"] = _repeat_slopes(same, k)
        totals = [(r["params"], sum(r["account"].values())) for r in same]
        if len({x for x, _ in totals}) >= 2:
            row["slope_account"], row["fixed_account"] = slope_of(totals)
    order = {t: i for i, t in enumerate(TRANSPORTS)}
    return sorted(rows, key=lambda r: (order.get(r["transport"], 9), r["codec"], r["params"]))


def _repeat_slopes(same: Sequence[dict], k: str) -> list[float]:
    """The slope of each repeat on its own (the i-th run of each configuration and baseline)."""
    n = min(len(r[f"{w}_each"]) for r in same for w in (k, f"base_{k}"))
    out = []
    for i in range(n):
        points = [(r["params"], r[f"{k}_each"][i] - r[f"base_{k}_each"][i]) for r in same]
        out.append(slope_of(points)[0])
    return out


HEADER = (
    "| transport | codec | params | peak / worker | baseline | DiLoCo above it | slope (B/param) "
    "| fixed | slope of PSS | slope of VmHWM | account (B/param) |"
)
FIGURES = ("Pss", "Pss_Mem", "vmhwm")
"""The peaks compared: the tree's PSS, its anonymous and shared-memory part (PSS less mapped files:
what another process mapping the same libraries moves), and the worker process's exact peak RSS."""


def _slope(r: dict, k: str) -> str:
    if f"slope_{k}" not in r:
        return ""
    each = r[f"slopes_{k}"]
    spread = f" ({min(each):.1f}-{max(each):.1f})" if len(each) > 1 else ""
    return f"{r[f'slope_{k}']:.1f}{spread}"


def _cells(r: dict) -> list[str]:
    k = "Pss_Mem"  # the headline: files aside
    fixed = f"{r[f'fixed_{k}'] / MIB:.0f} MiB" if f"fixed_{k}" in r else ""
    above = (r[k] - r[f"base_{k}"]) / MIB
    peaks = [f"{r[k] / MIB:.0f} MiB", f"{r[f'base_{k}'] / MIB:.0f} MiB", f"{above:.0f} MiB"]
    account = sum(r["account"].values()) / r["params"]
    head = [r["transport"], r["codec"], f"{r['params'] / 1e6:.2f}M"]
    slopes = [_slope(r, k), fixed, _slope(r, "Pss"), _slope(r, "vmhwm")]
    return [*head, *peaks, *slopes, f"{account:.2f}"]


def table(records: Sequence[dict]) -> str:
    """The markdown tables of ``summarize``: peaks (files aside) and slopes (in brackets: each
    repeat's), the peaks of whole PSS and VmHWM, then the account per component."""
    rows = summarize(records)
    lines = [HEADER, "|---" * 11 + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    lines += ["", "| transport | codec | params | peak PSS | baseline | VmHWM | baseline |"]
    lines.append("|---" * 7 + "|")
    for r in rows:
        figures = [r["Pss"], r["base_Pss"], r["vmhwm"], r["base_vmhwm"]]
        cells = [r["transport"], r["codec"], f"{r['params'] / 1e6:.2f}M"]
        lines.append("| " + " | ".join(cells + [f"{x / MIB:.0f} MiB" for x in figures]) + " |")
    order = [n for n, _ in COMPONENTS]
    found = {c for r in rows for c in r["account"]}
    components = [c for c in order if c in found] + sorted(found - set(order))
    names = [f"{r['transport']} {r['codec']} {r['params'] / 1e6:.0f}M" for r in rows]
    lines += ["", "| component (B/param per worker) | " + " | ".join(names) + " |"]
    lines.append("|---|" + "---|" * len(rows))
    for c in components:
        cells = [f"{r['account'].get(c, 0) / r['params']:.3f}" for r in rows]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: Sequence[dict], out: Path) -> None:
    """Two log-log plots against the parameters, per transport and codec: the peak per worker (the
    tree's PSS less its mapped files) beside training alone, and DiLoCo's part (the peak less its
    baseline's: a line of slope 1 grows linearly); written to ``out`` (matplotlib: the ``train``
    extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(records)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    peaks: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    above: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    base: dict[int, float] = {}
    for r in rows:
        name = f"{r['transport']} {r['codec']}"
        peaks[name].append((r["params"], r["Pss_Mem"] / MIB))
        above[name].append((r["params"], (r["Pss_Mem"] - r["base_Pss_Mem"]) / MIB))
        if r["transport"] != "inprocess":  # its baseline is 2 workers' process, halved
            base[r["params"]] = r["base_Pss_Mem"] / MIB
    for ax, lines in ((left, peaks), (right, above)):
        for name, points in sorted(lines.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=name)
    xs, ys = zip(*sorted(base.items()))
    label = "training alone (1 process)"
    left.plot(xs, ys, marker="s", color="black", linestyle="--", label=label)
    left.set_ylabel("peak memory per worker, MiB (PSS less mapped files)")
    right.set_ylabel("DiLoCo's memory above training alone, MiB per worker")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Memory per worker against model size (bench/scale.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------------


def _configurations(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    out = []
    for size in args.sizes:
        if "baseline" in args.transports or args.baselines:
            out += [("baseline", "fp32", size, 1), ("baseline", "fp32", size, 2)]
        for transport in [t for t in args.transports if t != "baseline"]:
            out += [(transport, codec, size, 2) for codec in args.codecs]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure configurations, one at a time; append them to --out")
    run.add_argument("--out", type=Path, required=True, help="a JSON-lines file (appended to)")
    run.add_argument("--transports", nargs="+", default=[*TRANSPORTS, "baseline"])
    run.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    run.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    run.add_argument("--baselines", action="store_true", help="and the baselines (--transports)")
    run.add_argument("--repeats", type=int, default=1)
    show = sub.add_parser("table", help="print the tables of a --out file")
    show.add_argument("path", type=Path)
    draw = sub.add_parser("plot", help="draw the log-log plot of a --out file")
    draw.add_argument("path", type=Path)
    draw.add_argument("--to", type=Path, required=True, help="the image to write (.png, .svg)")
    one = sub.add_parser("worker", help="(internal) one worker process")
    one.add_argument("spec")
    args = p.parse_args(argv)
    if args.command == "worker":
        return worker(json.loads(args.spec))
    if args.command == "table":
        lines = args.path.read_text().splitlines()
        print(table([json.loads(line) for line in lines if line.strip()]))
        return 0
    if args.command == "plot":
        lines = args.path.read_text().splitlines()
        plot([json.loads(line) for line in lines if line.strip()], args.to)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(args.repeats):
        for transport, codec, size, workers in _configurations(args):
            record = measure(transport, codec=codec, size=size, workers=workers)
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            peaks = [p["peak"].get("Pss", 0) / MIB for p in record["processes"]]
            hwm = [p["vmhwm"] / MIB for p in record["processes"]]
            print(
                f"{transport} {codec} {size} x{workers}: peak PSS {peaks} MiB, VmHWM {hwm} MiB, "
                f"{record['seconds']:.0f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
