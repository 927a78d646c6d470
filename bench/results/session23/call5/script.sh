#!/usr/bin/env bash
# session 23, call 5: why bench_fused_quant saw different bits for add_rms_norm at T = 512 (call 4): compare the fused
# and separate ways element by element at several T, PDL on and off, several repetitions, eager and synchronized.
set -o pipefail
mkdir -p $OUT/c5
trap 'tar czf $OUT/c5.tgz -C $OUT c5 && rm -rf $OUT/c5' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
cat > /tmp/diag.py <<'PY'
import torch
from multilora.kernels import fused, triton_fp8, triton_pdl
dev, dt = "cuda", torch.bfloat16
for pdl in (True, False):
    triton_pdl.ENABLED = pdl
    for T in (64, 256, 512, 1024, 4096):
        for rep in range(3):
            g = torch.Generator(device=dev).manual_seed(0)
            h = torch.randn(T, 4096, device=dev, dtype=dt, generator=g)
            d = torch.randn(T, 4096, device=dev, dtype=dt, generator=g)
            w = (torch.rand(4096, device=dev, generator=g) + 0.5).to(dt)
            h0 = h.clone()
            y = fused.add_rms_norm(h, d, w, 1e-5, backend="triton"); torch.cuda.synchronize()
            q, s = triton_fp8.quantize_per_token(y); torch.cuda.synchronize()
            h1 = h.clone(); h.copy_(h0); torch.cuda.synchronize()
            y2, (q2, s2) = fused.add_rms_norm(h, d, w, 1e-5, backend="triton", quant=True); torch.cuda.synchronize()
            qq, ss = triton_fp8.quantize_per_token(y2); torch.cuda.synchronize()
            dy = (y != y2).sum().item(); dq = (q.view(torch.uint8) != q2.view(torch.uint8)).sum().item()
            ds = (s != s2).sum().item(); dh = (h1 != h).sum().item()
            dq2 = (qq.view(torch.uint8) != q2.view(torch.uint8)).sum().item(); ds2 = (ss != s2).sum().item()
            rows = (q.view(torch.uint8) != q2.view(torch.uint8)).any(1).nonzero().flatten()[:5].tolist()
            print(f"pdl={pdl} T={T} rep={rep}: y {dy}, h {dh}, q {dq} (rows {rows}), s {ds}; fused vs quant(y2): q {dq2}, s {ds2}", flush=True)
PY
timeout 200 python3 /tmp/diag.py > $OUT/c5/diag.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c5/diag.log
