#!/usr/bin/env bash
# Set up this machine (scripts/machine.sh) and run the product end to end on an embedded demo
# recipe, as an operator would: install.sh as the user `lucia`, `systemctl --user start`, a
# request with the CLI, the answer over HTTP on the gateway address, the file_sd target and the
# journal. The demo engine is the stand-in recipe in demo/recipe-repo (busybox playing the
# engine, python and pip), so no GPU, registry or model download is needed. Run as root; safe
# to run again (the running engine is adopted, not restarted).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
user=${LUCIA_USER:-lucia}
name=demo
port=${LUCIA_DEMO_PORT:-18080}
as_user=$root/scripts/as-lucia

say() { printf '\n==> %s\n' "$*"; }

[ "$(id -u)" -eq 0 ] || { echo "demo.sh: run as root (it prepares the machine)" >&2; exit 1; }
bash "$root/scripts/machine.sh"

home=$(getent passwd "$user" | cut -d: -f6)
work=$home/lucia-demo
cli=$home/.local/share/lucia/venv/bin/lucia-supervisor

say "copying the project to $work/src (the user installs from their own copy)"
rm -rf "$work/src"
mkdir -p "$work/src"
(cd "$root" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -C "$work/src" -xf -

say "building the demo base image (FROM scratch, Debian's static busybox)"
context=$(mktemp -d)
cp "$(command -v busybox)" "$context/busybox"
cat >"$context/Dockerfile" <<'EOF'
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
RUN mkdir -p /tmp /usr/local/bin /site && chmod 1777 /tmp
EOF
docker build -q -t lucia-demo-busybox:1 "$context" >/dev/null
rm -rf "$context"

if [ ! -d "$work/recipe-repo/.git" ]; then
    say "making the demo recipe repository (git, served over file://)"
    cp -r "$root/demo/recipe-repo" "$work/recipe-repo"
    git -C "$work/recipe-repo" init -q -b main
    git -C "$work/recipe-repo" add -A
    git -C "$work/recipe-repo" -c user.name=demo -c user.email=demo@localhost commit -q -m "demo recipe"
fi
commit=$(git -C "$work/recipe-repo" rev-parse HEAD)

cat >"$work/$name.toml" <<EOF
# The demo: the shape of the Spark recipe, with a stand-in engine.
name = "$name"
engine = "tensorfold"
model = "demo/tiny-model"

[source]
repository = "file://$work/recipe-repo"
commit = "$commit"

[image]
tag = "lucia-demo-recipe:v1"
build_args = { BASE = "lucia-demo-busybox:1" }

[prepare]
commands = [["sh", "scripts/prepare.sh"]]

[grammar]
requirement = "xgrammar>=0.2.8,<0.3"
modules = ["xgrammar", "tensorfold"]

[settings]
PARALLEL = 4
CONTEXT = 200000
TENSORFOLD_MEMORY_RESERVE_GIB = 4
PORT = $port
MODEL_ID = "demo/tiny-model"
SERVED_NAME = "tiny"
HF_CACHE = "$work/hf-cache"
PREPARE_SECONDS = 3
READY_DELAY = 3

[run]
network = "lucia-demo"
port = $port
ready_path = "/v1/models"
metrics_path = "/metrics"
ready_timeout = 120
stop_grace = 60
EOF
chown -R "$user:" "$work"

say "installing as $user: $work/src/install.sh --recipe $work/$name.toml"
"$as_user" "$work/src/install.sh" --recipe "$work/$name.toml"

say "systemctl --user start lucia-$name (returns once the worker said READY=1)"
"$as_user" systemctl --user start "lucia-$name"
"$as_user" systemctl --user --no-pager status "lucia-$name" | head -5

say "lucia-supervisor request $name running --wait"
"$as_user" "$cli" request "$name" running --wait --timeout 300

say "lucia-supervisor status"
"$as_user" "$cli" status

url=$("$as_user" "$cli" status "$name" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["url"])')
say "the engine answers on the gateway address only: GET $url/v1/models"
python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$url/v1/models"
docker inspect "lucia-$name" -f 'published: {{json .HostConfig.PortBindings}}'

say "Prometheus file_sd target: $home/.local/share/lucia/host/data/telemetry/$name.json"
cat "$home/.local/share/lucia/host/data/telemetry/$name.json"

say "journalctl -t lucia-$name (the worker's lines, one per event, with priorities)"
journalctl -t "lucia-$name" -n 12 --no-pager -o cat

say "done. The demo engine keeps running. To stop it: $as_user $cli request $name stopped --wait"
