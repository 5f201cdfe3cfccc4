"""A pool of processes that form one torch.distributed group, for the context-parallel tests.

Starting processes and importing torch costs seconds, so a pool starts once per world size (a module-scoped
fixture) and runs many cases: each case is a function of ``distributed_cases`` that every rank runs with the
same arguments; the pool returns the R results, or for each rank the exception it raised. A case that does not
finish within the timeout fails the test and tears the pool down (the next test starts a fresh one).
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback

import multiprocessing as mp

CASE_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 60


class RankError:
    """What a rank raised: the class names of the exception's type and bases, and its message."""

    def __init__(self, exc: BaseException):
        self.classes = [cls.__name__ for cls in type(exc).__mro__]
        self.message = str(exc)
        self.traceback = "".join(traceback.format_exception(exc))

    def __repr__(self):
        return f"RankError({self.classes[0]}: {self.message})"


def _worker(rank: int, world_size: int, backend: str, store_path: str, tasks, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    import distributed_cases

    while True:
        task = tasks.get()
        if task is None:
            break
        name, kwargs = task
        try:
            value = getattr(distributed_cases, name)(rank, world_size, **kwargs)
        except BaseException as exc:  # reported to the test, which decides
            value = RankError(exc)
        results.put((rank, value))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size, self.backend = world_size, backend
        self._start()

    def _start(self):
        world_size, backend = self.world_size, self.backend
        self._dir = tempfile.TemporaryDirectory()
        # forkserver: one server process imports torch and sparseattn (the preload), then forks the ranks from it,
        # which is much faster than importing them in every rank; forking the test process itself is not safe once
        # torch has run its thread pools.
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["distributed_cases"])
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        store_path = os.path.join(self._dir.name, "store")
        self._procs = [context.Process(target=_worker, args=(rank, world_size, backend, store_path,
                                                             self._tasks[rank], self._results), daemon=True)
                       for rank in range(world_size)]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, name: str, **kwargs) -> list:
        """Runs case `name` on every rank; the results (or RankErrors) in rank order. A pool that a crash or a
        hang broke starts afresh."""
        if self.broken:
            self._start()
        for tasks in self._tasks:
            tasks.put((name, kwargs))
        out = [None] * self.world_size
        waited = 0.0
        for _ in range(self.world_size):
            while True:
                try:
                    rank, value = self._results.get(timeout=1.0)
                    break
                except queue.Empty:
                    waited += 1.0
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or waited >= CASE_TIMEOUT_S:
                        self.broken = True
                        self.close()
                        why = f"ranks {dead} exited" if dead else f"not every rank finished within {CASE_TIMEOUT_S} s"
                        raise RuntimeError(f"case {name}: {why} (a crash or a hang)") from None
            out[rank] = value
        if any(isinstance(v, RankError) and "SparseAttnError" not in v.classes and "RuntimeError" in v.classes
               for v in out):
            self.broken = True  # a collective failed (e.g. timed out): the group is unusable
            self.close()
        return out

    def close(self):
        self.broken = True
        for tasks in self._tasks:
            try:
                tasks.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._dir.cleanup()


def values(results: list) -> list:
    """The results, failing with the ranks' tracebacks if any rank raised."""
    errors = [(r, v) for r, v in enumerate(results) if isinstance(v, RankError)]
    if errors:
        raise AssertionError("\n".join(f"rank {r} raised:\n{v.traceback}" for r, v in errors))
    return results
