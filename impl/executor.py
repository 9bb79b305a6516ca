"""Driver side of TP: one worker process per rank (forked from a server that has imported torch), each
holding a ``ModelRunner``.

The driver sends every rank the same ``(method, args)`` over a pipe and waits for all answers with a
deadline. A rank that dies, hangs past the deadline or fails while its peers are stuck in a collective
gets the whole group torn down and an error naming the rank; workers also die with the driver
(``PR_SET_PDEATHSIG``), so nothing is left orphaned. Workers are reused across calls.

Under ``torchrun`` (``WORLD_SIZE`` set) ``LocalExecutor`` runs this process's rank in-process instead."""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

from impl.distributed import close_tp, init_tp
from impl.env import env_number

RUNNER = "impl.model_runner:ModelRunner"  # what ``_load`` builds in each rank, unless an executor names another


class _Packed:
    """A result whose tensors travel as one flat byte tensor (``pack``)."""

    def __init__(self, tree, flat):
        self.tree, self.flat = tree, flat


class _TensorAt:
    def __init__(self, offset: int, nbytes: int, dtype, shape):
        self.offset, self.nbytes, self.dtype, self.shape = offset, nbytes, dtype, shape


def on_host(tree):
    """``tree`` (dicts, lists, tuples) with every tensor on another device (a GPU's) copied to the host; the rest as
    is. What crosses a rank's pipe, either way, is on the host (``Executor.call``'s arguments, a rank's results): a
    CUDA tensor pickled into a pipe would travel as a CUDA IPC handle, opened by a process that may hold no CUDA
    context and that the receiver must not outlive. Each side moves what it receives to its own device."""
    import torch
    if isinstance(tree, torch.Tensor):
        return tree if tree.device.type == "cpu" else tree.detach().to("cpu")
    if isinstance(tree, dict):
        return {k: on_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(on_host(v) for v in tree)
    return tree


def pack(result):
    """``result`` with every tensor (in dicts, lists, tuples) moved into one flat uint8 tensor. A pipe sends a
    CPU tensor through shared memory with a socket handshake per tensor (torch.multiprocessing's file-descriptor
    sharing): a step's ~30 captured points cost ~0.3 ms each that way, one buffer costs one handshake."""
    import torch
    parts: list = []
    size = 0

    def walk(x):
        nonlocal size
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.requires_grad:
            b = x.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -b.numel() % 16  # each tensor starts 16-byte aligned: ``view(dtype)`` needs its offset aligned
            parts.extend([b, torch.zeros(pad, dtype=torch.uint8)] if pad else [b])
            ref = _TensorAt(size, b.numel(), x.dtype, tuple(x.shape))
            size += b.numel() + pad
            return ref
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x

    tree = walk(result)
    if size == 0 or len(parts) < 2:  # nothing to gain: the pipe's own sharing is one handshake already
        return result
    # written straight into shared memory: ``torch.cat`` and the pipe's ``share_memory_`` would copy twice
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # torch's own; not a public API
    if new_shared is None:
        return _Packed(tree, torch.cat(parts))
    flat = torch.empty(0, dtype=torch.uint8).set_(new_shared(size))
    offset = 0
    for b in parts:
        flat[offset:offset + b.numel()].copy_(b)
        offset += b.numel()
    return _Packed(tree, flat)


def unpack(value):
    """The inverse of ``pack``: tensors are views into the one received buffer."""
    if not isinstance(value, _Packed):
        return value
    flat = value.flat

    def walk(x):
        if isinstance(x, _TensorAt):
            return flat[x.offset:x.offset + x.nbytes].view(x.dtype).reshape(x.shape)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x
    return walk(value.tree)


class RankError(RuntimeError):
    """A TP rank died, hung or failed; ``rank`` names it."""

    def __init__(self, rank: int | list[int], message: str):
        super().__init__(message)
        self.rank = rank


def _die_with_parent(driver_pid: int) -> None:
    """SIGKILL this rank when its parent dies: the driver (spawn), or the fork server, which exits as soon as
    the driver is gone (its alive pipe reaches EOF)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    try:  # the driver died before prctl took effect
        os.kill(driver_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


def start_context():
    """The multiprocessing context ranks start from. A fork server that has imported torch and impl once
    forks each rank ready to run (~0.1 s) where a spawned rank imports torch afresh (~1.5 s of CPU each); the
    server holds no threads or state of the driver; its environment variables and ``sys.path`` are the
    driver's when it started (``start_fork_server``, or the first rank of the process). ``spawn`` where
    there is no fork server (not POSIX)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["impl.model_runner"])
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, without waiting: it imports torch and impl while this process goes on
    (loading a reference model, say), so the first rank need not wait for it."""
    if start_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver
        forkserver.ensure_running()


def rank_name(rank: int, world: int, pp_size: int = 1, tp_word: bool = False) -> str:
    """How a message names global rank ``rank``: "rank r" ("TP rank r" with ``tp_word``) in one stage; with
    pipeline stages also its stage and its rank in the stage, "rank 3 (stage 1, TP rank 1 of 2)", so a death at
    pp > 1 says where it happened."""
    own = f"{'TP ' if tp_word else ''}rank {rank}"
    if pp_size == 1:
        return own
    tp = world // pp_size
    return f"rank {rank} (stage {rank // tp}, TP rank {rank % tp} of {tp})"


def _error_reply(rank: int, exc: BaseException, world: int = 1, pp_size: int = 1) -> tuple:
    return ("err", exc, f"{rank_name(rank, world, pp_size)}: {type(exc).__name__}: {exc}", traceback.format_exc())


def runner_class(path: str) -> type:
    """The rank-side class a ``"module:Class"`` path names (imported in the rank)."""
    import importlib
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(rank: int, world: int, store: str, conn, device: str, parent_pid: int, timeout_s: float,
                 runner_path: str = RUNNER, pp_size: int = 1):
    # Ctrl-C in a terminal reaches the whole process group: the driver reports it once and closes the ranks
    # (or they die with it), so a rank ignores SIGINT rather than printing its own KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    try:
        init_tp(rank, world, store, timeout_s=timeout_s, device=device, pp_size=pp_size)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(_error_reply(rank, e, world, pp_size))
        return
    runner = None
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # driver gone
        if method == "_close":
            break
        try:
            if method == "_load":  # (re)build the runner on another checkpoint; the process stays
                runner = None
                runner = runner_class(runner_path)(*args, **kwargs)
                conn.send(("ok", None))
            else:
                conn.send(("ok", pack(on_host(getattr(runner, method)(*args, **kwargs)))))
        except BaseException as e:  # noqa: BLE001
            try:
                conn.send(_error_reply(rank, e, world, pp_size))
            except Exception:  # unpicklable exception: send its text only
                conn.send(("err", None, f"{rank_name(rank, world, pp_size)}: {type(e).__name__}: {e}",
                           traceback.format_exc()))
    close_tp()


@contextlib.contextmanager
def _main_not_reimported():
    """Spawned children re-run the parent's ``__main__`` (by path, or by module name under ``python -m``)
    before unpickling their target; a user script that builds an ``LLM`` at module level without
    ``if __name__ == "__main__":`` would then start ranks from inside ranks. The workers need nothing from
    ``__main__`` (their target is ``_worker_main`` in this module), so hide it while they start."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _death(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Executor:
    """``runner``: the ``"module:Class"`` each rank builds on ``call("_load", ...)`` (impl's ``ModelRunner``;
    tpcheck's Hugging Face TP ranks use the same process management with their own class).
    ``pp_size``: pipeline stages of ``tp_size`` ranks each (``impl.pipeline``); ``pp_size * tp_size`` ranks in
    all, results listed by global rank ``stage * tp_size + tp_rank``."""

    def __init__(self, tp_size: int, device: str = "cpu", timeout_s: float = 300.0, init_timeout_s: float = 120.0,
                 runner: str = RUNNER, pp_size: int = 1):
        self.tp_size, self.pp_size, self.timeout_s = tp_size, pp_size, timeout_s
        self.world_size = world = tp_size * pp_size
        self._tmp = tempfile.mkdtemp(prefix="impl-tp-")
        ctx = start_context()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True, name=f"impl-rank{rank}",
                            args=(rank, world, os.path.join(self._tmp, "store"), child, device,
                                  os.getpid(), timeout_s, runner, pp_size))
            try:
                with _main_not_reimported():
                    p.start()
            except (OSError, EOFError) as e:  # the fork server (or the interpreter it runs) died at start
                child.close()
                parent.close()
                self.shutdown(force=True)
                raise RankError(rank, f"{self._who(rank)} died before it started ({type(e).__name__}: {e})") from e
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(init_timeout_s)

    @property
    def closed(self) -> bool:
        return not self.procs

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``runner.method(*args, **kwargs)`` on every rank; returns the per-rank results."""
        if self.closed:
            raise RuntimeError("the TP workers are stopped (closed, or torn down after a rank failed)")
        args, kwargs = on_host(args), on_host(kwargs)  # a golden on a GPU hands its tensors over on the host
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args, kwargs))
            except OSError:  # BrokenPipeError: the rank is gone; name it rather than the pipe
                self._raise_dead(rank)
        return self._collect(timeout_s or self.timeout_s)

    def _who(self, rank: int) -> str:
        return rank_name(rank, self.world_size, self.pp_size, tp_word=True)

    def _raise_dead(self, rank: int):
        self.procs[rank].join(timeout=5)
        how = _death(self.procs[rank])
        self.shutdown(force=True)
        raise RankError(rank, f"{self._who(rank)} died ({how})") from None

    def _collect(self, timeout_s: float) -> list:
        results: list = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        failure = None
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            waiting = list(pending.values()) + [self.procs[r].sentinel for r in pending]
            ready = wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready or conn.poll():
                    try:
                        status, value, *info = conn.recv()
                    except (EOFError, OSError):  # the pipe closed: the rank is gone
                        self._raise_dead(rank)
                    del pending[rank]
                    results[rank] = unpack(value) if status == "ok" else value
                    if status == "err" and failure is None:
                        failure = (rank, value, info)
                        deadline = min(deadline, time.monotonic() + 10.0)  # peers may be stuck in a collective
                elif self.procs[rank].sentinel in ready:
                    self._raise_dead(rank)
        if failure is not None:
            rank, exc, (text, tb) = failure
            if pending:
                self.shutdown(force=True)
            if isinstance(exc, Exception):
                exc.args = (text,) + tuple(exc.args[1:])
                exc.rank, exc.rank_traceback = rank, tb
                raise exc
            raise RankError(rank, f"{text}\n{tb}")
        if pending:
            ranks = sorted(pending)
            self.shutdown(force=True)
            who = f"TP rank(s) {ranks}" if self.pp_size == 1 else ", ".join(map(self._who, ranks))
            raise RankError(ranks, f"{who} gave no answer within {timeout_s:.0f}s; workers stopped")
        return results

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker; with ``force`` kill them at once (a rank may be stuck in a collective)."""
        if not self.procs:
            return
        if not force:
            for conn in self.conns:
                try:
                    conn.send(("_close", (), {}))
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self._tmp, ignore_errors=True)


class LocalExecutor:
    """This process is one rank of a group launched by torchrun (``env://``); calls run in-process."""

    def __init__(self, tp_size: int, device: str = "cpu", timeout_s: float = 300.0, runner: str = RUNNER,
                 pp_size: int = 1, **_):
        if pp_size != 1:  # the driver here is every rank at once: a stage's ranks would each sample alone
            raise ValueError(f"pp_size={pp_size}: pipeline parallelism runs in impl's own worker processes, not "
                             "under torchrun (run without torchrun)")
        world = env_number("WORLD_SIZE", integer=True, minimum=1)
        if world != tp_size:
            raise ValueError(f"tp_size={tp_size} but torchrun started WORLD_SIZE={world} processes")
        init_tp(env_number("RANK", integer=True), world, None, timeout_s=timeout_s, device=device)
        self.tp_size, self.closed, self.runner, self.runner_path = tp_size, False, None, runner
        self.pp_size, self.world_size = 1, tp_size

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        if method == "_load":
            self.runner = runner_class(self.runner_path)(*args, **kwargs)
            return [None]
        return [getattr(self.runner, method)(*args, **kwargs)]

    def shutdown(self, force: bool = False) -> None:
        if not self.closed:
            close_tp()
            self.closed = True
