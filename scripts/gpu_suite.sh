#!/usr/bin/env bash
# One device call: every GPU test and benchmark of the suite, logs under $OUT.
# Sections may be appended by other issues; each runs under its own timeout so one hang cannot eat
# the whole call, and a failing section does not stop the next (the exit status is the worst one).
# SECTIONS picks sections; they run in this file's order, whatever order SECTIONS names them in.
set -u
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Deterministic cuBLAS (also across streams): graph-vs-eager comparisons are bit for bit.
export CUBLAS_WORKSPACE_CONFIG=:4096:8
PY=${PY:-python}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
status=0
# The pytest sections run with -v: each test's outcome is a line of the log as it ends, so a section cut
# off by its limit still names what failed (pytest's -q summary comes only at the end: a cut-off run of
# the twenty-second session lost its one failure's name).
section() {  # section NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc"; tail -n 15 "$OUT/$name.log"
    [ $rc -ne 0 ] && status=$rc
    return 0
}
negative_control() {  # negative_control NAME TIMEOUT_S COMMAND...: the command must FAIL (not time out)
    local name=$1 limit=$2; shift 2
    echo "=== $name, a negative control ($(date +%T))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then echo "=== $name: NOT CAUGHT (rc=$rc)"; status=1
    else echo "=== $name: caught as it should be (rc=$rc)"; fi
    return 0
}
# The device image lacks the server's packages: carry them as wheels in .whl (device README, Notes).
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
SECTIONS=${SECTIONS:-graph_tests engine_tests bench_decode_canary bench_decode_slice idle_canary idle_slice gate_record gate gate_stream_race}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# The device copy's .git is not this checkout's (its HEAD can be sessions old), so HEAD alone does not
# say what ran: the tree of the files that were copied does. Compare it locally with
# `git rev-parse COMMIT^{tree}` (a temporary index: the copy's own index is left alone).
{ echo "head $(git rev-parse HEAD 2>/dev/null)"
  echo "tree $($PY -c 'from canary.provenance import working_tree; print(working_tree() or "")')"
} > "$OUT/commit.txt"

# ---- issues 7, 14: the Triton kernels vs their references (batch invariance included), CUDA-graph
# runner, multi-stream, eager-vs-graph equivalence
# The kernel tests are bound by Triton compiles on the host: several workers share the GPU. The
# graph-runner tests run alone (their jitter controls depend on the GPU not being shared).
# `kernel_tests` is the first half alone; KERNEL_TEST_FILES / KERNEL_TEST_K narrow it to what a change touched.
KERNEL_TEST_FILES=${KERNEL_TEST_FILES:-tests/kernels/test_triton_kernels.py tests/kernels/test_moe_align.py \
    tests/kernels/test_graph_static.py tests/kernels/test_fused_glue.py tests/kernels/test_indexer_topk.py \
    tests/kernels/test_mla_prefill.py tests/kernels/test_indexer_maxima.py tests/kernels/test_indexer_pages.py}
(want graph_tests || want kernel_tests) && section graph_tests "${GRAPH_TEST_TIMEOUT:-240}" $PY -m pytest -v \
    -p no:cacheprovider --run-gpu -n "${KERNEL_TEST_WORKERS:-4}" $KERNEL_TEST_FILES ${KERNEL_TEST_K:+-k "$KERNEL_TEST_K"}
want graph_tests && section graph_runner_tests "${GRAPH_TEST_TIMEOUT:-240}" $PY -m pytest -v -p no:cacheprovider --run-gpu \
    tests/gpu/test_graph_gpu.py
want bench_decode_canary && section bench_decode_canary "${BENCH_TIMEOUT:-90}" $PY -m bench.decode_step --model canary \
    --sawtooth 1,16,17,32,33,48,49,64,65,96,97,128 --out "$OUT/decode_canary.json"
want step_profile && section step_profile "${BENCH_TIMEOUT:-90}" $PY -m bench.step_profile --batch-sizes "${PROFILE_BATCHES:-16,128}" \
    --top "${PROFILE_TOP:-15}" --out "$OUT/step_profile.json"
