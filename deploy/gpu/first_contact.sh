#!/usr/bin/env bash
# First contact with a GPU node: the codec tier's wheels installed from the kit into a private folder
# (never into the node's own environment), the GPU and the versions printed, then the codec-only doctor
# (python -m megapod.doctor --codec-only): its JSON, its log and the versions land in OUT_DIR.
#
#   make gpu-kit                                   # where pip reaches an index: the wheels into .gpu-kit/
#   deploy/gpu/first_contact.sh OUT_DIR [flags]    # on the node: python3 with torch; no network needed
#
# Flags go to the doctor (--max-batch N, --device cpu, --quick). PYTHON picks the interpreter (python3),
# MEGAPOD_GPU_KIT the wheels' folder (.gpu-kit/), MEGAPOD_DOCTOR_TIMEOUT_S the doctor's limit (330 s).
set -euo pipefail
out=${1:?usage: deploy/gpu/first_contact.sh OUT_DIR [megapod doctor flags]}
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
mkdir -p "$out"
# shellcheck source=deploy/gpu/kit_site.sh
source "$repo/deploy/gpu/kit_site.sh"

{
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'none (no nvidia-smi answer)')"
  echo "installed from the kit into $site: $(echo $wheels | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
  "$python" - <<'PY'
import importlib.metadata as md, platform, torch
names = ("torch", "numpy", "snac", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "prometheus-client",
         "pydantic", "pydantic-settings")
print("python", platform.python_version(), "| torch cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available())
print(" | ".join(f"{n} {md.version(n)}" for n in names))
PY
} 2>&1 | tee "$out/versions.txt"

status=0
timeout -k 5 "${MEGAPOD_DOCTOR_TIMEOUT_S:-330}" "$python" -m megapod.doctor --codec-only -o "$out/doctor.json" "$@" \
  >"$out/doctor.log" 2>&1 || status=$?
tail -n 40 "$out/doctor.log"
echo "first contact: doctor exit status $status; $out/doctor.json, $out/doctor.log, $out/versions.txt"
exit "$status"
