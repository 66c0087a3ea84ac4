#!/usr/bin/env bash
# Install lucia-supervisor for the current (non-root) user: a virtual environment, the recipes,
# one systemd user unit per recipe, the documentation and the data directories. Idempotent: a
# second run changes nothing. The services are left installed but stopped and not enabled unless
# --enable is given.
#
#   ./install.sh [--enable] [--recipe FILE]...   install (or update)
#   ./install.sh --uninstall                     stop, disable and remove every lucia unit, and
#                                                remove the venv, the recipes and the documentation;
#                                                keep the data (engine containers keep running)
#   ./install.sh --uninstall --purge             the same, then remove the data too; refused while
#                                                an engine container of this installation exists
set -euo pipefail

src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
home_share=${XDG_DATA_HOME:-$HOME/.local/share}/lucia
venv=$home_share/venv
recipes=$home_share/recipes
data=$home_share/host/data
state=${XDG_STATE_HOME:-$HOME/.local/state}/lucia
config=${XDG_CONFIG_HOME:-$HOME/.config}/lucia
units=${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user
python=${PYTHON:-python3}

enable=no
uninstall=no
purge=no
extra_recipes=()
changed=0

say() { printf 'install.sh: %s\n' "$*"; }
warn() { printf 'install.sh: warning: %s\n' "$*" >&2; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
# The usage: the header's comment, from its second line to the first line that is not a comment.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }

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
        --purge) purge=yes ;;
        --recipe) [ $# -ge 2 ] || usage; extra_recipes+=("$2"); shift ;;
        -h|--help) usage ;;
        *) printf 'install.sh: unknown argument %s\n' "$1" >&2; usage ;;
    esac
    shift
done
if [ "$uninstall" = yes ] && { [ "$enable" = yes ] || [ "${#extra_recipes[@]}" -gt 0 ]; }; then
    printf 'install.sh: --uninstall takes no --enable or --recipe\n' >&2; usage
fi
if [ "$purge" = yes ] && [ "$uninstall" = no ]; then
    printf 'install.sh: --purge removes the data of an uninstall: ./install.sh --uninstall --purge\n' >&2; usage
fi

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

# A folder (mode 0755) made or corrected only when it is missing or its mode differs; counted.
place_dir() {
    local to=$1
    if [ -d "$to" ] && [ "$(stat -c %a "$to")" = 755 ]; then
        return
    fi
    install -d -m 0755 "$to"
    say "installed $to/"
    changed=$((changed + 1))
}

