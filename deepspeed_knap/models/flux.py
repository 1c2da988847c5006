"""FLUX on packed, balanced batches, loading and saving diffusers' ``FluxTransformer2DModel`` weights.

    model = PackedFluxTransformer.from_pretrained("black-forest-labs/FLUX.1-dev/transformer")
    outputs = model.forward_samples(samples, balancer)  # one [L_i, C] prediction per sample

diffusers' model conditions a whole batch row on one timestep and one RoPE table, so samples of
different sizes cannot share a batch. Here each rank's samples are packed into one token sequence
(per sample: its text tokens, then its image or video tokens), conditioning is looked up per token
by sample, and attention runs over each sample alone. With a balancer, the tokens are routed to the
step's compute bags after the embedders and routed back before the loss.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from deepspeed_knap.attention import KnapDistributedAttention
from deepspeed_knap.balancer import KnapBalancer, balanced_forward
from deepspeed_knap.models.flux_layers import (
    AdaNormOut,
    FluxDoubleBlock,
    FluxSingleBlock,
    FluxStep,
    TimeTextEmbedding,
)
from deepspeed_knap.packing import PackedBatch
from deepspeed_knap.routing import RoutedBatch
from deepspeed_knap.topology import Topology

SAMPLE_KEYS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids")
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
_DIFFUSERS_CLASS = "FluxTransformer2DModel"


@dataclass(frozen=True, eq=False)
class FluxInputs:
    """One rank's samples, packed per stream; the names are diffusers' forward arguments.

    Attributes:
        hidden_states: ``[Ti, C]`` image/video latent tokens of every sample, sample after sample.
        encoder_hidden_states: ``[Tt, Dj]`` text-encoder tokens, sample after sample.
        pooled_projections: ``[N, Dp]`` pooled text embedding per sample.
        timestep: ``[N]`` in ``[0, 1]`` (the model scales by 1000, as diffusers does).
        img_ids: ``[Ti, 3]`` positions ``(t, h, w)``; ``t = 0`` for images, the frame for video.
        txt_ids: ``[Tt, 3]`` text positions (FLUX uses zeros).
        img_lens, txt_lens: ``N`` per-sample token counts of each stream.
        guidance: ``[N]`` guidance scales for guidance-distilled models (FLUX.1-dev), else ``None``.
    """

    hidden_states: Tensor
    encoder_hidden_states: Tensor
    pooled_projections: Tensor
    timestep: Tensor
    img_ids: Tensor
    txt_ids: Tensor
    img_lens: tuple[int, ...]
    txt_lens: tuple[int, ...]
    guidance: Tensor | None = None

    @property
    def num_samples(self) -> int:
        return len(self.img_lens)

    @functools.cached_property
    def _joint_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the text and of the image tokens in joint order (per sample: text, then image)."""
        txt_lens, img_lens = np.array(self.txt_lens, dtype=np.int64), np.array(self.img_lens, dtype=np.int64)
        starts = np.cumsum(txt_lens + img_lens) - (txt_lens + img_lens)
        txt_rows = np.repeat(starts, txt_lens) + _ranks_within(txt_lens)
        img_rows = np.repeat(starts + txt_lens, img_lens) + _ranks_within(img_lens)
        return txt_rows, img_rows

    def to(self, device: torch.device | str) -> FluxInputs:
        """The same inputs on ``device``."""
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return FluxInputs(**{name: t.to(device) if isinstance(t, Tensor) else t for name, t in tensors.items()})

    def split(self, image_rows: Tensor) -> list[Tensor]:
        """``[Ti, ...]`` rows (the model's output) -> one ``[L_i, ...]`` tensor per sample."""
        return list(torch.split(image_rows, list(self.img_lens)))


