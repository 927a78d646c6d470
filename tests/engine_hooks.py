"""What the server tests do to the engine that the server steps, as functions of the engine: called directly on an
engine of this process, or run in an engine process by ``EngineProcess.apply`` (so they are module-level, and their
arguments and results picklable). Also the engine factories those tests give ``EngineProcess.start``."""

from __future__ import annotations

import time

import torch


def single_thread(factory, *args, **kwargs):
    """``factory(*args, **kwargs)`` on one intra-op thread (the tests' ``one_thread``, in an engine process)."""
    torch.set_num_threads(1)
    return factory(*args, **kwargs)


def tiny_random_engine(max_batch_size=4):
    """Random weights of the "tiny" shape, no tokenizer, one adapter "a" (what bench/bench_serving.py serves)."""
    import tempfile
    from pathlib import Path

    from multilora import Engine
    from multilora.config import ModelConfig
    from multilora.runtime.weights import MODEL_SHAPES
    from testsupport import write_adapter

    torch.set_num_threads(1)
    e = Engine(ModelConfig(**MODEL_SHAPES["tiny"]), progress=False, max_batch_size=max_batch_size)
    e.load_adapter("a", write_adapter(Path(tempfile.mkdtemp()) / "a", e.config, seed=3, rank=4,
                                      modules=("q_proj", "v_proj")))
    return e


def state(engine):
    """(running, waiting, KV blocks free, KV blocks total, {adapter: refcount})."""
    s = engine.stats()
    return (s["running"], s["waiting"], s["kv_blocks_free"], s["kv_blocks_total"],
            {n: engine.cache.get(n).refcount for n in engine.list_adapters()})


def refcount(engine, name):
    return engine.cache.get(name).refcount


def list_adapters(engine):
    return engine.list_adapters()


def set_max_waiting(engine, n):
    """Set ``max_waiting_requests``; the old value."""
    cfg = engine.engine_config
    old, cfg.max_waiting_requests = cfg.max_waiting_requests, n
    return old


def max_waiting(engine):
    return engine.engine_config.max_waiting_requests


def queue_fills_after(engine, n):
    """The waiting queue takes ``n`` more requests, then refuses as a full one does (as when other clients' requests
    already wait); ``n`` None undoes it."""
    engine.__dict__.pop("_check_room", None)
    if n is None:
        return
    check, left = engine._check_room, [n]

    def fills():
        if left[0] > 0:
            left[0] -= 1
            return check()
        cfg = engine.engine_config  # the engine's own refusal, with the cap at what waits now
        old, cfg.max_waiting_requests = cfg.max_waiting_requests, len(engine.scheduler.waiting)
        try:
            check()
        finally:
            cfg.max_waiting_requests = old

    engine._check_room = fills


def slow_steps(engine, seconds):
    """Every forward sleeps ``seconds`` first (undo: ``restore_steps``)."""
    run = _original_run(engine)

    def slow(kind, batch, **kw):
        time.sleep(seconds)
        return run(kind, batch, **kw)

    engine.runner.run = slow


def failing_steps(engine, message):
    """Every forward raises RuntimeError(message) (undo: ``restore_steps``)."""
    _original_run(engine)

    def boom(kind, batch, **kw):
        raise RuntimeError(message)

    engine.runner.run = boom


def restore_steps(engine):
    run = engine.__dict__.pop("_hooks_run", None)
    if run is not None:
        engine.runner.run = run


def _original_run(engine):
    return engine.__dict__.setdefault("_hooks_run", engine.runner.run)


def stats(engine):
    return engine.stats()


def device(engine):
    return str(engine.device)


class _DeadGroup:
    """A tensor-parallel group whose worker died (``Engine.dead`` reads its ``dead``)."""

    def __init__(self, why):
        self.dead = why

    def poll_dead(self):
        return self.dead

    def close(self):
        pass


def dies(engine, why):
    """The engine's tensor-parallel group is dead from now on (``why``), as when a worker is killed."""
    with engine.step_lock:  # between steps: a step reads engine.tp more than once
        engine.tp = _DeadGroup(why)


def slow_loads(engine, seconds):
    """Every ``load_adapter`` sleeps ``seconds`` first (undo: ``restore_loads``)."""
    load = engine.__dict__.setdefault("_hooks_load", engine.load_adapter)

    def slow(*a, **k):
        time.sleep(seconds)
        return load(*a, **k)

    engine.load_adapter = slow


def restore_loads(engine):
    load = engine.__dict__.pop("_hooks_load", None)
    if load is not None:
        engine.load_adapter = load
