"""A pack in object storage (``s3://``) read through a real S3 server (moto's, on a free port of 127.0.0.1): the same
batches and the same run as the local pack, each shard fetched once per node into a bounded cache, faults retried
without losing or repeating a sample, bad URLs and full disks said in one line."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from cltrain.atomic import TEMP_PREFIX
from cltrain.data import ShardsDataModule
from cltrain.data.pack import pack
from cltrain.data.remote import RemoteError, redact, remote_error
from cltrain.data.shard_cache import CacheFullError, ShardCache, parse_size
from tests.helpers import REPO, warm
from tests.helpers.data_fixtures import write_image_folder
from tests.helpers.s3 import Fault, FaultProxy, S3Server, SECRET, s3_env, s3_env_fixture, s3_server_fixture  # noqa: F401 - the fixtures server and env

pytest.importorskip("s3fs", reason="the object-storage tests need s3fs and moto: pip install -e '.[test]'")
pytest.importorskip("moto.server", reason="the object-storage tests need moto[server]: pip install -e '.[test]'")

KW = dict(batch_size=4, num_workers=2, image_size=24, val_resize_size=28, persistent_workers=False)


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 3 classes: 33 train in 5 shards (uneven over 2 ranks), 15 val in 3
    folder = write_image_folder(tmp_path_factory.mktemp("images") / "f", classes=3, train=11, val=5, size=(48, 40))
    out = tmp_path_factory.mktemp("pack") / "pack"
    pack(folder, out, shard_size=7, progress=False)
    return out


@pytest.fixture(scope="module")
def url(server: S3Server, local_pack: Path) -> str:
    return server.upload(local_pack, "bucket", "data/pack")


def _batches(dm: ShardsDataModule, train: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dm.setup("fit")
    loader = dm.train_dataloader() if train else dm.val_dataloader()
    return [(x.clone(), y.clone()) for x, y, *_ in loader]


def _plain(name: str) -> str:
    """A cached file's name without its version (``shard-000000~1a2b3c4d5e.tar``: ``shard-000000.tar``)."""
    return re.sub(r"~[0-9a-f]{10}(?=\.[^./]*$)", "", name)


def test_a_bucket_gives_the_local_packs_batches_and_fetches_each_shard_once_per_node(url, local_pack, env):
    for train in (True, False):  # shuffled with augmentation, and in order
        here, there = ShardsDataModule(local_pack, **KW), ShardsDataModule(url, **KW)
        a, b = _batches(here, train), _batches(there, train)
        assert len(a) == len(b) > 1
        assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))
    cache = there.pack.cache
    files = sorted(_plain(p.relative_to(cache.folder).as_posix()) for p in cache.folder.rglob("*") if p.is_file())
    manifest = json.loads((local_pack / "shards.json").read_text())
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    assert [f for f in files if f.endswith(".tar")] == sorted(shards)  # every shard once, nothing else but indexes
    for s in shards:
        assert cache.local(s, cache.entry(s)[1]).read_bytes() == (local_pack / s).read_bytes()
    assert not [f for f in files if TEMP_PREFIX in f]
    # a second DataModule on the node (another rank, run or epoch) fetches nothing again
    again = ShardsDataModule(url, **KW)
    before = {p: p.stat().st_ino for p in cache.folder.rglob("*.tar")}
    _batches(again, True)
    assert {p: p.stat().st_ino for p in cache.folder.rglob("*.tar")} == before


def test_a_pack_uploaded_again_to_the_same_url_is_fetched_anew(local_pack, server, env, tmp_path):
    # the cache was named by the URL alone and took any file there as current: the run trained on the old pack
    other = tmp_path / "other"
    pack(write_image_folder(tmp_path / "g", classes=3, train=11, val=5, size=(44, 40)), other, shard_size=7,
         progress=False)
    url, client = server.upload(local_pack, "again", "pack"), server.client()
    first = _batches(ShardsDataModule(url, **KW), False)
    for listed in client.list_objects_v2(Bucket="again")["Contents"]:
        client.delete_object(Bucket="again", Key=listed["Key"])
    server.upload(other, "again", "pack")
    dm = ShardsDataModule(url, **KW)
    again, expected = _batches(dm, False), _batches(ShardsDataModule(other, **KW), False)
    assert len(again) == len(expected) and not torch.equal(first[0][0], again[0][0])
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(again, expected))
    assert len(list(dm.pack.cache.folder.rglob("*.tar"))) == 3  # the 3 val shards: the old versions removed