def _ranks_within(lens: np.ndarray) -> np.ndarray:
    """``0..n-1`` for each length ``n``, concatenated."""
    return np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """FLUX's split of a head's channels over the ``(t, h, w)`` axes, for any even ``head_dim``:
    ``(16, 56, 56)`` for 128, about 1/8 for time and the rest halved, every part even."""
    time_dim = max(2, head_dim // 16 * 2)
    height_dim = (head_dim - time_dim) // 4 * 2
    return time_dim, height_dim, head_dim - time_dim - height_dim


def latent_ids(frames: int, height: int, width: int) -> Tensor:
    """``[frames * height * width, 3]`` float positions ``(t, h, w)`` of a latent token grid, frame by
    frame, row by row; with ``frames=1`` exactly diffusers' FLUX image ids ``(0, h, w)``."""
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([t, h, w], dim=-1).reshape(-1, 3).float()


class PackedFluxTransformer(nn.Module):
    """FLUX (double-stream then single-stream blocks) over packed samples, balanced or not.

    The constructor takes ``FluxTransformer2DModel``'s config, so ``state_dict`` names and shapes are
    identical to diffusers' (``load_state_dict(diffusers_model.state_dict(), strict=True)`` works),
    plus:

    Args:
        attention_backend: local kernel of every block's attention (see ``VarlenAttention``); the
            config's ``knapformer.attention_backend`` replaces it under ``deepspeed_knap.initialize``.
        topology: when given, checked against the heads at construction.
        gradient_checkpointing: recompute each block in backward instead of keeping its activations.
    """

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: Sequence[int] = (16, 56, 56),
        attention_backend: str = "auto",
        topology: Topology | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if any(dim <= 0 or dim % 2 for dim in axes_dims_rope):
            raise ValueError(
                f"axes_dims_rope {list(axes_dims_rope)} must be positive and even: RoPE rotates channel pairs"
            )
        if sum(axes_dims_rope) != attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {list(axes_dims_rope)} sum to {sum(axes_dims_rope)}, but RoPE rotates every channel "
                f"of a head: they must sum to attention_head_dim={attention_head_dim}"
            )
        self.config = {
            "patch_size": patch_size,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "num_layers": num_layers,
            "num_single_layers": num_single_layers,
            "attention_head_dim": attention_head_dim,
            "num_attention_heads": num_attention_heads,
            "joint_attention_dim": joint_attention_dim,
            "pooled_projection_dim": pooled_projection_dim,
            "guidance_embeds": guidance_embeds,
            "axes_dims_rope": list(axes_dims_rope),
        }
        self.out_channels = out_channels or in_channels
        self.gradient_checkpointing = gradient_checkpointing
        dim = num_attention_heads * attention_head_dim
        self.time_text_embed = TimeTextEmbedding(dim, pooled_projection_dim, guidance_embeds)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.x_embedder = nn.Linear(in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            FluxDoubleBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            FluxSingleBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_single_layers)
        )
        self.norm_out = AdaNormOut(dim)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels)
        # One parameterless module shared by every block: the balancer's routing decides its groups.
        self.attention = KnapDistributedAttention(num_attention_heads, attention_backend, topology=topology)

    # ---- construction from and export to diffusers ----

    @classmethod
    def from_diffusers(cls, model: nn.Module, **kwargs: Any) -> PackedFluxTransformer:
        """A copy of a diffusers ``FluxTransformer2DModel`` (same weights, dtype and device).
        ``kwargs``: this class's extra arguments (``attention_backend``, ``topology``, ...)."""
        config = {key: model.config[key] for key in _config_keys()}
        parameter = next(model.parameters())
        packed = cls(**config, **kwargs).to(dtype=parameter.dtype, device=parameter.device)
        packed.load_state_dict(model.state_dict(), strict=True)
        return packed

    @classmethod
    def from_pretrained(cls, path: str | Path, torch_dtype: torch.dtype | None = None, **kwargs: Any):
        """Load a diffusers checkpoint directory: ``path`` holds ``config.json`` and
        ``diffusion_pytorch_model.safetensors`` (or its sharded ``.index.json`` form), or is a
        pipeline directory with them under ``transformer/``. Weights keep their stored dtype unless
        ``torch_dtype`` is given. ``kwargs``: this class's extra arguments."""
        directory = _transformer_dir(Path(path))
        config = _read_config(directory / "config.json")
        with torch.device("meta"):
            model = cls(**config, **kwargs)
        model.load_state_dict(_read_weights(directory), strict=True, assign=True)
        return model if torch_dtype is None else model.to(torch_dtype)

    def save_pretrained(self, path: str | Path, state_dict: Mapping[str, Tensor] | None = None) -> Path:
        """Write ``config.json`` and ``diffusion_pytorch_model.safetensors`` that diffusers'
        ``FluxTransformer2DModel.from_pretrained(path)`` loads. Pass ``state_dict`` when the
        parameters are partitioned (ZeRO-3: the engine's consolidated state dict)."""
        from safetensors.torch import save_file

        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"_class_name": _DIFFUSERS_CLASS, "_diffusers_version": _diffusers_version(), **self.config}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        weights = self.state_dict() if state_dict is None else state_dict
        save_file({name: t.detach().contiguous().cpu() for name, t in weights.items()}, directory / WEIGHTS_NAME)
        return directory

    # ---- packing ----

    def pack(self, samples: Sequence[Mapping[str, Tensor]]) -> FluxInputs:
        """Pack per-sample diffusers arguments (unbatched: ``hidden_states [L, C]``,
        ``encoder_hidden_states [Tt, Dj]``, ``pooled_projections [Dp]``, ``timestep`` and
        ``guidance`` scalars, ``img_ids [L, 3]``, ``txt_ids [Tt, 3]``) into :class:`FluxInputs`.
        No samples gives an empty batch with the right columns (a rank may have none this step).

        Raises:
            ValueError: a missing key or a shape that does not fit this model's config.
        """
        config = self.config
        guided = config["guidance_embeds"]
        for index, sample in enumerate(samples):
            _check_sample(index, sample, config)
        dtype = next(self.parameters()).dtype

        def cat(key: str, width: int) -> Tensor:
            rows = [torch.as_tensor(s[key]) for s in samples]
            return torch.cat(rows) if rows else torch.zeros(0, width, dtype=dtype)

        def stack(key: str) -> Tensor:
            rows = [torch.as_tensor(s[key]).reshape(-1) for s in samples]
            return torch.cat(rows) if rows else torch.zeros(0, dtype=dtype)

        return FluxInputs(
            hidden_states=cat("hidden_states", config["in_channels"]),
            encoder_hidden_states=cat("encoder_hidden_states", config["joint_attention_dim"]),
            pooled_projections=torch.stack([torch.as_tensor(s["pooled_projections"]) for s in samples])
            if samples
            else torch.zeros(0, config["pooled_projection_dim"], dtype=dtype),
            timestep=stack("timestep"),
            img_ids=cat("img_ids", 3),
            txt_ids=cat("txt_ids", 3),
            img_lens=tuple(int(s["hidden_states"].shape[0]) for s in samples),
            txt_lens=tuple(int(s["encoder_hidden_states"].shape[0]) for s in samples),
            guidance=stack("guidance") if guided else None,
        )

    # ---- forward ----

    def forward_samples(
        self, samples: Sequence[Mapping[str, Tensor]], balancer: KnapBalancer | None = None
    ) -> list[Tensor]:
        """:meth:`pack`, :meth:`forward`, split: one ``[L_i, patch^2 * C_out]`` output per sample,
        what diffusers returns for that sample alone. Collective when ``balancer`` is given."""
        inputs = self.pack(samples)
        return inputs.split(self(inputs, balancer))

    def forward(self, inputs: FluxInputs, balancer: KnapBalancer | None = None) -> Tensor:
        """``[Ti, patch^2 * C_out]`` predictions for ``inputs.hidden_states``' tokens, in their order.
        With a ``balancer`` the blocks run on the tokens the step's plan gives this GPU (collective:
        every rank calls it every step, even with no samples)."""
        img = self.x_embedder(inputs.hidden_states)  # [Ti, D]
        txt = self.context_embedder(inputs.encoder_hidden_states)  # [Tt, D]
        timestep = inputs.timestep.to(img.dtype) * 1000
        guidance = None if inputs.guidance is None else inputs.guidance.to(img.dtype) * 1000
        temb = self.time_text_embed(timestep, guidance, inputs.pooled_projections)  # [N, D]

        txt_rows, img_rows = (torch.as_tensor(rows, device=img.device) for rows in inputs._joint_rows)
        joint_order = torch.argsort(torch.cat([txt_rows, img_rows]))  # inverse of the stream order
        is_text = torch.zeros(len(joint_order), dtype=torch.bool, device=img.device).index_fill_(0, txt_rows, True)
        batch = PackedBatch(
            tokens=torch.cat([txt, img]).index_select(0, joint_order),
            seq_lens=tuple(t + i for t, i in zip(inputs.txt_lens, inputs.img_lens, strict=True)),
            token_data={
                "ids": torch.cat([inputs.txt_ids, inputs.img_ids]).float().index_select(0, joint_order),
                "is_text": is_text,
            },
            sample_data={"temb": temb},
        )
        return balanced_forward(batch, self._blocks, balancer).index_select(0, img_rows)

    def _blocks(self, routed: RoutedBatch) -> Tensor:
        """Every block on this GPU's routed tokens: ``[T, D]`` joint order -> ``[T, C_out]`` (zero
        rows for text tokens, which have no output)."""
        step = FluxStep.build(routed, self.attention, self.config["axes_dims_rope"])
        x = routed.batch.tokens
        txt, img = x.index_select(0, step.txt_rows), x.index_select(0, step.img_rows)
        for block in self.transformer_blocks:
            txt, img = self._run(block, txt, img, step)
        x = step.joint(txt, img)
        for block in self.single_transformer_blocks:
            x = self._run(block, x, step)
        img = x.index_select(0, step.img_rows)
        out = self.proj_out(self.norm_out(img, step.img_seq, step.temb))  # [Ti, C_out]
        return out.new_zeros(x.shape[0], out.shape[1]).index_copy(0, step.img_rows, out)

    def _run(self, block: nn.Module, *args: Any):
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)


