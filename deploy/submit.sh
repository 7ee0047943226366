#!/usr/bin/env bash
# Submit a distrl run to a Ray cluster: deploy/submit.sh http://HEAD:8265 configs/grpo-gsm8k.yaml [--set k=v ...]
set -euo pipefail
address=${1:?dashboard address, e.g. http://127.0.0.1:8265}
config=${2:?config file}
shift 2
export RAY_AUTH_MODE=token   # send the token: from ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN
exec ray job submit --address "$address" --working-dir . -- distrl train --config "$config" "$@"
