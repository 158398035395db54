#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what it needs (Rust through
# rustup, a C compiler, redis-server, iproute2, python3-venv; as root or with sudo; as a user
# with sudo the one test that makes network namespaces says SKIP, since it needs root itself),
# checks formatting and lints, runs every unit/integration/Lua test (each test starts its own
# brokers and redis-servers on free ports), then the Autobahn conformance suite against the
# broker's /echo endpoint (../shared/conformance installs it; a run that asked for it and could
# not install it fails).
#
#   tests/run-all.sh            # everything
#   AUTOBAHN=quick tests/run-all.sh   # Autobahn groups 1-7 and 10 only
#   AUTOBAHN=off tests/run-all.sh     # skip Autobahn
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Rust, a C compiler (and on PATH, cargo), when missing.
. tests/ensure-toolchain.sh
sudo=""
if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null; then sudo="sudo"; fi
apt_install() {
  ($sudo apt-get install -y "$@" >/dev/null 2>&1) || ($sudo apt-get update -qq && $sudo apt-get install -y "$@" >/dev/null)
}
if ! command -v redis-server >/dev/null; then
  echo "== installing redis-server"
  apt_install redis-server
fi
# `ip netns` for the vanished-rig fault test; python3 with venv for the Autobahn installer.
if ! command -v ip >/dev/null; then
  echo "== installing iproute2"
  apt_install iproute2
fi
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  echo "== installing python3 and python3-venv"
  apt_install python3 python3-venv
fi
# The admin API's HTTP/1.0 and pipelining tests speak to it through curl.
if ! command -v curl >/dev/null; then
  echo "== installing curl"
  apt_install curl ca-certificates
fi
# Network namespaces need root itself: sudo for apt-get does not give `cargo test` that.
if [[ "$(id -u)" -ne 0 && -z "${FLEETLINK_SKIP_NETNS:-}" ]]; then
  echo "== not root: the network-namespace fault test will say SKIP (run as root to include it)"
  export FLEETLINK_SKIP_NETNS=1
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items -p fleetlink >/dev/null
echo "== cargo test"
# Every wait in the tests is bounded; this bounds the whole run too (it takes about 8 min).
test_log="$(mktemp -t fleetlink-cargo-test.XXXXXX)"
if ! timeout 3600 cargo test --workspace 2>&1 | tee "$test_log" ||
  grep -q "test result: FAILED" "$test_log"; then
  echo "== cargo test FAILED; its whole output is in $test_log"
  exit 1
fi
rm -f "$test_log"

case "${AUTOBAHN:-full}" in
  off) echo "== Autobahn skipped (AUTOBAHN=off)"; exit 0 ;;
esac
installer=""
for cand in ../shared/conformance/install-autobahn.sh ./shared/conformance/install-autobahn.sh; do
  [[ -x "$cand" || -f "$cand" ]] && { installer="$cand"; break; }
done
# Asked for and not run is a failure, not a pass: a green run must mean the suite ran.
if [[ -z "$installer" ]]; then
  echo "== Autobahn FAILED to start: ../shared/conformance/install-autobahn.sh not found" \
    "(AUTOBAHN=off skips the suite)"
  exit 1
fi
echo "== installing Autobahn|Testsuite (cached after the first run)"
install_log="$(mktemp -t fleetlink-autobahn-install.XXXXXX)"
# wstest needs pyenv's CPython 2.7; where it is missing, run.sh uses kosoku (Python 3).
if ! bash "$installer" >"$install_log" 2>&1 || ! grep -q -E '^(wstest|kosoku): /' "$install_log"; then
  echo "== Autobahn FAILED to start: the suite could not be installed here (AUTOBAHN=off skips it);" \
    "the installer's output is in $install_log:"
  tail -5 "$install_log"
  exit 1
fi
rm -f "$install_log"
echo "== Autobahn|Testsuite against /echo"
cargo build --release --bin fleetlink-fe
if [[ "${AUTOBAHN:-full}" == quick ]]; then
  tests/autobahn/run.sh --quick
else
  tests/autobahn/run.sh
fi