# The MoE tables re-tuned for this GPU (bench.kernels --tune-out: the plain launch, the down projection's own, and for
# split shards the gate/up walking its splits), installed into this copy's tables (`configs install`: what changed is
# in moe_tune_install.log; bring tuned.json back whole and install it in the tree the same way), then the MoE GPU tests
# on the installed tables. Before the benches below, so `SECTIONS="moe_tune bench_kernels_vs"` times what it installed.
if want moe_tune; then
    section moe_tune "${TUNE_TIMEOUT:-300}" $PY -m bench.kernels --json "$OUT/kernels_tune.json" --only moe \
        --batches 1,2,4,8,16,32,64,128 --tune-out "$OUT/tuned.json"
    [ -s "$OUT/tuned.json" ] && section moe_tune_install 60 $PY -m runtime.kernels.triton.configs install "$OUT/tuned.json"
    section moe_tune_tests "${KERNEL_TEST_TIMEOUT:-240}" $PY -m pytest -v -p no:cacheprovider --run-gpu \
        -n "${KERNEL_TEST_WORKERS:-4}" tests/kernels/test_triton_kernels.py tests/kernels/test_moe_fused_act_quant.py \
        tests/kernels/test_moe_align.py -k "moe or fp8 or act_quant or align"
fi
# ---- issue 15: our sparse MLA decode and indexer selection beside SGLang's (needs .whl-sglang carried),
# and the decode GEMM tile sweep (which configs keep the default's bits, and their times)
want bench_kernels_vs && section bench_kernels_vs "${KERNELS_TIMEOUT:-200}" $PY -m bench.kernels --json "$OUT/kernels_vs.json" \
    --only "${KERNELS_ONLY:-mla,indexer}" --batches 1,8,32,64,128 --vs-sglang --moe-splits "${MOE_SPLITS:-1,default}"
# The indexer's selection and logits (issue 15 item 4): their GPU tests, then the bench alone (no SGLang
# wheel: the selection's launches one by one, its radix-vs-sort variants, the logits' eviction policies,
# the selection's pass 1 fused into the logits kernel both ways, the logits kernel's launch shapes and unmasked
# full blocks) and the logits loop taken apart (bench/indexer_anatomy.py).
want indexer_tests && section indexer_tests "${KERNEL_TEST_TIMEOUT:-240}" $PY -m pytest -v -p no:cacheprovider --run-gpu \
    -n "${KERNEL_TEST_WORKERS:-4}" tests/kernels/test_indexer_topk.py tests/kernels/test_triton_kernels.py \
    tests/kernels/test_indexer_maxima.py tests/kernels/test_indexer_pages.py -k "indexer or select or sort or maxima or page"
want bench_indexer && section bench_indexer "${KERNELS_TIMEOUT:-200}" $PY -m bench.kernels --json "$OUT/kernels_indexer.json" \
    --only indexer
# The page-tile indexer (TMA copies of whole pages) beside the pointer kernel: times, same bits, its launches, and
# logits + selection with each (bench.indexer_pages).
want bench_pages && section bench_pages "${BENCH_TIMEOUT:-90}" $PY -m bench.indexer_pages --json "$OUT/indexer_pages.json"
# The selection's defaults against the launch before them, same inputs and outputs (bench.kernels --only select).
want bench_select && section bench_select "${BENCH_TIMEOUT:-90}" $PY -m bench.kernels --json "$OUT/kernels_select.json" \
    --only select
# The fp8 MoE with the SiLU-and-mul output quantized by the launch that adds the split partials
# (moe.FUSED_ACT_QUANT, issue 15 item 5): its bits against the two launches', with the fp8 kernel tests.
want moe_fp8_tests && section moe_fp8_tests "${KERNEL_TEST_TIMEOUT:-240}" $PY -m pytest -v -p no:cacheprovider --run-gpu \
    -n "${KERNEL_TEST_WORKERS:-4}" tests/kernels/test_moe_fused_act_quant.py tests/kernels/test_triton_kernels.py -k "fp8 or act_quant"
