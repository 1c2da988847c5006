#!/usr/bin/env bash
# The thirteenth lent-GPU call (2026-11-28, an H200, after run12.sh): Qwen-Image at its real width
# (PackedQwenImageTransformer against diffusers per sample on a qwen_edit step, 4 blocks, bf16; with
# Edit-2511's zero_cond_t too), and the one-GPU training test again (run12 found it needing the
# deepspeed command; it now starts through DeepSpeed's per-node launcher).
#   run: carry [".whl"], command "bash docs/bench/gpu/run13.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
section qwen_image 120 python3 "$REPO/docs/bench/gpu/qwen_image.py" --blocks 4 --json qwen_image.json
section qwen_image_2511 100 python3 "$REPO/docs/bench/gpu/qwen_image.py" --blocks 4 --zero-cond --json qwen_image_2511.json
section gpu_train_test 120 bash -c "cd $REPO && python3 -m pytest -m gpu -q -p no:cacheprovider tests/e2e/test_train_flux.py"
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
