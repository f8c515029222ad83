# Sourced by the GPU scripts: the kit's wheels installed into a private folder (never into the node's own
# environment) that is removed at exit, and on PYTHONPATH beside the repository. Needs `repo` and `python` set;
# sets `site` and `wheels`. MEGAPOD_GPU_KIT names the wheels' folder (.gpu-kit/).
kit=${MEGAPOD_GPU_KIT:-$repo/.gpu-kit}
site=$(mktemp -d "${TMPDIR:-/tmp}/megapod-gpu-site.XXXXXX")
trap 'rm -rf "$site"' EXIT

wheels=$("$python" "$repo/deploy/gpu/kit_wheels.py" "$kit")
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one path a line, no spaces: the kit's wheel names
  "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" $wheels
fi
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
