# shellcheck shell=bash
# bench/lib/procs.sh — start and stop what a bench script runs, so that nothing it starts
# (broker, loadgen, redis-server, perf, a nested bench script) outlives it. Source it, then:
#
#   procs_traps               HUP, INT, TERM and PIPE end the script with 128 + the signal
#                             through its EXIT trap. Without a trap, HUP (a closed terminal or
#                             SSH session) and PIPE skip the script's own handling, and
#                             fleetlink-fe and redis-server ignore SIGHUP, so they stayed up.
#   procs_cleanup_begin       first thing in the EXIT trap's function: from then on a signal
#                             (a second Ctrl-C, the SIGTERM a supervisor sends after its own)
#                             only makes the procs_stop* below hurry to SIGKILL, instead of
#                             ending the script half-way through its cleanup; errexit is off.
#   procs_spawn [-s SIG] [-o FILE] [-e FILE|-] CMD [ARG]...
#                             CMD in the background, stdout to FILE (-o), stderr to FILE or, with
#                             `-e -`, to stdout's FILE (2>&1); else inherited. Its pid is set in
#                             PROCS_PID and added to PROCS_ALL before a signal that arrives
#                             meanwhile takes effect (a trap that ran between `cmd &` and
#                             `pid=$!` saw no pid and left the process running). CMD runs in a
#                             process group of its own (PID = PGID, so stopping it reaches
#                             whatever it forks), in the script's session, and gets SIG (default KILL;
#                             TERM for a bench script, which then stops what it started) when
#                             this script dies, however it dies, SIGKILL included (setpriv
#                             --pdeathsig). Not a session of its own (setsid): with
#                             kernel.sched_autogroup_enabled, as on Debian, each session is a
#                             scheduler group, so a broker, its loadgen and its publisher would
#                             share the CPUs as three groups rather than as threads, and a
#                             multi-threaded broker got less of them: run so, fleetlink-fe's admin
#                             fan-out p99 read 8-75 ms against 1.1-1.7 ms (3 alternating pairs).
#                             PROCS_PDEATHSIG_OK is 1 when setpriv and perl (for setpgrp) are
#                             there; without them, neither is used and CMD stays in the script's
#                             process group. Call
#                             it in the script's own shell, not in a $(...), ( ) or pipeline
#                             subshell: that subshell's exit would be the parent's death.
#   procs_stop TENTHS PID...  SIGTERM to each PID, then to what is left of its process group once
#                             it has ended; up to TENTHS tenths of a second for all of them to
#                             end, then SIGKILL to the groups; reaps them. Only PIDs that are
#                             still this shell's children are signalled (PIDs wrap around: one
#                             reaped long ago may name somebody else's process now).
#   procs_stop_all TENTHS     procs_stop over PROCS_ALL (and $!): the EXIT trap's last word.
#
# The script must not reset its HUP/INT/TERM/PIPE traps itself, nor run `trap - ...` in its
# cleanup. Needs bash 4.4+.

PROCS_PID=""
PROCS_ALL=()
PROCS_HURRY=0
_procs_spawning=0
_procs_pending=""
_procs_cleaning=0
# setpriv --pdeathsig is util-linux 2.33+ (2018).
if command -v perl >/dev/null 2>&1 && setpriv --pdeathsig KILL true >/dev/null 2>&1; then
  PROCS_PDEATHSIG_OK=1
else
  PROCS_PDEATHSIG_OK=0
fi

_procs_on_signal() { # EXIT_STATUS
  if (( _procs_cleaning )); then
    PROCS_HURRY=1
  elif (( _procs_spawning )); then
    _procs_pending="$1"
  else
    exit "$1"
  fi
}

procs_traps() {
  trap '_procs_on_signal 129' HUP
  trap '_procs_on_signal 130' INT
  trap '_procs_on_signal 141' PIPE
  trap '_procs_on_signal 143' TERM
}

procs_cleanup_begin() {
  _procs_cleaning=1
  # A signal to the whole process group also ends the cleanup's own `sleep`: with errexit on,
  # its status would end the script there, leaving the rest running.
  set +e
}

# The background child of procs_spawn: redirects, then execs CMD (so its pid is $!).
_procs_exec() { # SIG OUT ERR CMD [ARG]...
  local sig="$1" out="$2" err="$3"
  shift 3
  if [[ -n "$out" ]]; then exec >"$out"; fi
  if [[ "$err" == - ]]; then exec 2>&1; elif [[ -n "$err" ]]; then exec 2>"$err"; fi
  if (( PROCS_PDEATHSIG_OK )); then
    # shellcheck disable=SC2016 # perl's own variables
    exec setpriv --pdeathsig "$sig" -- perl -e \
      'setpgrp(0, 0) or die "setpgrp: $!\n"; exec { $ARGV[0] } @ARGV or die "exec $ARGV[0]: $!\n"' \
      -- "$@"
  fi
  exec "$@"
}

procs_spawn() { # [-s SIG] [-o FILE] [-e FILE|-] CMD [ARG]...
  local sig=KILL out="" err="" rc
  while :; do
    case "$1" in
      -s) sig="$2"; shift 2 ;;
      -o) out="$2"; shift 2 ;;
      -e) err="$2"; shift 2 ;;
      *) break ;;
    esac
  done
  _procs_spawning=1
  _procs_exec "$sig" "$out" "$err" "$@" &
  PROCS_PID=$!
  PROCS_ALL+=("$PROCS_PID")
  _procs_spawning=0
  if [[ -n "$_procs_pending" ]]; then
    rc="$_procs_pending"
    _procs_pending=""
    exit "$rc"
  fi
}

# Whether PID is (still) a child of this shell: running, or ended and not yet reaped. With
# "running", not ended either.
_procs_ours() { # PID [running]
  local s
  [[ "$1" =~ ^[0-9]+$ ]] || return 1
  { read -r s <"/proc/$1/stat"; } 2>/dev/null || return 1
  s=${s##*) } # after "(comm) ": state, ppid, pgrp, ...
  [[ "${s#* }" == "$$ "* ]] || return 1
  [[ "${2:-}" != running || "${s%% *}" != Z ]]
}

# Whether anything of PID's process group (or PID itself, when it leads none) still runs.
_procs_alive() {
  kill -0 -- "-$1" 2>/dev/null || _procs_ours "$1" running
}

procs_stop() { # TENTHS PID...
  local tenths="$1" p i left
  shift
  local mine=() grouped=" "
  for p in "$@"; do
    [[ -n "$p" ]] && _procs_ours "$p" && mine+=("$p")
  done
  (( ${#mine[@]} > 0 )) || return 0
  # The process first: a bench script then stops what it started itself, in order. What is left
  # of its process group (what a wrapper forked) gets its SIGTERM once the process has ended.
  for p in "${mine[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for ((i = 0; ; i++)); do
    left=0
    for p in "${mine[@]}"; do
      if [[ "$grouped" != *" $p "* ]] && ! _procs_ours "$p" running; then
        kill -TERM -- "-$p" 2>/dev/null || true
        grouped+="$p "
      fi
      _procs_alive "$p" && left=1
    done
    (( left && i < tenths && !PROCS_HURRY )) || break
    sleep 0.1 || true
  done
  for p in "${mine[@]}"; do
    if _procs_alive "$p"; then
      kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null || true
    fi
  done
  for p in "${mine[@]}"; do wait "$p" 2>/dev/null || true; done
  return 0
}

procs_stop_all() { # TENTHS
  procs_stop "$1" ${PROCS_ALL[@]+"${PROCS_ALL[@]}"} ${!-}
}
