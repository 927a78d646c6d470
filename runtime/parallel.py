"""Tensor parallelism across the devices of one host (Megatron-LM's layout: Shoeybi et al. 2019, section 3).

``Engine(model, tensor_parallel_size=N)`` runs N processes: the caller's (rank 0: the engine, its scheduler,
adapter cache, sampling and outputs) and N - 1 workers it spawns (ranks 1 .. N - 1: a model shard, a KV-cache
shard and an adapter-pool shard each). ``torch.distributed`` connects them: NCCL for the activations on CUDA
(rank r on ``cuda:r``), gloo on the CPU, and always a gloo group for the per-step messages.

What each rank holds (``runtime.sharding``: ``tp_rank_config``, ``shard_weights``, ``shard_lora``):

- q/k/v and gate/up are column-parallel: rank r keeps the rows of heads ``[r H / N, (r + 1) H / N)`` (and their KV
  heads: ``KV / N`` of them, or, when ``KV < N``, the one KV head its query heads share, replicated on ``N / KV``
  ranks) and rows ``[r I / N, (r + 1) I / N)`` of gate and up (biases likewise).
- o and down are row-parallel: rank r keeps the matching input columns; each rank's output is a partial sum and
  one all-reduce per projection (two per layer) adds them. o's bias is added by rank 0 only.
- Embeddings, norms, q/k norms and the LM head are replicated (rank 0 alone computes logits and samples).
- A LoRA adapter is sharded as its base weight: column-parallel modules keep A [r, d_in] whole and B's rows of
  the rank's outputs; row-parallel modules keep A's columns of the rank's inputs and B whole. A row-parallel
  module's shrink then gives a partial ``x_r A_r^T``; since ``(sum_r x_r A_r^T) B^T = sum_r (x_r A_r^T) B^T`` each
  rank expands its own partial with the whole B into its partial output, and the projection's existing
  all-reduce sums base and LoRA together: no extra collective, no kernel change.

Every rank's shard has the same shape, so each rank's pool and KV cache are those of one model of
``tp_rank_config``'s shape; rank 0 sizes them (its memory plan, with ``local_ranks = N``) and the workers take the
same sizes. Scheduling, adapter residency and sampling are decided by rank 0 and sent to the workers each step
(``TensorParallel.step``): the step's token ids, positions, block tables and slots, whether it replays a CUDA
graph, and the pool's slot map; a worker frees and loads slots until its pool holds the same adapters in the same
slots (bit-identical shards of the same files), then runs the same forward, so the collectives pair up. Workers
keep every loaded adapter's shard in host memory (read when ``load_adapter`` is called; a worker that cannot read
it makes that adapter's requests fail, as a file that changed on disk does on rank 0).

Failures: a worker that raises reports its traceback and exits; a worker that dies (killed, out of memory) closes
its sockets. Either way the collective rank 0 is in fails, the step's requests finish with an error naming the
worker, and the engine refuses further work (``TensorParallelError``). Workers exit when rank 0's process does
(they watch their parent), so no orphans are left; ``Engine.close()`` stops them explicitly.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

from multilora.config import ModelConfig
from multilora.runtime.sharding import check_tp_size, shard_weights, tp_rank_config

log = logging.getLogger("multilora")

#: seconds a collective may wait before it fails (a worker stuck, not dead); env MULTILORA_TP_TIMEOUT_S overrides
DEFAULT_TIMEOUT_S = 600


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed or exited; the engine cannot run further steps."""


