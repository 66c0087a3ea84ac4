#!/bin/sh
# The TensorFold stand-in (busybox sh): `tensorfold --version | serve | info | pull`, with TensorFold's serve
# flags and argparse's way of refusing what it does not know. Serving is busybox httpd over files this script
# keeps: /v1/models, /metrics (vLLM's metric names), /health, and /tensorfold/launch.json, the exact arguments and
# TENSORFOLD_* environment it was started with (also at /tmp/tensorfold/launch.json in the container).
#
# Test knobs (environment, all TENSORFOLD_TEST_* so that start.sh's TENSORFOLD_* pass-through carries them):
#   TENSORFOLD_TEST_READY_DELAY=S     seconds "loading weights" before the API answers (default 0)
#   TENSORFOLD_TEST_COMPILE_DELAY=S   seconds "compiling kernels" on a first start; a marker in
#                                     $TORCH_EXTENSIONS_DIR (the /cache mount) skips it later (default 0)
#   TENSORFOLD_TEST_EXIT_CODE=N       exit with N, TENSORFOLD_TEST_EXIT_AFTER=S seconds after starting (default 0)
#   TENSORFOLD_TEST_STOP_DELAY=S      seconds of draining after SIGTERM before exiting 0 (default 0)
# At run time: `echo 3 > /tmp/die` makes a serving stand-in exit with 3; `echo 64 > /tmp/hog` makes it hold 64 MB.
# For `pull` and `info` (scripts/prepare.sh forwards them): TEST_DOWNLOAD_SECONDS, TEST_CHECKPOINT_KIB, TEST_FAIL,
# TEST_PULL_FAIL_AT, TEST_HF_TOKEN_SHA256 (see the recipe's README.md).

SITE=/site/tensorfold
VERSION=$(cat "$SITE/VERSION")
HF_HOME=${HF_HOME:-/root/.cache/huggingface}
STATE=/tmp/tensorfold

# ------------------------------------------------------------------ argparse, as TensorFold's build_parser() does
TOP_USAGE="usage: tensorfold [-h] [--version] {serve,info,pull,plan} ..."
SERVE_USAGE="usage: tensorfold serve [-h] [--host HOST] [--port PORT] [--name NAME] [--parallel PARALLEL]
                        [--context CONTEXT] [--kv-dtype {bf16,int8,int4}] [--mtp-drafts MTP_DRAFTS]
                        [--mtp-confidence MTP_CONFIDENCE] [--temperature TEMPERATURE] [--top-p TOP_P]
                        [--top-k TOP_K] [--max-tokens MAX_TOKENS] [--ple-on-ssd] [--tp TP] [--vision]
                        [--vision-urls] [--vision-offload] [--vision-max-images VISION_MAX_IMAGES]
                        [--vision-image-tokens VISION_IMAGE_TOKENS] [--thinking, --no-thinking]
                        [--prefill-fp8] [--api-key API_KEY] [--name-priority NAME_PRIORITY]
                        model"
SERVE_OPTIONS="--host:str --port:int --name:str --parallel:int --context:int --kv-dtype:choice
--mtp-drafts:int --mtp-confidence:float --temperature:float --top-p:float --top-k:int --max-tokens:int
--ple-on-ssd:flag --tp:int --vision:flag --vision-urls:flag --vision-offload:flag --vision-max-images:int
--vision-image-tokens:int --thinking:flag --no-thinking:flag --prefill-fp8:flag --api-key:str --name-priority:str"
KV_CHOICES="bf16 int8 int4"

usage_error() {  # PROG USAGE MESSAGE: argparse's error(): usage and message on stderr, exit 2
    printf '%s\n%s: error: %s\n' "$2" "$1" "$3" >&2
    exit 2
}

