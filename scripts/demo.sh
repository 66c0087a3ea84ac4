#!/usr/bin/env bash
# Set up this machine (scripts/machine.sh) and run the product end to end on an embedded demo
# recipe, as an operator would: install.sh as the user `lucia`, `systemctl --user start`, a
# request with the CLI, the answer over HTTP on the gateway address, the file_sd target and the
# journal. The demo engine is the shipped Spark recipe on a repository laid out like the real
# one (tests/tensorfold-recipe: prepare.sh builds its image, busybox plays TensorFold, python and
# pip), so no GPU, registry or model download is needed. Then the shipped
# llama-router recipe on the real llama-server (Debian's llama.cpp-tools, built by machine.sh)
# with a tiny llama model generated here, answering a chat completion on the gateway address.
# Last, the lucia gateway (systemctl --user start lucia-gateway) on 127.0.0.1: an issued key,
# and the official openai client: a chat for the router's model after an operator stopped its
# engine is refused 503 naming who stopped it (traffic never undoes an operator's stop), and
# answered once the operator starts it again, the gateway waiting for the start; then 16 chats
# at once, all answered, as many at once as the router's slots hold (its status.json `slots`).
# Run as root; safe to run again: the workers are restarted (`systemctl --user restart`), so that
# a new version and changed recipes take effect; a running engine whose recipe did not change is
# adopted, not restarted, and one whose recipe changed is replaced.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
user=${LUCIA_USER:-lucia}
name=demo
port=${LUCIA_DEMO_PORT:-18080}
router=demo-router
router_port=${LUCIA_DEMO_ROUTER_PORT:-18081}
cpu=demo-vllm-cpu
cpu_port=${LUCIA_DEMO_VLLM_CPU_PORT:-18082}
as_user=$root/scripts/as-lucia

say() { printf '\n==> %s\n' "$*"; }

# die, and on_error: what the ERR trap below prints
source "$(dirname "${BASH_SOURCE[0]}")/lib/errors.sh"
set -E
trap 'on_error "$?" "${PIPESTATUS[*]}" "$LINENO" "$BASH_COMMAND"' ERR

[ "$(id -u)" -eq 0 ] || die "run as root (it prepares the machine)"
bash "$root/scripts/machine.sh"

home=$(getent passwd "$user" | cut -d: -f6)
work=$home/lucia-demo
cli=$home/.local/share/lucia/venv/bin/lucia-supervisor

