#!/usr/bin/env bash
# Build a Docker image of the real llama-server from Debian sid's `llama.cpp-tools` package, as
# root, once per package version: the image is tagged <repository>:<version, sanitised> and
# labelled with the version, and when an image with that version exists nothing is built.
# The version is read from sid's Packages index, fetched by apt into a private directory (the
# machine's own apt state is not touched); when the index is out of reach, an image built before
# is kept. The last line of output is the image reference.
#
#   scripts/llama-server-image.sh                      build (or find) the image
#   scripts/llama-server-image.sh --rootfs-version TAR the llama.cpp-tools version in a root file
#                                                      system tar's dpkg status (no root needed)
#
#   LUCIA_LLAMA_MIRROR      the Debian mirror (default: the first `URIs:` of the machine's apt)
#   LUCIA_LLAMA_CACHE       the private apt directory (default: /var/cache/lucia/llama-server-apt)
#   LUCIA_LLAMA_REPOSITORY  the image repository (default: lucia-llama-server)
#   LUCIA_LLAMA_LABEL       the label holding the version (default: org.lucia.llama-server.version);
#                           another label finds none of the images built under this one, so a
#                           private repository and label build from nothing (the tests' cold build)
set -euo pipefail

package=llama.cpp-tools
repository=${LUCIA_LLAMA_REPOSITORY:-lucia-llama-server}
label=${LUCIA_LLAMA_LABEL:-org.lucia.llama-server.version}
cache=${LUCIA_LLAMA_CACHE:-/var/cache/lucia/llama-server-apt}

say() { printf '==> %s\n' "$*" >&2; }

# die, and on_error: what the ERR trap below prints
source "$(dirname "${BASH_SOURCE[0]}")/lib/errors.sh"
# debian_mirror
source "$(dirname "${BASH_SOURCE[0]}")/lib/images.sh"
set -E
trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR

# rootfs_version TAR DIR: the version of $package in TAR's dpkg status, extracted into DIR.
# The status file is larger than a pipe: it is extracted first and awk reads it to the end, so
# that no early exit of a reader can kill tar with SIGPIPE under pipefail (exit 141, silent).
rootfs_version() {
    local tar=$1 status=$2/dpkg-status found
    tar -xOf "$tar" ./var/lib/dpkg/status >"$status" 2>"$2/tar.log" \
        || die "$tar has no ./var/lib/dpkg/status: $(sed -n 1p "$2/tar.log")"
    found=$(awk -v p="$package" '$1 == "Package:" {hit = ($2 == p)} hit && $1 == "Version:" && !found {print $2; found = 1}' \
        "$status")
    [ -n "$found" ] || die "the dpkg status in $tar lists no $package"
    echo "$found"
}

case ${1:-} in
    --rootfs-version)
        [ "$#" -eq 2 ] || die "usage: $0 --rootfs-version TAR"
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        rootfs_version "$2" "$work"
        exit 0 ;;
    "") ;;
    *) die "usage: $0 [--rootfs-version TAR]" ;;
esac

[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap and docker import need it)"
for tool in mmdebstrap docker apt-get apt-cache; do
    command -v "$tool" >/dev/null || die "$tool is missing (scripts/machine.sh installs it)"
done

# apt on a private sources list, lists and cache: only sid's index, nothing of the machine's.
private_apt() {
    local tool=$1
    shift
    "$tool" -q \
        -o Dir::Etc::sourcelist="$cache/sources.list" -o Dir::Etc::sourceparts=- \
        -o Dir::Etc::preferences=- -o Dir::Etc::preferencesparts=- \
        -o Dir::State::Lists="$cache/lists" -o Dir::Cache="$cache/cache" \
        -o Dir::State::status=/dev/null -o APT::Get::List-Cleanup=false \
        -o Acquire::Check-Valid-Until=false -o Acquire::Languages=none \
        "$@"
}

# The images this script built: tagged in its own repository and labelled with the version.
# Never an image built FROM one (an engine's, a test's): it inherits the label, not the tag.
# The newest built here before, as repository:tag, or nothing.
built_before() {
    # awk reads to the end (no early exit): under pipefail, a writer cut off early dies of SIGPIPE.
    docker images "$repository" --filter "label=$label" \
        --format '{{.CreatedAt}}\t{{.Repository}}:{{.Tag}}' \
        | sort -r | awk -F'\t' '$2 !~ /<none>/ && !found {print $2; found = 1}'
}

sid_version() {
    printf 'deb [check-valid-until=no] %s sid main\n' "$1" >"$cache/sources.list"
    private_apt apt-get update >"$cache/update.log" 2>&1 || return 1
    private_apt apt-cache show --no-all-versions "$package" >"$cache/show.txt" 2>"$cache/show.log" \
        || { cat "$cache/show.log" >&2; return 1; }
    awk '/^Version:/ && !found {print $2; found = 1}' "$cache/show.txt"
}

mirror=$(debian_mirror LUCIA_LLAMA_MIRROR)
mkdir -p "$cache/lists/partial" "$cache/cache/archives/partial"
if ! version=$(sid_version "$mirror"); then
    tail -20 "$cache/update.log" >&2
    previous=$(built_before)
    [ -n "$previous" ] || die "apt-get update of sid at $mirror failed, and no image was built before"
    say "sid's index is out of reach; keeping the image built before"
    echo "$previous"
    exit 0
fi
[ -n "$version" ] || die "$package is not in sid at $mirror"
# Docker tags allow [A-Za-z0-9_.-], at most 128 characters, not starting with . or -.
tag=$(printf '%s' "$version" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-128)
image=$repository:$tag

existing=$(docker images -q "$repository" --filter "label=$label=$version" | awk 'NR == 1')
if [ -n "$existing" ]; then
    say "$package $version is already built"
    docker tag "$existing" "$image"
    echo "$image"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say "building $image from sid's $package $version ($mirror)"
started=$(date +%s)
mmdebstrap --variant=apt --include="$package" \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    sid "$work/rootfs.tar" "deb [check-valid-until=no] $mirror sid main" >"$work/mmdebstrap.log" 2>&1 \
    || { tail -30 "$work/mmdebstrap.log" >&2; die "mmdebstrap failed"; }
built=$(rootfs_version "$work/rootfs.tar" "$work") || exit 1
[ "$built" = "$version" ] || die "the root file system holds $package $built, not $version"
docker import \
    --change 'ENTRYPOINT ["/usr/bin/llama-server"]' \
    --change "LABEL $label=\"$version\"" \
    --message "$package $version from Debian sid" \
    "$work/rootfs.tar" "$image" >/dev/null
say "built $image in $(($(date +%s) - started)) s"
echo "$image"
