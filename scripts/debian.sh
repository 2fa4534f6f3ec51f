#!/usr/bin/env bash
# Install the Debian packages named (those not installed yet), as root; as a user, say which
# are missing and stop. Used by scripts/test.sh: the image tests need skopeo, umoci, a registry
# server and busybox; the slow suite mmdebstrap, podman and runc.
set -euo pipefail
missing=()
for package in "$@"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [[ $EUID -ne 0 ]]; then
  echo "missing Debian packages: ${missing[*]} (apt-get install ${missing[*]}, as root)" >&2
  exit 1
fi
install=(apt-get install -y -q --no-install-recommends "${missing[@]}")
export DEBIAN_FRONTEND=noninteractive
"${install[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && "${install[@]}" >/dev/null; }