def _config_keys() -> tuple[str, ...]:
    return (
        "patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
        "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds", "axes_dims_rope",
    )  # fmt: skip


def _check_sample(index: int, sample: Mapping[str, Tensor], config: dict) -> None:
    keys = SAMPLE_KEYS + (("guidance",) if config["guidance_embeds"] else ())
    missing = [key for key in keys if key not in sample]
    if missing:
        hint = " (this model has guidance_embeds=True: pass a guidance scale)" if "guidance" in missing else ""
        raise ValueError(f"sample {index} has no {missing}{hint}; it has {sorted(sample)}")
    if not config["guidance_embeds"] and sample.get("guidance") is not None:
        raise ValueError(
            f"sample {index} has a guidance value but this model has guidance_embeds=False; drop it (or load a "
            "guidance-distilled model such as FLUX.1-dev)"
        )
    img_len, txt_len = sample["hidden_states"].shape[0], sample["encoder_hidden_states"].shape[0]
    expected = {
        "hidden_states": (img_len, config["in_channels"]),
        "encoder_hidden_states": (txt_len, config["joint_attention_dim"]),
        "pooled_projections": (config["pooled_projection_dim"],),
        "img_ids": (img_len, 3),
        "txt_ids": (txt_len, 3),
        "timestep": (),
    }
    if config["guidance_embeds"]:
        expected["guidance"] = ()
    for key, shape in expected.items():
        actual = tuple(torch.as_tensor(sample[key]).shape)
        if actual != shape and not (shape == () and actual == (1,)):
            raise ValueError(
                f"sample {index}: {key!r} has shape {list(actual)}; expected {list(shape)} (one unbatched sample: "
                f"in_channels={config['in_channels']}, joint_attention_dim={config['joint_attention_dim']}, "
                f"pooled_projection_dim={config['pooled_projection_dim']})"
            )