# ----------------------------------------------------------------------------------- process group
class TPGroup:
    """The activations' collective of one rank (what ``DecoderModel`` calls after o and down)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place."""
        import torch.distributed as dist

        dist.all_reduce(t)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("MULTILORA_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


def _device_of(rank: int, device: torch.device) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _init_group(rank: int, size: int, init_method: str, device: torch.device):
    """The default process group (NCCL on CUDA, else gloo) and a gloo group for messages."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=_timeout(), **kw)
    return dist.new_group(backend="gloo", timeout=_timeout()) if backend != "gloo" else dist.group.WORLD


# ---------------------------------------------------------------------------------------- rank 0
class TensorParallel:
    """Rank 0's side: the workers, their start and stop, and the per-step messages (module docstring).

    Usage (by ``Engine``): ``tp = TensorParallel(size, model, cfg, device)`` (spawns, returns at once);
    ``tp.wait_loaded()``, ``tp.connect()`` after rank 0 loaded its own shard; ``tp.configure(...)`` with the
    sizes; then each step ``tp.sync_adapters()`` (before scheduling) and ``tp.step(...)`` (from the runner);
    ``tp.close()`` at the end.
    """

    def __init__(self, size: int, model: Any, cfg: Any, device: torch.device) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("Engine(tensor_parallel_size > 1): torch.distributed is already initialised in this "
                               "process (another tensor-parallel engine is open: close() it first)")
        self.size, self.device = size, device
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.dead: str | None = None
        self._excepthooks: tuple | None = None  # (before connect(), torch's wrapper after it)
        self._closed = self._connected = False
        self._pending: list[tuple] = []  # adapter messages for the next sync
        self._slot_map: dict[int, tuple[str, int]] = {}
        self._sent_map: dict[int, tuple[str, int]] | None = None
        self._ctrl = None
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        worker_cfg = dataclasses.replace(cfg, progress=False, memory_snapshot=None)
        for r in range(1, size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(r, size, self.init_method, model, worker_cfg, str(device), child),
                            name=f"multilora-tp{r}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        log.info("tensor parallel: %d worker process(es) started (pids %s)", size - 1, [p.pid for p in self.procs])

    # ------------------------------------------------------------------ start
    def _recv(self, i: int, what: str, timeout: float) -> Any:
        conn, proc = self.conns[i], self.procs[i]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise TensorParallelError(f"tensor-parallel worker {i + 1} (pid {proc.pid}) exited with code "
                                          f"{proc.exitcode} while {what}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker {i + 1} did not answer within {timeout:.0f} s "
                                          f"while {what}")
        try:
            msg = conn.recv()
        except EOFError:  # it exited without a word: e.g. a script without ``if __name__ == "__main__":``
            proc.join(timeout=5.0)
            raise TensorParallelError(
                f"tensor-parallel worker {i + 1} (pid {proc.pid}) exited with code {proc.exitcode} while {what} (workers "
                f"are started with 'spawn': a script that builds the Engine needs an `if __name__ == \"__main__\":` "
                f"guard)") from None
        if msg[0] == "error":
            raise TensorParallelError(f"tensor-parallel worker {i + 1} failed while {what}: {msg[1]}")
        return msg

    def wait_loaded(self) -> None:
        for i in range(len(self.procs)):
            self._recv(i, "loading the model", _timeout().total_seconds())

    def connect(self) -> None:
        before = sys.excepthook  # init_process_group wraps it ("[rank0]: " on every traceback line)
        self._connected = True  # (from here the process's default group is ours: __init__ refused another's)
        self._ctrl = _init_group(0, self.size, self.init_method, _device_of(0, self.device))
        self._excepthooks = (before, sys.excepthook)  # (ours, torch's wrapper): close() puts ours back

    def _bcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        if self.dead:
            raise TensorParallelError(self.dead)
        try:
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=self._ctrl)
            return box[0]
        except Exception as e:
            raise self._failed(e) from e

    def _gather(self) -> list[Any]:
        import torch.distributed as dist

        try:
            out: list[Any] = [None] * self.size
            dist.gather_object(None, out, dst=0, group=self._ctrl)
            return out[1:]
        except Exception as e:
            raise self._failed(e) from e

    def _failed(self, e: BaseException) -> TensorParallelError:
        """The error to raise after a collective failed: the workers' own reports if any, else their exit codes."""
        time.sleep(0.2)  # a worker that raised is writing its report
        why = []
        for i, (conn, p) in enumerate(zip(self.conns, self.procs)):
            try:
                if conn.poll(0.5):
                    msg = conn.recv()
                    if msg[0] == "error":
                        why.append(f"worker {i + 1} failed: {msg[1]}")
                        continue
            except (EOFError, OSError):
                pass
            p.join(timeout=2.0)
            if not p.is_alive():
                why.append(f"worker {i + 1} (pid {p.pid}) exited with code {p.exitcode}")
        self.dead = "tensor-parallel engine stopped: " + ("; ".join(why) or f"{type(e).__name__}: {e}")
        log.error("%s", self.dead)
        return TensorParallelError(self.dead)

    def configure(self, **sizes: Any) -> None:
        """Send the sizes rank 0's memory plan chose (the workers build their KV cache, pool and runner)."""
        self._bcast(("configure", sizes))
        self._check(self._gather(), "building its KV cache and adapter pool")

    def profile(self, tokens: int, block_size: int, max_seq_len: int) -> None:
        """Let the workers run the memory plan's profiling forward together with rank 0 (CUDA): its all-reduces
        pair up with rank 0's."""
        self._bcast(("profile", tokens, block_size, max_seq_len))

    def _check(self, statuses: list[Any], what: str) -> None:
        bad = [f"worker {i + 1}: {s}" for i, s in enumerate(statuses) if s is not None]
        if bad:
            raise TensorParallelError(f"tensor-parallel workers failed while {what}: " + "; ".join(bad))

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, handle: Any) -> None:
        self._pending.append(("add", (handle.name, handle.version), str(handle.path), handle.allow_pickle,
                              handle.fingerprint))

    def sync_adapters(self) -> dict[tuple[str, int], str]:
        """Send the adapter loads and unloads since the last step; return the keys a worker could not read, with its
        error (the engine fails those adapters' requests)."""
        if not self._pending:
            return {}
        msgs, self._pending = self._pending, []
        self._bcast(("adapters", msgs))
        failed: dict[tuple[str, int], str] = {}
        for i, errs in enumerate(self._gather()):
            for key, err in (errs or {}).items():
                failed.setdefault(key, f"tensor-parallel worker {i + 1} cannot read it: {err}")
        return failed

    def retain(self, live: set[tuple[str, int]]) -> None:
        """The (name, version) keys requests may still need; the workers drop the shards of the others."""
        if live != getattr(self, "_live", None):
            self._live = set(live)
            self._pending.append(("retain", sorted(live)))

    def set_slot_map(self, slot_map: dict[int, tuple[str, int]]) -> None:
        """The pool's slot -> (name, version) map after this step's residency decisions (sent with the step)."""
        self._slot_map = slot_map

    # ------------------------------------------------------------------ steps
    def step(self, path: str, args: tuple) -> None:
        """Send one forward to the workers: ``path`` "graph" (``ModelRunner.decode_graph``'s arguments) or "eager"
        (``build_plan``'s), with the slot map when it changed."""
        slot_map = None if self._slot_map == self._sent_map else dict(self._slot_map)
        self._bcast(("step", path, args, slot_map))
        if slot_map is not None:
            self._sent_map = slot_map

    def poll_dead(self) -> str | None:
        """``dead``, first set from the workers' exit codes if one has exited (an idle group runs no collective that
        would fail: without this a worker killed between requests went unnoticed until the next step failed)."""
        if self.dead is None and not self._closed:
            gone = [f"worker {i + 1} (pid {p.pid}) exited with code {p.exitcode}"
                    for i, p in enumerate(self.procs) if p.exitcode is not None]
            if gone:
                self.dead = "tensor-parallel engine stopped: " + "; ".join(gone)
                log.error("%s", self.dead)
        return self.dead

    def close(self) -> None:
        """Stop the workers (a ``stop`` message, then terminate what is left) and leave the process group.
        Idempotent (a second call leaves alone a group another engine has made since)."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        owned = self._connected  # the process group is this object's to tear down (not one made after a close())
        stopped = False
        if self._ctrl is not None and not self.dead:
            try:
                self._bcast(("stop",))
                stopped = True
            except TensorParallelError:
                pass
        # told to stop: each has up to 10 s (one deadline for all); a dead group's survivors are waiting in a
        # collective that never ends: terminated at once (joined one by one, 8 ranks took minutes)
        deadline = time.monotonic() + (10.0 if stopped else 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=1.0)
        for c in self.conns:
            c.close()
        if owned and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peers died may fail to tear down cleanly
                log.debug("destroy_process_group failed", exc_info=True)
        self._ctrl = None
        hooks, self._excepthooks = self._excepthooks, None
        if hooks is not None and sys.excepthook is hooks[1]:  # no rank now: plain tracebacks again (each new group
            sys.excepthook = hooks[0]  # would add a prefix); a hook someone set since is left alone
        self.dead = self.dead or "tensor-parallel engine closed"


# ---------------------------------------------------------------------------------------- workers
def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (no orphans even if it was killed)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


class _Worker:
    """One worker rank: its model shard, KV cache, pool and runner, mirroring rank 0's steps."""

    def __init__(self, rank: int, size: int, model: Any, cfg: Any, device: torch.device) -> None:
        from multilora.runtime.model import DecoderModel
        from multilora.runtime.sizing import default_dtype
        from multilora.runtime.weights import load_model

        self.rank, self.size, self.cfg, self.device = rank, size, cfg, device
        dtype = default_dtype(cfg, device.type)
        self.dtype = dtype
        _, self.full_config, weights, _ = load_model(model, dtype=dtype, device=torch.device("cpu") if not isinstance(
            model, ModelConfig) else device, progress=False)
        check_tp_size(self.full_config, size)
        self.config = tp_rank_config(self.full_config, size)
        shard = shard_weights(weights, self.full_config, rank, size)
        del weights
        self.model = DecoderModel(self.config, shard, device=device, dtype=dtype, weight_dtype=cfg.weight_dtype,
                                  fp8_method=cfg.fp8_gemm, fp8_lm_head=cfg.fp8_lm_head, tp_group=TPGroup(rank, size),
                                  lora_side_max_tokens=cfg.lora_side_stream_max_tokens)
        self.model.skip_logits = True  # rank 0 computes logits and samples
        self.adapters: dict[tuple[str, int], Any] = {}  # key -> PackedAdapter (this rank's shard)
        self.owner: dict[int, tuple[str, int]] = {}  # slot -> key resident there

    def configure(self, *, num_blocks: int, pool_bytes: int, max_slots: int, max_seq_len: int) -> None:
        from multilora.memory.kv_cache import PagedKVCache
        from multilora.memory.pool import AdapterPool

        c, cfg = self.config, self.cfg
        self.make_runner(max_seq_len)
        self.pool = AdapterPool(c, num_bytes=pool_bytes, max_rank=cfg.max_lora_rank, max_slots=max_slots,
                                dtype=self.dtype, device=self.device)
        self.kv = PagedKVCache(num_layers=c.num_layers, num_blocks=num_blocks, block_size=cfg.kv_block_size,
                               num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype, device=self.device)
        self.runner.bind(self.kv, self.pool, cuda_graphs=cfg.cuda_graphs)
        self.model.ensure_rope_positions(max_seq_len)

    def make_runner(self, max_seq_len: int) -> None:
        """The runner, once (the profiling forward of the memory plan comes before ``configure``)."""
        from multilora.runtime.runner import ModelRunner

        if getattr(self, "runner", None) is None:
            cfg = self.cfg
            self.runner = ModelRunner(self.model, max_batch_size=cfg.max_batch_size, max_seq_len=max_seq_len,
                                      lora_backend=cfg.lora_backend, attention_backend=cfg.attention_backend)

    def read_adapter(self, key: tuple[str, int], path: str, allow_pickle: bool, fingerprint: Any) -> None:
        from multilora.runtime.adapters import AdapterError
        from multilora.runtime.adapters.disk import files_fingerprint
        from multilora.runtime.adapters.load import read_packed_adapter

        adapter, packed = read_packed_adapter(path, self.full_config, self.pool, name=key[0], allow_pickle=allow_pickle,
                                              shard=(self.rank, self.size))
        if packed is None:
            self.pool.check_rank(adapter.max_rank, name=key[0])
        if tuple(files_fingerprint(path)) != tuple(fingerprint):
            raise AdapterError(f"{path}: its files changed since rank 0 read them")
        self.adapters[key] = packed

    def mirror_slots(self, slot_map: dict[int, tuple[str, int]]) -> None:
        for slot, key in list(self.owner.items()):
            if slot_map.get(slot) != key:
                self.pool.free(slot)
                del self.owner[slot]
        for slot, key in sorted(slot_map.items()):
            if slot not in self.owner and key in self.adapters:  # (one it could not read is never used: acquire fails)
                self.pool.load(self.adapters[key], slot=slot)
                self.owner[slot] = key

    def run(self, path: str, args: tuple) -> None:
        with torch.inference_mode():
            if path == "graph":
                self.runner.decode_graph(*args)
            else:
                token_ids, starts, tables, slots = args
                self.runner.forward(self.runner.build_plan(token_ids, starts, tables, slots,
                                                           block_size=self.kv.block_size))


