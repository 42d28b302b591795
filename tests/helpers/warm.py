"""``run`` and ``Popen`` like :mod:`subprocess`'s for ``[sys.executable, ...]``, without paying for the imports.

Each call still starts its own process: a fork of a server (one per test process) that imported torch, torchvision,
Lightning, Hydra and cltrain once and has run nothing since. The child takes the call's working directory,
environment, standard streams, ``sys.argv`` and ``sys.path[0]``, a fresh ``__main__``, fresh ``random`` and numpy
seeds, and runs ``-m MODULE``, ``-c CODE`` or ``SCRIPT`` as Python would; its exit status, a signal included, is the
call's. Starting ``python`` costs about 9 s on a 2-core machine, nearly all of it importing Lightning; a fork costs
milliseconds. What Lightning decides at import (a console handler of its own where the root logger has none) is
decided at its logger's first record instead. ``lightning_ranks_forked`` and ``torchrun_workers_forked`` make the DDP
ranks a helper starts forks too.

A call goes to a real interpreter start instead (the same arguments to :mod:`subprocess`) when the test is about
what a start does (``fresh=True``), when its environment differs from the server's in a variable read at import
(thread counts, ISA limits, ``PYTHON*``, ``HF_*`` ...), when its first argument is not this interpreter or carries
interpreter options other than ``-u``, or when it passes an argument this module does not handle. ``WARM_LOG=FILE`` appends a line
naming the test and the variables for each call that a server could have taken but that started Python.
``file_size_limit=N`` sets ``RLIMIT_FSIZE`` in the child either way (SIGXFSZ ignored: a write past it fails with
EFBIG).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
PRELOAD = ("torch", "torchvision", "timm", "lightning", "hydra", "omegaconf", "cltrain", "cltrain.app.train",
           "cltrain.callback")
# read once, when Python, torch, oneDNN, OpenMP, CUDA or the Hugging Face libraries start: a change needs a real start
IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH", "PYTORCH_", "CUDA_",
               "NCCL_", "LD_", "MALLOC_", "HF_", "TRANSFORMERS_", "HUGGINGFACE_", "XDG_", "TMPDIR", "LC_", "LANG")
SOCKET = "CLTRAIN_TEST_WARM_SOCKET"  # in a forked child: the server's socket, for the processes it starts
NESTED = "CLTRAIN_TEST_WARM_NESTED"  # set by ``nested=True``: the child's own ``[sys.executable, ...]`` are forks too
_REAL_POPEN, _REAL_RUN = subprocess.Popen, subprocess.run  # what a call the server does not take goes to
_TMP = tempfile.gettempdir()  # the server's socket stays out of a $TMPDIR that a test sets and empties
_HANDLED = {"stdin", "stdout", "stderr", "capture_output", "text", "universal_newlines", "cwd", "env", "timeout",
            "check", "input", "start_new_session", "file_size_limit"}


# read at start too, and applied by the child as Python would have
APPLIED = ("PYTHONPATH", "PYTHONWARNINGS", "PYTHONUNBUFFERED", "TMPDIR")
# (prefixes) read when used, not at import, or by libraries the server has not loaded (Intel's OpenMP): libraries in
# the test process set them (torch's compile, Lightning's CUDA count, scikit-learn, OpenCV extends LD_LIBRARY_PATH for
# its own), and torch.distributed.run for each worker
LATE = ("TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_HOME", "KMP_DUPLICATE_LIB_OK",
        "KMP_INIT_AT_FORK", "LD_LIBRARY_PATH", "TORCHELASTIC_", "TORCH_NCCL_")


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in APPLIED and not k.startswith(LATE)}


class _Server:
    """The forking server this process talks to: started on first use and stopped at exit, or, in a process the
    server forked (a DDP rank 0 starting rank 1), the server that forked it."""

    lock = threading.Lock()
    instance: _Server | None = None
    env_at_start: dict[str, str] = {}  # in the server: its environment when it started

    def __init__(self, path: str | None = None) -> None:
        self.proc = None
        if path is not None:
            self.path = path
            self.env = json.loads(Path(path).with_name("env.json").read_text())
            self.ok = True
            return
        self.dir = tempfile.mkdtemp(prefix="cltrain-warm-", dir=_TMP)
        self.path = os.path.join(self.dir, "sock")
        # no GPU in the server, whichever test starts it: a fork of a process that has counted CUDA devices cannot use
        # CUDA; children given CUDA_VISIBLE_DEVICES="" (conftest's default) are served, others start Python
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        Path(self.dir, "env.json").write_text(json.dumps(self.env))
        self.proc = _REAL_POPEN([sys.executable, __file__, self.path], stdin=DEVNULL, stdout=PIPE, text=True,
                                     env=self.env)
        ready = self.proc.stdout.readline().strip()
        self.ok = ready == "ready"
        atexit.register(self.stop)

    def alive(self) -> bool:
        return os.path.exists(self.path) if self.proc is None else self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for name in ("sock", "env.json"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)

    @classmethod
    def get(cls) -> _Server | None:
        with cls.lock:
            if cls.instance is None or not cls.instance.alive():
                forked_by = os.environ.get(SOCKET)
                cls.instance = cls(forked_by) if forked_by and os.path.exists(forked_by) else cls()
            return cls.instance if cls.instance.ok else None


class _Stdio:
    """The child's three descriptors from subprocess-style arguments; the parent's ends of any pipes."""

    def __init__(self, stdin: Any, stdout: Any, stderr: Any, text: bool) -> None:
        self.child: list[int] = []
        self.to_close: list[int] = []
        self.parent: list[Any] = [None, None, None]
        for i, spec in enumerate((stdin, stdout, stderr)):
            if spec is None:
                fd = i
            elif spec == PIPE:
                r, w = os.pipe()
                mine, fd = (w, r) if i == 0 else (r, w)
                mode = ("w" if i == 0 else "r") + ("" if text else "b")
                self.parent[i] = open(mine, mode, encoding="utf-8" if text else None)
                self.to_close.append(fd)
            elif spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                self.to_close.append(fd)
            elif spec == STDOUT and i == 2:
                fd = self.child[1]
            elif isinstance(spec, int):
                fd = spec
            else:
                fd = spec.fileno()
            self.child.append(fd)

    def close_child_ends(self) -> None:
        for fd in self.to_close:
            os.close(fd)


class WarmPopen:
    """The subset of :class:`subprocess.Popen` the tests use, for a process forked by the server."""

    def __init__(self, server: _Server, args: list[str], stdin: Any = None, stdout: Any = None, stderr: Any = None,
                 text: bool = False, cwd: Any = None, env: dict[str, str] | None = None,
                 start_new_session: bool = False, file_size_limit: int | None = None) -> None:
        self.args, self.returncode = args, None
        stdio = _Stdio(stdin, stdout, stderr, text)
        self.stdin, self.stdout, self.stderr = stdio.parent
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(server.path)
        unbuffered = str(args[1]) == "-u"
        request = {"argv": [str(a) for a in args[1 + unbuffered:]], "unbuffered": unbuffered, "cwd": os.path.abspath(cwd if cwd is not None else "."),
                   "env": dict(os.environ if env is None else env), "new_session": start_new_session,
                   "file_size_limit": file_size_limit, "socket": server.path}
        socket.send_fds(self._sock, [json.dumps(request).encode()], stdio.child)
        stdio.close_child_ends()
        self.pid = int(self._sock.recv(64).decode())

    def poll(self) -> int | None:
        if self.returncode is None:
            self._sock.setblocking(False)
            try:
                data = self._sock.recv(64)
            except BlockingIOError:
                self._sock.setblocking(True)
                return None
            self._status(data)
        return self.returncode

    def _status(self, data: bytes) -> None:
        self.returncode = int(data.decode()) if data else -signal.SIGKILL  # no answer: the server died with it
        self._sock.close()

    def wait(self, timeout: float | None = None) -> int:
        timeout = None if timeout is None or timeout == float("inf") else timeout  # subprocess takes inf too
        if self.returncode is None:
            self._sock.settimeout(timeout)
            try:
                self._status(self._sock.recv(64))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out: dict[int, Any] = {}

        def read(i: int, stream: Any) -> None:
            out[i] = stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(i, s), daemon=True)
                   for i, s in ((1, self.stdout), (2, self.stderr)) if s is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out.get(1), out.get(2)

    def __enter__(self) -> WarmPopen:
        return self

    def __exit__(self, *exc: Any) -> None:
        for s in (self.stdout, self.stderr, self.stdin):
            if s is not None and not s.closed:
                s.close()
        self.wait()


def _server_for(args: Any, kwargs: dict[str, Any], fresh: bool) -> _Server | None:
    if fresh or set(kwargs) - _HANDLED or not isinstance(args, (list, tuple)) or len(args) < 2:
        return None
    first = 2 if str(args[1]) == "-u" else 1  # -u: unbuffered streams, as torch.distributed.run starts its workers
    if str(args[0]) != sys.executable or len(args) <= first:
        return None
    if str(args[first]).startswith("-") and str(args[first]) not in ("-m", "-c"):
        return None
    server = _Server.get()
    env = os.environ if kwargs.get("env") is None else kwargs["env"]
    if server is None or _import_time(dict(env)) != _import_time(server.env):
        if os.environ.get("WARM_LOG"):
            mine, its = _import_time(dict(env)), _import_time(server.env) if server else {}
            why = {k: mine.get(k) for k in set(mine) | set(its) if mine.get(k) != its.get(k)} if server else "no server"
            with open(os.environ["WARM_LOG"], "a") as log:
                log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: a real start: {why}\n")
        return None
    return server


def Popen(args: Any, fresh: bool = False, nested: bool = False, **kwargs: Any) -> Any:  # noqa: N802 - subprocess's name
    kwargs = _nested(kwargs) if nested else kwargs
    server = _server_for(args, {k: v for k, v in kwargs.items() if k != "capture_output"}, fresh)
    if server is None:
        return _REAL_POPEN(args, **_started(kwargs))
    text = bool(kwargs.pop("text", False) or kwargs.pop("universal_newlines", False))
    return WarmPopen(server, list(args), text=text, **kwargs)


def run(args: Any, fresh: bool = False, nested: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`, forked from the server where it can be (module docstring); ``nested=True``: the
    ``[sys.executable, ...]`` processes the child starts through :mod:`subprocess` are forks of the server too (a
    script that runs each case in a process of its own)."""
    kwargs = _nested(kwargs) if nested else kwargs
    server = _server_for(args, kwargs, fresh)
    if server is None:
        return _REAL_RUN(args, **_started(kwargs))
    timeout, check, given = kwargs.pop("timeout", None), kwargs.pop("check", False), kwargs.pop("input", None)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = PIPE
    if given is not None:
        kwargs["stdin"] = PIPE
    with WarmPopen(server, list(args), text=bool(kwargs.pop("text", False) or kwargs.pop("universal_newlines", False)),
                   **kwargs) as proc:
        try:
            out, err = proc.communicate(given, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process it started (a DDP run's ranks, their loader workers): left alive, they keep
    the child's output open and its status never comes, so a timed-out run would hang the test past its timeout."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _limit_file_size(limit: int) -> None:
    """``RLIMIT_FSIZE`` at ``limit`` bytes, with SIGXFSZ ignored: a write past it fails with EFBIG instead of killing."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _started(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for :mod:`subprocess`: ``file_size_limit`` applied in the child before it starts Python."""
    limit = kwargs.get("file_size_limit")
    rest = {k: v for k, v in kwargs.items() if k != "file_size_limit"}
    return rest if limit is None else {**rest, "preexec_fn": lambda: _limit_file_size(limit)}


def _nested(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**kwargs, "env": {**(os.environ if kwargs.get("env") is None else kwargs["env"]), NESTED: "1"}}


def _subprocess_forked() -> None:
    """In a child started with ``nested=True``: :mod:`subprocess`'s ``Popen`` (so ``run``, ``call`` ...) takes the
    calls the server can take and passes the others on."""
    subprocess.Popen = Popen  # type: ignore[misc] - a function where a class was: called only, in this child


def lightning_ranks_forked() -> None:
    """Lightning's DDP launcher starts ranks above 0 with :func:`Popen` (forks of the server) when this process is one
    the server forked; elsewhere it keeps starting Python. Each rank is still its own process, its own gloo peer."""
    if os.environ.get(SOCKET):
        from lightning.fabric.strategies.launchers import subprocess_script

        subprocess_script.subprocess = forking_subprocess


def torchrun_workers_forked() -> None:
    """``torch.distributed.run`` (imported after this) starts its workers with :func:`Popen` when this process is one
    the server forked."""
    if os.environ.get(SOCKET):
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        subprocess_handler.Popen = Popen


class _ForkingSubprocess:
    """:mod:`subprocess` with :func:`Popen` and :func:`run` from here: put in place of a module's ``subprocess``
    (``monkeypatch.setattr(module, "subprocess", warm.forking_subprocess)``), its Python processes are forks."""

    def __getattr__(self, name: str) -> Any:
        return {"Popen": Popen, "run": run}.get(name) or getattr(subprocess, name)


forking_subprocess = _ForkingSubprocess()


# ---- the server -------------------------------------------------------------------------------------------------


def _serve(path: str) -> tuple[dict, list[int]]:
    """Answer requests until one is forked: returns in the child only, with its request and descriptors."""
    import selectors

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.02):
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                return json.loads(data), fds
            for fd in fds:
                os.close(fd)
            conn.sendall(str(pid).encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass
                conn.close()


class _LightningConsole(logging.Handler):
    """What ``import lightning.pytorch`` (and ``.fabric``) decides, decided at the logger's first record instead of
    in the server: a console handler of its own when the root logger has none (Hydra's apps configure the root
    first and then import Lightning), else the records go on to the root's."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(self.name)
        logger.removeHandler(self)
        if not logging.getLogger().hasHandlers():
            own = logging.StreamHandler()
            logger.addHandler(own)
            logger.propagate = False
            own.handle(record)


def _defer_lightning_console() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True
        deferred = _LightningConsole()
        deferred.name = name
        logger.addHandler(deferred)


def _repoint_handlers(streams: dict) -> None:
    """Handlers made in the server (``lightning``'s console) write to this child's streams."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and handler.stream in streams:
                handler.setStream(streams[handler.stream])


def _apply_start_variables(env: dict[str, str], server_env: dict[str, str]) -> None:
    """``PYTHONPATH`` and ``PYTHONWARNINGS`` where they differ from the server's: the paths after ``sys.path[0]``, the
    filters in front of the others, as a start of Python puts them."""
    import warnings

    if env.get("PYTHONPATH", "") != server_env.get("PYTHONPATH", ""):
        extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
    if env.get("PYTHONWARNINGS", "") != server_env.get("PYTHONWARNINGS", ""):
        options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
        sys.warnoptions[:] = options
        warnings._processoptions(options)  # type: ignore[attr-defined] - what Python's start calls


def _exit_code(request: dict, fds: list[int]) -> int:
    """Run the request as ``_become`` does and end as Python's shutdown would, short of freeing every object (which
    in a fork copies most of the server's memory, about 2 s): threads joined, ``atexit`` (logging, temporary
    directories, ``weakref.finalize``) run, streams flushed; an uncaught exception printed with exit status 1."""
    import atexit

    code = 0
    try:
        _become(request, fds)
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined] - what Python's shutdown calls
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # Python ends an uninterrupted KeyboardInterrupt by SIGINT, as here
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def _become(request: dict, fds: list[int]) -> None:
    """Turn this forked child into ``python ARGV`` started in the request's directory and environment."""
    import io
    import random
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["new_session"]:
        os.setsid()
    if request.get("file_size_limit") is not None:
        _limit_file_size(request["file_size_limit"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[SOCKET] = request["socket"]
    if os.environ.get(NESTED):
        _subprocess_forked()
    old = sys.stdout, sys.stderr
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   line_buffering=True, errors="backslashreplace",
                                                   write_through=unbuffered)
    _repoint_handlers(dict(zip(old, (sys.stdout, sys.stderr))))
    _apply_start_variables(request["env"], _Server.env_at_start)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    argv = request["argv"]
    if argv[0] == "-m":
        import runpy

        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what ``python -m`` calls
        return
    if argv[0] == "-c":
        sys.argv, sys.path[0], name, source = ["-c", *argv[2:]], "", "<string>", argv[1]
    else:
        script = os.path.abspath(argv[0])
        sys.argv, sys.path[0], name, source = argv, os.path.dirname(script), argv[0], Path(script).read_text()
        main.__file__ = argv[0]
    main.__dict__["__builtins__"] = __builtins__
    exec(compile(source, name, "exec"), main.__dict__)


if __name__ == "__main__":
    import importlib

    _Server.env_at_start = dict(os.environ)
    for module in PRELOAD:
        importlib.import_module(module)
    if logging.getLogger().hasHandlers():  # the deferred decision below assumes Lightning saw none
        print("root handlers", flush=True)
        sys.exit(0)
    _defer_lightning_console()
    if threading.active_count() != 1:  # a fork copies no other thread: refuse, callers start Python instead
        print("threads", flush=True)
        sys.exit(0)
    request, fds = _serve(sys.argv[1])
    os._exit(_exit_code(request, fds))
