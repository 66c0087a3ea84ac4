# Settings shared by start.sh and scripts/prepare.sh: the same names and defaults as the Spark recipe's
# scripts/config.sh (recipe 0.7.0), so a recipe written for it works unchanged here. Any value can be overridden
# from the environment, or set in ./.env (KEY=value lines, parsed, never run); the environment wins over the file.
# Test fixture: busybox stands in for NVIDIA's PyTorch image and for TensorFold (see README.md).
# .env: KEY=value lines (optionally `export KEY=value`, values optionally quoted, `#` comments); a variable the
# environment already has keeps its value.
read_dotenv() {
  local line key value
  [[ -f .env ]] || return 0
  while IFS= read -r line || [[ -n "$line" ]]; do
    line=${line#"${line%%[![:space:]]*}"}
    line=${line#export }
    key=${line%%=*}
    [[ "$line" == *=* && "$key" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
    value=${line#*=}
    case "$value" in
      \"*\"*) value=${value#\"}; value=${value%%\"*} ;;
      \'*\'*) value=${value#\'}; value=${value%%\'*} ;;
      *) value=${value%%#*}; value=${value%"${value##*[![:space:]]}"} ;;
    esac
    [[ -v "$key" ]] || export "$key=$value"
  done < .env
}
read_dotenv

MODEL_ID="${MODEL_ID:-local-inference-lab/Qwen3.8-Flash-Next-NVFP4}"
TF_VERSION="${TF_VERSION:-v0.6.6}"
TF_REPO="${TF_REPO:-https://github.com/ashhart/TensorFold.git}"   # named in labels only: nothing is fetched
BASE_IMAGE="${BASE_IMAGE:-nvcr.io/nvidia/pytorch:26.07-py3}"     # named only: the stand-in starts FROM scratch
DRAFT_LANGUAGE="${DRAFT_LANGUAGE:-}"
IMAGE="${IMAGE:-tensorfold-qwen38:${TF_VERSION}${DRAFT_LANGUAGE:+-languages}}"   # the local image prepare.sh makes
CONTAINER_NAME="${CONTAINER_NAME:-qwen38-flash-next-tf}"
GHCR_IMAGE="${GHCR_IMAGE:-ghcr.io/miaai-lab/qwen3.8-flash-next-single-dgx-spark-tensorfold}"

SERVED_NAME="${SERVED_NAME:-Qwen3.8-Flash-Next}"
HOST="${HOST:-0.0.0.0}"
PORT="${PORT:-8888}"
PARALLEL="${PARALLEL:-5}"
CONTEXT="${CONTEXT:-262144}"
KV_DTYPE="${KV_DTYPE:-int8}"
PLE_ON_SSD="${PLE_ON_SSD:-0}"
VISION="${VISION:-1}"
VISION_URLS="${VISION_URLS:-0}"
VISION_MAX_IMAGES="${VISION_MAX_IMAGES-${TENSORFOLD_MAX_IMAGES:-50}}"
MTP_DRAFTS="${MTP_DRAFTS:-6}"
MTP_CONFIDENCE="${MTP_CONFIDENCE:-0.60}"
TEMPERATURE="${TEMPERATURE:-1.0}"
TOP_P="${TOP_P:-0.95}"
TOP_K="${TOP_K:-20}"
THINKING="${THINKING:-1}"
MAX_TOKENS="${MAX_TOKENS:-32768}"
export TENSORFOLD_VISION_WORKSPACE_MIB="${TENSORFOLD_VISION_WORKSPACE_MIB:-0}"
export TENSORFOLD_IMAGE_TOKENS="${TENSORFOLD_IMAGE_TOKENS:-16384}"
export TENSORFOLD_VIDEO_TOKENS="${TENSORFOLD_VIDEO_TOKENS:-16384}"
export TENSORFOLD_MEMORY_RESERVE_GIB="${TENSORFOLD_MEMORY_RESERVE_GIB:-2}"
export TENSORFOLD_MTP_COPY="${TENSORFOLD_MTP_COPY:-1}"
[[ -z "$DRAFT_LANGUAGE" ]] || export TENSORFOLD_DRAFT_VOCAB="$DRAFT_LANGUAGE"
export TENSORFOLD_NO_UPDATE_CHECK="${TENSORFOLD_NO_UPDATE_CHECK:-1}"

HF_CACHE="${HF_CACHE:-${HF_HOME:-$HOME/.cache/huggingface}}"
KERNEL_CACHE="${KERNEL_CACHE:-$HOME/.cache/tensorfold-qwen38}"

# The real recipe's defaults are 120 and 35 (GB); the stand-in's checkpoint and image are a few hundred KiB.
MIN_FREE_GB="${MIN_FREE_GB:-1}"
IMAGE_FREE_GB="${IMAGE_FREE_GB:-1}"

# One line each; warnings and errors on stderr; an error ends the script with exit code 1.
log()  { echo "[$(basename "$0")] $*"; }
warn() { echo "[$(basename "$0")] WARN: $*" >&2; }
die()  { echo "[$(basename "$0")] ERROR: $*" >&2; exit 1; }

model_cache_dir() { echo "$HF_CACHE/hub/models--${MODEL_ID//\//--}"; }

check_draft_language() {
  local lang
  [[ -n "$DRAFT_LANGUAGE" ]] || return 0
  for lang in ${DRAFT_LANGUAGE//,/ }; do
    case "$lang" in de|fr|ja|pt|ru|zh) ;; *) die "DRAFT_LANGUAGE=$DRAFT_LANGUAGE: zh or ja, de, fr, pt or ru, or several like zh,ja" ;; esac
  done
  [[ "$DRAFT_LANGUAGE" != *, && "$DRAFT_LANGUAGE" != ,* && "$DRAFT_LANGUAGE" != *,,* ]] || die "DRAFT_LANGUAGE=$DRAFT_LANGUAGE: a comma-separated list"
}
# The patches baked into $IMAGE, in order; their hash is the image's tf.patches label.
# (bytes of every file concatenated in name order, sha256, first 12 hex digits; no patches: sha256 of nothing)
patch_files() {
  local f
  for f in patches/*.patch; do [[ -e "$f" ]] && echo "$f"; done
  if [[ -n "$DRAFT_LANGUAGE" ]]; then for f in patches/languages/*.patch; do [[ -e "$f" ]] && echo "$f"; done; fi
  return 0
}
patches_hash() { local sum; sum=$(patch_files | while read -r f; do cat -- "$f"; done | sha256sum); echo "${sum:0:12}"; }

# What scripts/prepare.sh last left ready: one line in PREPARED_MARKER, compared by start.sh.
PREPARED_MARKER="$KERNEL_CACHE/.prepared"
image_label() { docker image inspect --format '{{index .Config.Labels "tf.patches"}}' "$1" 2>/dev/null; }
have_snapshot() { compgen -G "$(model_cache_dir)/snapshots/*/" >/dev/null; }
prepared_state() {
  local label model=missing
  label=$(image_label "$IMAGE") || label=missing
  have_snapshot && model=present
  echo "model=$MODEL_ID($model) image=$IMAGE($label) patches=$(patches_hash)"
}
