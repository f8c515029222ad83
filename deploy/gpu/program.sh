#!/usr/bin/env bash
# The GPU program (issue 45): what a lent GPU machine measures, in one call of at most 8 minutes, every figure as
# JSON in OUT_DIR. Each part runs under its own time limit; one that fails or runs out leaves its status in
# summary.json and the next still runs:
#   1. first contact (first_contact.sh): the codec-only doctor: the codec's checks on the compiled step, compiled
#      against eager, fp32 / fp16 / bf16 with their SNR and the precision to serve, one replica through gRPC;
#                                                                        OUT_DIR/first-contact/doctor.json
#   2. the MegaPod's codec layout: 3 snac-server replicas on the GPU, then 1, driven from client processes at real
#      time, 250 to 2,500 streams (benchmarks/snac_replicas.py);       OUT_DIR/snac-replicas.json
#   3. the LLM tier's ceiling: the Orpheus 3B decode step in plain PyTorch (vLLM cannot run on torch 2.11),
#      bf16 and FP8, both heads, batch 1-512 at contexts of 300-1,200 tokens (benchmarks/llm_ceiling.py);
#                                                                        OUT_DIR/llm-ceiling.json
#   4. OUT_DIR/summary.json: each part's exit status, seconds and files.
# The two benchmarks write their JSON as they go (after each level, and each weight format): one cut by its limit
# keeps what it measured. The doctor writes its JSON at the end; a cut doctor leaves each part's result in its log.
#
#   make gpu-kit                                    # where pip reaches an index: the codec's wheels into .gpu-kit/
#   deploy/gpu/program.sh OUT_DIR                   # on the node: python3 with torch; no network needed
#   deploy/gpu/program.sh OUT_DIR --device cpu      # the dry run (make test runs it): every GPU figure named and
#                                                   # marked "not measured: cpu"
#
# PYTHON picks the interpreter (python3); MEGAPOD_DOCTOR_TIMEOUT_S (240: on a GPU the doctor compiles the step),
# MEGAPOD_REPLICAS_TIMEOUT_S (120) and MEGAPOD_CEILING_TIMEOUT_S (70) the parts' limits: with the doctor's margin,
# the kills' 5 s and two installs of the kit, under 8 minutes.
set -uo pipefail
out=${1:?usage: deploy/gpu/program.sh OUT_DIR [--device cpu]}
shift
device=auto
if [ "${1:-}" = "--device" ]; then device=${2:?--device needs a value}; shift 2; fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
mkdir -p "$out"
: >"$out/parts.tsv"

part() {  # part NAME LIMIT_S COMMAND...: run it, its output in OUT_DIR/NAME.log, its status and seconds in parts.tsv
  local name=$1 limit=$2 started status=0
  shift 2
  started=$(date +%s.%N)
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1 || status=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$started" "$(date +%s.%N)" "$limit" >>"$out/parts.tsv"
  tail -n 5 "$out/$name.log"
  echo "$name: exit status $status"
}

if [ "$device" = cpu ]; then
  doctor_flags=(--device cpu --max-batch 2 --quick)
else
  doctor_flags=()
fi
doctor_s=${MEGAPOD_DOCTOR_TIMEOUT_S:-240}
MEGAPOD_DOCTOR_TIMEOUT_S=$doctor_s part first-contact $((doctor_s + 15)) "$repo/deploy/gpu/first_contact.sh" \
  "$out/first-contact" ${doctor_flags[@]+"${doctor_flags[@]}"}  # (an empty array under set -u: bash < 4.4)
# The benchmarks import the codec's packages (snac, grpcio): the kit's folder, as first_contact.sh installs it.
# shellcheck source=deploy/gpu/kit_site.sh
source "$repo/deploy/gpu/kit_site.sh"
part snac-replicas "${MEGAPOD_REPLICAS_TIMEOUT_S:-120}" "$python" "$repo/benchmarks/snac_replicas.py" --device "$device" \
  --out "$out/snac-replicas.json"
part llm-ceiling "${MEGAPOD_CEILING_TIMEOUT_S:-70}" "$python" "$repo/benchmarks/llm_ceiling.py" --device "$device" \
  --out "$out/llm-ceiling.json"

"$python" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {}
for line in (out / "parts.tsv").read_text().splitlines():
    name, status, started, ended, limit = line.split("\t")
    parts[name] = {"exit_status": int(status), "seconds": round(float(ended) - float(started), 1), "limit_s": int(limit),
                   "timed_out": int(status) in (124, 137)}
files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "summary.json")
summary = {"ok": all(p["exit_status"] == 0 for p in parts.values()), "parts": parts, "files": files}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary["parts"]))
sys.exit(0 if summary["ok"] else 1)
PY
