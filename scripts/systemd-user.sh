#!/usr/bin/env bash
# Start journald and a real systemd user manager for the test user on a machine whose PID 1 is
# not systemd (cgroup v1 with the v2 "unified" hierarchy beside it), as DESIGN.md "How it is
# tested" describes. Run as root. Safe to run again: it only starts what is not running.
#
#   scripts/systemd-user.sh            # then: scripts/as-lucia systemctl --user status
#   scripts/systemd-user.sh --restart  # stop the user manager (and its units) first, then start
#
# Environment: LUCIA_USER (default lucia), LUCIA_MACHINE_LOGS (default /var/log/lucia-machine),
# LUCIA_SYSTEMD_TIMEOUT (seconds to wait for each daemon, default 30).
#
# There is no logind here, so `loginctl enable-linger` cannot keep the manager alive: it lives
# until it is stopped (`scripts/as-lucia systemctl --user exit`) or the machine stops. Nothing
# restarts it if it dies; run this script again.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
user=${LUCIA_USER:-lucia}
log_dir=${LUCIA_MACHINE_LOGS:-/var/log/lucia-machine}
timeout=${LUCIA_SYSTEMD_TIMEOUT:-30}
as_user=$root/scripts/as-lucia

say() { printf '==> %s\n' "$*"; }

# die, and on_error: what the ERR trap below prints
source "$(dirname "${BASH_SOURCE[0]}")/lib/errors.sh"
set -E
trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR

restart= journald_started=
case ${1:-} in
    --restart) restart=1 ;;
    "") ;;
    *) die "usage: $0 [--restart]" ;;
esac
[ "$(id -u)" -eq 0 ] || die "run as root"
[ -x /lib/systemd/systemd ] && [ -x /lib/systemd/systemd-journald ] || die "systemd is not installed"
mkdir -p "$log_dir"

# wait_until SECONDS COMMAND...: true once COMMAND succeeds, false after SECONDS.
wait_until() {
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.2
    done
}

ensure_user() {
    local group
    for group in docker systemd-journal; do
        getent group "$group" >/dev/null || { say "creating group $group"; groupadd --system "$group"; }
    done
    if ! id -u "$user" >/dev/null 2>&1; then
        say "creating user $user (groups docker, systemd-journal)"
        useradd --create-home --home-dir "/home/$user" --shell /bin/bash \
            --groups docker,systemd-journal "$user"
    fi
    for group in docker systemd-journal; do
        # no pipe into an early-exit reader (grep -q) under pipefail: a word match in the list
        [[ " $(id -nG "$user") " == *" $group "* ]] || { say "adding $user to $group"; usermod -aG "$group" "$user"; }
    done
}

# journald of this machine (not of a container, not a zombie waiting to be reaped).
journald_pid() {
    local pid
    for pid in $(pgrep -x systemd-journal); do
        [ "$(readlink "/proc/$pid/root")" = / ] && ! grep -q '^State:\s*Z' "/proc/$pid/status" \
            && { echo "$pid"; return 0; }
    done
    return 1
}

# journald answers when a stream to its stdout socket can be opened (what units' stdout uses).
journald_answers() { systemd-cat -t systemd-user.sh true; }

start_journald() {
    # Debian's tmpfiles.d (not run here) makes the runtime journal readable by systemd-journal;
    # with the setgid bit, what journald creates below inherits that group.
    mkdir -p /run/systemd/journal /run/log/journal
    chown root:systemd-journal /run/log/journal
    chmod 2755 /run/log/journal
    find /run/log/journal -mindepth 1 \( -type d -exec chmod 2750 {} + -o -type f -exec chmod 0640 {} + \) \
        -exec chgrp systemd-journal {} +
    if journald_pid >/dev/null && journald_answers >/dev/null 2>&1; then
        return
    fi
    say "starting systemd-journald (log: $log_dir/journald.log)"
    journald_started=1
    setsid -f sh -c 'exec /lib/systemd/systemd-journald' </dev/null >>"$log_dir/journald.log" 2>&1
    wait_until "$timeout" journald_answers || { tail -20 "$log_dir/journald.log" >&2; die "journald did not answer within ${timeout}s"; }
}

manager_answers() { "$as_user" systemctl --user show --property=Version --value; }

# The manager's pid: its init.scope also holds runuser (root), its parent.
manager_pid() {
    local procs=/sys/fs/cgroup/unified/user.slice/user-$uid.slice/user@$uid.service/init.scope/cgroup.procs pid
    if [ -r "$procs" ]; then
        while read -r pid; do
            [ "$(stat -c %u "/proc/$pid" 2>/dev/null)" = "$uid" ] && { echo "$pid"; return 0; }
        done <"$procs"
    fi
    pgrep -u "$uid" -x systemd -o
}

