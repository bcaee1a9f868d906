#!/usr/bin/env bash
# Regenerate the Python modules of the slidespec.v1 API with grpcio-tools 1.84 (the generated
# code must run on grpcio 1.84):
#   cluster/proto/generate.sh [OUT_DIR]     # default OUT_DIR: the repository root
# Writes OUT_DIR/cluster/proto/slidespec/v1/generation_pb2{,_grpc}.py{,i}.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.}
python3 -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  cluster/proto/slidespec/v1/generation.proto