option_spec() {  # OPTION -> "name:type" of the option it means (exact, else a unique prefix), or "?" / "ambiguous"
    _exact=""; _prefixed=""; _count=0
    for _spec in $SERVE_OPTIONS; do
        _name=${_spec%%:*}
        if [ "$_name" = "$1" ]; then _exact=$_spec; fi
        case "$_name" in "$1"*) _prefixed="$_prefixed $_spec"; _count=$((_count + 1)) ;; esac
    done
    if [ -n "$_exact" ]; then echo "$_exact"
    elif [ "$_count" -eq 1 ]; then echo "${_prefixed# }"
    elif [ "$_count" -gt 1 ]; then echo "ambiguous$_prefixed"
    else echo "?"
    fi
}

is_int() { echo "$1" | grep -Eq '^[-+]?[0-9]+$'; }
is_float() { echo "$1" | grep -Eiq '^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(e[-+]?[0-9]+)?$|^[-+]?(inf|nan)$'; }
var_of() { echo "opt_$(echo "${1#--}" | tr '-' '_')"; }

parse_serve() {  # the serve sub-parser; sets opt_* and MODEL, or exits 2 like argparse
    MODEL=""; unknown=""
    while [ $# -gt 0 ]; do
        arg=$1; shift
        case "$arg" in
            -h|--help) echo "$SERVE_USAGE"; exit 0 ;;
            --*=*) flag=${arg%%=*}; inline=${arg#*=}; has_inline=1 ;;
            --?*) flag=$arg; inline=""; has_inline=0 ;;
            *)
                if [ -z "$MODEL" ]; then MODEL=$arg; else unknown="$unknown $arg"; fi
                continue ;;
        esac
        spec=$(option_spec "$flag")
        case "$spec" in
            "?") unknown="$unknown $arg"; continue ;;
            ambiguous*)
                matches=$(echo "${spec#ambiguous }" | sed 's/:[a-z]*//g; s/ /, /g')
                usage_error "tensorfold serve" "$SERVE_USAGE" "ambiguous option: $flag could match $matches" ;;
        esac
        name=${spec%%:*}; type=${spec#*:}
        if [ "$type" = flag ]; then
            [ "$has_inline" = 0 ] || usage_error "tensorfold serve" "$SERVE_USAGE" \
                "argument $name: ignored explicit argument '$inline'"
            case "$name" in  # one switch with a --no- form (argparse.BooleanOptionalAction): the last one wins
                --thinking) opt_thinking=1 ;;
                --no-thinking) opt_thinking=0 ;;
                *) eval "$(var_of "$name")=1" ;;
            esac
            continue
        fi
        if [ "$has_inline" = 1 ]; then
            value=$inline
        else
            if [ $# -eq 0 ] || { case "$1" in -*) ! is_float "$1" ;; *) false ;; esac; }; then
                usage_error "tensorfold serve" "$SERVE_USAGE" "argument $name: expected one argument"
            fi
            value=$1; shift
        fi
        case "$type" in
            int) is_int "$value" || usage_error "tensorfold serve" "$SERVE_USAGE" \
                     "argument $name: invalid int value: '$value'" ;;
            float) is_float "$value" || usage_error "tensorfold serve" "$SERVE_USAGE" \
                     "argument $name: invalid float value: '$value'" ;;
            choice)
                case " $KV_CHOICES " in
                    *" $value "*) ;;
                    *) usage_error "tensorfold serve" "$SERVE_USAGE" \
                           "argument $name: invalid choice: '$value' (choose from 'bf16', 'int8', 'int4')" ;;
                esac ;;
        esac
        eval "$(var_of "$name")=\$value"
    done
    [ -n "$MODEL" ] || usage_error "tensorfold serve" "$SERVE_USAGE" "the following arguments are required: model"
    # argparse reports leftovers from the top-level parser, after the sub-parser is done
    [ -z "$unknown" ] || usage_error "tensorfold" "$TOP_USAGE" "unrecognized arguments:$unknown"
}