say "copying the project to $work/src (the user installs from their own copy)"
rm -rf "$work/src"
mkdir -p "$work/src"
(cd "$root" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -C "$work/src" -xf -

if [ ! -d "$work/recipe-repo/.git" ] || [ ! -f "$work/recipe-repo/scripts/config.sh" ]; then
    say "making the demo recipe repository: the Spark recipe's layout, busybox playing TensorFold"
    rm -rf "$work/recipe-repo"
    cp -r "$root/tests/tensorfold-recipe" "$work/recipe-repo"
    git -C "$work/recipe-repo" init -q -b main
    git -C "$work/recipe-repo" add -A
    git -C "$work/recipe-repo" -c user.name=demo -c user.email=demo@localhost commit -q -m "demo recipe"
fi
# the repository is the user's once chown'd below: root's git refuses it on a run again unless
# it is named safe (for this command only, never in a global or system configuration)
commit=$(git -c safe.directory="$work/recipe-repo" -C "$work/recipe-repo" rev-parse HEAD)

say "the shipped recipes/spark-model.toml, made for this machine: $work/$name.toml"
# only [source], the network, the port, the GPU line, memlock (this dockerd refuses -1) and the
# [memory] figures (the Spark's 103 GiB do not fit here) change, and the name and image tag, so
# that the demo never takes a real installation's names
PYTHONPATH=$root "$root/.venv/bin/python" - "$work/$name.toml" "file://$work/recipe-repo" \
    "$commit" "$port" <<'PY'
import sys
from pathlib import Path

from tests.fixtures import shipped_recipe

out, repository, commit, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
text = shipped_recipe(repository, commit, "lucia-demo", port)
text = text.replace('name = "spark-model"', 'name = "demo"', 1)
text = text.replace('"tensorfold-qwen38:v0.6.6"', '"lucia-demo-tensorfold:v0.6.6"')
Path(out).write_text(text)
PY
diff "$root/recipes/spark-model.toml" "$work/$name.toml" || true

say "a tiny llama model (written with the gguf package) in a model library: $work/models"
PYTHONPATH=$root "$root/.venv/bin/python" - "$work/models" <<'PY'
import sys
from pathlib import Path

from tests.gguf_fixtures import add_model, write_llama

library = Path(sys.argv[1])
guid = "000000000000000000000000000de000"  # the library names models by a 32-hex GUID
if not (library / guid / "files" / "tiny.gguf").is_file():
    write_llama(add_model(library, "Ready", guid=guid) / "tiny.gguf")
PY
# the image machine.sh built (cached by the package version: this only reads its tag); its last
# line is the reference
image_log=$work/llama-server-image.log
llama_image=$(bash "$root/scripts/llama-server-image.sh" 2>"$image_log") \
    || { tail -n 20 "$image_log" >&2; die "no llama-server image: scripts/llama-server-image.sh failed (log: $image_log)"; }
llama_image=${llama_image##*$'\n'}
[ -n "$llama_image" ] || die "no llama-server image: scripts/llama-server-image.sh named none (log: $image_log)"
say "the shipped recipes/llama-router.toml, made for this machine: $work/$router.toml"
# only its name, image, directories, startup list, defaults, network and port change, and gpus
# (this machine has none). The defaults give each slot room for a chat: llama-server's auto slots
# (4) share one cache of ctx-size cells, each slot's context capped at the model's own (256 for
# tiny); a demo chat takes 67 tokens (59 of prompt, 8 of answer), so 256 cells overflowed at 4
# chats at once ("Context size has been exceeded"). 1024 holds all 4 slots' whole contexts, and
# the worker publishes 4 slots for the gateway to admit at once.
sed -e "s|^name = .*|name = \"$router\"|" \
    -e "s|^models_dir = \"[^\"]*\"|models_dir = \"$work/models\"|" \
    -e "s|^cache_dir = \"[^\"]*\"|cache_dir = \"$work/llama-cache\"|" \
    -e "s|^image = .*|image = \"$llama_image\"|" \
    -e "s|^load_on_startup = .*|load_on_startup = [\"tiny\"]|" \
    -e "s|^defaults = .*|defaults = { ctx-size = 1024 }|" \
    -e "s|^network = .*|network = \"lucia-demo\"|" \
    -e "s|^port = .*|port = $router_port|" \
    -e "s|^gpus = .*|gpus = \"none\"|" \
    "$root/recipes/llama-router.toml" >"$work/$router.toml"
diff "$root/recipes/llama-router.toml" "$work/$router.toml" || true

say "a tiny random Llama (HF layout, bf16) in the model library, for the real vLLM CPU server"
cpu_guid=000000000000000000000000000de001
PYTHONPATH=$root "$root/.venv/bin/python" - "$work/models" "$cpu_guid" <<'PY'
import sys
from pathlib import Path

from tests.gguf_fixtures import add_model
from tests.vllm_model import write_tiny_llama

library, guid = Path(sys.argv[1]), sys.argv[2]
if not (library / guid / "files" / "config.json").is_file():
    write_tiny_llama(add_model(library, "Ready", guid=guid), seed=21)
PY
cpu_image_log=$work/vllm-cpu-image.log
cpu_image=$(bash "$root/scripts/vllm-cpu-image.sh" 2>"$cpu_image_log") \
    || { tail -n 20 "$cpu_image_log" >&2; die "no vLLM CPU image: scripts/vllm-cpu-image.sh failed (log: $cpu_image_log)"; }
cpu_image=${cpu_image##*$'\n'}
say "the shipped recipes/vllm-cpu.toml, made for this machine: $work/$cpu.toml"
sed -e "s|^name = .*|name = \"$cpu\"|" \
    -e "s|^image = .*|image = \"$cpu_image\"|" \
    -e "s|^models_dir = \"[^\"]*\"|models_dir = \"$work/models\"|" \
    -e "s|^guid = .*|guid = \"$cpu_guid\"|" \
    -e "s|^network = .*|network = \"lucia-demo\"|" \
    -e "s|^port = .*|port = $cpu_port|" \
    "$root/recipes/vllm-cpu.toml" >"$work/$cpu.toml"
diff "$root/recipes/vllm-cpu.toml" "$work/$cpu.toml" || true
chown -R "$user:" "$work"

# The machine's memory settings (every worker of the user reads them). The defaults (4/3/8/3 GiB
# of reserves, a workstation's) leave a 24 GiB test machine about 6 GiB, less than the vLLM
# CPU recipe's 4 GiB whenever other programs run; this machine runs no desktop or services, so
# its reserves are smaller (voice keeps its 8 GiB). Written only when the user has none.
machine_file=$home/.config/lucia/machine.toml
if [ ! -e "$machine_file" ]; then
    say "the machine's memory settings for $user: $machine_file"
    install -d -o "$user" -g "$(id -gn "$user")" -m 700 "$home/.config" "$home/.config/lucia"
    cat >"$machine_file" <<'TOML'
# a CPU test machine: the host's memory, small reserves besides voice (GiB)
limit = "unified"
profile = "workstation"
[reserves]
os = 2
services = 1
voice = 8
runtime = 1
TOML
    chown "$user:" "$machine_file"
    chmod 600 "$machine_file"
fi

say "installing as $user: $work/src/install.sh --recipe $work/$name.toml --recipe $work/$router.toml --recipe $work/$cpu.toml"
"$as_user" "$work/src/install.sh" --recipe "$work/$name.toml" --recipe "$work/$router.toml" \
    --recipe "$work/$cpu.toml"

say "systemctl --user restart lucia-$name (returns once the worker said READY=1)"
"$as_user" systemctl --user restart "lucia-$name"
# its state without the journal lines (shown below): no pipe into head, whose early exit would
# kill systemctl with SIGPIPE under pipefail
"$as_user" systemctl --user --no-pager --lines=0 status "lucia-$name"

say "lucia-supervisor request $name running --wait"
"$as_user" "$cli" request "$name" running --wait --timeout 300

# this engine only: on a run again, the engines not yet started say stale (exit 3)
say "lucia-supervisor status $name"
"$as_user" "$cli" status "$name"

url=$("$as_user" "$cli" status "$name" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["url"])')
say "the engine answers on the gateway address only: GET $url/v1/models"
python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$url/v1/models"
docker inspect "lucia-$name" -f 'published: {{json .HostConfig.PortBindings}}'

say "Prometheus file_sd target: $home/.local/share/lucia/host/data/telemetry/$name.json"
cat "$home/.local/share/lucia/host/data/telemetry/$name.json"

say "journalctl -t lucia-$name (the worker's lines, one per event, with priorities)"
journalctl -t "lucia-$name" -n 12 --no-pager -o cat

say "the router: systemctl --user restart lucia-$router, then request $router running --wait"
"$as_user" systemctl --user restart "lucia-$router"
"$as_user" "$cli" request "$router" running --wait --timeout 300
"$as_user" "$cli" status "$router"
router_url=$("$as_user" "$cli" status "$router" --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["url"])')

say "a chat completion from the real llama-server on the gateway address: $router_url"
python3 - "$router_url" <<'PY'
import json
import sys
import urllib.request

body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
request = urllib.request.Request(sys.argv[1] + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as response:
    answer = json.load(response)
print(json.dumps({key: answer[key] for key in ("model", "object", "usage")}))
print("content:", repr(answer["choices"][0]["message"]["content"]), "(random weights)")
PY

say "its Prometheus file_sd: one target per loaded model, scraped with autoload=false"
cat "$home/.local/share/lucia/host/data/telemetry/$router.json"

say "vLLM on the CPU: systemctl --user restart lucia-$cpu, then request $cpu running --wait"
"$as_user" systemctl --user restart "lucia-$cpu"
cpu_asked=$(date +%s)
"$as_user" "$cli" request "$cpu" running --wait --timeout 900
"$as_user" "$cli" status "$cpu"
cpu_url=$("$as_user" "$cli" status "$cpu" --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["url"])')

say "a completion from the real vLLM 0.32.0 CPU server on the gateway address: $cpu_url"
python3 - "$cpu_url" <<'PY'
import json
import sys
import urllib.request

body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8}
request = urllib.request.Request(sys.argv[1] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as response:
    answer = json.load(response)
print(json.dumps({key: answer[key] for key in ("model", "object", "usage")}))
print("text:", repr(answer["choices"][0]["text"]), "(random weights)")
with urllib.request.urlopen(sys.argv[1] + "/version", timeout=10) as response:
    print("vLLM", json.load(response)["version"])
PY
echo "request to a completion: $(($(date +%s) - cpu_asked)) s"

config=$home/.config/lucia
gateway_settings=$config/gateway.toml
say "the lucia gateway: an issued key for the demo, the owner and inference key files and $gateway_settings (0600)"
install -d -o "$user" -g "$(id -gn "$user")" -m 700 "$home/.config" "$config"
# a run before left a key named demo: revoke it (it was shown once, then forgotten)
"$as_user" "$cli" keys revoke demo >/dev/null 2>&1 || true
# the key goes to this shell's variable only: never to an argument list, a file or the log
demo_key=$("$as_user" "$cli" keys create demo --expires 1d)
"$as_user" "$cli" keys list
# the owner and inference keys: written by the user's own python, never shown
"$as_user" python3 - "$config" <<'PY'
import os
import secrets
import sys

for name in ("owner.key", "inference.key"):
    path = os.path.join(sys.argv[1], name)
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
        os.close(fd)
PY
if [ ! -e "$gateway_settings" ]; then
    # written only when the user has none; the key files are at their default places
    "$as_user" sh -c 'umask 077; cat >"$1"' gateway-settings "$gateway_settings" <<TOML
# the demo's gateway: on loopback, every other setting at its default (see docs/gateway.md)
[listen]
address = "127.0.0.1"
port = ${LUCIA_DEMO_GATEWAY_PORT:-18400}
TOML
fi
ls -l "$config"
# where it listens, as the gateway itself reads its settings
gateway_url=$(PYTHONPATH=$root "$root/.venv/bin/python" -c 'import sys
from supervisor.host.gateway.settings import load
listen = load(sys.argv[1]).listen
scheme = "https" if listen.tls else "http"
print(f"{scheme}://{listen.address}:{listen.port}")' "$gateway_settings")

say "systemctl --user restart lucia-gateway (Type=notify: returns once it listens on $gateway_url)"
"$as_user" systemctl --user restart lucia-gateway
"$as_user" systemctl --user --no-pager --lines=0 status lucia-gateway

say "lucia-supervisor request $router stopped --wait: an operator stops the model's engine"
"$as_user" "$cli" request "$router" stopped --wait --timeout 120
"$as_user" "$cli" status "$router"

say "the official openai client, through the gateway on $gateway_url: a chat for tiny, whose engine an operator stopped"
OPENAI_API_KEY=$demo_key "$root/.venv/bin/python" - "$gateway_url" <<'PY'
import os
import sys

import openai

client = openai.OpenAI(
    base_url=sys.argv[1] + "/v1", api_key=os.environ["OPENAI_API_KEY"], timeout=60, max_retries=0
)
for model in client.models.list():
    extra = model.model_extra or {}
    print(f"model {model.id}: engine {extra.get('engine')}, state {extra.get('state')}")
try:
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
except openai.APIStatusError as error:
    if error.status_code != 503 or "by an operator" not in error.message:
        sys.exit(f"refused, but not for the operator's stop: {error.status_code} {error.message}")
    print(f"{error.status_code}: {error.message}")
else:
    sys.exit("answered: traffic started an engine an operator stopped")
PY
"$as_user" "$cli" status "$router"

say "lucia-supervisor request $router running: the operator starts it again; the same chat waits for the start"
gateway_asked=$(date +%s)
"$as_user" "$cli" request "$router" running
OPENAI_API_KEY=$demo_key "$root/.venv/bin/python" - "$gateway_url" <<'PY'
import os
import sys
import time

import openai

client = openai.OpenAI(
    base_url=sys.argv[1] + "/v1", api_key=os.environ["OPENAI_API_KEY"], timeout=600, max_retries=0
)
began = time.monotonic()
answer = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
)
print(f"answered in {time.monotonic() - began:.1f} s (the gateway waited for the start)")
print(answer.model_dump_json(include={"model", "object", "usage"}))
print("content:", repr(answer.choices[0].message.content), "(random weights)")
PY
echo "request to an answer through the gateway: $(($(date +%s) - gateway_asked)) s"

router_status=$home/.local/share/lucia/host/data/$router/status.json
say "16 chats at once through the gateway with the demo key: as many run at once as $router's slots hold"
python3 -c 'import json, sys; print("slots in status.json:", json.load(open(sys.argv[1])).get("slots"))' \
    "$router_status"
OPENAI_API_KEY=$demo_key "$root/.venv/bin/python" - "$gateway_url" <<'PY'
import collections
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

AT_ONCE = 16
client = openai.OpenAI(
    base_url=sys.argv[1] + "/v1", api_key=os.environ["OPENAI_API_KEY"], timeout=600, max_retries=0
)


def chat(_: int) -> tuple[int, str]:
    try:
        answer = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
    except openai.APIStatusError as error:
        return error.status_code, error.message
    except openai.APIError as error:  # no answer at all
        return 0, str(error)
    return answer.http_response.status_code, ""


began = time.monotonic()
with ThreadPoolExecutor(AT_ONCE) as pool:
    results = list(pool.map(chat, range(AT_ONCE)))
codes = collections.Counter(code for code, _ in results)
shown = ", ".join(f"{count} x {code or 'no answer'}" for code, count in sorted(codes.items()))
print(f"{AT_ONCE} chats at once: {shown} in {time.monotonic() - began:.1f} s")
failed = sorted({f"{code}: {why}" for code, why in results if code != 200})
if failed:
    sys.exit(f"not every chat was answered 200: {'; '.join(failed)}")
PY
unset demo_key
say "the engine the operator started: lucia-supervisor status $router"
"$as_user" "$cli" status "$router"
journalctl -t lucia-gateway -n 4 --no-pager -o cat

say "the operator's page: open $gateway_url/page/ and sign in with the owner key in $config/owner.key"
# signed in as the page does (the key read from its file by the user's own python, never shown):
# what the page shows of the engines and the memory plan, as text
"$as_user" python3 - "$gateway_url" "$config/owner.key" <<'PY'
import http.cookiejar
import json
import sys
import urllib.request

base, key_file = sys.argv[1] + "/page/api/", sys.argv[2]
opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
with open(key_file, encoding="utf-8") as handle:
    body = json.dumps({"key": handle.read().strip()}).encode()
sign_in = urllib.request.Request(base + "signin", body, {"Content-Type": "application/json"})
opener.open(sign_in, timeout=30).close()
with opener.open(base + "overview", timeout=30) as answer:
    page = json.load(answer)
for engine in page["engines"]:
    status = engine.get("status") or {}
    print(f"engine {engine['name']}: {status.get('state', 'no status')}")
memory = page["memory"].get("data")
if memory:
    gib = lambda value: f"{value / 2**30:.1f} GiB"  # noqa: E731
    reserves = ", ".join(f"{k} {gib(v)}" for k, v in (memory["reserves"] or {}).items())
    held = ", ".join(f"{h['name']} {gib(h['bytes'])}" for h in memory["held"]) or "nothing"
    print(f"memory: limit {gib(memory['limit'])} ({memory['limitSource']}); reserves {reserves}")
    print(f"memory: held by {held}; free {gib(memory['free'])}")
    for need in memory["needs"]:
        verdict = "fits" if need["fits"] else "cannot fit: " + need["message"]
        print(f"memory: {need['name']} would need {gib(need['need'] or 0)}: {verdict}")
PY

say "done. The demo engines and the gateway keep running. To stop them: $as_user $cli request NAME stopped --wait (NAME: $name, $router, $cpu); $as_user systemctl --user stop lucia-gateway"