def _transformer_dir(path: Path) -> Path:
    for directory in (path, path / "transformer"):
        if (directory / "config.json").is_file():
            return directory
    raise FileNotFoundError(
        f"no config.json in {path} or {path / 'transformer'}; pass the directory of a diffusers FluxTransformer2DModel "
        "checkpoint (config.json + diffusion_pytorch_model*.safetensors) or of a FLUX pipeline"
    )


def _read_config(path: Path) -> dict:
    config = json.loads(path.read_text())
    if config.get("_class_name", _DIFFUSERS_CLASS) != _DIFFUSERS_CLASS:
        raise ValueError(f"{path} describes a {config['_class_name']!r}, not a {_DIFFUSERS_CLASS!r}")
    known = set(_config_keys())
    unknown = sorted(key for key in config if not key.startswith("_") and key not in known)
    if unknown:
        raise ValueError(
            f"{path} has config keys {unknown} that PackedFluxTransformer does not implement (it knows {sorted(known)}); "
            "this checkpoint is a FLUX variant it cannot run faithfully"
        )
    return {key: value for key, value in config.items() if key in known}


def _read_weights(directory: Path) -> dict[str, Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as error:
        raise ImportError(
            "loading diffusers weights needs safetensors: pip install 'deepspeed_knap[diffusers]'"
        ) from error
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return load_file(single)
    index = directory / f"{WEIGHTS_NAME}.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {index.name}")
    weights: dict[str, Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        weights.update(load_file(directory / shard))
    return weights


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version

        return version("diffusers")
    except Exception:  # diffusers is optional; any version that has FluxTransformer2DModel reads the file
        return "0.30.0"
