"""How often the issue-46 ratio row passes for a mode against its own twin: per ``bench train
--json`` file of ``run.sh`` (knapformer on g1n2 twice, and auto), the twins' summed-step ratio, each
twin's and auto's ratio to the better of the two, and how many runs reach 0.98.

    .venv/bin/python docs/bench/refit46/twin/twins.py docs/bench/refit46/twin/*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from deepspeed_knap.bench.train import summarize

TWINS = ("knapformer", "knapformer@g1n2")


def main(paths: list[Path]) -> None:
    rows = []
    for path in paths:
        totals = {mode: row["total_speedup"] for mode, row in summarize(json.loads(path.read_text())).items()}
        best = max(totals[mode] for mode in TWINS)
        rows.append([totals[TWINS[0]] / totals[TWINS[1]], *(totals[mode] / best for mode in (*TWINS, "auto"))])
        print(f"{path.stem:28s} twins {rows[-1][0]:.3f}; of the better twin: "
              + ", ".join(f"{mode} {ratio:.3f}" for mode, ratio in zip((*TWINS, "auto"), rows[-1][1:], strict=True)))  # fmt: skip
    print(f"{len(rows)} runs: twins' ratio sd {statistics.stdev(row[0] for row in rows):.1%}; runs >= 0.98 of the better "
          "twin: " + ", ".join(f"{mode} {sum(row[k] >= 0.98 for row in rows)}"
                               for k, mode in enumerate((*TWINS, "auto"), start=1)))  # fmt: skip


if __name__ == "__main__":
    main([Path(name) for name in sys.argv[1:]])
