"""Object-storage URLs as data roots: what is one, the filesystem that reaches it, its failures in one line.

A root such as ``s3://bucket/imagenet-shards`` (also ``gs://``, ``az://`` / ``abfs://``, ``https://``, any
protocol fsspec knows) is read through fsspec: ``s3fs``, ``gcsfs``, ``adlfs`` or fsspec's own HTTP
filesystem (``pip install 'cltrain[s3]'``, ``[gcs]``, ``[azure]``, or all three: ``[cloud]``). Credentials and endpoints come from each library's standard
chain: for S3, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE`` / an instance role, and
``AWS_ENDPOINT_URL`` for MinIO, Cloudflare R2 or Ceph (a plain ``http://`` endpoint works as it is);
``GOOGLE_APPLICATION_CREDENTIALS`` for GCS; ``AZURE_STORAGE_ACCOUNT_NAME`` with a key, a SAS token or
``az login`` for Azure. cltrain holds no client and no HTTP code of its own.

Why fsspec and not obstore (both measured, ``python -m scripts.bench.object_storage --clients``, numbers in
docs/guides/object-storage.md): on whole-shard reads both are bound by the server, and fsspec gives one
interface for every store, the standard credential chains of boto, google-auth and azure-identity, and is
already installed with Hugging Face ``datasets``.

A failure is said in one line naming the URL and the fix (``remote_error``), with no secret in it (``redact``).

Example::

    >>> is_url("s3://bucket/pack"), is_url("/data/pack"), is_url("C:/data")
    (True, False, False)
    >>> redact("https://user:hunter2@host/p?sig=abc&x=1")
    'https://***@host/p?sig=***&x=1'
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from cltrain.data.errors import StorageError

__all__ = ["RemoteError", "is_url", "join", "open_fs", "redact", "remote_error", "root_of"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
#: The environment variables whose values are secrets: never printed, even inside a library's message.
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY",
                    "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_SECRET",
                    "GOOGLE_OAUTH_ACCESS_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_PASSWORD",
                    "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY")
# a query value whose name says secret (sig, signature, token, access_token, key, api_key, client_secret, password,
# X-Amz-Credential, session, code, auth...) or is one of an Azure SAS token's fields
_QUERY_SECRETS = re.compile(r"(?i)([?&](?:[\w.-]*(?:sig|token|key|secret|pass|pwd|credential|auth|session|code)[\w.-]*|"
                            r"sv|se|sp|st|sr|ss|srt|spr|skoid|sktid|skt|ske|sks|skv)=)[^&\s'\"]+")
#: ``user@`` or ``user:password@`` after the scheme; a password may hold "/" (half of AWS's secret keys do), a user not
_USERINFO = re.compile(r"(://)(?:[^/@\s'\"]+|[^/@:\s'\"]*:[^@\s'\"]*)@")
#: Per-request retries of the S3 client (botocore's "standard" mode: exponential backoff with jitter on 5xx,
#: SlowDown/throttling, reset connections and timeouts); a whole shard is also retried (``shard_cache``).
S3_ATTEMPTS = 6


class RemoteError(StorageError):
    """A root in object storage cannot be read: the message names the URL, why, and what to do."""


def is_url(root: Any) -> bool:
    """Whether ``root`` is a URL (``scheme://...``, the scheme longer than one letter: not a Windows drive)."""
    return isinstance(root, str) and _SCHEME.match(root) is not None and not root.startswith("file://")


def root_of(root: str | os.PathLike) -> str | Path:
    """A data root as the DataModules keep it: a URL as given (without a trailing ``/``), anything else a ``Path``."""
    return str(root).rstrip("/") if is_url(root) else Path(root)


def split_query(url: str) -> tuple[str, str]:
    """``(url without its query, "?query" or "")`` of an ``http(s)://`` URL (a signed URL's, an Azure SAS token's:
    the credentials, not the place); other URLs whole (a ``?`` may be part of an object's key)."""
    if url[:8].lower().startswith(("http://", "https://")) and "?" in url:
        base, query = url.split("?", 1)
        return base, "?" + query
    return url, ""


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended to its path, ``/``-separated (an ``http(s)://`` URL's query kept at the end)."""
    base, query = split_query(url)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)]) + query