# The fused MoE bench alone (bf16 and fp8 at I = 256 / 512 / 2,048; no SGLang wheel, unlike bench_kernels_vs).
want bench_moe && section bench_moe "${KERNELS_TIMEOUT:-200}" $PY -m bench.kernels --json "$OUT/kernels_moe.json" \
    --only moe --batches "${MOE_BATCHES:-1,8,32,64,128}" --moe-splits "${MOE_SPLITS:-1,default}"
# The fused MoE taken apart (each launch's time per call) and the alignment's two paths by routed rows.
want moe_anatomy && section moe_anatomy "${BENCH_TIMEOUT:-90}" $PY -m bench.moe_anatomy --json "$OUT/moe_anatomy.json"
want moe_align && section moe_align "${BENCH_TIMEOUT:-90}" $PY -m bench.moe_align --json "$OUT/moe_align.json"
want indexer_anatomy && section indexer_anatomy "${BENCH_TIMEOUT:-90}" $PY -m bench.indexer_anatomy --out "$OUT/indexer_anatomy.json"
# Do mma.sync (tiles under 64 rows) and wgmma add alike, and do row sums depend on the warps? (the
# MLA kernel's BLOCK_H and the MoE's BLOCK_M could then follow the batch)
want mma_bits && section mma_bits "${BENCH_TIMEOUT:-90}" $PY -m bench.mma_bits --out "$OUT/mma_bits.json"
# Taller MoE tiles (prefill: an expert's weights read once per 64 rows, not per 16): same bits? time?
want moe_tiles && section moe_tiles "${BENCH_TIMEOUT:-90}" $PY -m bench.moe_tiles --out "$OUT/moe_tiles.json"
want moe_prefill && section moe_prefill "${BENCH_TIMEOUT:-150}" $PY -m bench.moe_tiles --prefill-sweep \
    --out "$OUT/moe_prefill.json"
# The down projection's own launch (column tiles walked per program) and the gate/up launch with its
# splits added in the program, at 4,096 tokens, bits vs the bucket.
want moe_launch && section moe_launch "${BENCH_TIMEOUT:-300}" $PY -m bench.moe_tiles --launch-sweep \
    --tokens "${MOE_LAUNCH_TOKENS:-4096}" --out "$OUT/moe_launch.json"
# Which sparse MLA launch knobs keep the deployment's bits (may follow the batch), their times, and
# whole new deployments (MLA_CANDIDATES, H:BLOCK_H,BLOCK_S,chunk,warps,stages,V_SPLIT,narrow).
want mla_free && section mla_free "${MLA_TIMEOUT:-300}" $PY -m bench.mla_sweep --json "$OUT/mla_free.json" --free \
    --heads "${MLA_HEADS:-64}" --batches "${MLA_BATCHES:-1,16,32,64,128}" ${MLA_VARIANTS:+--variants "$MLA_VARIANTS"} \
    ${MLA_VS_SGLANG:+--vs-sglang} --candidates ${MLA_CANDIDATES:-}
# The same knobs around a deployment whose softmax row sums are an MMA (p @ ones): do BLOCK_H and
# warps become free (then prefill could run 64-head wgmma tiles with decode's bits)?
want mla_free_mma && section mla_free_mma "${MLA_TIMEOUT:-300}" $PY -m bench.mla_sweep --json "$OUT/mla_free_mma.json" \
    --free --rowsum-mma --heads "${MLA_HEADS:-64}" --batches "${MLA_BATCHES:-1,16,32,64,128}" ${MLA_VARIANTS:+--variants "$MLA_VARIANTS"} \
    ${MLA_VS_SGLANG:+--vs-sglang} --candidates ${MLA_CANDIDATES:-}
# The two-pass sparse MLA prefill form (mla_prefill): its bits vs the rowsum_mma deployment's and its
# 4,096-row time per launch shape (each pass apart for one), beside the deployment.
want mla_two_pass && section mla_two_pass "${MLA_TIMEOUT:-300}" $PY -m bench.mla_sweep --json "$OUT/mla_two_pass.json" \
    --only-two-pass --heads "${MLA_HEADS:-64}" --batches 1,16,128