def worker_main(rank: int, size: int, init_method: str, model: Any, cfg: Any, device: str, conn: Any) -> None:
    """A worker process's body: load, connect, then serve rank 0's messages until ``stop``."""
    import torch.distributed as dist

    # an engine process ignores SIGTERM (runtime.engine_process._child_main) and a spawned child inherits SIG_IGN:
    # without this, close()'s terminate() of a dead group's survivors does nothing and each join waits its 5 s
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dev = _device_of(rank, torch.device(device))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        w = _Worker(rank, size, model, cfg, dev)
        conn.send(("loaded",))
        ctrl = _init_group(rank, size, init_method, dev)
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=6)))
        return
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=ctrl)
            msg = box[0]
            kind = msg[0]
            if kind == "stop":
                break
            if kind == "configure":
                status = None
                try:
                    w.configure(**msg[1])
                except Exception as e:
                    status = f"{type(e).__name__}: {e}"
                dist.gather_object(status, None, dst=0, group=ctrl)
            elif kind == "profile":
                w.make_runner(msg[3])
                w.runner.profile_reserve(msg[1], msg[2])
            elif kind == "adapters":
                errors: dict[tuple[str, int], str] = {}
                for m in msg[1]:
                    if m[0] == "add":
                        try:
                            w.read_adapter(*m[1:])
                        except Exception as e:  # that adapter's requests fail on rank 0; the worker goes on
                            errors[m[1]] = f"{type(e).__name__}: {e}"
                    elif m[0] == "retain":
                        keep = {tuple(k) for k in m[1]}
                        for key in [k for k in w.adapters if k not in keep]:
                            del w.adapters[key]
                dist.gather_object(errors, None, dst=0, group=ctrl)
            elif kind == "step":
                _, path, args, slot_map = msg
                if slot_map is not None:
                    w.mirror_slots(slot_map)
                w.run(path, args)
    except BaseException:  # report, then exit: rank 0's pending collective fails and it reads this
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        finally:
            os._exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