def test_an_https_root_public_or_signed_gives_the_local_packs_batches_and_keeps_no_credential(local_pack, server, env, tmp_path):
    url, client = server.upload(local_pack, "bucket", "public/pack"), server.client()
    for entry in client.list_objects_v2(Bucket="bucket", Prefix="public/pack/")["Contents"]:
        # fsspec's HTTP filesystem sends plain GETs, without credentials: S3 answers 403 to them where not public
        client.put_object_acl(Bucket="bucket", Key=entry["Key"], ACL="public-read")
    web = url.replace("s3://", f"{server.endpoint}/")  # http://127.0.0.1:<port>/bucket/public/pack
    here = ShardsDataModule(local_pack, **KW)
    # a signed URL (an Azure SAS token, a presigned prefix): its query is sent with each file's name in the path
    there = ShardsDataModule(web + "?sv=2022-11-02&sig=first", **KW, cache_dir=str(tmp_path))
    a, b = _batches(here, True), _batches(there, True)
    assert len(a) == len(b) > 1 and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))
    assert sorted(_plain(p.name) for p in tmp_path.rglob("*.tar")) == sorted(p.name for p in (local_pack / "train").glob("*.tar"))
    assert not [p for p in tmp_path.rglob("*") if "sig" in p.name or "first" in p.name]  # no credential on disk
    renewed = ShardsDataModule(web + "?sv=2022-11-02&sig=second", **{**KW, "num_workers": 0}, cache_dir=str(tmp_path))
    assert len(_batches(renewed, True)) == len(a) and renewed.pack.cache.fetched == 0  # a new token: the same cache


def test_ranges_read_the_same_bytes_and_cache_nothing(url, local_pack, env):
    here, there = ShardsDataModule(local_pack, **KW), ShardsDataModule(url, fetch="ranges", **KW)
    a, b = _batches(here, True), _batches(there, True)
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))
    assert not list(there.pack.cache.folder.rglob("*.tar"))


def test_the_cache_keeps_its_limit_evicting_the_shards_unused_longest(url, local_pack, env, tmp_path):
    sizes = {p.name: p.stat().st_size for p in (local_pack / "train").glob("*.tar")}
    limit = max(sizes.values()) * 2 + 4096  # two shards (and the indexes, which are small)
    cache = ShardCache(url, tmp_path / "small", limit)
    for name in sorted(sizes):
        cache.get(f"train/{name}")
        time.sleep(0.01)  # a distinct time of use
        held = sum(p.stat().st_size for p in cache.folder.rglob("*") if p.is_file())
        assert held <= limit
    kept = sorted(_plain(p.name) for p in cache.folder.rglob("*.tar"))
    assert kept == sorted(sizes)[-2:]  # the two used last
    with pytest.raises(CacheFullError, match=r"\(\d+\.\d KiB\) is larger than the cache's limit \(1\.0 KiB\)"):
        ShardCache(url, tmp_path / "tiny", 1024).get("train/shard-000000.tar")  # once "(0.0 MiB) ... (0.0 MiB)"


def test_concurrent_downloads_wait_for_room_instead_of_going_over_the_limit(url, local_pack, server, env, tmp_path,
                                                                            monkeypatch):
    # Downloads in flight could not be evicted, and a download that found only those over the limit went ahead: the
    # cache of two ranks' fetch threads held 2.5x its limit. Five threads fetch five shards at once through a proxy
    # that stalls each answer, into a cache of two shards, while its size is sampled.
    import threading

    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    names = sorted(p.name for p in (local_pack / "train").glob("*.tar"))
    limit = max(p.stat().st_size for p in (local_pack / "train").glob("*.tar")) * 2 + 4096
    proxy.faults = [Fault("stall", path=name, seconds=0.3) for name in names]
    cache = ShardCache(url, tmp_path / "small", limit)
    cache.size(f"train/{names[0]}")  # the folder's listing, before the threads
    held, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            held.append(cache._used())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        threads = [threading.Thread(target=cache.get, args=(f"train/{name}",)) for name in names]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
    finally:
        done.set()
        sampler.join()
        proxy.stop()
    assert all(f.hit == 1 for f in proxy.faults)  # every shard fetched
    assert max(held) <= limit, (max(held), limit)


def test_processes_on_a_node_fetch_a_shard_once(url, server, env, tmp_path):
    proxy = FaultProxy(server.endpoint)
    try:
        code = ("import sys; from cltrain.data.shard_cache import ShardCache; "
                "c = ShardCache(sys.argv[1], sys.argv[2]); [c.get(f'train/shard-00000{k}.tar') for k in range(5)]")
        run_env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
        procs = [warm.Popen([sys.executable, "-c", code, url, str(tmp_path / "shared")], env=run_env,
                            stderr=subprocess.PIPE, text=True) for _ in range(3)]
        assert all(p.wait(timeout=120) == 0 for p in procs), [p.stderr.read() for p in procs]
        assert [proxy.gets(f"shard-00000{k}.tar") for k in range(5)] == [1] * 5  # one GET each (one range: < 16 MiB)
    finally:
        proxy.stop()


def test_a_cold_pass_asks_the_store_once_per_file_and_once_per_folder(url, server, env, monkeypatch):
    # sizes come from one listing of each folder (a HEAD per file costs the client and the server about as much
    # CPU as 2 MiB of a shard), the manifest is read once for both splits
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        dm = ShardsDataModule(url, **KW)
        _batches(dm, True)
        _batches(dm, False)
        seen = list(proxy.seen)
    finally:
        proxy.stop()
    names = [p for m, p in seen if m == "GET" and "list-type" not in p]
    assert not [p for m, p in seen if m == "HEAD"], seen
    assert len([p for m, p in seen if "list-type" in p]) == 2, seen  # train/ and val/
    assert sorted(names) == sorted(set(names)) and sum("shards.json" in p for p in names) == 1, names
    assert len([p for p in names if p.split("?")[0].endswith(".tar")]) == 8  # 5 train + 3 val shards


