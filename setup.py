"""deepspeed_knap: KnapFormer-style sequence balancing for DeepSpeed DiT training."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="deepspeed_knap",
    version="0.1.0",
    description="Balance Diffusion Transformer training across GPUs: knapsack routing + DeepSpeed-Ulysses bags",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["deepspeed_knap", "deepspeed_knap.*"]),
    # torch is not pinned here on purpose: install the build your machine needs first (README).
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "numpy>=1.24",
        "pydantic>=2",
        "matplotlib>=3.7",
        "tqdm>=4.60",
    ],
    extras_require={
        "mpi": ["mpi4py>=4", "mpich"],
        "flash": ["flash-attn>=2.6"],
        # transformers: the FLUX pipeline's text encoders (validation images, encoding images); peft: LoRA;
        # av (PyAV, its own FFmpeg in the wheel): decoding videos in examples/prepare_video_latents.py; ftfy:
        # WanImageToVideoPipeline cleans prompts with it (and fails without it)
        "diffusers": ["diffusers>=0.36", "safetensors>=0.4", "transformers>=4.45", "peft>=0.15", "av>=15", "ftfy>=6"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "ruff>=0.6", "scipy>=1.10"],
    },
    entry_points={"console_scripts": ["deepspeed-knap=deepspeed_knap.cli:main"]},
)
