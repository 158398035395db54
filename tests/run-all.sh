#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what it needs (Rust through
# rustup, a C compiler, redis-server; as root or with sudo),
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
if ! command -v redis-server >/dev/null; then
  echo "== installing redis-server"
  ($sudo apt-get install -y redis-server >/dev/null 2>&1) || ($sudo apt-get update -qq && $sudo apt-get install -y redis-server >/dev/null)
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items -p fleetlink >/dev/null
echo "== cargo test"
# Every wait in the tests is bounded; this bounds the whole run too (it takes about 8 min).
timeout 3600 cargo test --workspace 2>&1 | tee /tmp/fleetlink-cargo-test.log
grep -q "test result: FAILED" /tmp/fleetlink-cargo-test.log && exit 1

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
if ! bash "$installer" >/tmp/fleetlink-autobahn-install.log 2>&1 || ! grep -q '^wstest: /' /tmp/fleetlink-autobahn-install.log; then
  echo "== Autobahn FAILED to start: the suite could not be installed here (AUTOBAHN=off skips it):"
  tail -5 /tmp/fleetlink-autobahn-install.log
  exit 1
fi
echo "== Autobahn|Testsuite against /echo"
cargo build --release --bin fleetlink-fe
if [[ "${AUTOBAHN:-full}" == quick ]]; then
  tests/autobahn/run.sh --quick
else
  tests/autobahn/run.sh
fi