want gemm_sweep && section gemm_sweep "${BENCH_TIMEOUT:-150}" $PY -m bench.gemm_sweep --budget-s 100 --out "$OUT/gemm_sweep.json"
# Prefill-sized GEMMs: tiles, and the splits added apart or in the tile's program (same bits?)
want gemm_prefill && section gemm_prefill "${BENCH_TIMEOUT:-150}" $PY -m bench.gemm_sweep --rows 4096 --budget-s 90 \
    --out "$OUT/gemm_prefill.json"
want bench_decode_slice && section bench_decode_slice "${BENCH_TIMEOUT:-90}" $PY -m bench.decode_step --model dsv4-slice \
    --batch-sizes 1,16,32,64,128 --iters 10 --prefill-iters "${PREFILL_ITERS:-10}" --out "$OUT/decode_slice.json"
# The slice's 4,096-row prefill pass with each sparse MLA prefill candidate (skip_tail, rowsum_mma,
# two-pass), each one's logits checked against the pass it must equal; few decode points.
want prefill_variants_slice && section prefill_variants_slice "${PREFILL_TIMEOUT:-240}" $PY -m bench.decode_step \
    --model dsv4-slice --batch-sizes 1,16 --iters 10 --prefill-iters "${PREFILL_ITERS:-10}" --prefill-variants --out "$OUT/prefill_variants_slice.json"
# ---- the engine on the GPU (issues 7, 8): graphs + multi-stream through Engine.step(), overlap
want engine_tests && section engine_tests "${ENGINE_TEST_TIMEOUT:-300}" $PY -m pytest -v -p no:cacheprovider \
    --run-gpu ${ENGINE_TEST_FILES:-tests/gpu/test_engine_gpu.py tests/gpu/test_device_draw_gpu.py tests/gpu/test_prefix_cache_gpu.py tests/gpu/test_slice_prefill_chunks_gpu.py} -rA \
    ${ENGINE_TEST_K:+-k "$ENGINE_TEST_K"}
want idle_canary && section idle_canary "${BENCH_TIMEOUT:-120}" $PY -m bench.idle_time --model canary \
    --batch-sizes 1,4,16,64 --out "$OUT/idle_canary.json"
want idle_slice && section idle_slice "${BENCH_TIMEOUT:-150}" $PY -m bench.idle_time --model dsv4-slice \
    --batch-sizes 1,4,16,64 --steps 20 --out "$OUT/idle_slice.json"

# ---- the 80-session canary gate against the GPU server (graphs + multi-stream on by default).
# Golden tokens are per numerics (canary/gate.py golden_path): `gate_record` records this GPU's
# store and perf baseline (every other oracle still applies), `gate` checks a fresh server against
# them, `gate_stream_race` must fail. float32: bf16 is a different model numerically.
# GATE_DTYPE=bfloat16 runs the gate in the GPU's serving dtype against its own store (record it first).
GATE=($PY -m pytest -m stress --sessions 80 -p no:cacheprovider tests/stress/test_canary_gate.py
      --server-arg=--dtype=${GATE_DTYPE:-float32} --perf-tolerance 0.1)
# Extra gate flags for every gate section. Four driver processes by default on the GPU host: one
# asyncio loop running the openai client cannot keep up with the GPU server (docs/results.md); the
# perf verdict measures its own trial workload (canary/perf/trial_load.py) against a stored baseline
# of that workload, which judges the GPU it was recorded on only (canary/gate.py `recorded_elsewhere`:
# across H200 machine starts an unchanged build failed 3 of 3): SECTIONS="gate_baseline gate" records
# one and judges a fresh server against it in one call; on another GPU the verdict is inconclusive.
GATE+=(${GATE_ARGS:---driver-processes 4})
if want gate_record; then
    section gate_record "${GATE_TIMEOUT:-300}" "${GATE[@]}" --golden-update
    mkdir -p "$OUT/golden"
    cp golden/transcripts/stress-*.*-*.jsonl "$OUT/golden/" 2>/dev/null
    # The store just written beside the other GPU kinds' stores of its dtype and kernels: "the same" is what
    # canary.gate.SAME_NUMERICS_AS needs to check this kind against theirs (golden_compare.log).
    dtype=${GATE_DTYPE:-float32}
    for new in $(find golden/transcripts -name "stress-*.*-$dtype*.jsonl" -newer "$OUT/gpu.txt"); do
        for other in golden/transcripts/stress-*.*-"$dtype${new##*-"$dtype"}"; do
            [ "$other" != "$new" ] && [ -f "$other" ] && { echo "== $other vs $new"
                $PY -m canary golden compare "$other" "$new"; echo "rc=$?"; } >> "$OUT/golden_compare.log" 2>&1
        done
    done
    find golden/baselines -newer "$OUT/gpu.txt" -name "*.json" -exec cp {} "$OUT/golden/" \;
