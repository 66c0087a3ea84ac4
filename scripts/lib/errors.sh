# Sourced by the operator scripts: die, and the ERR trap's report, each under the script's name.
# The script itself keeps `set -euo pipefail`, `set -E` and the trap line, so that each one
# visibly installs them:
#     trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR

die() { printf '%s: %s\n' "${0##*/}" "$*" >&2; exit 1; }

# No exit under set -e is silent: the line, the command and its exit status (a pipeline's too).
# A command substitution's failure is reported once, by the line that used it.
on_error() {
    [ "$BASH_SUBSHELL" -eq 0 ] || return 0
    local how="exit $1"
    [ "$1" -le 128 ] || how="$how, killed by SIG$(kill -l "$(($1 - 128))" 2>/dev/null || echo '?')"
    [ "${2// /}" = "$2" ] || how="$how; pipeline exits $2"
    printf '%s: line %s: `%s` failed (%s)\n' "${0##*/}" "$3" "$4" "$how" >&2
}
