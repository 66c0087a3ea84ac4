#!/usr/bin/env bash
# Install lucia-supervisor for the current (non-root) user: a virtual environment, the recipes,
# one systemd user unit per recipe, and the data directories. Idempotent: a second run changes
# nothing. The services are left installed but stopped and not enabled unless --enable is given.
#
#   ./install.sh [--enable] [--recipe FILE]...     install (or update)
#   ./install.sh --uninstall                       remove units and environment; keep the data
set -euo pipefail

src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
home_share=${XDG_DATA_HOME:-$HOME/.local/share}/lucia
venv=$home_share/venv
recipes=$home_share/recipes
data=$home_share/host/data
state=${XDG_STATE_HOME:-$HOME/.local/state}/lucia
units=${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user
python=${PYTHON:-python3}

enable=no
uninstall=no
extra_recipes=()
changed=0

say() { printf 'install.sh: %s\n' "$*"; }
warn() { printf 'install.sh: warning: %s\n' "$*" >&2; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,8s/^# \{0,1\}//p' "$0"; exit 2; }

# No exit under set -e is silent: the line, the command and its exit status (a pipeline's too).
# A command substitution's failure is reported once, by the line that used it.
on_error() {
    [ "$BASH_SUBSHELL" -eq 0 ] || return 0
    local how="exit $1"
    [ "$1" -le 128 ] || how="$how, killed by SIG$(kill -l "$(($1 - 128))" 2>/dev/null || echo '?')"
    [ "${2// /}" = "$2" ] || how="$how; pipeline exits $2"
    printf 'install.sh: line %s: `%s` failed (%s)\n' "$3" "$4" "$how" >&2
}
set -E
trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR

while [ $# -gt 0 ]; do
    case "$1" in
        --enable) enable=yes ;;
        --uninstall) uninstall=yes ;;
        --recipe) [ $# -ge 2 ] || usage; extra_recipes+=("$2"); shift ;;
        -h|--help) usage ;;
        *) printf 'install.sh: unknown argument %s\n' "$1" >&2; usage ;;
    esac
    shift
done

systemctl_user() { systemctl --user "$@"; }

check() {
    [ "$(id -u)" -ne 0 ] || die "run this as the user who will own the services, not as root (for example: sudo -iu lucia $src/install.sh)"
    command -v docker >/dev/null || die "docker is not installed (Debian: sudo apt-get install docker.io)"
    docker info >/dev/null 2>&1 || die "$(id -un) cannot reach the Docker daemon: is dockerd running, and is $(id -un) in the docker group? (sudo usermod -aG docker $(id -un), then log in again)"
    command -v git >/dev/null || die "git is not installed (Debian: sudo apt-get install git)"
    command -v "$python" >/dev/null || die "$python not found; install Python 3.11 or newer, or set PYTHON=/path/to/python3.11"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "Python 3.11 or newer is needed; $python is $("$python" --version 2>&1) (set PYTHON=...)"
    "$python" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$python cannot create virtual environments (Debian: sudo apt-get install python3-venv)"
    systemctl_user show-environment >/dev/null 2>&1 \
        || die "no systemd user manager answers for $(id -un) (is XDG_RUNTIME_DIR=/run/user/$(id -u) set? log in through a session, or: sudo loginctl enable-linger $(id -un))"
    local linger
    linger=$(loginctl show-user "$(id -un)" -p Linger --value 2>/dev/null || true)
    if [ "$linger" != "yes" ]; then
        warn "user services stop when $(id -un) logs out and do not start at boot; to keep them: sudo loginctl enable-linger $(id -un)"
    fi
}

# Copy src to dst (mode) only when the content or mode differs; count changes.
place() {
    local from=$1 to=$2 mode=$3
    if [ -f "$to" ] && cmp -s "$from" "$to" && [ "$(stat -c %a "$to")" = "${mode#0}" ]; then
        return
    fi
    install -m "$mode" "$from" "$to"
    say "installed $to"
    changed=$((changed + 1))
}

