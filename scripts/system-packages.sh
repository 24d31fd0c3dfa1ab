#!/usr/bin/env bash
# Debian packages the tests use where the machine allows: prometheus (prometheus + promtool: the dashboard's
# queries and the alert rules, tests/ops) and chromium (headless: the syncer's status page). Installs them with
# apt-get when running as root on a machine with apt-get and they are missing; otherwise does nothing (the tests
# that need them skip, saying why). Quiet and idempotent: nothing is fetched when both are installed.
#   bash scripts/system-packages.sh          # called by scripts/test.sh before the tests
#   YETO_SYSTEM_PACKAGES=0 bash scripts/test.sh   # never touch the system's packages
set -uo pipefail
[ "${YETO_SYSTEM_PACKAGES:-1}" = 0 ] && exit 0
want=(prometheus chromium)
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-packages: ${missing[*]} not installed (not root, or no apt-get): the tests that need them skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
# prometheus' package starts its service where systemd runs; policy-rc.d keeps a container's from starting.
if { apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
     || { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1; }; }; then
  echo "system-packages: installed ${missing[*]}" >&2
else
  echo "system-packages: apt-get could not install ${missing[*]} (the tests that need them skip); last lines:" >&2
  tail -5 "$log" >&2
fi
rm -f "$log"
exit 0
