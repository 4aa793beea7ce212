#!/usr/bin/env bash
# The main job: set up the environment if needed, then a short personalized-FL
# experiment on real MNIST (FedEmbed's preference task, FedEmbed-Type: private
# personal embeddings and sub-population heads, FedEmbed Table 2's upper
# bound), with user-level DP accounting shown in a second, DP run. Extra
# arguments are passed to both runs.
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
        --rounds=10 --clients_per_round=50 --eval_clients=200
        --algorithm=fedembed_type --root_output_dir="$OUT")
echo "== FedEmbed-Type on MNIST preferences, no DP"
.venv/bin/python -m binaries.train "${COMMON[@]}" \
  --experiment_name="main-$STAMP" "$@"
echo "== FedEmbed-Type with user-level DP (gaussian_fixed, z=1.0, clip 1.0)"
.venv/bin/python -m binaries.train "${COMMON[@]}" \
  --dp=gaussian_fixed --noise_multiplier=1.0 --clip_norm=1.0 \
  --experiment_name="main-dp-$STAMP" "$@"
echo "== Results: $OUT/main-$STAMP/summary.json and $OUT/main-dp-$STAMP/summary.json"
