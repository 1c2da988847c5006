"""The timer's floor on this machine: the same single-thread compute (matmuls and attention, about
80 ms, the size of a bench train step's compute at x1/4) run 200 times in one process; prints its
scatter. Run it alone and as two processes at once (the 2 ranks' case):

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/compute_floor.py
    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/compute_floor.py & \\
        OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/compute_floor.py; wait
"""

import os
import statistics
import time

import numpy as np
import torch

torch.set_num_threads(1)
torch.manual_seed(0)
x, w = torch.randn(1000, 256), torch.randn(256, 256, requires_grad=True)
q = torch.randn(4, 1000, 64)
seconds = []
for _ in range(200):
    start = time.perf_counter()
    for _ in range(2):
        (x @ w).relu().sum().backward()
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    seconds.append(time.perf_counter() - start)
ms = np.array(seconds[5:]) * 1e3  # after a warm-up
median = float(np.median(ms))
print(f"pid {os.getpid()}: median {median:.1f} ms, sd/mean {statistics.stdev(ms) / ms.mean():.1%}, "
      f"median |deviation|/median {np.median(np.abs(ms - median)) / median:.1%}, max/min {ms.max() / ms.min():.2f}, "
      f"5-95th percentile {np.percentile(ms, 5):.1f}-{np.percentile(ms, 95):.1f} ms")  # fmt: skip
