#!/usr/bin/env bash
# Prepare what serving needs, as the Spark recipe's scripts/prepare.sh does, with busybox for NVIDIA's image:
#   1. preflight (the lock on $KERNEL_CACHE/.prepare.lock, docker, disk)
#   2. the image $IMAGE: "pulled" when $GHCR_IMAGE:<TF_VERSION>-<patches hash> is already local (PULL=0 skips
#      that), else built with `docker build -f - CONTEXT` from the inline Dockerfile below and labelled
#      tf.patches=<patches hash>; skipped when $IMAGE carries the label of the current patches
#   3. the checkpoint into $HF_CACHE/hub, by `tensorfold pull` in a container (resumable, hf-style progress)
#   4. `tensorfold info` in a container, then the marker $KERNEL_CACHE/.prepared
# Needs no network. --rebuild builds the image again from scratch. Test knobs: see README.md.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
source ./scripts/config.sh
check_draft_language

REBUILD=0
for arg in "$@"; do
  case "$arg" in
    --rebuild) REBUILD=1 ;;
    -h|--help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) die "unknown argument: $arg" ;;
  esac
done

# ---------------------------------------------------------------- 1. preflight
mkdir -p "$KERNEL_CACHE"
exec 9>"$KERNEL_CACHE/.prepare.lock"
flock -n 9 || die "another prepare.sh is already running (it holds the download locks); wait for it or stop it: pgrep -af prepare.sh"
log "Preflight checks"
command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot talk to the docker daemon (is your user in the docker group?)"
command -v nvidia-smi >/dev/null || warn "nvidia-smi not found on the host"
BUSYBOX="${TEST_BUSYBOX:-$(command -v busybox || true)}"
[[ -n "$BUSYBOX" && -x "$BUSYBOX" ]] || die "busybox is not installed (the stand-in image is made of it: apt-get install busybox-static)"
[[ "$(file -L "$BUSYBOX" 2>/dev/null)" == *'statically linked'* ]] || [[ ! -x /usr/bin/file ]] || \
  die "$BUSYBOX is not statically linked (apt-get install busybox-static)"

mkdir -p "$HF_CACHE/hub" "$KERNEL_CACHE/torch_extensions" "$KERNEL_CACHE/triton" patches
PATCHES_HASH=$(patches_hash)
built_hash=$(image_label "$IMAGE" || true)

gb_free() { df -BG --output=avail "$1" | tail -1 | tr -dc '0-9'; }
need=0
have_snapshot || need=$MIN_FREE_GB
[[ $REBUILD -eq 0 && "$built_hash" == "$PATCHES_HASH" ]] || need=$((need + IMAGE_FREE_GB))
have=$(gb_free "$HF_CACHE")
(( need == 0 || have >= need )) || die "only ${have} GB free under $HF_CACHE, need ~${need} GB"
log "Disk: ${have} GB free under $HF_CACHE"

# ---------------------------------------------------------------- 2. image
prebuilt="$GHCR_IMAGE:${TF_VERSION}-${PATCHES_HASH}"
if [[ $REBUILD -eq 0 && "${PULL:-1}" == 1 && "$built_hash" != "$PATCHES_HASH" ]]; then
  # the stand-in has no registry: a prebuilt image counts as pullable when it is already local
  log "Pulling the prebuilt image $prebuilt (PULL=0 builds instead)"
  if [[ "$(image_label "$prebuilt" || true)" == "$PATCHES_HASH" ]]; then
    docker tag "$prebuilt" "$IMAGE"
    built_hash=$PATCHES_HASH
    log "Using $prebuilt as $IMAGE"
  else
    warn "could not pull $prebuilt (no image for these patches, the package is not public, or no network): building it locally"
  fi
fi

