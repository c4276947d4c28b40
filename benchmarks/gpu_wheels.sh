#!/usr/bin/env bash
# Wheels for the GPU machine (docs/gpu.md): Python 3.12, torch 2.11 (CUDA 13), transformers, peft and
# accelerate preinstalled; no network there. Downloads, here, what composer-cloud needs beyond that into
# .gpu-wheels/ (git-ignored; carried with the working tree, 64 MiB in all), pinned as in
# composer_cloud/images/requirements.txt. vLLM's wheel (~400 MB) does not fit.
#   bash benchmarks/gpu_wheels.sh             # trl, torchft, pydantic, typer, rich (~18 MB)
#   bash benchmarks/gpu_wheels.sh --datasets  # also datasets and pyarrow (~63 MB), if the machine lacks them
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
rm -rf "$dest" && mkdir -p "$dest"
wheels=(trl==1.16.0 torchft==0.2.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typer==0.29.2 rich==15.0.0 click==8.5.1 shellingham==1.5.4 markdown-it-py==4.3.0
        mdurl==0.1.2 pygments==2.21.0)
if [[ "${1:-}" == "--datasets" ]]; then
  wheels+=(datasets==5.2.0 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0)
fi
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --dest "$dest" "${wheels[@]}"
du -sh "$dest"