# The source's docs/ tree as $home_share/docs: files 0644, folders 0755, each placed only when
# it differs; an installed file or folder the source no longer has is removed.
install_docs() {
    [ -d "$src/docs" ] || return 0
    local from rel
    place_dir "$home_share/docs"
    while IFS= read -r -d '' from; do
        rel=${from#"$src/docs/"}
        if [ -d "$from" ]; then
            place_dir "$home_share/docs/$rel"
        else
            place "$from" "$home_share/docs/$rel" 0644
        fi
    done < <(find "$src/docs" -mindepth 1 \( -type d -o -type f \) -print0 | sort -z)
    while IFS= read -r -d '' from; do
        rel=${from#"$home_share/docs/"}
        [ ! -e "$src/docs/$rel" ] || continue
        rm -rf "$from"
        say "removed $from (no longer in $src/docs)"
        changed=$((changed + 1))
    done < <(find "$home_share/docs" -mindepth 1 -depth -print0)
}

install_all() {
    check
    install -d -m 0750 "$home_share" "$home_share/host" "$data"
    install -d -m 0700 "$state"
    install -d -m 0755 "$recipes" "$units"
    install_venv
    place "$src/README.md" "$home_share/README.md" 0644
    install_docs
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

# -- uninstall ------------------------------------------------------------------------------------

cli=$venv/bin/lucia-supervisor

# The engine containers this installation's workers made, one line each, `|` between: the
# container, its engine and how it is known as this installation's: `labelled` (its lucia.data
# label is this installation's data directory) or `named` (made before containers carried that
# label, its lucia.name is an engine of this data directory). Another installation's are never
# listed. Fails when Docker cannot be asked.
installation_containers() {
    local listing container name dir ours
    command -v docker >/dev/null || return 1
    listing=$(docker ps -a --filter label=lucia.managed=true \
        --format '{{.Names}}|{{.Label "lucia.name"}}|{{.Label "lucia.data"}}' 2>/dev/null) || return 1
    ours=$(realpath -m -- "$data")
    while IFS='|' read -r container name dir; do
        [ -n "$container" ] || continue
        if [ -n "$dir" ]; then
            if [ "$(realpath -m -- "$dir")" = "$ours" ]; then
                printf '%s|%s|labelled\n' "$container" "$name"
            fi
        elif [[ "$name" =~ ^[a-z0-9][a-z0-9_.-]*$ ]] && [ -d "$data/$name" ]; then
            printf '%s|%s|named\n' "$container" "$name"
        fi
    done <<<"$listing"
}

# The command that stops an engine container: its worker's request while the worker is
# installed (it stops and removes the container), else docker's.
stop_command() {
    local container=$1 name=$2
    if [ -f "$units/lucia-$name.service" ] && [ -x "$cli" ]; then
        if [ "$(systemctl_user is-active "lucia-$name.service" 2>/dev/null || true)" = active ]; then
            echo "$cli request $name stopped --wait"
        else
            echo "systemctl --user start lucia-$name && $cli request $name stopped --wait"
        fi
    else
        echo "docker stop $container && docker rm $container (no worker of $name is installed)"
    fi
}

# --purge refused while an engine container of this installation exists: the data holds what it
# mounts (its model, its KV tiers, its secrets). True, having said so with each container and the
# command that stops it, when there is one; $1 says what was done before.
purge_refused() {
    local found container name how note
    found=$(installation_containers) \
        || die "--purge refused, $1: Docker cannot be asked whether an engine container of this installation still exists, and the data holds what such a container mounts; start dockerd (or let $(id -un) reach it) and run this again"
    [ -n "$found" ] || return 1
    printf 'install.sh: --purge refused, %s: engine containers of this installation still exist, and the data holds what they mount; stop each, then run %s --uninstall --purge again:\n' \
        "$1" "$src/install.sh" >&2
    while IFS='|' read -r container name how; do
        note=""
        [ "$how" = labelled ] || note="; unlabelled, made before containers named their installation, it has the name of one of its engines"
        printf 'install.sh:   %s (engine %s%s): %s\n' "$container" "$name" "$note" "$(stop_command "$container" "$name")" >&2
    done <<<"$found"
    return 0
}

# Remove paths; any that cannot be removed whole (an engine container that ran as root leaves
# files the user cannot remove) is named with its first such file, and the script fails.
remove_all() {
    local path first stuck=()
    for path in "$@"; do
        [ -e "$path" ] || continue
        if rm -rf -- "$path" 2>/dev/null; then
            say "removed $path"
        else
            stuck+=("$path")
        fi
    done
    [ "${#stuck[@]}" -gt 0 ] || return 0
    first=$(find "${stuck[@]}" ! -user "$(id -u)" -print -quit 2>/dev/null || true)
    die "could not remove all of ${stuck[*]}${first:+ ($first belongs to uid $(stat -c %u "$first"): an engine container that ran as root writes files so)}; remove what is left with: sudo rm -rf ${stuck[*]}"
}

uninstall_all() {
    [ "$(id -u)" -ne 0 ] || die "run this as the user who owns the services, not as root (for example: sudo -iu lucia $src/install.sh --uninstall)"
    local path name out found container unit_files=() dropins=() installed=() data_paths=()
    for path in "$units"/lucia-*.service; do
        if [ -f "$path" ]; then unit_files+=("$path"); fi
    done
    for path in "$units"/lucia-*.service.d; do
        if [ -d "$path" ]; then dropins+=("$path"); fi
    done
    for path in "$venv" "$recipes" "$home_share/README.md" "$home_share/docs"; do
        if [ -e "$path" ]; then installed+=("$path"); fi
    done
    for path in "$home_share" "$state" "$config"; do
        if [ -e "$path" ]; then data_paths+=("$path"); fi
    done
    if [ "${#unit_files[@]}" -eq 0 ] && [ "${#installed[@]}" -eq 0 ] \
        && { [ "$purge" = no ] || [ "$((${#data_paths[@]} + ${#dropins[@]}))" -eq 0 ]; }; then
        say "nothing to remove: no lucia unit, venv, recipes or documentation is installed for $(id -un)$([ "$purge" = no ] || echo ', and no data is left')"
        [ "$purge" = yes ] || [ "${#data_paths[@]}" -eq 0 ] \
            || say "the data is kept in ${data_paths[*]}; to remove it: $src/install.sh --uninstall --purge"
        return 0
    fi
    if [ "$purge" = yes ] && purge_refused "nothing removed"; then
        exit 1
    fi

    if [ "${#unit_files[@]}" -gt 0 ]; then
        systemctl_user show-environment >/dev/null 2>&1 \
            || die "no systemd user manager answers for $(id -un), so its lucia units cannot be stopped; nothing removed (is XDG_RUNTIME_DIR=/run/user/$(id -u) set? log in through a session, or: sudo loginctl enable-linger $(id -un))"
        for path in "${unit_files[@]}"; do
            name=$(basename "$path")
            if ! out=$(systemctl_user disable --now "$name" 2>&1); then
                warn "systemctl --user disable --now $name: $out"
            fi
            rm -f "$path"
            say "stopped, disabled and removed $name"
        done
        systemctl_user daemon-reload
        # a unit still loaded without its file, and the failed ones' records
        systemctl_user stop 'lucia-*.service' >/dev/null 2>&1 || true
        systemctl_user reset-failed 'lucia-*.service' >/dev/null 2>&1 || true
        say "systemd reloaded"
    fi
    if [ "${#installed[@]}" -gt 0 ]; then
        remove_all "${installed[@]}"
    fi

    if [ "$purge" = yes ]; then
        if purge_refused "the units, venv, recipes and documentation are removed, the data is kept"; then
            exit 1
        fi
        remove_all "$home_share" "$state" "$config" "${dropins[@]}"
        say "purged: no lucia unit, program or data is left for $(id -un)"
        return 0
    fi
    local kept=() joined
    if [ -e "$home_share" ]; then kept+=("$home_share (host/data: the engines' files, the keys' digests, the record; models: the model library)"); fi
    if [ -e "$state" ]; then kept+=("$state (the workers' state)"); fi
    if [ -e "$config" ]; then kept+=("$config (gateway.toml, key files, machine.toml)"); fi
    if [ "${#kept[@]}" -gt 0 ]; then
        joined=$(printf '%s, ' "${kept[@]}")
        say "kept the data: ${joined%, }"
    fi
    if [ "${#dropins[@]}" -gt 0 ]; then
        say "kept the units' drop-ins: ${dropins[*]}"
    fi
    if found=$(installation_containers); then
        if [ -z "$found" ]; then
            say "no engine container of this installation exists (uninstalling never stops one)"
        else
            say "uninstalling never stops an engine: these engine containers of this installation are kept:"
            while IFS='|' read -r container name _; do
                say "  $container (engine $name): stop it with: $(stop_command "$container" "$name")"
            done <<<"$found"
        fi
    else
        say "uninstalling never stops an engine: any engine container keeps running (Docker could not be asked which are this installation's)"
    fi
    if [ "$((${#kept[@]} + ${#dropins[@]}))" -gt 0 ]; then
        say "to remove the data too: $src/install.sh --uninstall --purge (refused while an engine container of this installation exists)"
    fi
}

if [ "$uninstall" = yes ]; then
    uninstall_all
else
    install_all
fi
