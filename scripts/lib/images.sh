# Sourced by the image scripts: what they share about where Debian comes from.

# debian_mirror VAR: the Debian mirror, from the variable named VAR when it is set, else the
# first `URIs:` of the machine's deb822 apt sources, else the first URI of its sources.list.
debian_mirror() {
    local var=$1 uri
    if [ -n "${!var:-}" ]; then
        echo "${!var}"
        return
    fi
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "${uri:-}" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
            /etc/apt/sources.list)
    fi
    [ -n "${uri:-}" ] || die "no Debian mirror found in /etc/apt (set $var)"
    echo "$uri"
}