# The manager's units get the groups the manager had when it started: a membership added since
# (usermod above) needs a new manager.
manager_groups_stale() {
    local pid wanted have
    pid=$(manager_pid) && [ -n "$pid" ] || return 1
    wanted=$(id -G "$user" | tr ' ' '\n' | sort -n | tr '\n' ' ')
    have=$( (sed -n 's/^Groups:\s*//p' "/proc/$pid/status" | tr ' \t' '\n\n'; id -g "$user") \
        | grep . | sort -nu | tr '\n' ' ')
    [ "$wanted" != "$have" ]
}

manager_gone() { ! pgrep -u "$uid" -x systemd >/dev/null; }

stop_manager() {
    "$as_user" systemctl --user exit >/dev/null 2>&1 || true
    wait_until "$timeout" manager_gone || die "the user manager of $user did not exit within ${timeout}s"
}

start_manager() {
    local runtime=/run/user/$uid hierarchy dir
    if manager_answers >/dev/null 2>&1; then
        if [ -n "$restart" ]; then
            say "stopping the user manager of $user"
            stop_manager
        elif [ -n "$journald_started" ]; then
            # its journal socket still points at the old journald: its own lines would be lost
            say "journald was restarted under the running user manager of $user; restarting the manager"
            stop_manager
        elif manager_groups_stale; then
            say "the groups of $user changed since its user manager started; restarting the manager"
            stop_manager
        else
            return 0
        fi
    fi
    # Without /run/systemd/system (sd_booted()) the manager refuses: "Trying to run as user
    # instance, but the system has not been booted with systemd."
    mkdir -p /run/systemd/system "$runtime"
    chown "$user:" "$runtime"
    chmod 700 "$runtime"
    # A delegated cgroup the user owns, in the named v1 hierarchy and in the v2 one.
    for hierarchy in systemd unified; do
        [ -d "/sys/fs/cgroup/$hierarchy" ] || continue
        dir=/sys/fs/cgroup/$hierarchy/user.slice/user-$uid.slice/user@$uid.service
        mkdir -p "$dir"
        chown -R "$user:" "$dir"
    done
    say "starting the systemd user manager of $user (its messages: journalctl _UID=$uid _SYSTEMD_USER_UNIT=init.scope; stderr: $log_dir/systemd-user.log)"
    # A new session, so it outlives the caller; the shell moves itself into the cgroup first,
    # then becomes runuser, whose child is the manager. The manager copies its own environment
    # into its units, so it gets a clean one. Its stderr is no journal stream (as under a real
    # user@.service), so it is told to log to the journal, where its lines about a unit
    # ("Watchdog timeout", "Scheduled restart job") carry USER_UNIT= as usual.
    setsid -f bash -c '
        uid=$1 user=$2 home=$3
        for hierarchy in systemd unified; do
            procs=/sys/fs/cgroup/$hierarchy/user.slice/user-$uid.slice/user@$uid.service/cgroup.procs
            [ -e "$procs" ] && echo $$ >"$procs"
        done
        exec runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" \
            SHELL=/bin/bash LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin \
            XDG_RUNTIME_DIR=/run/user/$uid DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/$uid/bus \
            /lib/systemd/systemd --user --log-target=journal
    ' systemd-user "$uid" "$user" "$home" </dev/null >>"$log_dir/systemd-user.log" 2>&1
    wait_until "$timeout" manager_answers || { tail -20 "$log_dir/systemd-user.log" >&2; die "the user manager did not answer within ${timeout}s"; }
}

manager_settled() {
    state=$("$as_user" systemctl --user is-system-running 2>/dev/null) || true
    [ "$state" = running ] || [ "$state" = degraded ]
}

ensure_user
uid=$(id -u "$user")
home=$(getent passwd "$user" | cut -d: -f6)
start_journald
start_manager
state=
wait_until "$timeout" manager_settled || die "the user manager of $user is '$state' after ${timeout}s"
if [ "$state" = degraded ]; then
    "$as_user" systemctl --user --failed --no-legend --no-pager >&2 || true
fi
printf 'systemd-user.sh: ready: journald pid %s, systemd --user pid %s for %s (uid %s) is %s; use LUCIA_USER=%s %s systemctl --user ...\n' \
    "$(journald_pid)" "$(manager_pid)" "$user" "$uid" "$state" "$user" "$as_user"
