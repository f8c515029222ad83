#!/usr/bin/env bash
# Put Prometheus's `promtool` into BIN_DIR (default .venv/bin) for the alert-rule tests
# (tests/test_observability.py: `promtool check rules` and `promtool test rules`).
#
# promtool is on no PyPI wheel; Debian's `prometheus` package ships it. Only that one binary is
# taken out of the package (no Prometheus server installed, no service started, no root needed
# beyond what `apt-get download` needs for its lists). Doing nothing when it is already there, so
# `make install` may call it every time.
set -euo pipefail
BIN_DIR="${1:-.venv/bin}"
[ -x "$BIN_DIR/promtool" ] && exit 0
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
if ! { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download prometheus >/dev/null 2>&1; }; }; then
  # Not Debian, or no rights to refresh apt's lists: the promtool tests then skip, saying why.
  echo "install_promtool: could not fetch Debian's prometheus package; the promtool tests will skip" >&2
  exit 0
fi
dpkg-deb -x prometheus_*.deb extracted
cd - >/dev/null
install -m 0755 "$WORK/extracted/usr/bin/promtool" "$BIN_DIR/promtool"
"$BIN_DIR/promtool" --version | head -1