if [[ $REBUILD -eq 1 || "$built_hash" != "$PATCHES_HASH" ]] || ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "Building $IMAGE (TensorFold $TF_VERSION stand-in, patches $PATCHES_HASH: $(patch_files | xargs -rn1 basename | paste -sd' '))"
  context=$(mktemp -d)
  trap 'rm -rf -- "$context"' EXIT
  cp "$BUSYBOX" "$context/busybox"
  cp -r stand-in "$context/stand-in"
  mkdir "$context/patches"
  patch_files | xargs -r cp -t "$context/patches"
  build=(docker build -t "$IMAGE" --build-arg PATCHES_HASH="$PATCHES_HASH"
         --build-arg TF_SPEC="git+${TF_REPO}@${TF_VERSION}"
         --build-arg TEST_BUILD_SECONDS="${TEST_BUILD_SECONDS:-0}" --build-arg TEST_FAIL="${TEST_FAIL:-}")
  [[ $REBUILD -eq 0 ]] || build+=(--no-cache)
  [[ -z "${TEST_BUILD_LABEL:-}" ]] || build+=(--label "$TEST_BUILD_LABEL")
  "${build[@]}" -f - "$context" <<'DOCKERFILE'
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
RUN mkdir -p /tmp /usr/local/bin /site /root/.cache/huggingface /cache /workspace /etc && chmod 1777 /tmp
ARG TF_SPEC
ARG TEST_BUILD_SECONDS=0
ARG TEST_FAIL=
# the "pip install" of TensorFold: the stand-in package and its console script
COPY stand-in/bin/ /usr/local/bin/
COPY stand-in/site/ /site/
RUN echo "Installing ${TF_SPEC} (stand-in)"; i=0; \
    while [ "$i" -lt "$TEST_BUILD_SECONDS" ]; do i=$((i+1)); echo "Building wheel for tensorfold $i/$TEST_BUILD_SECONDS"; sleep 1; done; \
    if [ "$TEST_FAIL" = build ]; then echo "ERROR: Failed building wheel for tensorfold (TEST_FAIL=build)" >&2; exit 1; fi; \
    tensorfold --version
COPY patches/ /opt/tf-patches/
RUN cd /site && for p in /opt/tf-patches/*.patch; do [ -e "$p" ] || continue; echo "applying $p"; patch -p0 -N < "$p" || exit 1; done && \
    python -c "import tensorfold"
ARG PATCHES_HASH
LABEL tf.patches=${PATCHES_HASH}
ENV PATH=/usr/local/bin:/bin \
    HF_HOME=/root/.cache/huggingface \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    TRITON_CACHE_DIR=/cache/triton
WORKDIR /workspace
DOCKERFILE
else
  log "Image $IMAGE already built with patches $PATCHES_HASH (use --rebuild to force)"
fi
docker run --rm --entrypoint tensorfold "$IMAGE" --version 2>/dev/null | tail -1

# tensorfold in the image, with the HF cache and the kernel cache mounted; a token only by name and only when set
tf_run() {
  local pass=() name
  [[ -z "${HF_TOKEN:-}" ]] || pass+=(-e HF_TOKEN)
  for name in TEST_DOWNLOAD_SECONDS TEST_CHECKPOINT_KIB TEST_FAIL TEST_PULL_FAIL_AT TEST_HF_TOKEN_SHA256; do
    [[ -z "${!name:-}" ]] || pass+=(-e "$name")
  done
  docker run --rm --ipc=host --network none --entrypoint tensorfold "${pass[@]}" \
    ${TEST_RUN_LABEL:+--label "$TEST_RUN_LABEL"} \
    -v "$HF_CACHE":/root/.cache/huggingface \
    -v "$KERNEL_CACHE":/cache \
    "$IMAGE" "$@"
}

# ---------------------------------------------------------------- 3. download
log "Downloading $MODEL_ID into $HF_CACHE/hub (resumes if interrupted)"
tf_run pull "$MODEL_ID"
have_snapshot || die "no snapshot found under $(model_cache_dir)"
snapshot=$(compgen -G "$(model_cache_dir)/snapshots/*/" | head -1)
log "Checkpoint: $snapshot ($(du -shL "$snapshot" | cut -f1))"

# ---------------------------------------------------------------- 4. verify
log "Verifying checkpoint with tensorfold info"
tf_run info "$MODEL_ID"

prepared_state > "$PREPARED_MARKER"
log "Done. Start the server with ./start.sh (port $PORT)."
