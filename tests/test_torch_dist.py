"""torch.distributed specifics beyond the contract: 4-rank shards, a dead peer, torchrun end to end."""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import time

import procs
import pytest
import torch
from lan_job import job
from world import GROUP_TIMEOUT_S, GlooWorld, RankError, ThreadWorld

from diloco_core import TransportError, codec_for, reference_mean
from transports import TorchDistTransport, create_transport
from transports.torch.wire_bytes import Path

pytestmark = pytest.mark.timeout(180)
HERE = os.path.dirname(os.path.abspath(__file__))


def _reduce_big(transport, wire_dtype, block=256, bucket_mb=None, narrow=None):
    settings = {k: v for k, v in {"bucket_mb": bucket_mb, "narrow": narrow}.items() if v is not None}
    if settings:  # another transport on the same process group: small buckets, or a path set (config.path)
        transport = TorchDistTransport(**settings)
    g = torch.Generator().manual_seed(transport.rank)
    x = [torch.randn(1001, generator=g), torch.randn(3, 5, generator=g)]
    transport.all_reduce(x, codec=codec_for(wire_dtype, block=block)).wait(30)
    return x


def _big_reference(world_size, codec):
    """The reference mean of ``_reduce_big``'s contributions, concatenated as they travel."""
    flat = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(r)
        flat.append(torch.cat([torch.randn(1001, generator=g), torch.randn(3, 5, generator=g).view(-1)]))
    want = reference_mean(flat, codec)
    return [want[:1001], want[1001:].view(3, 5)]


@pytest.mark.parametrize("world_size", [2, 4])  # with 4: each path, by bytes (auto) and set (config.path)
def test_buckets_and_shards_cut_at_codec_blocks_so_every_path_matches_reference(world_size, tmp_path):
    world = GlooWorld(world_size, str(tmp_path))
    cases = [(w, 256, None) for w in ("fp16", "bf16", "int8", "int4", "sign")] if world_size == 4 else []
    # ~100-value buckets: cut at multiples of the block (96 values at block 16; one block of 256)
    cases += [(w, b, 0.0004) for w in ("int8", "int4") for b in (16, 256)] + [("fp16", 256, 0.0004)]
    cases += [
        ("sign", 32, 0.0004),
        ("int2", 16, 0.0004),
    ]  # partial last shards: each decoded at its own length (not zero-padded)
    cases += [("topk", 32, 0.0004)] + ([("topk", 256, None)] if world_size == 4 else [])  # 1 and 4 values a block
    # with 4: by bytes (None: the block codecs gather, the casts scatter-gather), then scatter-gather set for all
    paths = [None, Path.SCATTER_GATHER] if world_size == 4 else [None]
    try:
        for (wire, block, bucket_mb), narrow in itertools.product(cases, paths):
            run = functools.partial(_reduce_big, wire_dtype=wire, block=block, bucket_mb=bucket_mb, narrow=narrow)
            results = world.run(run)
            assert not any(isinstance(r, RankError) for r in results), results
            want = _big_reference(world_size, codec_for(wire, block=block))
            for res in results:
                assert all(torch.equal(a, b) for a, b in zip(res, want)), (wire, block, bucket_mb, narrow)
    finally:
        world.close()


def _reduce_on(transport, path):
    """Rank 0 set to one path, the others to ``path``: the header tells them apart before any payload moves."""
    narrow = Path.GATHER if transport.rank == 0 else path
    try:
        TorchDistTransport(narrow=narrow).all_reduce([torch.ones(1000)], codec=codec_for("int4")).wait(30)
    except TransportError as e:
        return str(e)
    return "no error"


def test_ranks_set_to_different_paths_fail_at_the_header_naming_both(tmp_path):
    world = GlooWorld(2, str(tmp_path))
    try:
        results = world.run(_reduce_on, Path.SCATTER_GATHER, fresh=True)
    finally:
        world.close()
    for message in results:
        assert "collective mismatch" in message and "int4b256v2 by gather" in message, message
        assert "int4b256v2 by scatter-gather" in message, message