def test_a_store_that_does_not_list_is_read_with_a_size_per_file(url, local_pack, server, env, monkeypatch):
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.faults = [Fault("denied", path="list-type", times=100)]  # a key with GetObject but no ListBucket
    try:
        a = _batches(ShardsDataModule(local_pack, **KW), True)
        b = _batches(ShardsDataModule(url, **KW), True)
        heads = len([p for m, p in proxy.seen if m == "HEAD"])
    finally:
        proxy.stop()
    assert proxy.faults[0].hit >= 1 and heads >= 5
    assert len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def test_the_s3_filesystems_of_a_process_share_botocores_parsed_models(url, env):
    from cltrain.data.remote import open_fs

    # parsed once per process (about 0.1 s of CPU per filesystem otherwise), each with its own session: the
    # variables of the moment (endpoint, keys) are read by each
    one, two = open_fs(url)[0], open_fs(url, quick=True)[0]
    assert one.session is not two.session
    assert one.session.get_component("data_loader") is two.session.get_component("data_loader")
    assert two.cat_file(url + "/shards.json") == one.cat_file(url + "/shards.json")


@pytest.mark.parametrize("fault", ["slowdown", "reset", "stall"])
def test_transient_faults_are_retried_and_no_sample_is_lost_or_read_twice(url, local_pack, server, env, fault,
                                                                          monkeypatch):
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 1, "connect_timeout": 1}})
    proxy.faults = [Fault(fault, path="shard-00000", times=3, seconds=2.5)]
    try:
        a = _batches(ShardsDataModule(local_pack, **{**KW, "num_workers": 0}), True)
        b = _batches(ShardsDataModule(url, **{**KW, "num_workers": 0}), True)
        assert proxy.faults[0].hit == 3  # the faults happened
        assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b)) and len(a) == len(b)
    finally:
        proxy.stop()


def test_a_lasting_fault_is_said_at_each_of_the_caches_attempts(url, local_pack, env, server, monkeypatch, tmp_path,
                                                                caplog):
    # A store that went away mid-run was retried in silence for minutes (nested: s3fs's 6 retries of each of
    # botocore's 6 attempts, each of the cache's 4). Each of the cache's attempts is said now, s3fs adds none.
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    name = "train/" + sorted(p.name for p in (local_pack / "train").glob("*.tar"))[0]
    proxy.faults = [Fault("reset", path=name, times=1000)]
    try:
        with pytest.raises(RemoteError, match=name):
            ShardCache(url, tmp_path, limit=2**30).get(name)
        tries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
        assert [t.rpartition("(")[2] for t in tries] == ["2 of 4)", "3 of 4)", "4 of 4)"], tries
        assert all(f"reading {url}/{name} failed (" in t for t in tries), tries
    finally:
        proxy.stop()


_ANOTHER_JOB = """
import sys
from cltrain.data.shard_cache import ShardCache
url, folder, name = sys.argv[1:]
cache = ShardCache(url, folder, limit=2**30)
cache.size(name)  # reading before the other job's failure
print("reading", flush=True)
sys.stdin.readline()
print(cache.get(name), flush=True)
"""


def test_a_read_failed_for_good_ends_its_jobs_processes_not_another_jobs_reading_through_the_same_folder(
        url, local_pack, env, server, monkeypatch, tmp_path):
    # A training job and an eval job of one pack share its cache folder on a node: the eval job's endpoint going away
    # ended the training job too, 0.1 s later, with the eval job's reason (the note in the folder was the node's).
    import pickle

    import fsspec.config

    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    proxy = FaultProxy(server.endpoint)
    names = ["train/" + n for n in sorted(p.name for p in (local_pack / "train").glob("*.tar"))[:2]]
    other = subprocess.Popen([sys.executable, "-c", _ANOTHER_JOB, url, str(tmp_path), names[1]], cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "WORLD_SIZE": "2"})
    try:
        assert other.stdout.readline().strip() == "reading", other.stderr.read()
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # this job's own endpoint
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"retries": {"max_attempts": 1}}})
        cache, rank = ShardCache(url, tmp_path, limit=2**30), ShardCache(url, tmp_path, limit=2**30)
        worker = pickle.loads(pickle.dumps(cache))  # a DataLoader worker's copy
        for reader in (rank, worker):
            reader.size(names[1])  # reading before the failure
        proxy.faults = [Fault("reset", path=names[0], times=10**6)]
        with pytest.raises(RemoteError, match=names[0]) as first:
            cache.get(names[0])
        for reader in (cache, rank, worker):  # this process, its job's other rank and worker: not tried, and the
            with pytest.raises(RemoteError) as quiet:  # first one's line (it named this shard, with the other's error)
                reader.get(names[1])
            assert str(quiet.value) == str(first.value)
        assert proxy.gets(names[1]) == 0
        out, err = other.communicate("\n", timeout=120)  # the other job, its endpoint fine, reads on
        assert other.returncode == 0, err[-2000:]
        assert Path(out.strip()).read_bytes() == (local_pack / names[1]).read_bytes()
    finally:
        other.kill()
        proxy.stop()


