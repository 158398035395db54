# Sourced by tests/run-all.sh and by the README's broker command: on a fresh Debian machine,
# installs what building fleetlink needs and puts cargo on PATH. Does nothing where it is
# there already. Needs root, or sudo, for apt-get; rustup installs into ~/.cargo.
#
#   . tests/ensure-toolchain.sh && cargo run --release --bin fleetlink-fe -- ...
#
# No `set -e` here: it would stay set in the shell that sources this. Its status says whether
# cargo is there to use, so that `&&` stops, and run-all.sh's `set -e` ends, with the reason
# printed rather than at "cargo: command not found".

fl_min_rust=1.88   # the oldest rustc the locked dependencies build with (Cargo.toml rust-version)

fl_sudo=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then fl_sudo="sudo"; fi
fl_apt() {
  $fl_sudo apt-get install -y "$@" >/dev/null 2>&1 ||
    { $fl_sudo apt-get update -qq && $fl_sudo apt-get install -y "$@" >/dev/null; }
}

# ring and mimalloc compile C.
if ! command -v cc >/dev/null 2>&1; then
  echo "== installing a C compiler (build-essential)"
  fl_apt build-essential
fi

if [ -x "$HOME/.cargo/bin/cargo" ]; then
  case ":$PATH:" in *":$HOME/.cargo/bin:"*) ;; *) PATH="$HOME/.cargo/bin:$PATH"; export PATH ;; esac
fi
# A rustc older than this (Debian's packaged one, say) cannot build the locked dependencies.
fl_too_old() {
  fl_rustc=$(rustc --version 2>/dev/null | awk '{print $2}')
  [ -z "$fl_rustc" ] || [ "$(printf '%s\n%s\n' "$fl_min_rust" "$fl_rustc" | sort -V | head -1)" != "$fl_min_rust" ]
}
if ! command -v cargo >/dev/null 2>&1 || fl_too_old; then
  if command -v rustup >/dev/null 2>&1; then
    echo "== rustc ${fl_rustc:-missing} is older than $fl_min_rust: installing stable with rustup"
    rustup toolchain install stable --profile minimal --component rustfmt,clippy >/dev/null &&
      rustup default stable >/dev/null
  else
    # Debian's packaged Rust is too old for the dependencies: rustup's stable it is, ahead of
    # any packaged one on PATH (the skip lets rustup install beside /usr/bin/rustc).
    echo "== installing Rust (rustup, stable, with rustfmt and clippy)"
    command -v curl >/dev/null 2>&1 || fl_apt curl ca-certificates
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
      RUSTUP_INIT_SKIP_PATH_CHECK=yes sh -s -- -y --profile minimal --component rustfmt,clippy >/dev/null
  fi
  PATH="$HOME/.cargo/bin:$PATH"; export PATH
  hash -r
  if fl_too_old; then
    echo "== rustc ${fl_rustc:-missing} is still older than $fl_min_rust, which the dependencies" \
      "need: install Rust with rustup (https://rustup.rs), not apt" >&2
  fi
fi
if command -v rustup >/dev/null 2>&1 && ! cargo fmt --version >/dev/null 2>&1; then
  # Only the test suite's fmt and clippy steps need them; they say so if they are missing.
  rustup component add rustfmt clippy >/dev/null 2>&1 ||
    echo "== rustup could not add rustfmt and clippy (the test suite's first steps need them)" >&2
fi
fl_ready=yes
if ! command -v cargo >/dev/null 2>&1; then
  echo "== cargo is not on PATH: the steps above could not install Rust (see their output)" >&2
  fl_ready=no
elif fl_too_old; then
  fl_ready=no
fi
unset fl_min_rust fl_sudo fl_rustc
unset -f fl_apt fl_too_old
case $fl_ready in yes) unset fl_ready ;; *) unset fl_ready; false ;; esac
