"""Which lengths cuDNN's SDPA backward fails on: forward + backward of one [1, H, L, D] bf16 attention
laid out as diffusers' FLUX and our ``sdpa`` backend lay it out ([L, H, D] transposed), with only
cuDNN's kernel allowed, each length in a fresh process (a failure can poison the CUDA context).

    python3 docs/bench/gpu/cudnn_probe.py 256,274,458,1024,4096   # prints one line per length
"""

import subprocess
import sys

CHILD = """
import sys, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
length, heads, dim = int(sys.argv[1]), 24, 128
q, k, v = (torch.randn(length, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
    out.float().square().sum().backward()
torch.cuda.synchronize()
"""

for length in sys.argv[1].split(","):
    result = subprocess.run([sys.executable, "-c", CHILD, length], capture_output=True, text=True, timeout=60)
    lines = [line for line in result.stderr.strip().splitlines() if "Error" in line]
    print(f"length {length:>6}: {'ok' if result.returncode == 0 else 'FAILED: ' + (lines[-1] if lines else '?')[:160]}")
