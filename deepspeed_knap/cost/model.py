"""Workload model: modeled forward + backward time of one sequence on each GPU of its bag.

For a sequence of ``s`` tokens run with Ulysses degree ``G`` (a bag of ``G`` GPUs), every GPU of the
bag spends::

    time(s, G) = (a * s + b * s**2 * heads(G)) / (G * speed * efficiency(G))  +  e / speed
                 +  c * s * (G - 1) / G**2,         heads(G) = ceil(H / G) * G / H

* ``a * s``: token-wise work (projections, MLP); ``b * s**2``: attention. Both split evenly over the
  bag: Ulysses gives each GPU ``s / G`` tokens for the linear layers and ``H / G`` heads of attention.
* Heads the degree does not divide (``num_heads`` ``H``, when known): Ulysses gives a member of a bag
  of ``G`` ``floor(H/G)`` or ``ceil(H/G)`` heads, and the bag moves at its ``ceil`` members' pace, so
  the attention term costs ``ceil(H/G) * G / H`` times the even split (12 heads in a bag of 8: each
  member waits for 2/12 of the attention, not 1.5/12: 4/3 times). 1 where ``G`` divides ``H``.
* ``e``: work every GPU of the bag repeats whatever ``G`` (Wan: each member projects the sample's
  text to cross-attention keys and values itself); 0 for FLUX.
* Attention segments (FLUX.3's token modes): a sequence of segments ``l_1 .. l_K`` (summing to
  ``s``) attends within each segment alone in some blocks and over all of ``s`` in the others. With
  ``f`` (``segment_attention_share``) the share of ``b`` those per-segment blocks carry, its
  attention term is ``b * (s**2 - f * (s**2 - sum_k l_k**2))``: ``b * s**2`` for the joint blocks'
  share, ``b * sum_k l_k**2`` for the per-segment ones'. A sequence given without segments, or a
  model with ``f = 0``, is priced ``b * s**2`` as before, bit for bit.
* ``c * s * (G-1) / G**2``: the Ulysses all-to-alls. Each GPU holds ``s / G`` tokens and sends the
  fraction ``(G-1)/G`` of them away, for q, k, v and the output, forward and backward. Zero at G=1.
  A group that spans nodes sends ``P/G`` of them to its ``P`` members on other nodes (``P = G - n``
  for a group of whole nodes of ``n`` GPUs), at the inter-node rate ``c'``
  (``inter_node_alltoall_coef``): ``(c * (G-1-P) + c' * P) * s / G**2``, the two shares one after
  the other. ``c'`` unset: ``c`` for every peer, as before.
* ``speed``: relative speed of the bag, the slowest of its GPUs (a bag moves in lockstep).
* ``efficiency(G)``: how much of the ideal ``1/G`` share a member of a bag of ``G`` achieves (1 at
  ``G = 1``; below 1 where small chunks and narrow head slices run slower), calibrated per degree by
  ``deepspeed-knap calibrate --degrees``; 1 unless given.

Besides its sequences, every GPU spends ``overhead / speed_g`` per step whatever its tokens (kernel
launches, Python: every rank runs every block, with or without tokens), ``speed_g`` its own speed.
With equal speeds that is the same on every GPU and changes no plan; on a slow GPU it is larger,
and the plan gives that GPU less work to make up for it. The online refit learns it; 0 unless given.

Defaults come from FLOP counts of the model's dimensions: :meth:`CostModel.from_model_dims` for
DiTs whose text and image tokens attend jointly (FLUX, MMDiTs), a family's own formula where it
differs (Wan's cross-attention: ``deepspeed_knap/models/wan/spec.py``), each family's presets in its
spec (:mod:`deepspeed_knap.models.registry`);
:func:`fit_cost_model` fits ``a, b, c`` to measured (length, bag size, time) triples by non-negative
least squares.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def index_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], starts[i] + lens[i])`` over ``i``, as int64: e.g. the GPUs
    of every sequence's group, sequence by sequence (``starts`` the groups' first GPUs, ``lens``
    their sizes). Shared by the refit, the planner and the runtime's layouts."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    firsts = np.cumsum(lens) - lens
    return np.repeat(starts - firsts, lens) + np.arange(total, dtype=np.int64)


# The defaults of from_model_dims, the config block and the CLI: an H100 in bf16, NVLink all-to-alls.
DEFAULT_TFLOPS = 400.0
DEFAULT_ALLTOALL_GBPS = 150.0
# All-to-all GB/s per GPU to other nodes: H100 nodes with 8 x 400 Gb/s InfiniBand (NDR), one port per
# GPU (the DGX H100's eight ConnectX-7 compute-fabric ports): 400 Gb/s = 50 GB/s per GPU and direction,
# the line rate, a third of DEFAULT_ALLTOALL_GBPS (itself a third of NVLink 4's 450 GB/s per direction).
DEFAULT_INTER_NODE_ALLTOALL_GBPS = 50.0

# The prices a cost model is made of, by the one name the dataclass, the "knapformer" config block
# (cost_model), calibration files and the online refit all use (tests/unit/test_cost_model.py sends
# each through all four). Not among them: overhead_s, which the start-up calibration and the refit fit.
COEFFICIENTS = (
    "linear_coef", "quadratic_coef", "alltoall_coef", "sequence_coef", "route_coef", "inter_node_route_coef",
    "inter_node_alltoall_coef", "route_latency_s",
)  # fmt: skip

# Forward + backward over forward FLOPs. Linear layers: backward is two matmuls per forward matmul.
# Flash attention's backward also recomputes the scores: ~2.5 forward's worth.
_LINEAR_TRAIN_FACTOR = 3.0
_LINEAR_FROZEN_FACTOR = 2.0  # frozen weights: no weight-gradient matmul
_ATTENTION_TRAIN_FACTOR = 3.5


def step_factors(frozen_base: bool, forward_only: bool) -> tuple[float, float, int]:
    """``(linear, attention, all-to-alls per block)``: the step's FLOPs over one forward's for linear
    layers and attention, and the Ulysses all-to-alls of ``hidden``-wide tokens per block (q, k, v in
    and the output back: 4 in a forward, 8 with backward)."""
    if forward_only:
        return 1.0, 1.0, 4
    return (_LINEAR_FROZEN_FACTOR if frozen_base else _LINEAR_TRAIN_FACTOR), _ATTENTION_TRAIN_FACTOR, 8


@dataclass(frozen=True)
class CostModel:
    """Per-GPU modeled seconds of a sequence; see the module docstring for the formula.

    Attributes:
        linear_coef: ``a``, seconds per token on one GPU (forward + backward).
        quadratic_coef: ``b``, seconds per token**2 on one GPU.
        alltoall_coef: ``c``, seconds per token of Ulysses all-to-all traffic (0 disables the term).
        gpu_speed: relative speed of each rank of the balance group (``None``: all equal). A bag runs
            at the speed of its slowest GPU.
        degree_efficiency: ``((G, efficiency), ...)``: the fraction of the ideal ``1/G`` of the work
            a member of a bag of ``G`` GPUs achieves; degrees not listed (and ``G = 1``) have 1.
        overhead_s: seconds a GPU of speed 1 spends per step whatever its tokens (module docstring).
        num_heads: ``H``, the attention heads Ulysses splits over a bag; prices the bags whose size
            does not divide it (module docstring). ``None``: unknown, priced as if every size divided it.
        sequence_coef: ``e``, seconds of speed 1 each GPU of a bag spends on a sequence whatever the
            bag's size (module docstring); 0 unless given.
        segment_attention_share: ``f`` in ``[0, 1]``, the share of ``quadratic_coef`` spent in blocks
            that attend within each attention segment of a sequence alone (FLUX.3's per-mode blocks:
            ``mode_blocks / (mode_blocks + joint blocks)``); prices the sequences the planner is given
            segments of (module docstring). 0: every block attends over the whole sequence.
        route_coef: seconds of one token's round trip off its home GPU to another GPU of its node:
            the route and the reverse route, forward and backward. The planner adds the route phase
            to a plan's step (:mod:`~deepspeed_knap.planner.route`) and keeps a sequence home when
            moving it costs more than it saves. 0 (the default): moving is free, as before.
        inter_node_route_coef: the same to a GPU of another node; ``None``: ``route_coef``.
        inter_node_alltoall_coef: ``c'``, seconds per token of Ulysses all-to-all traffic to members
            of the group on other nodes (module docstring). ``None``: not priced apart, ``c`` for
            every peer, and topology ``auto`` gives its groups of whole nodes only the sequences the
            memory cap keeps out of every group inside a node (the model cannot tell what crossing
            costs); set, they are a cost decision like any group.
        route_latency_s: seconds a step's route phase costs once any token leaves its home GPU,
            however few: the fixed cost of the route's and the reverse route's all-to-alls, forward
            and backward, which a plan that keeps every token home skips
            (:attr:`~deepspeed_knap.runtime.routing.RoutedBatch.stays_home`). The planner keeps
            every sequence home unless balancing saves more than it and the per-token price. 0 (the
            default): not priced, the plans of before.
    """

    linear_coef: float
    quadratic_coef: float
    alltoall_coef: float = 0.0
    gpu_speed: tuple[float, ...] | None = None
    degree_efficiency: tuple[tuple[int, float], ...] | None = None
    overhead_s: float = 0.0
    num_heads: int | None = None
    sequence_coef: float = 0.0
    segment_attention_share: float = 0.0
    route_coef: float = 0.0
    inter_node_route_coef: float | None = None
    inter_node_alltoall_coef: float | None = None
    route_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_heads is not None and (
            isinstance(self.num_heads, bool) or not isinstance(self.num_heads, (int, np.integer)) or self.num_heads < 1
        ):
            raise ValueError(f"cost model num_heads must be a positive integer or None; got {self.num_heads!r}")
        for name in (*COEFFICIENTS, "overhead_s"):
            value = getattr(self, name)
            if value is None and name.startswith("inter_node_"):  # None: as the intra-node coefficient
                continue
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"cost model {name} must be a finite number >= 0; got {value!r}")
        share = self.segment_attention_share
        if isinstance(share, bool) or not isinstance(share, (int, float, np.floating)) or not 0 <= share <= 1:
            raise ValueError(
                f"cost model segment_attention_share must be a number from 0 to 1 (the share of the attention "
                f"term in blocks that attend within each segment); got {share!r}"
            )
        if self.linear_coef == 0 and self.quadratic_coef == 0:
            raise ValueError("cost model linear_coef and quadratic_coef are both 0: every sequence would cost nothing")
        if self.gpu_speed is not None:
            speeds = np.asarray(self.gpu_speed, dtype=np.float64)
            if speeds.ndim != 1 or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
                raise ValueError(f"gpu_speed must be a list of positive numbers, one per rank; got {self.gpu_speed!r}")
        for degree, efficiency in self.degree_efficiency or ():
            if not (isinstance(degree, int) and degree >= 1 and np.isfinite(efficiency) and 0 < efficiency <= 2):
                raise ValueError(
                    f"degree_efficiency holds (bag size >= 1, efficiency in (0, 2]) pairs; got ({degree!r}, {efficiency!r})"
                )

    @classmethod
    def from_model_dims(
        cls,
        hidden: int = 3072,
        double_blocks: int = 19,
        single_blocks: int = 38,
        mlp_ratio: float = 4,
        tflops: float = DEFAULT_TFLOPS,
        alltoall_gbps: float = DEFAULT_ALLTOALL_GBPS,
        bytes_per_element: int = 2,
        gpu_speed: tuple[float, ...] | None = None,
        frozen_base: bool = False,
        num_heads: int | None = None,
        mode_blocks: int = 0,
        inter_node_alltoall_gbps: float | None = DEFAULT_INTER_NODE_ALLTOALL_GBPS,
        forward_only: bool = False,
    ) -> CostModel:
        """FLOP-based defaults for a FLUX-style DiT (defaults: FLUX.1-dev on an H100 in bf16).

        Per block and token (forward), a FLUX double- or single-stream block does
        ``(4 + 2 * mlp_ratio) * hidden**2`` multiply-adds in its linear layers (q, k, v, output, MLP;
        the single-stream block fuses the same matrices) and ``2 * s * hidden`` in attention.
        FLUX.3's per-mode blocks (``mode_blocks``: every token runs through that many blocks of its
        own mode, text, image or references) have the same linear layers and attend within the
        token's mode only: ``2 * l * hidden`` per token of a mode of ``l`` tokens. They count in
        ``a`` and ``b`` like the others, and their share of ``b`` is
        :attr:`segment_attention_share`, which prices a sequence by its segments (the module
        docstring) when the planner is given them.
        With ``frozen_base`` (LoRA: the base weights take no gradient) a linear layer's backward
        skips its weight-gradient matmul: forward + backward is 2 forwards' worth instead of 3 (on
        the CPU the LoRA calibration measured ``a`` at 0.64 of full fine-tuning's).

        Args:
            hidden: model width ``d``.
            double_blocks, single_blocks: number of each block type; both attend over the whole sequence.
            mode_blocks: blocks every token runs through that attend within its attention segment
                only (FLUX.3's per-mode blocks, ``num_layers``); 0 for FLUX.1 and FLUX.2.
            mlp_ratio: MLP hidden size over ``d`` (a gated MLP counts its gate: SwiGLU 3x wide is 4.5).
            tflops: sustained training throughput of one GPU, in 10**12 FLOP/s (H100 bf16 ~ 400).
            alltoall_gbps: per-GPU all-to-all bandwidth inside a node, in 10**9 bytes/s.
            bytes_per_element: activation dtype size moved by the all-to-alls.
            gpu_speed: see the class attributes.
            frozen_base: the base weights are frozen (LoRA, adapters).
            num_heads: attention heads (:attr:`num_heads`); ``None`` (the FLUX presets) prices every
                bag size as if it divided them.
            inter_node_alltoall_gbps: per-GPU all-to-all bandwidth to other nodes, in 10**9 bytes/s
                (:attr:`inter_node_alltoall_coef`); ``None``: not priced apart.
            forward_only: price one forward (generation: no backward, half the all-to-alls)
                instead of a training step.
        """
        blocks = double_blocks + single_blocks + mode_blocks
        dims = (hidden, blocks, mlp_ratio, tflops, alltoall_gbps, bytes_per_element, inter_node_alltoall_gbps or 1.0)
        if not all(np.isfinite(dims)) or min(dims) <= 0 or min(double_blocks, single_blocks, mode_blocks) < 0:
            raise ValueError(
                "model dims must be finite and positive (block counts >= 0, at least one block): got "
                f"hidden={hidden}, blocks={double_blocks}+{single_blocks}+{mode_blocks} (double+single+mode), "
                f"mlp_ratio={mlp_ratio}, tflops={tflops}, alltoall_gbps={alltoall_gbps}, "
                f"bytes_per_element={bytes_per_element}, inter_node_alltoall_gbps={inter_node_alltoall_gbps}"
            )
        flops_per_s = tflops * 1e12
        linear_factor, attention_factor, exchanges = step_factors(frozen_base, forward_only)
        linear = linear_factor * 2 * (4 + 2 * mlp_ratio) * hidden**2 * blocks / flops_per_s
        quadratic = attention_factor * 2 * 2 * hidden * blocks / flops_per_s
        token_bytes = exchanges * hidden * bytes_per_element * blocks
        return cls(linear, quadratic, token_bytes / (alltoall_gbps * 1e9), gpu_speed, num_heads=num_heads,
                   segment_attention_share=mode_blocks / blocks if mode_blocks else 0.0,
                   inter_node_alltoall_coef=per_token_s(token_bytes, inter_node_alltoall_gbps))  # fmt: skip

    @property
    def inter_node_route(self) -> float:
        """Seconds of one token's round trip to another node: :attr:`inter_node_route_coef`, or
        :attr:`route_coef` when that is ``None``."""
        return self.route_coef if self.inter_node_route_coef is None else self.inter_node_route_coef

    @property
    def prices_inter_node_alltoall(self) -> bool:
        """Whether the Ulysses all-to-all to other nodes has its own price
        (:attr:`inter_node_alltoall_coef` is set): groups across nodes are then a cost decision."""
        return self.inter_node_alltoall_coef is not None

    def cross_node_peers(
        self, group_start: np.ndarray, group_size: np.ndarray, gpus_per_node: int | None
    ) -> np.ndarray:
        """``[B]`` int64: of each group (GPUs ``group_start`` to ``group_start + group_size - 1``), how
        many members on other nodes the member whose all-to-all takes longest exchanges with: the
        ``P`` of the module docstring. That is the member whose node holds the fewest of the group
        where the inter-node rate is the dearer (the most where it is the cheaper); ``G - n`` for a
        group of whole nodes of ``n`` GPUs. All 0 where nodes are unknown (``gpus_per_node``
        ``None``) or the model prices no inter-node all-to-all."""
        starts = np.asarray(group_start, dtype=np.int64)
        sizes = np.asarray(group_size, dtype=np.int64)
        if gpus_per_node is None or not self.prices_inter_node_alltoall:
            return np.zeros(sizes.shape, dtype=np.int64)
        n = gpus_per_node
        ends = starts + sizes  # one past the last GPU
        first_node, last_node = starts // n, (ends - 1) // n
        # Members on each node the group touches: the first and last nodes partly, those between wholly.
        on_first = np.minimum(ends, (first_node + 1) * n) - starts
        on_last = np.where(last_node > first_node, ends - last_node * n, on_first)
        between = last_node - first_node >= 2
        if self.inter_node_alltoall_coef >= self.alltoall_coef:  # the member with the fewest in its node
            held = np.minimum(np.minimum(on_first, on_last), np.where(between, n, sizes))
        else:
            held = np.maximum(np.maximum(on_first, on_last), np.where(between, n, 0))
        return sizes - held

    @property
    def prices_routes(self) -> bool:
        """Whether moving a token costs anything (a route coefficient or the route latency above 0)."""
        return self.route_coef > 0 or self.inter_node_route > 0 or self.route_latency_s > 0

    def head_factor(self, bag_size: np.ndarray | int) -> np.ndarray:
        """``[...]`` ``ceil(H / G) * G / H`` of each bag size ``G``: how much longer a bag's attention
        takes than an even split of the heads (1 where ``G`` divides ``H``, or ``H`` is unknown)."""
        g = np.asarray(bag_size)
        if self.num_heads is None:
            return np.ones(g.shape, dtype=np.float64)
        g = g.astype(np.int64)
        heads = int(self.num_heads)
        return (-(-heads // g) * g).astype(np.float64) / heads

    def attention_squares(self, seq_lens: np.ndarray, segment_squares: np.ndarray | None = None) -> np.ndarray:
        """``[...]`` float64 the squared length each sequence's attention term is priced at:
        ``s**2 - f * (s**2 - sum_k l_k**2)`` (module docstring), ``s**2`` where ``segment_squares`` is
        ``None`` or ``f`` is 0.

        Args:
            seq_lens: ``[...]`` token counts ``s``.
            segment_squares: ``[...]`` ``sum_k l_k**2`` of each sequence's segments
                (:func:`segment_square_sums`; ``s**2`` for a sequence of one segment), or ``None``.
        """
        s = np.asarray(seq_lens, dtype=np.float64)
        if segment_squares is None or not self.segment_attention_share:
            return s * s
        # Elementwise only (no reduction whose order could differ between CPUs): the same bits on
        # every rank. A sequence of one segment gives s*s - f*0 = s*s exactly.
        whole = s * s
        return whole - self.segment_attention_share * (whole - np.asarray(segment_squares, dtype=np.float64))

    def per_gpu_time(
        self,
        seq_lens: np.ndarray,
        bag_size: np.ndarray | int,
        bag_speed: np.ndarray | float = 1.0,
        segment_squares: np.ndarray | None = None,
        cross_node_peers: np.ndarray | int | None = None,
    ) -> np.ndarray:
        """Modeled seconds each GPU of the bag spends on each sequence.

        Args:
            seq_lens: ``[...]`` token counts.
            bag_size: Ulysses degree ``G``, broadcastable against ``seq_lens``.
            bag_speed: relative bag speed, broadcastable against ``seq_lens``.
            segment_squares: ``[...]`` like ``seq_lens``: ``sum_k l_k**2`` over each sequence's
                attention segments (:func:`segment_square_sums`), priced by
                :attr:`segment_attention_share`; ``None``: one segment each.
            cross_node_peers: the bag's members on other nodes that its busiest member exchanges
                with (:meth:`cross_node_peers`), broadcastable against ``seq_lens``, priced at
                :attr:`inter_node_alltoall_coef`; ``None`` or 0: every peer in the node.

        Returns:
            ``[...]`` float64 seconds, the broadcast shape.
        """
        s = np.asarray(seq_lens, dtype=np.float64)
        g = np.asarray(bag_size, dtype=np.float64)
        quadratic = self.quadratic_coef * s * s
        if segment_squares is not None and self.segment_attention_share:
            # Less the per-segment blocks' cross-segment pairs, as a difference, so that a sequence of
            # one segment (s*s - sum_k l_k**2 = 0) keeps b * s * s to the last bit.
            cross = s * s - np.asarray(segment_squares, dtype=np.float64)
            quadratic = quadratic - self.quadratic_coef * self.segment_attention_share * cross
        if self.num_heads is not None:  # the bag waits for its members with ceil(H / G) heads
            quadratic = quadratic * self.head_factor(bag_size)
        compute = (self.linear_coef * s + quadratic) / (g * bag_speed * self.efficiency(bag_size))
        if self.sequence_coef:  # repeated by every member, whatever G
            compute = compute + self.sequence_coef / np.asarray(bag_speed, dtype=np.float64)
        if cross_node_peers is None or not self.prices_inter_node_alltoall:
            return compute + self.alltoall_coef * s * (g - 1.0) / (g * g)
        # With no peer across (P = 0) this is c * s * (G - 1) + 0: the bits of the line above.
        across = np.asarray(cross_node_peers, dtype=np.float64)
        alltoall = self.alltoall_coef * s * (g - 1.0 - across) + self.inter_node_alltoall_coef * s * across
        return compute + alltoall / (g * g)

    def efficiency(self, bag_size: np.ndarray | int) -> np.ndarray:
        """``[...]`` :attr:`degree_efficiency` of each bag size (1 where not listed)."""
        g = np.asarray(bag_size)
        result = np.ones(g.shape, dtype=np.float64)
        for degree, efficiency in self.degree_efficiency or ():
            result = np.where(g == degree, efficiency, result)
        return result

    def group_speeds(self, group_first: np.ndarray, group_sizes: np.ndarray, num_gpus: int) -> np.ndarray:
        """``[B]`` speed of each group of GPUs: the slowest of its GPUs (1.0 everywhere without
        ``gpu_speed``).

        Raises:
            ValueError: ``gpu_speed`` does not list one speed per GPU of the balance group.
        """
        if self.gpu_speed is None:
            return np.ones(len(group_sizes))
        if len(self.gpu_speed) != num_gpus:
            raise ValueError(
                f"gpu_speed has {len(self.gpu_speed)} entries but the balance group has {num_gpus} ranks; "
                "give one speed per rank of the balance group"
            )
        speeds = np.asarray(self.gpu_speed, dtype=np.float64)
        return np.array(
            [speeds[first : first + size].min() for first, size in zip(group_first, group_sizes, strict=True)]
        )

    def gpu_overhead_s(self, num_gpus: int) -> np.ndarray:
        """``[S]`` seconds each GPU spends per step whatever its tokens: ``overhead_s / speed``.

        Raises:
            ValueError: ``gpu_speed`` does not list one speed per GPU of the balance group.
        """
        return self.overhead_s / self.group_speeds(np.arange(num_gpus), np.ones(num_gpus, dtype=np.int64), num_gpus)


def per_token_s(token_bytes: float, gbps: float | None) -> float | None:
    """Seconds per token of all-to-all traffic of ``token_bytes`` bytes at ``gbps`` 10**9 bytes/s;
    ``None`` where no bandwidth is given."""
    return None if gbps is None else token_bytes / (gbps * 1e9)


def degree_efficiency_pairs(value: object) -> tuple[tuple[int, float], ...] | None:
    """A calibration file's ``degree_efficiency`` (``[[G, efficiency], ...]``, as ``deepspeed-knap
    calibrate --degrees`` writes it) as :attr:`CostModel.degree_efficiency` takes it; ``None`` or
    ``[]``: none. Training's config and ``bench step`` both read it here.

    Raises:
        ValueError: not a list of ``[G, efficiency]`` pairs, one per bag size, of a whole bag size
            ``G >= 1`` and an efficiency in ``(0, 2]``, neither a bool (the message names the value).
    """
    if value is None or (isinstance(value, list) and not value):
        return None

    def number(x: object) -> bool:  # JSON's Infinity and NaN are numbers to json.loads, and so is 10**400
        real = isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
        try:
            return real and math.isfinite(x)
        except OverflowError:
            return False

    pairs = isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 and all(map(number, p)) for p in value)
    if pairs and all(int(g) == g and g >= 1 and 0 < e <= 2 for g, e in value):
        efficiency = tuple((int(g), float(e)) for g, e in value)
        if len({g for g, _ in efficiency}) == len(efficiency):  # one efficiency per bag size
            return efficiency
    raise ValueError(f"degree_efficiency = {value!r}; expected [[bag size, efficiency], ...], one pair per bag size "
                     "(a whole number >= 1, and a number in (0, 2]), as deepspeed-knap calibrate --degrees writes it")  # fmt: skip


def segment_square_sums(segments: np.ndarray) -> np.ndarray:
    """``[N]`` float64 ``sum_k l_k**2`` of each sequence's attention segments, the input of
    :meth:`CostModel.per_gpu_time`'s ``segment_squares``.

    Args:
        segments: ``[N, K]`` non-negative integer segment lengths per sequence (zeros for absent
            segments; e.g. ``Flux3Inputs.segments``: text, image, references).

    Exact Python integers, each sum rounded once to float64: the same value on every machine, and
    ``s**2`` exactly (as ``s * s`` in float64) for a sequence of one segment.
    """
    rows = segments.tolist() if isinstance(segments, np.ndarray) else [list(row) for row in segments]
    if isinstance(segments, np.ndarray) and segments.ndim != 2:
        raise ValueError(f"segments must be an [N, K] table of segment lengths; got shape {segments.shape}")
    return np.array([float(sum(int(v) * int(v) for v in row)) for row in rows], dtype=np.float64)


def fit_cost_model(
    seq_lens: np.ndarray,
    times: np.ndarray,
    bag_sizes: np.ndarray | None = None,
) -> CostModel:
    """Fit ``a, b, c`` >= 0 to measured per-GPU times by non-negative least squares.

    Exact (:func:`nonnegative_least_squares` over the three columns).

    Args:
        seq_lens: ``[M]`` sequence lengths of the measurements.
        times: ``[M]`` measured per-GPU seconds (forward + backward).
        bag_sizes: ``[M]`` Ulysses degree of each measurement; default all 1, which leaves ``c = 0``.

    Raises:
        ValueError: mismatched or too few measurements, non-positive lengths, negative times.
    """
    s = np.asarray(seq_lens, dtype=np.float64).ravel()
    t = np.asarray(times, dtype=np.float64).ravel()
    g = np.ones_like(s) if bag_sizes is None else np.asarray(bag_sizes, dtype=np.float64).ravel()
    if not (s.shape == t.shape == g.shape):
        raise ValueError(f"seq_lens, times and bag_sizes must have equal lengths; got {s.size}, {t.size}, {g.size}")
    if s.size < 2 or np.any(s <= 0) or np.any(g < 1) or np.any(t < 0) or not np.all(np.isfinite(t)):
        raise ValueError(
            f"need >= 2 measurements with positive lengths, bag sizes >= 1 and finite times >= 0; got {s.size} "
            f"measurements, min length {s.min() if s.size else None}, min time {t.min() if t.size else None}"
        )
    coef = nonnegative_least_squares(np.stack([s / g, s * s / g, s * (g - 1) / (g * g)], axis=1), t)
    if coef[0] == 0 and coef[1] == 0:
        raise ValueError("the measurements give no positive compute coefficient; are the times all zero?")
    return CostModel(float(coef[0]), float(coef[1]), float(coef[2]))


def nonnegative_least_squares(
    columns: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None
) -> np.ndarray:
    """``argmin sum(weights * (columns @ x - targets)**2)`` over ``x >= 0``, exactly, for a handful
    of columns, and bit-identically on every machine (:func:`nonnegative_normal_equations`).

    Args:
        columns: ``[M, K]`` regressors, ``K`` small (at most ~6).
        targets: ``[M]``.
        weights: ``[M]`` non-negative row weights; default all 1.

    Returns:
        ``[K]`` float64 coefficients, all >= 0 (all 0 when no subset fits with non-negative ones).
    """
    rows = np.asarray(columns, dtype=np.float64).tolist()
    ys = np.asarray(targets, dtype=np.float64).tolist()
    ws = [1.0] * len(ys) if weights is None else np.asarray(weights, dtype=np.float64).tolist()
    k = np.asarray(columns).shape[1]
    gram = [[sum(w * row[i] * row[j] for w, row in zip(ws, rows, strict=True)) for j in range(k)] for i in range(k)]
    rhs = [sum(w * row[i] * y for w, row, y in zip(ws, rows, ys, strict=True)) for i in range(k)]
    return np.array(nonnegative_normal_equations(gram, rhs, sum(w * y * y for w, y in zip(ws, ys, strict=True))))


def nonnegative_normal_equations(gram: list[list[float]], rhs: list[float], target_norm: float) -> list[float]:
    """Exact non-negative least squares from its normal equations: ``gram = A^T W A``, ``rhs = A^T W y``
    and ``target_norm = y^T W y`` of a weighted problem with a handful of columns.

    The optimum is the unconstrained least-squares solution on one subset of the columns (its
    support), so trying every subset and keeping the best non-negative one is exact: ``2**K`` small
    solves for ``K`` columns. Columns are scaled to unit norm first (``s`` and ``s**2`` differ by ~10
    orders); all-zero columns get 0. Plain Python floats in a fixed order, no BLAS (whose reduction
    order differs between CPUs): the online refit runs this on every rank, and the ranks must agree
    to the last bit. Taking sums instead of rows lets the refit keep running sums.

    Returns:
        ``K`` coefficients, all >= 0 (all 0 when no subset fits with non-negative ones).
    """
    num_columns = len(rhs)
    usable = [i for i in range(num_columns) if gram[i][i] > 0]
    best_coef, best_residual = [0.0] * num_columns, target_norm
    for size in range(1, len(usable) + 1):
        for support in itertools.combinations(usable, size):
            sub, norms = unit_norm_gram(gram, support)
            sub_rhs = [rhs[i] / n for i, n in zip(support, norms, strict=True)]
            solution = solve_linear(sub, sub_rhs)
            if solution is None or any(v < 0 for v in solution):
                continue
            residual = normal_equations_residual(sub, sub_rhs, target_norm, solution)  # in the scaled columns
            if residual < best_residual:
                best_residual, best_coef = residual, [0.0] * num_columns
                for v, i, n in zip(solution, support, norms, strict=True):
                    best_coef[i] = v / n
    return best_coef


def unit_norm_gram(gram: list[list[float]], columns: Sequence[int]) -> tuple[list[list[float]], list[float]]:
    """``gram = A^T W A`` restricted to ``columns`` (each with ``gram[i][i] > 0``) with those columns
    of ``A`` scaled to unit norm, and their norms: ``s`` and ``s**2`` differ by ~10 orders, which
    the elimination of :func:`solve_linear` would not survive unscaled. Plain Python floats."""
    norms = [math.sqrt(gram[i][i]) for i in columns]
    return [[gram[i][j] / (ni * nj) for j, nj in zip(columns, norms, strict=True)]
            for i, ni in zip(columns, norms, strict=True)], norms  # fmt: skip


def normal_equations_residual(gram: list[list[float]], rhs: list[float], target_norm: float, x: list[float]) -> float:
    """``||A x - y||^2 = y^T W y - 2 x^T A^T W y + x^T A^T W A x`` of a weighted least-squares problem
    from its normal equations (``gram = A^T W A``, ``rhs = A^T W y``, ``target_norm = y^T W y``), in
    plain Python floats in a fixed order. Rounding may leave a perfect fit's slightly below 0."""
    quadratic = sum(a * gram[i][j] * b for i, a in enumerate(x) for j, b in enumerate(x))
    return target_norm - 2 * sum(a * r for a, r in zip(x, rhs, strict=True)) + quadratic


def solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """``matrix^-1 @ rhs`` by Gaussian elimination with partial pivoting; ``None`` when (nearly) singular."""
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= factor * a[col][k]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (a[r][n] - sum(a[r][k] * solution[k] for k in range(r + 1, n))) / a[r][r]
    return solution