source_hash() {
    (cd "$src" && find pyproject.toml README.md supervisor kvplugin -type f -not -path '*/__pycache__/*' \
        -print0 | sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1
}

install_venv() {
    local want have=""
    want=$(source_hash)
    [ -f "$venv/.lucia-source" ] && have=$(cat "$venv/.lucia-source")
    if [ -x "$venv/bin/lucia-supervisor" ] && [ "$want" = "$have" ]; then
        return
    fi
    if [ ! -x "$venv/bin/python" ]; then
        say "creating $venv"
        mkdir -p "$home_share"
        "$python" -m venv "$venv"
    fi
    say "installing lucia-supervisor into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$src" \
        2> >(grep -v '^WARNING: Location' >&2)
    echo "$want" > "$venv/.lucia-source"
    changed=$((changed + 1))
}

render_unit() {
    local name=$1 tmp
    tmp=$(mktemp)
    sed "s/@NAME@/$name/g" "$src/units/lucia-worker.service.in" > "$tmp"
    place "$tmp" "$units/lucia-$name.service" 0644
    rm -f "$tmp"
}

install_all() {
    check
    install -d -m 0750 "$home_share" "$home_share/host" "$data"
    install -d -m 0700 "$state"
    install -d -m 0755 "$recipes" "$units"
    install_venv
    place "$src/README.md" "$home_share/README.md" 0644
    local recipe name
    for recipe in "$src"/recipes/*.toml "${extra_recipes[@]}"; do
        [ -f "$recipe" ] || die "no such recipe file: $recipe"
        name=$(basename "$recipe" .toml)
        [[ "$name" =~ ^[a-z0-9][a-z0-9_.-]*$ ]] || die "recipe file name $name is not a valid engine name"
        [ "$name" != gateway ] || die "recipe file name gateway is taken by the lucia-gateway unit"
        [ "$name" != models ] || die "recipe file name models is taken by the lucia-models unit"
        "$venv/bin/python" -c 'import sys; from pathlib import Path; from supervisor.engines.loader import load; load(Path(sys.argv[1]))' "$recipe" \
            || die "recipe $recipe is invalid (see above)"
        place "$recipe" "$recipes/$name.toml" 0644
        render_unit "$name"
    done
    # the gateway: installed, never started or enabled here (it needs its key files first)
    place "$src/units/lucia-gateway.service" "$units/lucia-gateway.service" 0644
    # the model library's download queue: installed, never started or enabled here
    place "$src/units/lucia-models.service" "$units/lucia-models.service" 0644
    if [ "$changed" -gt 0 ]; then
        systemctl_user daemon-reload
        say "$changed change(s); systemd reloaded"
    else
        say "already installed; nothing to change"
    fi
    if [ "$enable" = yes ]; then
        for recipe in "$recipes"/*.toml; do
            name=$(basename "$recipe" .toml)
            systemctl_user enable --now "lucia-$name.service"
        done
    fi
    say "the gateway is installed stopped: write its key files, then systemctl --user enable --now lucia-gateway"
    say "the model library's downloads are installed stopped: systemctl --user enable --now lucia-models"
    say "services: $(cd "$units" && ls lucia-*.service | tr '\n' ' ')"
    say "start one with: systemctl --user start lucia-NAME; request it with: $venv/bin/lucia-supervisor request NAME running --wait"
}

uninstall_all() {
    [ "$(id -u)" -ne 0 ] || die "run this as the user who owns the services, not as root"
    local unit
    for unit in "$units"/lucia-*.service; do
        [ -f "$unit" ] || continue
        systemctl_user disable --now "$(basename "$unit")" 2>/dev/null || true
        rm -f "$unit"
        say "removed $unit (its engine container, if any, keeps running: request stopped first to stop it)"
    done
    systemctl_user daemon-reload 2>/dev/null || true
    rm -rf "$venv" "$recipes" "$home_share/README.md"
    say "removed $venv and $recipes; kept the data in $data and $state"
}

if [ "$uninstall" = yes ]; then
    uninstall_all
else
    install_all
fi