def _die_mid_run(transport, timeout):
    x = [torch.ones(1000)]
    transport.all_reduce(x).wait(30)  # one good round first
    if transport.rank == 1:
        os._exit(3)  # the process is gone, sockets and all
    time.sleep(0.5)
    start = time.monotonic()
    try:
        transport.all_reduce(x).wait(timeout)
    except TransportError as e:
        return time.monotonic() - start, str(e)
    return "no error"


def test_a_peer_that_exits_mid_run_is_a_transport_error_within_the_timeout(tmp_path):
    world = GlooWorld(3, str(tmp_path))
    try:
        timeout = 10.0
        results = world.run(_die_mid_run, timeout, timeout=60, fresh=True)
    finally:
        world.close()
    for rank in (0, 2):
        assert isinstance(results[rank], tuple), results[rank]
        elapsed, message = results[rank]
        # within its 10 s timeout (twice it: room for a loaded machine), far from gloo's own 60 s it would wait out
        assert elapsed < 2 * timeout < GROUP_TIMEOUT_S
        assert "torch.distributed all_reduce" in message


# lossy ones with error feedback; fp16 and int8 (~5 s of torchrun each) with -m slow: test_contract.py runs every
# wire dtype over gloo in the default run
@pytest.mark.parametrize(
    "wire_dtype", ["fp32", pytest.param("fp16", marks=pytest.mark.slow), pytest.param("int8", marks=pytest.mark.slow)]
)
def test_torchrun_job_agrees_across_ranks_and_with_the_in_process_oracle(wire_dtype, tmp_path):
    path = os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "src")])  # this checkout's code, not an install
    env = procs.loopback_env(OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = procs.torchrun(os.path.join(HERE, "lan_job.py"), wire_dtype, str(tmp_path))
    out = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))  # the replicas agree bit for bit
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the torchrun job
    try:
        oracle = ThreadWorld(2).run(job, wire_dtype)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*oracle))
    # Same data, same math; only the CPU kernels' summation order may differ between processes.
    for a, b in zip(rank0, oracle[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_kind_outside_torchrun_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        create_transport({"kind": "torch"})


def test_torch_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"\[transport\] backend='mpi' is invalid: expected one of \['gloo', 'nccl'\]"):
        create_transport({"kind": "torch", "backend": "mpi"})
    with pytest.raises(ValueError, match=r"path='ring' is invalid: expected one of \['auto', 'gather', 'scatter-"):
        create_transport({"kind": "torch", "path": "ring"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bucket'\].*bucket_mb"):
        create_transport({"kind": "torch", "bucket": 3})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            create_transport({"kind": "torch", "backend": "nccl", "init_method": "file:///nonexistent"})


def test_unknown_transport_kind_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"kind='carrier-pigeon' is invalid: expected one of \['hivemind', 'inprocess', 'torch'\]"
    ):
        create_transport({"kind": "carrier-pigeon"})


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs at least 2 GPUs (bench/nccl_check.py runs on a GPU machine)"
)
def test_nccl_contract_on_two_gpus():
    out = subprocess.run(
        procs.torchrun(os.path.join(os.path.dirname(HERE), "bench", "nccl_check.py")),
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0 and "nccl check passed" in out.stdout, out.stdout + out.stderr


def _timeouts(transport):
    from diloco_core import DiLoCo, DiLoCoConfig

    derived = create_transport({"kind": "torch"}, reduce_timeout=42).own_timeout
    explicit = create_transport({"kind": "torch", "timeout": 10}, reduce_timeout=42).own_timeout
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        DiLoCo(model, opt, create_transport({"kind": "torch", "timeout": 30}), DiLoCoConfig(reduce_timeout=20))
        refused = None
    except ValueError as e:
        refused = str(e)
    return derived, explicit, refused


def test_the_process_group_timeout_follows_the_cores_unless_set_and_may_not_exceed_it(tmp_path):
    world = GlooWorld(2, str(tmp_path))
    try:
        for derived, explicit, refused in world.run(_timeouts):
            assert (derived, explicit) == (42, 10)
            assert "reduce_timeout=20 is shorter than the transport's own timeout (30s)" in refused
    finally:
        world.close()
