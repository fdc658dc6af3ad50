#!/usr/bin/env bash
# Re-measure, with each system in a prefix-cache namespace of its own, the vLLM-backend figures
# that compared kvcomm with dense / stock vLLM on ONE in-process engine before that isolation
# existed (kvcomm calls that injected nothing were served the blocks their dense twin had just
# computed; the eval's dense run was served the warm-up's):
#
#   1. `kvcomm eval --backend vllm` scope runs of 2026-12-05 on MMLU, retrieval and GSM
#      (docs/measurements/2026-12-05-content-gsm-humaneval.md, "The scopes on the vLLM backend";
#      quoted in docs/decisions.md), the same commands.
#   2. `kvcomm run --backend vllm` on the bundled review pipeline with the demo's settings (the
#      workload of the issue's 3.23x / 2.38x figures; not published) and on the chain pipeline,
#      3 rows, 8-token replies, first_use (the 2026-11 history figure, then made by
#      bench_vllm.py through the same side-by-side loop as `kvcomm run`).
#   3. benchmarks/bench_vllm.py with its defaults (docs/measurements/2026-12-02-bench-vllm.md).
#      Its baseline already had a salt of its own, so its figures should not move beyond noise;
#      re-run for the cached-token counts it now reports for both systems.
#
# Run it ALONE on the machine (TTFT is what is measured), from any folder:
#
#     benchmarks/remeasure_vllm_sides.sh [STEP ...]      # steps: eval run bench (default: all three)
#     DRY_RUN=1 benchmarks/remeasure_vllm_sides.sh       # print the commands, run nothing
#     benchmarks/remeasure_vllm_sides.sh summary         # only SUMMARY.txt, from the outputs already there
#
# Outputs under out/remeasure/ (one folder per eval run, JSON and text per command, stderr logs,
# start/end times, the environment, and SUMMARY.txt comparing against the published figures).
# Expected wall time on the project's 2-core VM: about 1 h 30 min (the three evaluations took
# 74 min on 2026-12-05, bench_vllm.py about 6 min, the two `kvcomm run`s about 8 min, plus an
# engine start-up of about 1 min per command).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
KVCOMM="${KVCOMM:-$ROOT/.venv/bin/kvcomm}"
OUT="${OUT:-$ROOT/out/remeasure}"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(eval run bench)

# The published runs' environment: vLLM in process, one unbound OpenMP thread, fp32.
export OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"

mkdir -p "$OUT"
TIMES="$OUT/times.txt"

note() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$TIMES" >&2; }

environment() {
  {
    echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . ':!out' || echo ' (dirty)')"
    echo "host: $(uname -srm), $(getconf _NPROCESSORS_ONLN) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PYTHON" - <<'EOF'
import importlib.metadata as m


def version(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
    return "absent"


print("vllm", version("vllm-cpu", "vllm"), "| torch", version("torch"), "| transformers", version("transformers"))
EOF
    env | grep -E '^(OMP_NUM_THREADS|VLLM_[A-Z0-9_]+)=' | sort
  } > "$OUT/environment.txt"
  cat "$OUT/environment.txt" >&2
  load=$(cut -d' ' -f1 /proc/loadavg)
  if awk -v l="$load" 'BEGIN {exit !(l > 0.5)}'; then
    note "WARNING: load average $load: something else is running; TTFT figures would not be comparable"
  fi
}

FAILED=()
run_step() {  # name, then the command; stdout to $OUT/name.out, stderr to $OUT/name.err; a failure is noted, the next step runs
  local name="$1"; shift
  if [ -n "${DRY_RUN:-}" ]; then echo "$name: $*"; return; fi
  note "start $name: $*"
  if "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; then
    note "end $name"
  else
    note "FAILED $name (exit $?; see $OUT/$name.err)"
    FAILED+=("$name")
  fi
}

step_eval() {
  # docs/measurements/2026-12-05-content-gsm-humaneval.md, the three commands of "The scopes on the vLLM backend"
  local common=(--limit 24 --warm-items 24 --agents 2 --modes dense,kvcomm --single-pass --backend vllm --no-kl)
  run_step eval-mmlu24 "$KVCOMM" eval --workload mmlu "${common[@]}" --reuse-scope all,content --out "$OUT/mmlu24-vllm-scopes"
  run_step eval-retr24 "$KVCOMM" eval --workload retrieval "${common[@]}" --reuse-scope all,all-reader-replies,content --out "$OUT/retr24-vllm-scopes"
  run_step eval-gsm24 "$KVCOMM" eval --workload gsm "${common[@]}" --reuse-scope all,all-reader-replies,content --out "$OUT/gsm24-vllm-scopes"
}

step_run() {
  # The review pipeline with the demo's settings of then (gamma 1, first_use base, scope all), every row.
  run_step run-review "$KVCOMM" run "$ROOT/kvcomm/data/review_pipeline.json" --backend vllm --gamma 1 --base-source first_use --reuse-scope all --json
  # The chain pipeline as the 2026-11 history figure ran it: 3 rows, 8-token replies, first_use.
  "$PYTHON" - "$ROOT/kvcomm/data/demo_pipeline.json" "$OUT/chain3.json" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1]))