def _stalled_read(url, local_pack, server, monkeypatch, tmp_path, timeout: int, attempts: int, window: float,
                  stall: int) -> tuple[Fault, list[str]]:
    """A shard's reads stalled by a proxy (the folder's listing not) under the client's ``timeout`` and ``attempts``
    and the cache's ``window``: its fault, once the read raised, and the retry lines said."""
    import logging

    import fsspec

    import cltrain.data.shard_cache

    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {
        "read_timeout": timeout, "connect_timeout": timeout, "retries": {"max_attempts": attempts, "mode": "standard"}}})
    monkeypatch.setattr(cltrain.data.shard_cache, "RETRY_WINDOW", window, raising=False)
    name = "train/" + sorted(p.name for p in (local_pack / "train").glob("*.tar"))[0]
    proxy.faults = [Fault("stall", path=name, times=1000, seconds=stall)]
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cltrain.data.shard_cache").addHandler(handler)
    try:
        cache = ShardCache(url, tmp_path, limit=2**30)
        cache.size(name)  # the folder's listing, not stalled
        with pytest.raises(RemoteError, match=name):
            cache.get(name)
    finally:
        logging.getLogger("cltrain.data.shard_cache").removeHandler(handler)
        proxy.stop()
    return proxy.faults[0], [line for line in said if "trying again" in line]


def test_an_endpoint_that_stalls_is_not_tried_again_past_the_window(url, local_pack, env, server, monkeypatch,
                                                                     tmp_path):
    # each of the cache's 4 tries waited for botocore's 6 attempts, each for its read timeout: 24 minutes
    fault, retries = _stalled_read(url, local_pack, server, monkeypatch, tmp_path, timeout=1, attempts=2,
                                   window=1.5, stall=4)  # a window shorter than the client's attempts take
    assert fault.hit >= 2 and retries == []  # the client's own attempts, and no try of the cache's after them


def test_no_try_starts_that_would_end_past_the_window(url, local_pack, env, server, monkeypatch, tmp_path):
    # a dead endpoint's tries each took the client's attempts and backoff (18-50 s): a try started just inside the
    # 2-minute window ended the run 200 s after the outage
    _, retries = _stalled_read(url, local_pack, server, monkeypatch, tmp_path, timeout=2, attempts=1, window=12.0,
                               stall=6)
    # a try is ~5 s here (a request and its read timeouts): tried at 0 s and ~5.2 s; a third from ~10.6 s would end at
    # ~15.6 s, past the window: not started (it was, as it began inside the window)
    assert len(retries) == 1, retries


def test_downloads_under_way_at_exit_or_at_a_kill_leave_no_temporary_file(url, env, server, monkeypatch):
    # a shard's temporary file is in the pack's split folder (train/), not in the cache's own
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.faults = [Fault("stall", path="shard-00000", times=9, seconds=30)]  # each download hangs
    temps = lambda: [p for p in env.rglob("*") if p.name.startswith(TEMP_PREFIX)]  # noqa: E731
    code = ("import sys, threading, time; from cltrain.data.shard_cache import ShardCache\n"
            "cache = ShardCache(sys.argv[1]); cache.open()\n"
            "threading.Thread(target=cache.get, args=(sys.argv[2],), daemon=True).start()\n"
            "while not list(cache.folder.rglob('.cltrain-tmp-*' + sys.argv[2][-10:-4] + '~*')): time.sleep(0.05)\n"
            "if sys.argv[3] == 'killed': __import__('os').kill(__import__('os').getpid(), 9)")
    try:
        killed = warm.run([sys.executable, "-c", code, url, "train/shard-000001.tar", "killed"], timeout=60)
        assert killed.returncode == -9 and len(temps()) == 1  # SIGKILL: nothing of the process ran
        ended = warm.run([sys.executable, "-c", code, url, "train/shard-000000.tar", "exits"], timeout=60)
        assert ended.returncode == 0  # its own download (a daemon thread) still under way at exit
        assert not temps(), temps()  # its own, and the killed process's
    finally:
        proxy.stop()


def test_a_download_a_thread_starts_during_the_exit_leaves_no_temporary_file(url, env, server, monkeypatch):
    # a fetch-ahead thread that began a download after the exit's clean-up had looked left its temporary file
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.faults = [Fault("stall", path="shard-000002", times=9, seconds=30)]
    code = ("import atexit, sys, threading, time\n"
            "def late():  # registered before cltrain's clean-up, so it runs after it\n"
            "    threading.Thread(target=cache.get, args=(sys.argv[2],), daemon=True).start()\n"
            "    time.sleep(1)\n"
            "atexit.register(late)\n"
            "from cltrain.data.shard_cache import ShardCache\n"
            "cache = ShardCache(sys.argv[1]); cache.open(); cache.size(sys.argv[2])\n")
    try:
        # a fresh interpreter (not tests.helpers.warm's, which has cltrain imported: its clean-up would run last)
        ended = subprocess.run([sys.executable, "-c", code, url, "train/shard-000002.tar"], capture_output=True,
                               text=True, timeout=60)
        assert ended.returncode == 0, ended.stderr
        assert not [p for p in env.rglob("*") if p.name.startswith(TEMP_PREFIX)], list(env.rglob("*"))
    finally:
        proxy.stop()


