"""``python train.py data=shards data.root=s3://bucket/pack`` against a real S3 server (moto's, on 127.0.0.1): the run
the local pack gives, through a SIGTERM and a resume from the bucket, bit for bit; every bad URL, bad credential,
unreachable endpoint or full cache disk one line and a non-zero exit within seconds; no temporary file, shared
memory or secret left anywhere."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from cltrain.atomic import TEMP_PREFIX
from cltrain.data.pack import pack
from tests.app.test_signals import _final_state, run_until_signalled
from tests.helpers import REPO, shm_entries, shm_left_behind, warm
from tests.helpers.s3 import S3Server, SECRET, free_port, s3_env, s3_server_fixture  # noqa: F401 - the fixtures server and env

pytest.importorskip("s3fs", reason="the object-storage tests need s3fs and moto: pip install -e '.[test]'")
pytest.importorskip("moto.server", reason="the object-storage tests need moto[server]: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def local_pack(demo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pack") / "pack"
    pack(demo_root, out, shard_size=5, progress=False)  # the tiny demo: 32 training images in 7 shards
    return out


@pytest.fixture(scope="module")
def url(server: S3Server, local_pack: Path) -> str:
    return server.upload(local_pack, "bucket", "demo-pack")


def _env(server: S3Server, cache: Path, **changes: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", **s3_env(server.endpoint),
           "CLTRAIN_SHARD_CACHE": str(cache), **changes}
    env.pop("LOCAL_RANK", None)
    return env


def _args(root: str, run_dir: Path, epochs: int) -> list[str]:
    return ["experiment=smoke", "data=shards", f"data.root={root}", "data.batch_size=8", "data.num_workers=2",
            "data.image_size=32", "data.val_resize_size=36", "device=cpu", "amp=false", f"trainer.max_epochs={epochs}",
            "channels_last_layout=channels_last",  # pinned: the layout race times, so could pick differently per run
            "trainer.enable_progress_bar=false", "print_freq=1", f"hydra.run.dir={run_dir}"]


def _files(*folders: Path) -> list[Path]:
    return [p for f in folders for p in f.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_sigterm_mid_epoch_and_a_resume_from_the_bucket_end_where_the_local_packs_run_ends(server, url, local_pack,
                                                                                          tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(os, "environ", _env(server, cache))  # run_until_signalled passes os.environ on
    shm = shm_entries()
    status, out = run_until_signalled(_args(url, tmp_path / "run", epochs=50), signal.SIGTERM, "Epoch: [1][2/")
    assert status == 143, out[-3000:]
    assert "Traceback" not in out
    assert not [p for p in _files(cache) if p.name.startswith(TEMP_PREFIX)]  # nothing half-fetched left behind
    assert not shm_left_behind(shm)  # and no shared memory
    resume = [line for line in out.splitlines() if "resume with:" in line]
    command = shlex.split(resume[0].split("resume with: ", 1)[1])[2:]
    command = [a.replace("trainer.max_epochs=50", "trainer.max_epochs=2") for a in command]
    command = [a for a in command if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={tmp_path / 'resumed'}"]
    outputs = [out]
    for args in (command, _args(str(local_pack), tmp_path / "local", epochs=2)):  # the resume; the local pack's run
        done = warm.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=REPO,
                        env=os.environ, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        outputs.append(done.stdout + done.stderr)
    a, b = _final_state(tmp_path / "local"), _final_state(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    assert "not resumable" not in "".join(outputs)
    for path in _files(tmp_path):  # the secret key is in no output and no file of the runs or the cache
        assert SECRET.encode() not in path.read_bytes(), path
    assert not [o for o in outputs if SECRET in o]


def _fails(args: list[str], env: dict[str, str], **kwargs) -> tuple[str, float]:
    started = time.monotonic()
    done = warm.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=REPO,
                    env=env, timeout=120, **kwargs)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("cltrain: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert SECRET not in done.stdout + done.stderr
    return errors[0], took


def test_a_bad_url_credentials_endpoint_or_full_cache_is_one_line_within_seconds(server, url, tmp_path, monkeypatch):
    import moto.settings

    base = _args(url, tmp_path / "run", epochs=1)
    env = _env(server, tmp_path / "cache")
    cases = [("s3://no-such-bucket/pack", {}, "not found", "cltrain-pack"),
             (url.rsplit("/", 1)[0] + "/no-pack", {}, "not a complete cltrain pack", "upload"),
             (url, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, "cannot be reached", "AWS_ENDPOINT_URL")]
    for k, (root, changes, reason, fix) in enumerate(cases):
        args = [a if not a.startswith("data.root=") else f"data.root={root}" for a in base]
        line, took = _fails([*args, f"hydra.run.dir={tmp_path / f'run{k}'}"], {**env, **changes})
        assert root in line and reason in line and fix in line, line
        assert took < 30, (line, took)
    # a password in the URL (the docs say: credentials in the environment): in no output and no file of the run
    root = f"https://alice:Pw-in-url-1234@127.0.0.1:{free_port()}/pack"
    args = [a if not a.startswith("data.root=") else f"data.root={root}" for a in base]
    line, _ = _fails([*args, f"hydra.run.dir={tmp_path / 'userinfo'}"], env)
    assert "cannot be reached" in line and "https://***@127.0.0.1:" in line and "Pw-in-url-1234" not in line, line
    assert not [p for p in _files(tmp_path / "userinfo") if b"Pw-in-url-1234" in p.read_bytes()]
    # a sweep: Hydra's launcher line and its multirun.yaml, a failed job's overrides on stderr
    done = warm.run([sys.executable, str(REPO / "train.py"), "-m", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                    capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 1 and "cannot be reached" in done.stderr and "#0 : " in done.stdout, done.stderr[-2000:]
    assert "Pw-in-url-1234" not in done.stdout + done.stderr and "Error executing job" in done.stderr
    assert (tmp_path / "sweep" / "multirun.yaml").is_file()
    assert not [p for p in _files(tmp_path / "sweep") if b"Pw-in-url-1234" in p.read_bytes()]
    # wrong credentials: the server checks signatures from now on and knows no such key
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    line, _ = _fails([*base, f"hydra.run.dir={tmp_path / 'creds'}"], env)
    assert "access denied" in line and "AWS_ACCESS_KEY_ID" in line, line
    monkeypatch.undo()
    # a cache that cannot take a shard (a full disk: test_remote_shards.py)
    line, _ = _fails([*base, "data.cache_limit=4096", f"hydra.run.dir={tmp_path / 'full'}"], env)
    assert "shard cache" in line and "larger than the cache's limit" in line and "data.cache_limit" in line, line
    assert not [p for p in _files(tmp_path / "cache") if p.name.startswith(TEMP_PREFIX)]


@pytest.mark.slow
def test_a_second_signal_while_a_download_hangs_stops_the_run_at_once(server, url, tmp_path):
    # no loader workers: the shard downloads run in this process's decode threads, which Python's exit would wait for
    import subprocess

    from tests.helpers.s3 import Fault, FaultProxy

    proxy = FaultProxy(server.endpoint)
    proxy.faults = [Fault("stall", path=".tar", times=100, seconds=50)]
    args = [a.replace("data.num_workers=2", "data.num_workers=0") for a in _args(url, tmp_path / "run", epochs=1)]
    proc = warm.Popen([sys.executable, str(REPO / "train.py"), *args], stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, cwd=REPO,
                      env=_env(server, tmp_path / "cache", AWS_ENDPOINT_URL=proxy.endpoint))
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "cltrain: lr" in line:  # fit starts: its first batch waits for a shard that does not come
                break
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
        out = "".join(lines) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.stop()
    assert code == 130 and took < 15, (code, took, out[-2000:])
    assert "a second signal stopped the run at once" in out and "Traceback" not in out, out[-2000:]
    assert not [p for p in _files(tmp_path / "cache") if p.name.startswith(TEMP_PREFIX)]


def test_a_webdataset_stream_trains_once_its_epoch_length_is_given(server, local_pack, tmp_path):
    # a pack's shards are WebDataset tars; a stream has no length, and the schedule counts its epochs in steps: the
    # app could never train on data=webdataset (a traceback, exit 1); now one line asks for the length, then it trains
    import json

    classes = len(json.loads((local_pack / "shards.json").read_text())["classes"])
    args = [a for a in _args(str(local_pack), tmp_path / "run", 1) if not a.startswith(("data=", "data.root"))]
    args = [*args, "data=webdataset", f"data.root={local_pack}", f"data.num_classes={classes}", "data.num_workers=0",
            "trainer.limit_train_batches=1.0"]  # the whole stream: no count of batches to take instead
    line, _ = _fails(args, _env(server, tmp_path / "cache"))
    assert "data.samples_per_epoch=null" in line and "no length" in line, line
    done = warm.run([sys.executable, str(REPO / "train.py"), *args, "data.samples_per_epoch=32",
                     f"hydra.run.dir={tmp_path / 'run2'}"], capture_output=True, text=True, cwd=REPO,
                    env=_env(server, tmp_path / "cache"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run2" / "metrics.json").read_text())["status"] == "completed"
    batch = int(next(a for a in args if a.startswith("data.batch_size=")).split("=")[1])
    out = done.stdout + done.stderr  # the progress lines: the epoch's batches from its samples, not "/inf"
    assert f"Epoch: [0][1/~{32 // batch}]" in out and "/inf]" not in out, out[-3000:]