def redact(text: str, url: str = "") -> str:
    """``text`` without secrets: the user part of URLs, the query values named as secrets, and the value of any
    secret environment variable (``SECRET_VARIABLES``) that appears in it; with ``url``, its own user part and secret
    query values wherever they appear (a library's message quoting them without the URL around them)."""
    text = _USERINFO.sub(r"\1***@", _QUERY_SECRETS.sub(r"\1***", text))
    user = _USERINFO.search(url)
    secrets = [os.environ.get(name) or "" for name in SECRET_VARIABLES]
    secrets += [user.group(0)[3:-1]] if user else []
    secrets += [m.group(0)[len(m.group(1)):] for m in _QUERY_SECRETS.finditer(url)]
    for value in secrets:
        if len(value) >= 16:  # a real key or token: wherever it appears, glued to other characters too
            text = text.replace(value, "***")
        elif len(value) >= 4:  # a local server's short key ("test", "minioadmin"): as a whole token only
            text = re.sub(rf"(?<!\w){re.escape(value)}(?!\w)", "***", text)
    return text


def redacted(obj: Any) -> Any:
    """``obj`` (nested dicts, lists and tuples, as a config's container) with every string ``redact``-ed."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redacted(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redacted(v) for v in obj)
    return obj


def open_fs(url: str, quick: bool = False) -> tuple[Any, str]:
    """``(filesystem, path)`` of ``url`` through fsspec; ``quick``: few retries and short timeouts (a root's first
    read, so that an unreachable endpoint is said within seconds).

    Raises:
        RemoteError: the URL's protocol needs a package that is not installed (which one, and the extra).
    """
    import fsspec  # `cloud` extra (with s3fs; Hugging Face datasets brings it too)
    from fsspec.registry import known_implementations

    from fsspec.config import conf

    given = _SCHEME.match(url).group(1)  # type: ignore[union-attr]
    protocol = given.lower()
    if given != protocol:  # fsspec knows protocols in lowercase only
        raise RemoteError(f"{redact(url)}: write the scheme in lowercase: {redact(protocol + url[len(given):])}.")
    if protocol not in ("http", "https") and _USERINFO.search(url):  # fsspec reads "key:secret@bucket" as a bucket
        raise RemoteError(f"{redact(url)}: credentials in the URL are not read; give them the way the "
                          "store's own tools take them (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or "
                          "AWS_PROFILE) and the URL without them.")
    options: dict[str, Any] = {}
    attempts = 2 if quick else S3_ATTEMPTS
    if protocol in ("s3", "s3a"):  # fsspec's own config (FSSPEC_S3='{...}', ~/.config/fsspec/) wins over these
        user = conf.get(protocol, {})
        options = {**user, "config_kwargs": {"retries": {"max_attempts": attempts, "mode": "standard"},
                                             "connect_timeout": 3 if quick else 20, "read_timeout": 5 if quick else 20,
                                             **user.get("config_kwargs", {})}}
    try:
        # a filesystem of our own (fsspec would hand out one cached by its arguments alone, whatever the environment
        # says now); ShardCache keeps one per process
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    except (ImportError, ValueError) as err:
        known = known_implementations.get(protocol)
        if known is None:
            raise RemoteError(f"{redact(url)}: {protocol}:// is not a storage protocol fsspec knows; use s3://, gs://, "
                              "az://, abfs:// or https://, or a local path.") from None
        package = known["class"].split(".")[0]  # s3fs, gcsfs, adlfs, fsspec (HTTP: aiohttp)
        extra = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}.get(package, "cloud")
        raise RemoteError(f"{redact(url)}: reading {protocol}:// needs {package}: pip install 'cltrain[{extra}]' "
                          f"({' '.join(str(err).split())[:160]}).") from None
    if protocol in ("s3", "s3a"):
        # s3fs's own retries of a request (a class attribute, not an argument): none on top of botocore's attempts and
        # the cache's (nested, they made 144 attempts of a request to an endpoint that had gone: 518 s)
        fs.retries = 1
        if getattr(fs, "session", None) is None:  # not one the user's fsspec config handed in
            fs.session = _s3_session(fs.kwargs)
    return fs, path


_LOADERS: dict[Any, Any] = {}  # botocore's data path -> its loader, shared by the S3 sessions of the process


def _s3_session(kwargs: dict[str, Any]) -> Any:
    """The aiobotocore session s3fs would make from ``kwargs``, with the process's shared botocore loader: botocore's
    service models (megabytes of JSON) are parsed once per process, not once per filesystem (about 0.1 s of CPU
    each; a pack's manifest, its cache and each DataLoader worker that fetches open one), and forked workers inherit
    them parsed. Credentials and endpoints are still read by each session (the loader holds only botocore's data)."""
    from aiobotocore.session import AioSession
    from botocore.loaders import create_loader

    session = AioSession(**kwargs)
    data_path = session.get_config_variable("data_path")
    loader = _LOADERS.get(data_path)
    if loader is None:
        loader = _LOADERS.setdefault(data_path, create_loader(data_path))
    session.register_component("data_loader", loader)
    return session


def remote_error(err: BaseException, url: str, what: str = "", missing: str | None = None) -> RemoteError:
    """``err`` met while reading ``url`` as one line: the URL, what went wrong, and the fix.

    ``what`` says what was being read (``"the pack's manifest"``); ``missing`` what to do where it is not found (a
    dataset's own advice: how it is made and uploaded; ``None``: a pack's)."""
    if isinstance(err, RemoteError):
        return err
    shown = redact(url)
    reason = redact(" ".join(f"{type(err).__name__}: {err}".split()), url)[:240]
    reading = f" ({what})" if what else ""
    name = type(err).__name__
    text = str(err)
    timeout = "Timeout" in name or isinstance(err, TimeoutError)  # LitData's ChunkWaitTimeoutError: a FileNotFoundError
    endpoint_variable = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v)),
                             "AWS_ENDPOINT_URL")  # botocore's order
    if "Invalid endpoint" in text:
        return RemoteError(f"{shown}{reading}: the endpoint is not a URL ({reason}); write {endpoint_variable} with "
                           "its scheme: http://HOST:PORT or https://HOST.")
    if "ProfileNotFound" in name or "profile" in text and "could not be found" in text:
        return RemoteError(f"{shown}{reading}: {reason}; name a profile of ~/.aws/config or ~/.aws/credentials in "
                           "AWS_PROFILE, or unset it.")
    if "SSLError" in name or "SSL" in text and "record" in text.lower():
        return RemoteError(f"{shown}{reading}: the endpoint does not answer TLS ({reason}); an http:// server needs "
                           f"{endpoint_variable}=http://...")
    if not timeout and (isinstance(err, FileNotFoundError) or "NoSuchBucket" in text or "NoSuchKey" in text):
        fix = missing or ("check the bucket and prefix (e.g. `aws s3 ls` on it), or make a pack with "
                          "`cltrain-pack IMAGEFOLDER OUT` and upload OUT there as it is")
        return RemoteError(f"{shown}{reading}: not found ({reason}); {fix}.")
    if any(k in name for k in ("NoCredentials", "PartialCredentials", "DefaultCredentialsError",
                               "CredentialUnavailable")) or "Unable to locate credentials" in text:
        return RemoteError(f"{shown}{reading}: no credentials were found ({reason}); give them the way the store's own "
                           "tools take them (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE; for "
                           "GCS: GOOGLE_APPLICATION_CREDENTIALS; for Azure: AZURE_STORAGE_ACCOUNT_NAME and a key or "
                           "az login), or read a public pack through its https:// URL.")
    if isinstance(err, PermissionError) or any(k in text for k in ("AccessDenied", "InvalidAccessKeyId",
                                                                   "SignatureDoesNotMatch", "Forbidden")) \
            or re.search(r"(?<![\w.:'])403(?!\w)", text):  # the status, not a port (127.0.0.1:53403) or a number
        return RemoteError(f"{shown}{reading}: access denied ({reason}); check the credentials (for S3: "
                           "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and AWS_ENDPOINT_URL for "
                           "MinIO, R2 or Ceph) and that they may read this bucket.")
    if "EndpointConnectionError" in name or "Connect" in name or "Timeout" in name or isinstance(err, (ConnectionError,
                                                                                                       TimeoutError)):
        endpoint = redact(os.environ.get(endpoint_variable, "")) if url.startswith("s3") else ""
        at = f" at {endpoint}" if endpoint else ""
        return RemoteError(f"{shown}{reading}: the storage endpoint{at} cannot be reached ({reason}); check the "
                           f"network and the endpoint ({endpoint_variable} for an S3-compatible server).")
    return RemoteError(f"{shown}{reading}: cannot be read ({reason}).")