# ------------------------------------------------------------------ small helpers
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g; s/	/\\t/g')"; }
cache_dir() { echo "$HF_HOME/hub/models--$(echo "$1" | sed 's|/|--|g')"; }
snapshot_of() { for d in "$(cache_dir "$1")"/snapshots/*/; do [ -d "$d" ] && { echo "${d%/}"; return 0; }; done; return 1; }
pause() { sleep "$1" & wait $!; }
fraction() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }'; }

# ------------------------------------------------------------------ pull: the checkpoint into the HF cache
checkpoint_files() { echo "config.json tokenizer.json model.safetensors"; }
checkpoint_content() {  # FILE MODEL: the stand-in checkpoint's bytes (deterministic)
    case "$1" in
        config.json)
            printf '{"architectures": ["Qwen3_8FlashNextForConditionalGeneration"], "model_type": "qwen3_8_flash_next",\n'
            printf ' "num_hidden_layers": 48, "num_experts": 512, "mtp_num_hidden_layers": 1, "vision_config": {"depth": 27},\n'
            printf ' "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "_name_or_path": "%s"}\n' "$2" ;;
        tokenizer.json) printf '{"version": "1.0", "model": {"type": "BPE", "vocab": {"<|im_start|>": 0}}}\n' ;;
        model.safetensors) yes "stand-in NVFP4 weights of $2" | head -c $(( ${TEST_CHECKPOINT_KIB:-106} * 1024 )) ;;
    esac
}
nominal() {  # BYTES: the progress bar's size; 1 KiB of the stand-in's weights stands for 1 GB of the real ones
    awk -v b="$1" 'BEGIN { g = b / 1024; if (g >= 100 || g == int(g)) printf "%dG", g; else printf "%.1fG", g }'
}
pull_token() {  # which token huggingface_hub would send: HF_TOKEN, else the cache's token file
    if [ -n "${HF_TOKEN:-}" ]; then echo env
    elif [ "${HF_HUB_DISABLE_IMPLICIT_TOKEN:-0}" != 1 ] && [ -s "$HF_HOME/token" ]; then echo file
    else echo none
    fi
}
cmd_pull() {
    model=$1
    [ -n "$model" ] || usage_error "tensorfold pull" "usage: tensorfold pull [-h] model" \
        "the following arguments are required: model"
    token=$(pull_token)
    case "$token" in
        env) echo "Using the token in HF_TOKEN" ;;
        file) echo "Using the token in $HF_HOME/token" ;;
        none) echo "No token: downloading as an anonymous user" ;;
    esac
    if [ "${TEST_FAIL:-}" = pull ]; then
        echo "huggingface_hub.errors.HfHubHTTPError: 503 Server Error: Service Unavailable for url: https://huggingface.co/api/models/$model/revision/main (TEST_FAIL=pull)" >&2
        exit 1
    fi
    if [ -n "${TEST_HF_TOKEN_SHA256:-}" ]; then
        case "$token" in env) given=$HF_TOKEN ;; file) given=$(cat "$HF_HOME/token") ;; *) given="" ;; esac
        if [ "$(printf '%s' "$given" | sha256sum | cut -c1-64)" != "$TEST_HF_TOKEN_SHA256" ]; then
            echo "huggingface_hub.errors.GatedRepoError: 401 Client Error: Unauthorized for url: https://huggingface.co/api/models/$model/revision/main. Access to model $model is restricted: you must have access to it and be authenticated." >&2
            exit 1
        fi
    fi
    dir=$(cache_dir "$model")
    revision=$(printf '%s' "$model" | sha1sum | cut -c1-40)
    mkdir -p "$dir/blobs" "$dir/refs" "$dir/snapshots/$revision" "$STATE/pull"
    files=$(checkpoint_files)
    count=$(echo "$files" | wc -w)
    seconds=${TEST_DOWNLOAD_SECONDS:-1}
    for file in $files; do
        src="$STATE/pull/$file"
        checkpoint_content "$file" "$model" > "$src"
        sha=$(sha256sum "$src" | cut -c1-64)
        total=$(wc -c < "$src")
        link="$dir/snapshots/$revision/$file"
        if [ -f "$dir/blobs/$sha" ] && [ -L "$link" ]; then
            echo "$file: already downloaded"
            continue
        fi
        part="$dir/blobs/$sha.incomplete"
        [ -f "$part" ] || : > "$part"
        done_bytes=$(wc -c < "$part")
        [ "$done_bytes" -le "$total" ] || { : > "$part"; done_bytes=0; }
        [ "$done_bytes" -eq 0 ] || echo "Resuming $file from $(nominal "$done_bytes")"
        steps=1; step_pause=0
        if [ "$file" = model.safetensors ]; then steps=20; step_pause=$(fraction "$seconds" 20); fi
        step=$(( (total + steps - 1) / steps ))
        start=$(date +%s)
        while :; do
            now=$(( done_bytes + step )); [ "$now" -le "$total" ] || now=$total
            if [ -n "${TEST_PULL_FAIL_AT:-}" ] && [ "$file" = model.safetensors ] && \
               [ $(( now * 100 / total )) -gt "$TEST_PULL_FAIL_AT" ]; then
                printf '\n' >&2
                echo "requests.exceptions.ChunkedEncodingError: ('Connection broken: IncompleteRead', IncompleteRead) while downloading $file (TEST_PULL_FAIL_AT=$TEST_PULL_FAIL_AT)" >&2
                exit 1
            fi
            tail -c +$(( done_bytes + 1 )) "$src" | head -c $(( now - done_bytes )) >> "$part"
            done_bytes=$now
            pct=$(( done_bytes * 100 / total ))
            bar=$(printf '%-10s' "$(printf '%*s' $(( pct / 10 )) '' | tr ' ' '#')")
            elapsed=$(( $(date +%s) - start ))
            if [ "$file" = model.safetensors ]; then
                printf '\r%s: %3d%%|%s| %s/%s [00:%02d<00:00]' "$file" "$pct" "$bar" \
                    "$(nominal "$done_bytes")" "$(nominal "$total")" "$elapsed"
            else
                printf '\r%s: %3d%%|%s| %d/%d [00:%02d<00:00]' "$file" "$pct" "$bar" "$done_bytes" "$total" "$elapsed"
            fi
            [ "$done_bytes" -lt "$total" ] || break
            pause "$step_pause"
        done
        printf '\n'
        mv "$part" "$dir/blobs/$sha"
        ln -sfn "../../blobs/$sha" "$link"
    done
    echo "$revision" > "$dir/refs/main"
    printf 'Fetching %d files: 100%%|##########| %d/%d\n' "$count" "$count" "$count"
    echo "$dir/snapshots/$revision"
}

# ------------------------------------------------------------------ info: what the checkpoint is
cmd_info() {
    model=$1
    [ -n "$model" ] || usage_error "tensorfold info" "usage: tensorfold info [-h] model" \
        "the following arguments are required: model"
    snapshot=$(snapshot_of "$model") || { echo "error: $model is not in the Hugging Face cache ($HF_HOME/hub)" >&2; exit 1; }
    for file in $(checkpoint_files); do
        [ -e "$snapshot/$file" ] || { echo "error: $model: $file is missing or incomplete in $snapshot" >&2; exit 1; }
    done
    if [ "${TEST_FAIL:-}" = info ]; then
        echo "error: $model: model.safetensors: header length does not match the file (TEST_FAIL=info)" >&2
        exit 1
    fi
    size=$(cat "$snapshot"/* | wc -c)
    echo "$model  (revision $(basename "$snapshot"))"
    echo "  family        qwen3.8-flash-next (48 layers, 512 experts, MTP head)"
    echo "  weights       NVFP4 (ModelOpt): FP4 routed experts and n-gram rows, MXFP8 elsewhere"
    echo "  vision tower  27 layers"
    echo "  on disk       $(nominal "$size") (stand-in: $size bytes)"
    echo "  engine        tensorfold $VERSION, cuda, one rank"
}

# ------------------------------------------------------------------ serve
write_launch() {  # the exact argv and TENSORFOLD_*/HF_* environment, for tests to assert
    mkdir -p "$STATE/www/tensorfold"
    {
        printf '{"argv": ['
        sep=""
        for a in "$@"; do printf '%s%s' "$sep" "$(json_str "$a")"; sep=", "; done
        printf '], "env": {'
        sep=""
        env | grep -E '^(TENSORFOLD_[A-Z0-9_]*|HF_[A-Z_]*|HUGGING_FACE_HUB_TOKEN|TORCH_EXTENSIONS_DIR|TRITON_CACHE_DIR)=' \
            | grep -Ev '^(HF_TOKEN|HUGGING_FACE_HUB_TOKEN)=' | sort | while IFS= read -r line; do
            printf '%s%s: %s' "$sep" "$(json_str "${line%%=*}")" "$(json_str "${line#*=}")"; sep=", "
        done
        printf '}, "hf_token_set": %s' "$( [ -n "${HF_TOKEN:-}${HUGGING_FACE_HUB_TOKEN:-}" ] && echo true || echo false)"
        printf ', "mounts": ['
        sep=""
        for m in /root/.cache/huggingface /cache; do
            if grep -q " $m " /proc/mounts; then printf '%s%s' "$sep" "$(json_str "$m")"; sep=", "; fi
        done
        printf '], "ulimit": {"memlock": %s, "stack_kib": %s}' "$(json_str "$(ulimit -l)")" "$(json_str "$(ulimit -s)")"
        printf ', "features": ['
        sep=""
        grep -v '^#' "$SITE/features" | while IFS= read -r f; do printf '%s%s' "$sep" "$(json_str "$f")"; sep=", "; done
        printf ']}\n'
    } > "$STATE/launch.json.tmp"
    mv "$STATE/launch.json.tmp" "$STATE/launch.json"
    cp "$STATE/launch.json" "$STATE/www/tensorfold/launch.json"
}

write_api() {  # NAME: the files httpd serves once loaded
    www=$STATE/www
    mkdir -p "$www/v1"
    printf '{"object": "list", "data": [{"id": %s, "object": "model", "created": %s, "owned_by": "tensorfold", "max_model_len": %s}]}\n' \
        "$(json_str "$1")" "$(date +%s)" "${opt_context:-262144}" > "$www/v1/models"
    label="model_name=$(json_str "$1")"
    {
        echo "# HELP vllm:num_requests_running Number of requests in model execution batches."
        echo "# TYPE vllm:num_requests_running gauge"
        echo "vllm:num_requests_running{$label} 0.0"
        echo "# HELP vllm:num_requests_waiting Number of requests waiting to be processed."
        echo "# TYPE vllm:num_requests_waiting gauge"
        echo "vllm:num_requests_waiting{$label} 0.0"
        echo "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage."
        echo "# TYPE vllm:kv_cache_usage_perc gauge"
        echo "vllm:kv_cache_usage_perc{$label} 0.0"
        echo "# HELP vllm:prompt_tokens_total Number of prefill tokens processed."
        echo "# TYPE vllm:prompt_tokens_total counter"
        echo "vllm:prompt_tokens_total{$label} 0.0"
        echo "# HELP vllm:generation_tokens_total Number of generation tokens processed."
        echo "# TYPE vllm:generation_tokens_total counter"
        echo "vllm:generation_tokens_total{$label} 0.0"
    } > "$www/metrics"
    printf '{"status": "ok", "busy": false, "streams": %s, "prompt_tokens": 0, "generated_tokens": 0}\n' \
        "${opt_parallel:-1}" > "$www/health"
}

cmd_serve() {
    parse_serve "$@"
    [ "${TENSORFOLD_PARSE_ONLY:-0}" != 1 ] || exit 0
    write_launch serve "$@"
    host=${opt_host:-127.0.0.1}; port=${opt_port:-8000}; name=${opt_name:-$MODEL}
    parallel=${opt_parallel:-1}; context=${opt_context:-262144}
    echo "TensorFold $VERSION (stand-in) serving $MODEL as $name on $host:$port"
    if [ "${opt_ple_on_ssd:-0}" = 1 ]; then
        echo "error: $MODEL is an NVFP4 checkpoint: --ple-on-ssd reads MLX checkpoints only" >&2; exit 1
    fi
    if [ "${opt_tp:-1}" -gt 1 ]; then
        echo "error: $MODEL is an NVFP4 checkpoint: it runs on one GPU (--tp ${opt_tp})" >&2; exit 1
    fi
    snapshot=$(snapshot_of "$MODEL") || {
        echo "OSError: $MODEL is not in the local cache ($HF_HOME/hub) and HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-0}: cannot download it" >&2
        exit 1
    }
    started=$(date +%s)
    on_term() {
        echo "SIGTERM: draining for ${TENSORFOLD_TEST_STOP_DELAY:-0}s"
        pause "${TENSORFOLD_TEST_STOP_DELAY:-0}"
        [ -z "${httpd_pid:-}" ] || kill "$httpd_pid" 2>/dev/null
        echo "stopped"
        exit 0
    }
    trap on_term TERM INT
    check_exit() {
        if [ -n "${TENSORFOLD_TEST_EXIT_CODE:-}" ] && \
           [ $(( $(date +%s) - started )) -ge "${TENSORFOLD_TEST_EXIT_AFTER:-0}" ]; then
            echo "fatal: exiting with ${TENSORFOLD_TEST_EXIT_CODE} (TENSORFOLD_TEST_EXIT_CODE)" >&2
            exit "$TENSORFOLD_TEST_EXIT_CODE"
        fi
    }
    check_exit
    kv_gib=$(awk -v c="$context" -v p="$parallel" 'BEGIN { printf "%.2f", 4.47 * c / 262144 }')
    echo "CUDA rank 0 startup estimate 83.07 GiB within 111.71 GiB; native 262144, allocated prompt/reply window $context, cache slots $((context + 7))"
    echo "up to $parallel streams, each growing to $context prompt/reply tokens while memory lasts (34.8 GiB free for their caches, $kv_gib GiB for one at the full window)"
    compiled=${TORCH_EXTENSIONS_DIR:-/cache/torch_extensions}/standin-gb10.done
    if [ ! -f "$compiled" ]; then
        i=0; n=${TENSORFOLD_TEST_COMPILE_DELAY:-0}
        while [ "$i" -lt "$n" ]; do i=$((i + 1)); echo "compiling CUDA kernels for GB10 $i/$n (once; cached)"; pause 1; check_exit; done
        mkdir -p "$(dirname "$compiled")" && date > "$compiled"
    fi
    i=0; n=${TENSORFOLD_TEST_READY_DELAY:-0}
    while [ "$i" -lt "$n" ]; do i=$((i + 1)); echo "loading weights $i/$n from $snapshot"; pause 1; check_exit; done
    write_api "$name"
    httpd -f -p "$host:$port" -h "$STATE/www" &
    httpd_pid=$!
    echo "OpenAI API on http://$host:$port/v1 (model: $name)"
    while :; do
        if [ -f /tmp/hog ]; then
            mb=$(cat /tmp/hog); rm -f /tmp/hog
            echo "allocating ${mb} MB for stream caches"
            hog=$(head -c $((mb * 1048576)) /dev/zero | tr '\0' a)
        fi
        if [ -f /tmp/die ]; then
            code=$(cat /tmp/die)
            echo "fatal: CUDA error, exiting with $code" >&2
            exit "$code"
        fi
        kill -0 "$httpd_pid" 2>/dev/null || { echo "fatal: the HTTP server died" >&2; exit 1; }
        check_exit
        pause 0.2
    done
}

# ------------------------------------------------------------------ the commands
case "${1:-}" in
    --version) echo "tensorfold $VERSION"; exit 0 ;;
    -h|--help) echo "$TOP_USAGE"; exit 0 ;;
    serve) shift; cmd_serve "$@" ;;
    info) shift; [ "${TENSORFOLD_PARSE_ONLY:-0}" != 1 ] || exit 0; cmd_info "$@" ;;
    pull) shift; [ "${TENSORFOLD_PARSE_ONLY:-0}" != 1 ] || exit 0; cmd_pull "$@" ;;
    plan) echo "tensorfold plan: not in the stand-in" >&2; exit 1 ;;
    "") usage_error "tensorfold" "$TOP_USAGE" "the following arguments are required: command" ;;
    *) usage_error "tensorfold" "$TOP_USAGE" "argument command: invalid choice: '$1' (choose from 'serve', 'info', 'pull', 'plan')" ;;
esac
