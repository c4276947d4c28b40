#!/usr/bin/env bash
# Wheels for the GPU machine (docs/gpu.md, "The GPU check"). Its stock image has Python 3.12, torch 2.11
# (CUDA 13), transformers 5.17, peft 0.21, accelerate 1.15, huggingface_hub 1.33 and pyarrow 25, and
# with them what those need (numpy, tokenizers, safetensors, typer, click, httpx, psutil, jinja2, ...);
# it has no trl, torchft, datasets, pydantic or opentelemetry, and no network. This downloads, here, the
# closure composer-cloud needs beyond the image into .gpu-wheels/ (git-ignored; carried with the working
# tree, 64 MiB in all), pinned as in composer_cloud/images/requirements.txt, with
# .gpu-wheels/requirements.txt: the names to install there without re-resolving the image's stack:
#     pip install --no-index --find-links .gpu-wheels -r .gpu-wheels/requirements.txt
# pip then installs only what is missing or too old; torch, transformers and the rest stay as they are.
# vLLM's wheel (~400 MB) does not fit.
#
#   bash benchmarks/gpu_wheels.sh            # ~25 MB: trl, torchft + opentelemetry, datasets, pandas, pydantic, ...
#   bash benchmarks/gpu_wheels.sh --pyarrow  # also pyarrow (~45 MB), for a machine without it (datasets needs >= 24)
#   bash benchmarks/gpu_wheels.sh --verify   # then install them into a fresh venv shaped like the image and import
#
# --verify approximates the image on this machine's Python (3.11; the download is for 3.12): torch from this
# venv (linked, not downloaded), transformers 5.17.0, peft 0.21.0, accelerate 1.15.0, huggingface_hub 1.33.0,
# pyarrow 25.0.1 and a typer without pydantic from PyPI; then the carried wheels with --no-index, `pip check`,
# and `import composer_cloud.replica, torchft, trl, datasets` from the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
pyarrow=0 verify=0
for a in "$@"; do
  case "$a" in
    --pyarrow|--datasets) pyarrow=1 ;;  # --datasets: the old name (datasets itself is always carried now)
    --verify) verify=1 ;;
    *) echo "gpu_wheels.sh: unknown argument $a (use --pyarrow, --verify)" >&2; exit 2 ;;
  esac
done

# What to install there (top-level; pip finds the rest of the closure among the wheels below).
top=(trl==1.16.0 torchft==0.2.0 datasets==5.2.0 pydantic==2.14.4 typer rich)
wheels=(
  trl==1.16.0
  # torchft imports torchft/otel.py, which imports the OpenTelemetry SDK and its OTLP/HTTP exporter
  torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  googleapis-common-protos==1.76.0 protobuf==7.36.2
  requests==2.34.2 charset-normalizer==3.5.3 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
  # trl and composer-cloud build datasets.Dataset; datasets needs pyarrow >= 24 (the image's 25 will do) and pandas
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0
  pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0
  # the spec and the CLI (pydantic needs typing_extensions >= 4.16; torch's floor is lower)
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  typer==0.29.2 annotated-doc==0.0.7 rich==15.0.0 click==8.5.1 shellingham==1.5.4 markdown-it-py==4.3.0
  mdurl==0.1.2 pygments==2.21.0
)
if (( pyarrow )); then
  wheels+=(pyarrow==26.0.1)
fi
rm -rf "$dest" && mkdir -p "$dest"
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --dest "$dest" "${wheels[@]}"
printf '%s\n' "${top[@]}" > "$dest/requirements.txt"
(( pyarrow )) && echo "pyarrow>=24" >> "$dest/requirements.txt"
echo "$(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest (with the working tree: 64 MiB at most)"

if (( verify )); then
  # GPU_IMAGE_VENV=DIR: reuse a venv an earlier --verify built (its image part; the carried part is redone).
  venv=${GPU_IMAGE_VENV:-$(mktemp -d /tmp/gpu-image-venv.XXXXXX)}
  py=$(command -v python3)
  if [[ ! -f $venv/image-before.txt ]]; then
    "$py" -m venv "$venv"
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # torch is not downloaded: link this venv's build (and its dist-info, so pip sees it installed).
    here=$("$py" -c "import torch, pathlib; print(pathlib.Path(torch.__file__).parent.parent)")
    for d in "$here"/torch "$here"/torchgen "$here"/functorch "$here"/torch-*.dist-info; do ln -s "$d" "$site/"; done
    # The image's stack (torch's own dependencies first, then the packages the issue lists; an old
    # typing_extensions and a typer from before it needed pydantic, as an image without pydantic has).
    "$venv/bin/pip" install --quiet filelock typing-extensions==4.12.2 sympy networkx jinja2 fsspec \
      "typer<0.21" transformers==5.17.0 huggingface_hub==1.33.0 peft==0.21.0 accelerate==1.15.0 pyarrow==25.0.1
    "$venv/bin/pip" list --format=freeze > "$venv/image-before.txt"
  fi
  # The compiled (and Python-version-tagged) wheels above are for 3.12; this Python needs the same versions
  # built for itself, as stand-ins.
  compiled=$(cd "$dest" && ls *.whl | grep -vE -- '-(py3|py2\.py3)-none-any\.whl$' | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
  pip download --quiet --no-deps --only-binary=:all: --dest "$venv/here-wheels" $compiled
  # Nothing but the carried wheels (and those stand-ins): no index, no configured find-links.
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install --no-index --find-links "$dest" \
    --find-links "$venv/here-wheels" -r "$dest/requirements.txt"
  "$venv/bin/pip" list --format=freeze > "$venv/image-after.txt"
  echo "changed or added by the carried wheels:"; diff "$venv/image-before.txt" "$venv/image-after.txt" | grep '^[<>]' || true
  "$venv/bin/pip" check
  PYTHONPATH=$PWD "$venv/bin/python" -c "
import composer_cloud.replica, torchft, trl, datasets
from importlib.metadata import version
print('imports ok:', {p: version(p) for p in ('torch', 'transformers', 'huggingface_hub', 'peft', 'trl', 'torchft', 'datasets', 'pyarrow')})"
  echo "verified in $venv (remove it when done)"
fi