fi
# The same gate recording this GPU's perf baseline only (golden transcripts still checked); before `gate`,
# which then judges a fresh server against it on the same GPU.
if want gate_baseline; then
    section gate_baseline "${GATE_TIMEOUT:-300}" "${GATE[@]}" --baseline-update --report-dir "$OUT/gate_baseline"
    mkdir -p "$OUT/golden"
    find golden/baselines -newer "$OUT/gpu.txt" -name "*.json" -exec cp {} "$OUT/golden/" \;
fi
# GATE_RUNS fresh servers one after the other (the gate's tok/s spreads ~25% from run to run on the H200).
if want gate; then
    for run in $(seq 1 "${GATE_RUNS:-1}"); do
        name=gate; [ "${GATE_RUNS:-1}" -gt 1 ] && name=gate_$run
        section "$name" "${GATE_TIMEOUT:-300}" "${GATE[@]}" --report-dir "$OUT/$name"
    done
fi
# A/B against another build on this same GPU: the baseline server runs from AB_TREE (a copy of an
# older commit's runtime/ and golden/models, carried into the call), the candidate is this checkout;
# interleaved trials answer "is this build slower than that one here?", which a baseline stored on
# another machine start cannot (the host-bound canary trials move with the host's CPU).
# Both servers on the same two CPUs (AB_SERVER_CPUS, default 4,5 on a host of 8 or more; "" leaves them to the
# scheduler), the harness on the others: how the H200's perf series met issue 17's bar (docs/pre-deploy.md).
if want gate_ab_tree; then
    AB_PORT=${AB_PORT:-18431}
    ab_cpus=${AB_SERVER_CPUS-$([ "$(nproc)" -ge 8 ] && echo 4,5)}
    pin=(); [ -n "$ab_cpus" ] && pin=(--server-cpus "$ab_cpus")
    # The other tree's server as the gate starts its own (pool, threads, CPUs: canary.targets.embedded_server),
    # with this interpreter (the device image's; the other tree has no .venv there).
    setsid $PY -m canary baseline-server --tree "${AB_TREE:?gate_ab_tree needs AB_TREE}" --port "$AB_PORT" \
        "${pin[@]}" --python "$(realpath -s "$(command -v "$PY")")" --log-dir "$OUT" -- --dtype "${GATE_DTYPE:-float32}" \
        >"$OUT/ab_baseline_server.log" 2>&1 &
    ab_pid=$!  # setsid execs in place (a background job leads no group): this is the command itself
    $PY -c "from canary.targets import wait_healthy; wait_healthy('http://127.0.0.1:$AB_PORT', None, 120, None)"
    section gate_ab_tree "${GATE_TIMEOUT:-300}" "${GATE[@]}" "${pin[@]}" \
        --baseline-url "http://127.0.0.1:$AB_PORT" --report-dir "$OUT/gate_ab"
    kill -TERM "$ab_pid" 2>/dev/null; wait "$ab_pid" 2>/dev/null  # it stops its server before it exits
fi
# Where the gate's time goes, server and harness together (needs py-spy's wheel in .whl).
want gate_profile && section gate_profile "${GATE_TIMEOUT:-300}" /tmp/site/bin/py-spy record --subprocesses --threads --rate 100 \
    --format raw -o "$OUT/gate_profile.txt" -- "${GATE[@]}"
want gate_stream_race && negative_control gate_stream_race "${GATE_TIMEOUT:-300}" \
    env DSV4_STREAM_JITTER_CYCLES=2000000 "${GATE[@]}" --inject-fault stream-race