spec["inputs"], spec["max_new_tokens"] = spec["inputs"][:3], 8
json.dump(spec, open(sys.argv[2], "w"), indent=2)
EOF
  run_step run-chain3 "$KVCOMM" run "$OUT/chain3.json" --backend vllm --base-source first_use --reuse-scope all --json
}

step_bench() {
  # docs/measurements/2026-12-02-bench-vllm.md: the defaults of then (5 rows, 3 passes, documents >= 1,000 tokens,
  # 12-token replies; scope all, the default until 2026-12-06)
  run_step bench-vllm "$PYTHON" "$ROOT/benchmarks/bench_vllm.py" --reuse-scope all --json
}

summary() {
  "$PYTHON" - "$OUT" "$ROOT" <<'EOF' | tee "$OUT/SUMMARY.txt"
"""Each re-measured figure next to the published one (TTFT sums over all calls, misses
included; ratios stock over kvcomm), with each system's prompt tokens served by vLLM's prefix
cache (kvcomm's beyond what it injected)."""
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
# docs/measurements/2026-12-05-content-gsm-humaneval.md, lines 123-133: TTFT sum (s), ratio
PUBLISHED = {
    ("mmlu24-vllm-scopes", "dense"): (25.17, 1.00), ("mmlu24-vllm-scopes", "all"): (9.23, 2.73),
    ("mmlu24-vllm-scopes", "content"): (10.85, 2.32),
    ("retr24-vllm-scopes", "dense"): (73.13, 1.00), ("retr24-vllm-scopes", "all"): (27.04, 2.70),
    ("retr24-vllm-scopes", "all-reader-replies"): (28.15, 2.60), ("retr24-vllm-scopes", "content"): (27.65, 2.64),
    ("gsm24-vllm-scopes", "dense"): (39.27, 1.00), ("gsm24-vllm-scopes", "all"): (15.10, 2.60),
    ("gsm24-vllm-scopes", "all-reader-replies"): (20.92, 1.88), ("gsm24-vllm-scopes", "content"): (15.94, 2.46),
}
for folder in ("mmlu24-vllm-scopes", "retr24-vllm-scopes", "gsm24-vllm-scopes"):
    path = out / folder / "results.json"
    if not path.is_file():
        continue
    data = json.loads(path.read_text())
    print(f"== kvcomm eval --backend vllm: {folder} ({data['settings'].get('model', '')})")
    print(f"{'run':<20} {'TTFT sum':>9} {'ratio':>6} {'published':>17} {'p50 / p95 s':>15} {'tok reuse':>9} "
          f"{'reply eq':>8} {'prefix hit':>17}")
    sums = {}
    for row in (r for r in data["aggregates"] if r["seed"] == "pooled"):
        key = "dense" if row["mode"] == "dense" else (row["scope"] or data["settings"]["scopes"][0])
        sums[key] = sum(c["ttft_s"] for c in data["calls"] if c["mode"] == row["mode"] and c["setting"] == row["setting"])
        ratio = sums["dense"] / sums[key]
        was = PUBLISHED.get((folder, key))
        published = "" if was is None else f"{was[0]:.2f} s {was[1]:.2f}x"
        print(f"{key:<20} {sums[key]:>7.2f} s {ratio:>5.2f}x {published:>17} "
              f"{row['ttft_p50_s']:.3f} / {row['ttft_p95_s']:.3f} {row['token_reuse_rate']:>9.1%} "
              f"{row['reply_agreement']:>8.1%} {row['cached_tokens']:>7} of {row['prompt_tokens']:<7}")
    print()

for name in ("run-review", "run-chain3"):
    path = out / f"{name}.out"
    if not path.is_file() or not path.stat().st_size:
        continue
    from kvcomm.eval.report import CallReport, format_table
    report = json.loads(path.read_text())
    print(f"== kvcomm run --backend vllm: {name}")
    print(format_table([CallReport(**c) for c in report["calls"]]))
    print()

path = out / "bench-vllm.out"
if path.is_file() and path.stat().st_size:
    sys.path.insert(0, str(Path(sys.argv[2]) / "benchmarks"))
    from bench_vllm import format_overhead
    from kvcomm.eval.demo_report import format_demo
    report = json.loads(path.read_text())
    print("== benchmarks/bench_vllm.py (published 2026-12-02, run A: 93.7 s / 62.9 s = 1.49x; run B 1.55x)")
    print(format_demo(report["pipeline"], "stock vLLM"))
    print("per pass: " + ", ".join(f"{p['total_ttft_dense_s']:.1f} s / {p['total_ttft_reuse_s']:.1f} s = "
                                   f"{p['total_ttft_speedup']:.2f}x (cached {p['dense_cached_tokens']} / "
                                   f"{p['reuse_cached_tokens']})" for p in report["pipeline"]["passes"]))
    print(format_overhead(report["overhead"]))
EOF
}

[ -z "${DRY_RUN:-}" ] && environment
for step in "${STEPS[@]}"; do
  case "$step" in
    eval) step_eval ;;
    run) step_run ;;
    bench) step_bench ;;
    summary) ;;  # only the summary of what is already under $OUT
    *) echo "unknown step $step (eval, run, bench, summary)" >&2; exit 2 ;;
  esac
done
[ -n "${DRY_RUN:-}" ] && exit 0
summary
note "done; outputs in $OUT${FAILED[*]:+; FAILED: ${FAILED[*]}}"
[ ${#FAILED[@]} -eq 0 ]
