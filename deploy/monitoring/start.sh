#!/usr/bin/env bash
# Prometheus, and Grafana when it is installed, for the Ray clusters on this machine, until Ctrl-C:
#   deploy/monitoring/start.sh [RAY_TEMP_DIR]            (make monitor)
# RAY_TEMP_DIR is Ray's temporary directory, found as Ray finds it: ${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray. Both
# servers listen on 127.0.0.1 only and follow Ray's newest session there, so they can be started before or after a
# run and keep working across runs. Their data stays in MONITOR_DIR.
#
# Environment: PROMETHEUS (the server; default `prometheus` on PATH), PROMETHEUS_PORT (9090), GRAFANA (the
# Grafana server command; default `grafana server` or `grafana-server` on PATH, `off` for none), GRAFANA_HOME
# (/usr/share/grafana), GRAFANA_PORT (3000), MONITOR_DIR (runs/monitoring).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ray_dir=${1:-${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray}
prometheus=${PROMETHEUS:-prometheus}
prometheus_port=${PROMETHEUS_PORT:-9090}
grafana_port=${GRAFANA_PORT:-3000}
mkdir -p "${MONITOR_DIR:-runs/monitoring}"
data=$(cd "${MONITOR_DIR:-runs/monitoring}" && pwd)

if ! command -v "$prometheus" >/dev/null; then
  echo "no Prometheus server ($prometheus): 'make monitor' fetches Debian's package into .tools/, or" \
       "apt-get install prometheus, or set PROMETHEUS" >&2
  exit 1
fi
if [[ -z ${GRAFANA:-} ]]; then
  if command -v grafana >/dev/null; then GRAFANA="grafana server"
  elif command -v grafana-server >/dev/null; then GRAFANA=grafana-server
  else GRAFANA=off
  fi
fi

pids=()
stop() {  # ends the servers this script started
  trap - EXIT INT TERM
  kill "${pids[@]}" 2>/dev/null || true
  wait || true
}
trap stop EXIT
trap 'exit 0' INT TERM

# The shipped config names Ray's default temporary directory.
sed "s|/tmp/ray/prom_metrics_service_discovery.json|$ray_dir/prom_metrics_service_discovery.json|" \
  "$here/prometheus.yml" >"$data/prometheus.yml"
: >"$data/prometheus.log"  # before the server starts: the wait below reads it
"$prometheus" --config.file="$data/prometheus.yml" --storage.tsdb.path="$data/prometheus" \
  --web.listen-address="127.0.0.1:$prometheus_port" >"$data/prometheus.log" 2>&1 &
pids+=($!)
ready="Server is ready to receive web requests"
for _ in $(seq 300); do  # up to 30 s
  grep -q "$ready" "$data/prometheus.log" && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$data/prometheus.log" >&2; exit 1; }
  sleep 0.1
done
if ! grep -q "$ready" "$data/prometheus.log"; then
  echo "Prometheus did not start in 30 s: $data/prometheus.log" >&2
  exit 1
fi
echo "prometheus: http://127.0.0.1:$prometheus_port (scraping the Ray nodes listed in" \
     "$ray_dir/prom_metrics_service_discovery.json; log $data/prometheus.log)"

if [[ $GRAFANA != off ]]; then
  # grafana.ini and the provisioning files read these.
  export DISTRL_GRAFANA="$here/grafana" RAY_TEMP_DIR="$ray_dir" PROMETHEUS_PORT="$prometheus_port" \
         GRAFANA_PORT="$grafana_port" GRAFANA_DATA="$data/grafana"
  $GRAFANA --homepath "${GRAFANA_HOME:-/usr/share/grafana}" --config "$here/grafana/grafana.ini" \
    >"$data/grafana.log" 2>&1 &
  pids+=($!)
  echo "grafana: http://127.0.0.1:$grafana_port/d/distrl (and Ray's dashboards; log $data/grafana.log)"
else
  echo "grafana: not started (none on PATH, or GRAFANA=off; https://grafana.com/grafana/download): the Ray" \
       "dashboard's metrics view embeds its panels; Prometheus's own page answers PromQL without it"
fi
if [[ $prometheus_port != 9090 || $grafana_port != 3000 ]]; then
  echo "the Ray dashboard looks for them at localhost:9090 and :3000: start the Ray head (distrl train, ray start)" \
       "with RAY_PROMETHEUS_HOST=http://127.0.0.1:$prometheus_port RAY_GRAFANA_HOST=http://127.0.0.1:$grafana_port"
fi
echo "Ctrl-C stops them"
wait -n "${pids[@]}"