def test_a_pack_larger_than_the_cache_under_a_full_shuffle_is_said_in_a_readable_size(url, env):
    dm = ShardsDataModule(url, cache_limit=30000, shuffle_window=None, **KW)
    with pytest.warns(UserWarning, match=r"about \d+\.\d KiB\) does not fit the shard cache \(29\.3 KiB"):
        dm.setup("fit")  # a small pack was "about 0.0 GiB", a 30 KB limit "0.0 MiB"
    # a limit just below the split's size: "about 0.1 MiB" beside "0.1 MiB" looked like a split that fits
    split = int((dm.train_set.index[:, 0] + dm.train_set.index[:, 1]).max()) * len(dm.train_set.shard_names)
    with pytest.warns(UserWarning, match=r"about (\d+\.\d+) KiB\) does not fit the shard cache \((?!\1 )\d+\.\d+ KiB"):
        ShardsDataModule(url, cache_limit=split - 2000, shuffle_window=None, **KW).setup("fit")


def test_a_missing_bucket_prefix_or_pack_is_one_line_naming_the_url(url, env, server, tmp_path):
    for bad in ("s3://no-such-bucket/pack", url.rsplit("/", 1)[0] + "/nopack", url + "/train"):
        with pytest.raises(RemoteError) as caught:
            ShardsDataModule(bad, **KW).num_classes
        line = str(caught.value)
        assert "\n" not in line and bad in line and "not a complete cltrain pack" in line and "cltrain-pack" in line
    # an image folder uploaded as it is: its bucket and prefix are there ("no bucket, prefix or manifest" misled)
    folder = write_image_folder(tmp_path / "images", classes=2, train=1, val=1, size=(8, 8))
    with pytest.raises(RemoteError, match="is an image folder, not a pack: pack it with `cltrain-pack IMAGEFOLDER OUT` "
                                          "and upload OUT"):
        ShardsDataModule(server.upload(folder, "bucket", "data/images"), **KW).num_classes


def test_an_unreadable_image_in_a_bucket_says_to_upload_the_pack_again(local_pack, server, env, tmp_path):
    import shutil

    from cltrain.data.errors import BadImageError

    bad = tmp_path / "pack"
    shutil.copytree(local_pack, bad)
    dm = ShardsDataModule(bad, **KW)
    dm.setup("fit")
    shard, (start, size) = bad / dm.train_set.shard_names[int(dm.train_set.shard_of[0])], dm.train_set.index[0, :2]
    data = bytearray(shard.read_bytes())
    data[int(start):int(start) + int(size)] = b"\x00" * int(size)
    shard.write_bytes(bytes(data))
    remote = ShardsDataModule(server.upload(bad, "bucket", "data/badpack"), **KW)
    remote.setup("fit")
    with pytest.raises(BadImageError, match=r"replace the file and pack the folder again \(and upload the pack\)\.$"):
        remote.train_set.load(0)


def test_a_shard_missing_or_cut_short_in_the_bucket_is_one_line_before_the_first_step(local_pack, server, env):
    # a missing shard was said when first read, after steps of training (hours into a large pack), once per rank
    client, shard = server.client(), "train/shard-000001.tar"
    for prefix, body in (("missing", None), ("short", (local_pack / shard).read_bytes()[:3000])):
        url = server.upload(local_pack, "gaps", prefix)
        client.delete_object(Bucket="gaps", Key=f"{prefix}/{shard}")
        if body is not None:
            client.put_object(Bucket="gaps", Key=f"{prefix}/{shard}", Body=body)
        dm = ShardsDataModule(url, **KW)
        with pytest.raises(RemoteError) as caught:
            dm.setup("fit")
        line = str(caught.value)
        assert "\n" not in line and f"{url}/{shard}" in line and "upload it again whole" in line
        assert ("missing" in line) == (body is None) and ("cut short" in line) == (body is not None)
        assert not list(dm.pack.cache.folder.rglob("*.tar"))  # said before any shard was fetched


def test_shards_and_indexes_of_another_pack_uploaded_over_part_of_this_one_are_one_line_at_setup(local_pack, server,
                                                                                                 env):
    # an index of another pack, of as many samples (the same size), was read as this shard's: the wrong offsets
    client, tar = server.client(), "train/shard-000001.tar"
    size = (local_pack / tar).stat().st_size
    other = next(p for p in sorted((local_pack / "train").glob("*.tar")) if p.stat().st_size != size)
    for key, body, said in (("train/shard-000001.idx.npy", (local_pack / "train/shard-000000.idx.npy").read_bytes(),
                             "not the index the pack's manifest records"),
                            (tar, other.read_bytes(), "bytes where the manifest says")):
        prefix = key.rsplit(".", 1)[-1]
        url = server.upload(local_pack, "over", prefix)
        client.put_object(Bucket="over", Key=f"{prefix}/{key}", Body=body)
        with pytest.raises(RemoteError) as caught:
            ShardsDataModule(url, **KW).setup("fit")
        line = str(caught.value)
        assert "\n" not in line and line.startswith(f"{url}/{key}: ") and said in line
        assert "upload it again whole" in line