# ---- issue 17: the perf verdict's error rates: N clean and N slow-step 10% A/B verdicts (the bar:
# 0 alarms, >= 19 of 20 caught). Resumable: the results live outside $OUT, so a second call on the
# still-warm machine goes on where the first stopped (--budget-s keeps each call inside its limit).
if want perf_trials; then
    PERF_TRIALS_OUT=${PERF_TRIALS_OUT:-/tmp/perf_trials/perf_trials.jsonl}
    mkdir -p "$(dirname "$PERF_TRIALS_OUT")"
    # The trial workload as JSON (the gate's --perf-workload form), e.g. '{"concurrency": [8], "ttft_rate": 16, "rounds": 10}'.
    default_workload='{"ttft_rate": 16, "rounds": '"${PERF_TRIALS_ROUNDS:-1}"'}'
    section perf_trials "${PERF_TRIALS_TIMEOUT:-580}" $PY -m bench.perf_verdict_trials \
        --runs "${PERF_TRIALS_RUNS:-20}" --mode "${PERF_TRIALS_MODE:-ab}" --budget-s "${PERF_TRIALS_BUDGET:-420}" \
        --perf-workload "${PERF_TRIALS_WORKLOAD:-$default_workload}" \
        --server-arg=--dtype=float32 --out "$PERF_TRIALS_OUT" ${PERF_TRIALS_ARGS:-}
    cp "$PERF_TRIALS_OUT" "$OUT/" 2>/dev/null
