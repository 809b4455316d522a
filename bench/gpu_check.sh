#!/usr/bin/env bash
# The GPU check: one prepared script, run when a GPU machine is lent (docs/kernels.md).
#
# Each section is one line of SECTIONS: "name|time limit in seconds|command". Sections run in
# order, each under its own limit, each logged to $LOG_DIR/<name>.log; a failing section does not
# stop the others. The script ends by reprinting each section's final table (from its log's last
# line starting with "== ", else its last lines) and a summary table. Exit status: 0 when every
# section passed. Add a section: append a line to SECTIONS (keep the whole check under 5 minutes).
#
#   bash bench/gpu_check.sh            # logs under $OUT (the device tool's folder) or a temp dir
#   PY=/path/to/python bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${LOG_DIR:-${OUT:-$(mktemp -d)}}"
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1

# A Python with CUDA torch: $PY, else the project venv if it sees a GPU, else python3.
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -P -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
      2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
# batchinfer must import: an editable install without dependencies (torch/triton are there).
if ! "$PY" -P -c 'import batchinfer.kernels' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$LOG_DIR/install.log" 2>&1 \
    || { echo "gpu_check: could not install batchinfer (see $LOG_DIR/install.log)"; exit 1; }
fi
"$PY" -P -c 'import torch; gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"gpu_check: {gpu}, torch {torch.__version__}")'

SECTIONS=(
  "kernel_tests|85|$PY -P -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels_triton.py tests/test_kernels_moe.py tests/test_gguf_dequant.py"
  "noncausal|18|$PY -P -m pytest -q -p no:cacheprovider tests/test_kernels_noncausal.py -k 'gpu or triton_non_causal'"
  "kernels|22|$PY bench/kernels_gpu.py --json $LOG_DIR/kernels.json"
  "engine|40|$PY bench/engine_gpu.py --requests 128 --json $LOG_DIR/engine.json"
  "moe|14|$PY bench/moe_gpu.py --json $LOG_DIR/moe.json"
  "lora|22|$PY -P -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -m gpu && $PY -P bench/lora_cpu.py --kernel-table"
  "embed|28|$PY -P bench/embed_cpu.py --tiny-cuda --texts 4096 && $PY -P -m pytest -q -p no:cacheprovider tests/test_embed_engine.py -k cuda"
  "tp|8|n=\$($PY -P -c 'import torch; print(torch.cuda.device_count())'); if [ \"\$n\" -lt 2 ]; then echo \"== tp: skipped, \$n GPU(s) (needs 2)\"; else $PY -P -m pytest -q -p no:cacheprovider tests/test_tp_engine.py -m gpu && $PY -P bench/tp_cpu.py --device cuda --quick --tp \$([ \$n -ge 8 ] && echo 8 || ([ \$n -ge 4 ] && echo 4 || echo 2)); fi"
  "host|18|$PY bench/host_overhead.py --device cuda --vocabs 49152 --running 256 --modes greedy sampled --steps 30 --output-kind final_only"
  "structured|45|$PY -P -m pytest -q -p no:cacheprovider tests/test_structured_backend.py -m gpu && $PY -P bench/structured.py --quick --device cuda --engine-backends llguidance,xgrammar --json $LOG_DIR/structured.json"
  "spec|40|$PY -P bench/spec_decode.py --quick --device cuda --json $LOG_DIR/spec.json"
)

summary=()
failed=0
for section in "${SECTIONS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$section"
  echo
  echo "######## $name (limit ${limit}s): $cmd"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  seconds=$(( $(date +%s) - start ))
  case $rc in
    0) status=ok ;;
    124|137) status="TIMEOUT after ${limit}s"; failed=1 ;;
    *) status="FAILED (exit $rc)"; failed=1 ;;
  esac
  summary+=("$name|$status|$seconds|$LOG_DIR/$name.log")
done

echo
echo "################################ results ################################"
for line in "${summary[@]}"; do
  IFS='|' read -r name _ _ log <<<"$line"
  echo
  echo "---- $name ----"
  marker=$(grep -n '^== ' "$log" | tail -1 | cut -d: -f1)
  if [ -n "$marker" ]; then tail -n "+$marker" "$log"; else tail -n 5 "$log"; fi
done
echo
printf '%-14s %-22s %8s  %s\n' section status seconds log
printf '%-14s %-22s %8s  %s\n' -------------- ---------------------- -------- ---
for line in "${summary[@]}"; do
  IFS='|' read -r name status seconds log <<<"$line"
  printf '%-14s %-22s %8s  %s\n' "$name" "$status" "$seconds" "$log"
done
exit $failed
