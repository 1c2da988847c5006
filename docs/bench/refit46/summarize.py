"""The issue-46 must-show from ``bench train --json`` files (run.sh): per file, auto's summed steps
against the better fixed topology's, the cost model's median error from step 2 (and its share error,
:func:`~deepspeed_knap.bench.train.share_errors`), and with
``--slow-rank`` the step the slow rank was called at and the compute max/mean after it.

    .venv/bin/python docs/bench/refit46/summarize.py docs/bench/refit46/*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from deepspeed_knap.bench.train import share_errors, speed_calls, summarize


def summarize_run(path: Path) -> str:
    data = json.loads(path.read_text())
    totals = {mode: row["total_speedup"] for mode, row in summarize(data).items()}  # over off, steps 1..
    auto = [row for row in data["steps"] if row["mode"] == "auto"]
    errors = [max(abs(e) for e in row["model_error"]) for row in auto if row["step"] >= 2]
    # The model's split of each step among the ranks (files from before bench train recorded it:
    # the predicted seconds are the measured times the model error).
    shares = [max(abs(e) for e in share_errors([c * (1 + e) for c, e in zip(row["compute_s"], row["model_error"],
                                                                            strict=True)], row["compute_s"]))
              for row in auto if row["step"] >= 2]  # fmt: skip
    line = f"{path.stem:24s} auto {totals['auto']:.2f}x of off"
    fixed = [mode for mode in totals if mode.startswith("knapformer")]
    if fixed:
        best = max(fixed, key=totals.get)
        line += f", {totals['auto'] / totals[best]:.3f}x of {best} ({totals[best]:.2f}x)"
    line += f"; model error from step 2: median {statistics.median(errors):.1%}, share error {statistics.median(shares):.1%}"
    slow = data["options"].get("slow_rank")
    if slow:
        rank = slow[0]
        called = speed_calls(data).get("auto", {}).get(rank, (None,))[0]
        line += f"; rank {rank} called at step {called}"
        if called is not None:
            after = [row["compute_imbalance"] for row in auto if row["step"] > called]
            line += f", compute max/mean after: median {statistics.median(after):.3f}, max {max(after):.3f}"
    return line


def timer_scatter(paths: list[Path]) -> dict[str, float]:
    """Per mix, the scatter of the same work's compute seconds between runs: ``off`` keeps every
    sequence home, so step ``s`` on rank ``r`` computes the same tokens in every run; the median over
    (step >= 1, rank) of the standard deviation over the runs relative to the mean."""
    times: dict[str, dict[tuple[int, int], list[float]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        if data["options"].get("slow_rank"):
            continue
        mix = path.stem.rsplit("_run", 1)[0]
        for row in data["steps"]:
            if row["mode"] == "off" and row["step"] >= 1:
                for rank, seconds in enumerate(row["compute_s"]):
                    times.setdefault(mix, {}).setdefault((row["step"], rank), []).append(seconds)
    scatter = {mix: [statistics.stdev(t) / statistics.mean(t) for t in cells.values() if len(t) > 1]
               for mix, cells in times.items()}  # fmt: skip
    return {mix: statistics.median(values) for mix, values in scatter.items() if values}


if __name__ == "__main__":
    paths = [Path(name) for name in sys.argv[1:]]
    for path in paths:
        print(summarize_run(path))
    for mix, scatter in timer_scatter(paths).items():
        print(
            f"{mix}: the same work's compute seconds scatter {scatter:.1%} between runs (off, median over steps and ranks)"
        )
