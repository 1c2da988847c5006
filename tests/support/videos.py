"""Video files the tests write themselves, with PyAV (examples/prepare_video_latents.py's decoder)."""

from pathlib import Path

import numpy as np


def write_video(path: Path, frames: int, height: int, width: int, codec: str, seed: int) -> None:
    """``frames`` frames of a moving pattern plus noise, ``height x width``, at 8 fps."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            y, x = np.mgrid[:height, :width]
            pattern = ((x + y + 4 * index) % 32 * 8)[..., None] * np.array([1, 0.5, 0.25])
            pixels = np.clip(pattern + rng.integers(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
