"""LitData reads an item got by index from a bucket by a ranged GET of its bytes (``on_demand_bytes``, the default
of ``StreamingDataset.__getitem__``): a ``bytes`` field fails there with ``struct.error`` (``unpack_from requires a
buffer of at least 8 bytes``), while whole chunks (its iterator's way) read it. Plain LitData and moto only::

    python -m scripts.repro.litdata_ranged_bytes

Prints each way's result; exits 1 while the ranged read fails (``cltrain.data.litdata_source`` reads whole chunks
where the split fits ``max_cache_size`` and says this in one line where it does not).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from pathlib import Path


def _item(i: int) -> dict:
    return {"image": bytes(range(256)) * (i + 1), "label": i % 3}


def _read(url: str, cache: str, ranged: bool) -> str:
    from litdata import StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache)
    ds._on_demand_bytes = ranged  # the attribute LitData's iterator sets; no argument sets it
    try:
        return f"{len(ds[3]['image'])} bytes, as written" if len(ds[3]["image"]) == 1024 else "WRONG bytes"
    except Exception as err:  # noqa: BLE001 - the fault is the output
        return f"FAILS ({type(err).__name__}: {err})"


def main() -> int:
    import boto3
    import litdata
    from litdata.streaming import downloader
    from moto.server import ThreadedMotoServer

    work = Path(tempfile.mkdtemp())
    litdata.optimize(fn=_item, inputs=list(range(12)), output_dir=str(work / "ds"), chunk_bytes="4KB", num_workers=1,
                     mode="overwrite")
    multiprocessing.set_start_method("fork", force=True)  # optimize() leaves spawn set
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
                      AWS_DEFAULT_REGION="us-east-1")
    downloader._OBSTORE_AVAILABLE = False  # its obstore client refuses a plain-http endpoint
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="repro")
    for f in (work / "ds").iterdir():
        s3.upload_file(str(f), "repro", f"ds/{f.name}")
    results = {way: _read("s3://repro/ds", str(work / way), way == "ranged") for way in ("ranged", "whole chunks")}
    server.stop()
    shutil.rmtree(work)
    print(f"litdata {litdata.__version__}")
    for way, result in results.items():
        print(f"{way:<13} {result}")
    return 1 if results["ranged"].startswith("FAILS") else 0


if __name__ == "__main__":
    sys.exit(main())
