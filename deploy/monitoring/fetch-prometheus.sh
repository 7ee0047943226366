#!/usr/bin/env bash
# Debian's prometheus package unpacked into DIR (the server is DIR/usr/bin/prometheus), not installed:
#   deploy/monitoring/fetch-prometheus.sh DIR          (make prometheus)
# apt reads this machine's sources into a list directory of its own, so the system's package state is untouched and
# no root is needed. Only the server binary is used (its web UI's JavaScript dependencies are not fetched; the
# query API and graphs that Grafana draws do not need them). `apt-get install prometheus` works as well.
set -euo pipefail
dest=${1:?directory to unpack Debian\'s prometheus package into}
command -v apt-get >/dev/null || {
  echo "fetch-prometheus.sh needs apt-get (Debian or Ubuntu); elsewhere install Prometheus and set PROMETHEUS" >&2
  exit 1
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
# As root, apt would hand the download to its _apt user, which cannot write into this private directory.
apt=(apt-get -q -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Debug::NoLocking=1
     -o "APT::Sandbox::User=$(id -un)")
"${apt[@]}" update >/dev/null
(cd "$work" && "${apt[@]}" download prometheus >/dev/null)
rm -rf "$dest" "$dest.part" && mkdir -p "$dest.part"
dpkg-deb -x "$work"/prometheus_*.deb "$dest.part"
mv "$dest.part" "$dest"  # complete or absent: make tests for the binary
"$dest/usr/bin/prometheus" --version 2>&1 | head -1
