#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what it needs (redis-server),
# checks formatting and lints, runs every unit/integration/Lua test (each test starts its own
# brokers and redis-servers on free ports), then the Autobahn conformance suite against the
# broker's /echo endpoint when the suite is installable here.
#
#   tests/run-all.sh            # everything
#   AUTOBAHN=quick tests/run-all.sh   # Autobahn groups 1-7 and 10 only
#   AUTOBAHN=off tests/run-all.sh     # skip Autobahn
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v redis-server >/dev/null; then
  echo "== installing redis-server"
  (apt-get install -y redis-server >/dev/null 2>&1) || (apt-get update -qq && apt-get install -y redis-server >/dev/null)
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items -p fleetlink >/dev/null
echo "== cargo test"
cargo test --workspace 2>&1 | tee /tmp/fleetlink-cargo-test.log
grep -q "test result: FAILED" /tmp/fleetlink-cargo-test.log && exit 1

case "${AUTOBAHN:-full}" in
  off) echo "== Autobahn skipped (AUTOBAHN=off)"; exit 0 ;;
esac
installer=""
for cand in ../shared/conformance/install-autobahn.sh ./shared/conformance/install-autobahn.sh; do
  [[ -x "$cand" || -f "$cand" ]] && { installer="$cand"; break; }
done
if [[ -z "$installer" ]]; then
  echo "== Autobahn skipped: ../shared/conformance/install-autobahn.sh not found"
  exit 0
fi
echo "== installing Autobahn|Testsuite (cached after the first run)"
if ! bash "$installer" >/tmp/fleetlink-autobahn-install.log 2>&1 || ! grep -q '^wstest: /' /tmp/fleetlink-autobahn-install.log; then
  echo "== Autobahn skipped: the suite could not be installed here:"
  tail -5 /tmp/fleetlink-autobahn-install.log
  exit 0
fi
echo "== Autobahn|Testsuite against /echo"
cargo build --release --bin fleetlink-fe
if [[ "${AUTOBAHN:-full}" == quick ]]; then
  tests/autobahn/run.sh --quick
else
  tests/autobahn/run.sh
fi
