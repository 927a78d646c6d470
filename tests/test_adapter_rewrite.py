"""An adapter file rewritten in place while it is read (issue 15, item 1): two processes, bounded in time.

A writer process rewrites ``adapter_model.safetensors`` in place in a loop, the ways a user's tools do
(``open(p, "wb")`` then one write or many small ones, ``cp`` over it, ``rsync --inplace``: same inode, no
truncation), alternating two versions of the same size and shapes. A loader process meanwhile reads the
directory over and over through every path the engine takes (``read_adapter`` with and without preload,
``read_packed_adapter`` as the reload does, ``load_peft_adapter``). Each load must either give one of the two
versions exactly (bit-identical images, the right header) or raise ``AdapterError`` naming the file; the loader
must never die. (The writer leaves the file alone for 120 ms now and then, longer than the 50 ms a file must
be quiet to be read, ``runtime/adapters/disk.py``'s ``SETTLE_S``: that is when loads can succeed.) With memory-mapped reads it did: a page past the new end of the file faults (SIGBUS, exit
-7). The loader runs as a child of pytest so that a crash fails this test instead of killing the run.

``MULTILORA_REWRITE_SECONDS`` sets how long the two race (default 8 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

LOADER = textwrap.dedent(r'''
    import json, os, shutil, subprocess, sys, time
    from pathlib import Path
    import torch
    from multilora.config import TARGET_MODULES, ModelConfig
    from multilora.memory.pool import AdapterPool
    from multilora.runtime.adapters import (AdapterError, SAFETENSORS_NAME, load_peft_adapter, read_adapter,
                                            read_packed_adapter, save_peft_adapter)

    root, seconds = Path(sys.argv[1]), float(sys.argv[2])
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2)
    pool = AdapterPool(cfg, num_bytes=1 << 20, max_rank=16, dtype=torch.float32)

    def version(seed):  # same shapes and file size, other values
        g = torch.Generator().manual_seed(seed)
        mods = {(l, m): (torch.randn(16, cfg.module_shape(m)[0], generator=g).to(torch.bfloat16),
                         torch.randn(cfg.module_shape(m)[1], 16, generator=g).to(torch.bfloat16))
                for l in range(cfg.num_layers) for m in TARGET_MODULES}
        d = save_peft_adapter(root / f"v{seed}", mods, r=16, lora_alpha=32, target_modules=list(TARGET_MODULES))
        return d, read_packed_adapter(d, cfg, pool)[1].data, load_peft_adapter(d, cfg)
    versions = [version(1), version(2)]
    blobs = [(d / SAFETENSORS_NAME).read_bytes() for d, _, _ in versions]
    assert len(blobs[0]) == len(blobs[1]) and blobs[0] != blobs[1]
    live = root / "live"
    shutil.copytree(versions[0][0], live)
    target = live / SAFETENSORS_NAME
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(versions[0][0] / SAFETENSORS_NAME),
                               str(versions[1][0] / SAFETENSORS_NAME), str(seconds)])

    def same_as_a_version(kind, got):
        if kind == "pages":
            return any(torch.equal(got.view(torch.int32), want.view(torch.int32)) for _, want, _ in versions)
        return any(all(torch.equal(w.a, v.modules[k].a) and torch.equal(w.b, v.modules[k].b)
                       for k, w in got.modules.items()) for _, _, v in versions)

    counts = {"ok": 0, "refused": 0}
    messages, wrong = {}, []
    deadline = time.monotonic() + seconds
    i = 0
    try:
        while time.monotonic() < deadline:
            i += 1
            try:
                if i % 4 == 0:
                    _, packed = read_adapter(live, cfg, pool, preload=True)
                    ok = same_as_a_version("pages", packed.data)
                elif i % 4 == 1:
                    _, packed = read_packed_adapter(live, cfg, pool)
                    ok = same_as_a_version("pages", packed.data)
                elif i % 4 == 2:
                    adapter, packed = read_adapter(live, cfg, pool, preload=False)
                    ok = packed is None and all(w.a.shape == (16, cfg.module_shape(m)[0])
                                                for (_, m), w in adapter.modules.items())
                else:
                    ok = same_as_a_version("modules", load_peft_adapter(live, cfg))
                counts["ok"] += 1
                if not ok:
                    wrong.append(i)
            except AdapterError as e:
                counts["refused"] += 1
                msg = str(e)
                if str(target) not in msg and str(live) not in msg:
                    wrong.append(f"message does not name the file: {msg}")
                messages.setdefault(msg.split(": ", 1)[-1][:60], 0)
                messages[msg.split(": ", 1)[-1][:60]] += 1
    finally:
        writer.terminate()
        writer.wait()
    print(json.dumps({"counts": counts, "wrong": wrong[:10], "messages": messages}))
''')

WRITER = textwrap.dedent(r'''
    import os, shutil, sys, time
    target, a, b, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    blobs = [open(a, "rb").read(), open(b, "rb").read()]
    srcs = [a, b]
    deadline = time.monotonic() + seconds + 5
    i = 0
    while time.monotonic() < deadline:
        i += 1
        data, mode = blobs[i % 2], i % 4
        if mode == 0:  # open(p, "wb") and one write
            with open(target, "wb") as f:
                f.write(data)
        elif mode == 1:  # open(p, "wb"), many small writes: the file grows under the reader
            with open(target, "wb") as f:
                for k in range(0, len(data), 1 << 16):
                    f.write(data[k:k + (1 << 16)])
                    f.flush()
        elif mode == 2:  # cp over it
            shutil.copyfile(srcs[i % 2], target)
        else:  # rsync --inplace: overwrite in place, no truncation
            with open(target, "r+b") as f:
                for k in range(0, len(data), 1 << 16):
                    f.write(data[k:k + (1 << 16)])
        time.sleep(0.0005 * (i % 3) if i % 8 else 0.12)  # now and then quiet for longer than SETTLE_S
''')


def test_in_place_rewrite_fails_only_the_load(tmp_path):
    seconds = float(os.environ.get("MULTILORA_REWRITE_SECONDS", "8"))
    script = f"WRITER = {WRITER!r}\n" + LOADER
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(seconds)], capture_output=True,
                          text=True, timeout=seconds + 120)
    assert proc.returncode == 0, (
        f"the loader died: exit {proc.returncode}"
        + (f" ({signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else "") + f"\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["wrong"] == [], report
    assert report["counts"]["ok"] > 0 and report["counts"]["refused"] > 0, report  # both outcomes were exercised