fi
# ---- issue 16: PD's KV transfer between CUDA pools (staged through pinned host slots, Mooncake over
# loopback TCP) and the PD pair of GPU servers against the colocated one. Mooncake and the libraries it
# links are not in the image: carry .whl-pd and .debs-pd (scripts/pd_device_deps.sh) with .whl. The
# debs are unpacked under /tmp/pdroot (never /), and only the libraries the image lacks are linked
# into /tmp/pdlib, so none of the image's own (libssl, libcurl) is shadowed by Debian's build.
pd_libs() {  # pd_libs SO ROOT LIBDIR: link into LIBDIR, from the debs unpacked under ROOT, each library SO cannot find
    local so=$1 root=$2 libdir=$3 round lib found missing
    command -v ldd >/dev/null || { ln -sf "$root"/usr/lib/x86_64-linux-gnu/* "$root"/lib/x86_64-linux-gnu/* "$libdir"/; return 0; }
    for round in 1 2 3 4 5 6; do
        missing=$(LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ldd "$so" | awk '/not found/{print $1}' | sort -u)
        [ -z "$missing" ] && return 0
        for lib in $missing; do
            found=$(find "$root" -name "$lib" | head -n 1)
            [ -n "$found" ] || { echo "PD: no carried package holds $lib (round $round)"; return 1; }
            ln -sf "$found" "$libdir/$lib"
        done
    done
    return 1
}
if want pd_gpu || want pd_gpu_tests || want pd_gpu_ttft || want pd_phases || want pd_phases_profile || want gate_pd || want gate_pd_profile; then
    rm -rf /tmp/pdroot /tmp/pdlib && mkdir -p /tmp/pdroot /tmp/pdlib
    for deb in .debs-pd/*.deb; do dpkg -x "$deb" /tmp/pdroot; done
    # A folder of their own: `--upgrade --target` replaces a top-level folder it also installs, and the
    # Mooncake wheel's scripts would replace /tmp/site/bin (py-spy from .whl with it).
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-pd .whl-pd/*.whl
    [[ ":$PYTHONPATH:" == *":/tmp/site-pd:"* ]] || export PYTHONPATH=/tmp/site-pd:$PYTHONPATH
    pd_libs /tmp/site-pd/mooncake/engine.so /tmp/pdroot /tmp/pdlib > "$OUT/pd_libs.txt" 2>&1; ls /tmp/pdlib >> "$OUT/pd_libs.txt"
    export LD_LIBRARY_PATH=/tmp/pdlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    $PY -c "from runtime.disagg.transfer import unavailable_reason as r; print(r() or 'PD: transfer engine loads')" >> "$OUT/pd_libs.txt" 2>&1
fi
want pd_gpu && section pd_transfer_gpu_dsv4 "${PD_BENCH_TIMEOUT:-60}" $PY -m bench.pd_transfer --device cuda --mode staged --tokens 2048 --shape dsv4 --repeats 5 --out "$OUT/pd_transfer_gpu.json"
want pd_gpu && section pd_transfer_gpu_canary "${PD_BENCH_TIMEOUT:-60}" $PY -m bench.pd_transfer --device cuda --mode staged --tokens 2048 --shape canary --repeats 5 --out "$OUT/pd_transfer_gpu_canary.json"
# `pd_gpu_tests` alone: the GPU PD tests without the transfer benches.
(want pd_gpu || want pd_gpu_tests) && section pd_gpu_tests "${PD_TEST_TIMEOUT:-360}" $PY -m pytest -v -p no:cacheprovider --run-gpu -rA ${PD_TEST_FILES:-tests/gpu/test_pd_gpu.py tests/unit/test_pd_staging.py tests/unit/test_pd_transfer.py}
# TTFT of the PD pair (two server processes on the one GPU, or a GPU each on a host with two, plus the router)
# against a colocated server process. pd_gpu and pd_gpu_ttft each fill most of one 10-minute device call: run
# them in two calls.
want pd_gpu_ttft && section pd_gpu_ttft "${PD_TTFT_TIMEOUT:-480}" $PY -m bench.pd_ttft --repeats 10 --words 8,400 --server-arg=--dtype=float32 --out "$OUT/pd_ttft_gpu.json"
# Where the PD pair's first token spends its time beside the colocated server's, phase by phase (the
# servers' x-dsv4-trace marks): PD_PHASES_REPEATS per prompt size.
# PD_PIN=apart|apart-swapped|pd-shared pins every process to whole cores (bench/pd_ttft.py's --pin).
want pd_phases && section pd_phases "${PD_TTFT_TIMEOUT:-300}" $PY -m bench.pd_ttft --repeats "${PD_PHASES_REPEATS:-10}" \
    --words 8,100,400 --phases ${PD_PIN:+--pin "$PD_PIN"} --server-arg=--dtype=float32 --out "$OUT/pd_phases_gpu.json"
# The same, 400-word prompts only, under py-spy (every server process, every thread, GIL holders marked
# with --gil off: all samples; 1,000 Hz fell behind on the H200 host, hence 250 by default; needs py-spy's
# wheel in .whl): where the prefill server's template + tokenize spent 3x the colocated server's time on
# the H200 (docs/results.md, "Seventeenth session"; not seen again in the twenty-second).
want pd_phases_profile && section pd_phases_profile "${PD_TTFT_TIMEOUT:-300}" /tmp/site/bin/py-spy record \
    --subprocesses --threads --idle --rate "${PD_PROFILE_RATE:-250}" --format raw -o "$OUT/pd_phases_profile.txt" -- \
    $PY -m bench.pd_ttft --repeats "${PD_PHASES_REPEATS:-10}" --words 400 --phases --server-arg=--dtype=float32 \
    --out "$OUT/pd_phases_profile.json"
# Issue 16: the 80-session gate against a PD pair (prefill + decode servers on the one GPU or a GPU each, the
# router in front) with the H200 golden store, beside the colocated `gate` of the same call: TTFT of
# the pair vs the colocated server on the same workload.
want gate_pd && section gate_pd "${GATE_TIMEOUT:-300}" "${GATE[@]}" --pd --report-dir "$OUT/gate_pd"
# The PD gate's 80 sessions alone under py-spy (every process, 100 Hz, active samples only): where
# the pair's TTFT goes under load (p50 ~1 s on the H200 against the colocated server's 0.05 s).
want gate_pd_profile && section gate_pd_profile "${GATE_TIMEOUT:-300}" /tmp/site/bin/py-spy record --subprocesses \
    --threads --rate 100 --format raw -o "$OUT/gate_pd_profile.txt" -- "${GATE[@]}" --pd -k "test_canary_gate and not preemption"
# The device tool brings back at most 8 files: pack the logs, the recorded golden files and the report.
(cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt && rm -f ./*.log ./*.txt
 for dir in golden gate gate_baseline gate_ab gate_pd; do [ -d "$dir" ] && tar czf "$dir.tgz" "$dir" && rm -rf "$dir"; done) || true
exit $status
