#!/usr/bin/env bash
# The wheels the device check needs on the lent GPU machine and that its image lacks
# (/work/.library/device/KINDS.md lists what is there: torch 2.11, tokenizers, tensorboard,
# einops, pillow, fsspec, pyarrow, pandas, huggingface-hub, ... but no torchtitan, torchao).
# That machine has no network: the files travel in the ignored folder .whl (carry: [".whl"])
# and benchmarks/device_check.py installs them there with pip --no-index --no-deps --target.
#
#   bash benchmarks/device_wheels.sh        # here, once, in the checkout's root
#
# torchtitan 0.2.2, not 0.3.0: 0.3.0 needs torch_checkpointing and spmd_types, cut against a
# newer torch; 0.2.2 imports on torch 2.11 (checked in /work/venv211). Its needs the image
# lacks: torchdata, tyro (+ docstring-parser, typeguard), datasets (+ dill, multiprocess;
# imported by torchtitan's llama3 package though the check feeds random tokens).
# torchao 0.18: loom's --float8 (pyproject's float8 extra).
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE=$(git rev-parse --git-path info/exclude)  # a worktree's is the main checkout's
grep -qxF '/.whl/' "$EXCLUDE" 2> /dev/null || echo /.whl/ >> "$EXCLUDE"
mkdir -p .whl
WHEELS=(torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0
        typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
