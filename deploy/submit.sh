#!/usr/bin/env bash
# Submit a distrl run to a Ray cluster: deploy/submit.sh http://HEAD:8265 configs/grpo-gsm8k.yaml [--set k=v ...]
# For deploy/raycluster.yaml:
#   kubectl port-forward svc/distrl-dashboard 8265:8265 &
#   export RAY_AUTH_TOKEN=$(kubectl get secret distrl-ray-token -o jsonpath='{.data.auth_token}' | base64 -d)
#   deploy/submit.sh http://127.0.0.1:8265 configs/grpo-gsm8k.yaml
# In a Ray job run.output_dir must be an absolute path that every node sees: runs go to $DISTRL_OUTPUT_DIR, by
# default /shared/runs on the volume that the manifests mount at /shared. A --set run.output_dir=... given here wins.
set -euo pipefail
address=${1:?dashboard address, e.g. http://127.0.0.1:8265}
config=${2:?config file}
shift 2
# Ray reads the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token.
if [[ -z ${RAY_AUTH_TOKEN:-} && ! -s ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} ]]; then
  echo "submit.sh: no Ray auth token: set RAY_AUTH_TOKEN (on Kubernetes: kubectl get secret distrl-ray-token" \
       "-o jsonpath='{.data.auth_token}' | base64 -d) or RAY_AUTH_TOKEN_PATH" >&2
  exit 2
fi
export RAY_AUTH_MODE=token
exec ray job submit --address "$address" --working-dir . -- \
  distrl train --config "$config" --set "run.output_dir=${DISTRL_OUTPUT_DIR:-/shared/runs}" "$@"
