#!/usr/bin/env bash
# The main job: set up the environment if needed, then a short personalized-FL
# experiment on real MNIST (FedEmbed's preference task, Global+: FedAvg with a
# private personal embedding per user), with user-level DP accounting shown in
# a second, DP run. Extra arguments are passed to both runs.
#
#   bash scripts/run_main.sh [--data_dir=...] [--root_output_dir=...]
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
DATA_DIR="${TFF_PERSONAL_MNIST_DIR:-$ROOT/../shared/data/mnist}"
OUT="${TFF_PERSONAL_OUT:-$ROOT/out}"
STAMP="$(date +%Y%m%d-%H%M%S)"
COMMON=(--task=mnist_preference --data_dir="$DATA_DIR" --num_users=1000
        --rounds=10 --clients_per_round=20 --eval_clients=500
        --root_output_dir="$OUT")
echo "== Global+ on MNIST preferences, no DP"
.venv/bin/python -m binaries.train "${COMMON[@]}" --algorithm=global_plus \
  --experiment_name="main-$STAMP" "$@"
echo "== Global+ with user-level DP (gaussian_fixed, z=1.0, clip 0.5)"
.venv/bin/python -m binaries.train "${COMMON[@]}" --algorithm=global_plus \
  --dp=gaussian_fixed --noise_multiplier=1.0 --clip_norm=0.5 \
  --experiment_name="main-dp-$STAMP" "$@"
echo "== Results: $OUT/main-$STAMP/summary.json and $OUT/main-dp-$STAMP/summary.json"
