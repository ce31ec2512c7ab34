#!/usr/bin/env bash
# Install the Debian packages osfarm's desktops need; a no-op when they are all present.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mapfile -t wanted < <(grep -v '^\s*#' "$here/system-packages.txt" | sed '/^\s*$/d')
missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# en_US.UTF-8, the GNOME desktop's locale as on OSWorld's VM (Debian generates none by default)
ensure_locale() {
  locale -a 2>/dev/null | grep -qix 'en_US.utf8' && return 0
  [ "$(id -u)" -eq 0 ] || { echo "locale en_US.UTF-8 missing: run as root" >&2; return 1; }
  sed -i 's/^# *en_US.UTF-8 UTF-8/en_US.UTF-8 UTF-8/' /etc/locale.gen
  grep -q '^en_US.UTF-8 UTF-8' /etc/locale.gen || echo 'en_US.UTF-8 UTF-8' >> /etc/locale.gen
  locale-gen >/dev/null
}
if [ ${#missing[@]} -eq 0 ]; then
  echo "system packages: all ${#wanted[@]} present"
  ensure_locale
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing Debian packages: ${missing[*]}" >&2
  echo "run as root, or: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
ensure_locale