def test_a_damaged_index_in_the_cache_is_fetched_again_and_one_in_the_bucket_is_one_line(local_pack, server, env,
                                                                                          tmp_path, caplog):
    # np.load's traceback, at every setup while the damaged copy stayed in the node's cache
    url = server.upload(local_pack, "damaged", "pack")
    ShardsDataModule(url, cache_dir=str(tmp_path), **KW).setup("fit")
    cached = next(tmp_path.rglob("shard-000000.idx~*.npy"))
    cached.write_bytes(cached.read_bytes()[:-8])  # cut short on the node's disk
    dm = ShardsDataModule(url, cache_dir=str(tmp_path), **KW)
    with caplog.at_level(logging.WARNING, logger="cltrain"):
        dm.setup("fit")
    said = [r.getMessage() for r in caplog.records if "is not a shard index" in r.getMessage()]
    assert len(said) == 1 and str(cached) in said[0] and said[0].endswith("fetching it again"), said
    assert len(dm.train_set) == 33 and np.load(cached).shape == (7, 5)
    good = cached.read_bytes()
    cached.write_bytes(next(tmp_path.rglob("shard-000001.idx~*.npy")).read_bytes())  # loads, but another shard's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cltrain"):
        ShardsDataModule(url, cache_dir=str(tmp_path), **KW).setup("fit")
    said = [r.getMessage() for r in caplog.records if "is not the index the pack's manifest records" in r.getMessage()]
    assert len(said) == 1 and str(cached) in said[0] and cached.read_bytes() == good, said
    server.client().put_object(Bucket="damaged", Key="pack/train/shard-000000.idx.npy", Body=b"\x93NUMPY damaged")
    with pytest.raises(RemoteError) as caught:
        ShardsDataModule(url, cache_dir=str(tmp_path / "fresh"), **KW).setup("fit")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{url}/train/shard-000000.idx.npy: not a shard index (")
    assert f"the pack at {url} is incomplete" in line


def test_a_shard_removed_from_the_bucket_during_the_run_is_one_line_saying_the_pack_is_incomplete(local_pack, server,
                                                                                                   env):
    # said as a wrong URL was ("check the bucket and prefix ..., or make a pack"), though the manifest names the shard
    client, shard = server.client(), "train/shard-000001.tar"
    url = server.upload(local_pack, "removed", "pack")
    dm = ShardsDataModule(url, fetch="ranges", **KW)
    dm.setup("fit")
    client.delete_object(Bucket="removed", Key=f"pack/{shard}")
    with pytest.raises(RemoteError) as caught:
        dm.pack.pread(shard, 0, 100)
    line = str(caught.value)
    assert "\n" not in line and f"{url}/{shard}" in line and "not found" in line
    assert f"the pack at {url} is incomplete (its manifest names the file): upload it again whole" in line
    assert "make a pack" not in line


def test_no_credentials_an_uppercase_scheme_and_keys_in_the_url_are_one_line_with_the_fix(url, env, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(RemoteError, match="no credentials were found .*AWS_ACCESS_KEY_ID") as caught:
        ShardsDataModule(url, **KW).num_classes
    assert "\n" not in str(caught.value) and url in str(caught.value)
    upper = "S3" + url[2:]
    with pytest.raises(RemoteError, match="write the scheme in lowercase") as caught:
        ShardsDataModule(upper, **KW).num_classes
    assert f"lowercase: {url}/" in str(caught.value)
    # botocore read "AKIAUSER:URLSECRET@bucket" as the bucket; a secret holding "/" (half of AWS's do) was neither
    # refused nor redacted, and was printed whole
    for secret in ("URLSECRET", "URL/SECRET+KEY"):
        keyed = url.replace("s3://", f"s3://AKIAUSER:{secret}@")
        with pytest.raises(RemoteError, match=r"\*\*\*@.*credentials in the URL are not read; .*AWS_ACCESS_KEY_ID") \
                as caught:
            ShardsDataModule(keyed, **KW).num_classes
        assert secret not in str(caught.value) and "URL/" not in str(caught.value)


def test_an_unreachable_endpoint_is_one_line_within_seconds(env, monkeypatch):
    from tests.helpers.s3 import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(RemoteError, match="cannot be reached.*AWS_ENDPOINT_URL") as caught:
        ShardsDataModule("s3://bucket/data/pack", **KW).num_classes
    assert time.monotonic() - started < 10 and "\n" not in str(caught.value)


def test_a_full_cache_disk_is_one_line_and_leaves_no_temporary_file(url, env):
    # a file size limit (EFBIG, as ENOSPC: the write fails part-way) stands in for a full disk
    code = ("import sys; from cltrain.data import ShardsDataset, eval_transform\n"
            "try: ShardsDataset(sys.argv[1], 'train', eval_transform(24, 28))[list(range(8))]\n"
            "except Exception as e: print(type(e).__name__, e); sys.exit(2)")
    done = warm.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=120,
                    file_size_limit=8192)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stdout.strip()
    assert line.startswith("CacheFullError shard cache") and "no room for train/shard-" in line, line
    assert "CLTRAIN_SHARD_CACHE" in line and "\n" not in line
    assert not [p for p in env.rglob("*") if p.name.startswith(TEMP_PREFIX)]


def test_an_empty_or_garbled_manifest_in_the_bucket_is_one_line_with_the_fix(server, url, env):
    # "cannot be read (OSError: The requested range is not satisfiable)", or a bare JSONDecodeError, after 3 retries
    client = server.client()
    for body, name in ((b"", "empty"), (b"<html>not found</html>", "garbled")):
        client.put_object(Bucket="bucket", Key=f"{name}/shards.json", Body=body)
        with pytest.raises(RemoteError, match="not a cltrain pack's manifest .*upload the pack again whole") as caught:
            ShardsDataModule(f"s3://bucket/{name}", **KW).num_classes
        assert "\n" not in str(caught.value)


def test_the_clients_own_settings_are_one_line_at_once_with_their_fix(monkeypatch):
    # retried three times, then "cannot be read" with no fix; LitData's wait for a chunk from a gone endpoint (a
    # FileNotFoundError) read as "not found", with a pack's advice
    from botocore.exceptions import ProfileNotFound, SSLError

    from cltrain.data.shard_source import _transient

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # botocore takes it before AWS_ENDPOINT_URL
    url = "s3://bucket/pack"
    cases = [(ValueError("Invalid endpoint: 127.0.0.1:9000"), "write AWS_ENDPOINT_URL_S3 with its scheme"),
             (ProfileNotFound(profile="nosuch"), "name a profile of ~/.aws/config"),
             (SSLError(endpoint_url="https://h", error="wrong version number"), "AWS_ENDPOINT_URL_S3=http://"),
             (TimeoutError("Timed out waiting for chunk-0-0.bin"), "endpoint at http://127.0.0.1:9 cannot be reached")]
    pytest.importorskip("litdata")
    from litdata.exceptions import ChunkWaitTimeoutError

    cases.append((ChunkWaitTimeoutError("chunk-0-0.bin", 120), "cannot be reached"))
    for err, fix in cases:
        line = str(remote_error(err, url))
        assert fix in line and "not found" not in line, line
        assert not _transient(err) or isinstance(err, ChunkWaitTimeoutError), err  # said at once, not tried again


def test_an_endpoint_on_a_port_holding_403_is_unreachable_not_access_denied():
    # a free port such as 53403 made "Cannot connect to host 127.0.0.1:53403" read as an HTTP 403: "access denied"
    url = "https://127.0.0.1:53403/pack"
    refused = ConnectionRefusedError("Cannot connect to host 127.0.0.1:53403 ssl:default [Connect call failed "
                                     "('127.0.0.1', 53403)]")
    assert "cannot be reached" in str(remote_error(refused, url))
    for said in ("Client error '403 Forbidden' for url", "HTTP 403", "status code 403 (AccessDenied)", "(403)"):
        assert "access denied" in str(remote_error(OSError(said), url)), said


def test_secrets_are_never_in_a_message():
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET
    try:
        text = redact(f"https://u:pw@h/x?X-Amz-Signature=abc&sig=def&ok=1 key {SECRET}")
        assert SECRET not in redact(f"run_{SECRET}0 cache/hf_{SECRET}_models")  # a long one glued to a name too
    finally:
        del os.environ["AWS_SECRET_ACCESS_KEY"]
    assert "pw" not in text and "abc" not in text and "def" not in text and SECRET not in text and "ok=1" in text
    # any query value named as a secret, not only a fixed list's
    named = redact("https://h/p?access_token=t1&api_key=t2&client_secret=t3&password=t4&X-Goog-Credential=t5&n=6")
    assert not [t for t in ("t1", "t2", "t3", "t4", "t5") if t in named] and "n=6" in named, named
    # a library's message quoting the URL's user part without its scheme (botocore's "Invalid bucket name")
    url = "s3://AKIAINURL:SecretInUrl42@bucket/pack"
    line = str(remote_error(ValueError('Invalid bucket name "AKIAINURL:SecretInUrl42@bucket"'), url))
    assert "SecretInUrl42" not in line and "s3://***@bucket/pack" in line, line
    # a password holding "/"; paths holding "@" or ":" are not user parts
    assert redact("https://u:pa/ss@h/p gs://k:a/b@c/d") == "https://***@h/p gs://***@c/d"
    assert redact("s3://bucket/dir@v2/x s3://bucket/x:y@z") == "s3://bucket/dir@v2/x s3://bucket/x:y@z"
    # a local server's key (LocalStack's "test") as a whole token only: not in a key's or a path's name
    os.environ["AWS_SECRET_ACCESS_KEY"] = "test"
    try:
        text = redact("limit_test_batches: null, ckpt_path=/runs/latest/last.ckpt, secret test, s3://k:test@b/x")
    finally:
        del os.environ["AWS_SECRET_ACCESS_KEY"]
    assert text == "limit_test_batches: null, ckpt_path=/runs/latest/last.ckpt, secret ***, s3://***@b/x", text


@pytest.mark.slow
def test_ddp_two_ranks_two_workers_read_a_two_shard_bucket_pack_each_sample_once(server, env, tmp_path):
    # 2 training shards for 2 ranks x 2 workers: no hang, no repeat; each rank builds its dataset in setup, after the
    # ranks exist (LitData #250 duplicated samples when the dataset was built before)
    folder = write_image_folder(tmp_path / "images", classes=3, train=7, val=2, size=(40, 32))
    pack(folder, tmp_path / "two", shard_size=12, progress=False)  # 21 train in 2 shards, 6 val in 1
    two = server.upload(tmp_path / "two", "bucket", "two-shards")
    proc = warm.run([sys.executable, "-m", "tests.helpers.shards_ddp_run", two, str(tmp_path), "2"], cwd=REPO,
                    capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    for split, n in (("train", 21), ("val", 6)):
        for epoch in (0, 1):
            ids = [i for r in ranks for s in r[split] if s["epoch"] == epoch for i in s["ids"]]
            assert sorted(ids) == list(range(n)), (split, epoch, Counter(ids))
    assert {s["worker"] for r in ranks for s in r["train"]} == {0, 1}
    assert len(list(env.rglob("*.tar"))) == 3  # the node fetched each shard once, for both ranks and all workers


def test_sizes_and_urls_are_checked_where_they_are_given(local_pack):
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size(10) == 10 and parse_size("auto") is None
    for bad in ("lots", -1, "0GB"):
        with pytest.raises(ValueError, match="cache_limit"):
            ShardsDataModule(local_pack, cache_limit=bad, **KW)
    with pytest.raises(ValueError, match="fetch='all'"):
        ShardsDataModule(local_pack, fetch="all", **KW)
    from cltrain.data import ImageFolderDataModule

    with pytest.raises(ValueError, match="is a URL; .*cltrain-pack ROOT OUT.*data=shards"):
        ImageFolderDataModule("s3://bucket/imagenet", **KW)
    from cltrain.data import HFImageDataModule

    with pytest.raises(ValueError, match=r"is a URL; the HF door .* reads a local dataset folder.*aws s3 sync") as error:
        HFImageDataModule("s3://bucket/hf", **KW)
    assert "cltrain-pack" not in str(error.value)  # it takes image folders, not an HF dataset


@pytest.mark.parametrize("url,package,extra", [("gs://bucket/pack", "gcsfs", "gcs"), ("az://box/pack", "adlfs", "azure")])
def test_a_store_whose_package_is_missing_names_its_own_extra(url, package, extra):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(RemoteError, match=rf"needs {package}: pip install 'cltrain\[{extra}\]'"):
        ShardsDataModule(url, **KW).num_classes


def test_the_manifest_is_read_again_after_a_transient_failure_and_not_after_a_lasting_one(url, local_pack, server, env,
                                                                                           monkeypatch, caplog):
    # one reset, or three SlowDowns in a row, on shards.json (a job's ranks all read it at once) ended the run
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        proxy.faults = [Fault("slowdown", path="shards.json", times=3), Fault("reset", path="shards.json")]
        with caplog.at_level("WARNING", logger="cltrain"):
            b = _batches(ShardsDataModule(url, **{**KW, "num_workers": 0}), True)
        assert [f.hit for f in proxy.faults] == [3, 1]
        assert sum("shards.json failed" in r.getMessage() and "trying again" in r.getMessage()
                   for r in caplog.records) >= 2, caplog.text
        proxy.faults = [Fault("denied", path="shards.json", times=10)]
        with pytest.raises(RemoteError, match="shards.json"):
            ShardsDataModule(url, **KW).setup("fit")
        assert proxy.faults[0].hit == 1  # a refused key: said at once
    finally:
        proxy.stop()
    a = _batches(ShardsDataModule(local_pack, **{**KW, "num_workers": 0}), True)
    assert len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def test_an_endpoint_that_never_answers_the_manifest_is_one_line_without_trying_it_again(url, server, env,
                                                                                          monkeypatch):
    # each of the manifest's 4 tries waited out the client's own attempts of its 5 s read timeout: 78 s to say it
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.faults = [Fault("stall", path="shards.json", times=100, seconds=100)]
    started = time.monotonic()
    try:
        with pytest.raises(RemoteError) as raised:
            ShardsDataModule(url, **KW).setup("fit")
    finally:
        proxy.stop()
    took = time.monotonic() - started
    assert took < 45, f"{took:.0f} s: {raised.value}"
    assert "shards.json" in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize("fetch", ["shards", "ranges"])
def test_a_pack_uploaded_again_during_the_run_is_refused_not_read(local_pack, server, env, tmp_path, fetch):
    # another pack uploaded over a running one: its shards were read at the first pack's offsets, with its labels
    # (under bad_files=skip, silently); each GET now asks If-Match the ETag listed when the run began
    other = pack(write_image_folder(tmp_path / "other", classes=3, train=11, val=5, size=(40, 48)),
                 tmp_path / "other_pack", shard_size=7, progress=False).parent
    url = server.upload(local_pack, "bucket", f"swap-{fetch}")
    dm = ShardsDataModule(url, **{**KW, "num_workers": 0, "fetch": fetch, "bad_files": "skip"})
    dm.setup("fit")  # the manifest, the listing and the indexes read: the shards are read from the first batch on
    server.upload(other, "bucket", f"swap-{fetch}")
    with pytest.raises(RemoteError, match=r"\.tar: replaced in the store during the run .* uploaded again"):
        list(dm.train_dataloader())
