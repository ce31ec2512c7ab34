#!/usr/bin/env bash
# The Ubuntu font family (UI font of the GNOME desktop, as on OSWorld's Ubuntu VM): Debian has no
# package of it; npm has Google Fonts' TTF files. Installed into /usr/share/fonts (sandbox boxes
# see the host's /usr; the Docker image runs this too). Idempotent: a no-op once installed.
set -euo pipefail
dest=/usr/share/fonts/truetype/ubuntu
packages=("@expo-google-fonts/ubuntu@0.4.1" "@expo-google-fonts/ubuntu-mono@0.4.1")
if [ -f "$dest/.osfarm-installed" ] && [ "$(cat "$dest/.osfarm-installed")" = "${packages[*]}" ]; then
  echo "fonts: Ubuntu font family present"
  exit 0
fi
command -v npm >/dev/null || { echo "fonts: npm is needed to fetch the Ubuntu font family" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "${packages[@]}" >/dev/null)
mkdir -p "$dest"
for tgz in "$work"/*.tgz; do
  tar -xzf "$tgz" -C "$work" --wildcards 'package/*.ttf'
  find "$work/package" -name '*.ttf' -exec install -m 0644 {} "$dest/" \;
  rm -rf "$work/package"
done
fc-cache -f "$dest" >/dev/null 2>&1 || true
echo "${packages[*]}" > "$dest/.osfarm-installed"
echo "fonts: installed $(ls "$dest"/*.ttf | wc -l) Ubuntu font files into $dest"
