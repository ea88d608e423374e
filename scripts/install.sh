#!/usr/bin/env bash
# Everything the test suite needs, into the active Python environment: what CI has (.ci/run runs
# this, then the README's test command), so the suite skips only tests that need a GPU.
#   - torch: the CPU build (torch==2.13.0) unless a torch is installed already (a GPU machine
#     brings its own), then the package with its test extras;
#   - NIXL without its CUDA torch (UCX is bundled), Mooncake's non-CUDA build;
#   - system packages (apt-get, as root or through sudo): a C++ compiler for the native decode
#     layers, Chromium and curl for the console's browser tests, Node.js/npm for the Codex CLI (pinned,
#     into .ci/node), and the libraries Mooncake's engine.so
#     links (libibverbs.so.1 with libnl-3/libnl-route-3, libnuma.so.1, libcurl.so.4);
# then it checks each piece imports or runs, and exits non-zero naming what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(python -m pip install -q)

if ! python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" torch==2.13.0
fi
"${PIP[@]}" -e ".[test]"
"${PIP[@]}" --no-deps "nixl-cu12==1.5.1"
"${PIP[@]}" "mooncake-transfer-engine-non-cuda==0.3.13.post1"

SYSTEM=(g++ curl chromium libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4)
if command -v dpkg-query >/dev/null && command -v apt-get >/dev/null; then
    missing=()
    for package in "${SYSTEM[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" \
            || missing+=("$package")
    done
    # Node.js with npm, for the Codex CLI: Debian's two packages unless an npm is on PATH already
    # (NodeSource's nodejs brings its own npm and conflicts with Debian's npm package)
    command -v npm >/dev/null || missing+=(nodejs npm)
    if [ ${#missing[@]} -gt 0 ]; then
        as_root=()
        [ "$(id -u)" = 0 ] || as_root=(sudo -n)
        echo "install.sh: apt-get install ${missing[*]}"
        # A fresh machine's package lists may be empty or old: always update first (without it,
        # `apt-get install libibverbs1` fails and Mooncake's import with it).
        "${as_root[@]}" apt-get update -q
        DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -q "${missing[@]}"
    fi
else
    echo "install.sh: not a Debian system: install a C++ compiler, Chromium (or run" \
         "'playwright install chromium') and libibverbs, libnl-3, libnuma, libcurl yourself"
fi
# the Codex CLI for the Responses API test (tests/test_responses_embedded.py), pinned, from npm
npm install --prefix .ci/node --no-audit --no-fund --loglevel=error "@openai/codex@0.171.0"
if ! python tests/chromium.py >/dev/null; then
    python -m playwright install chromium || true  # its own browser, found by tests/chromium.py
fi

python - <<'EOF'
import importlib.util, shutil, subprocess, sys
failed = []
def check(what, ok, fix):
    if not ok:
        failed.append(f"  {what}: {fix}")
check("C++ compiler (native decode layers)", shutil.which("c++"), "apt-get install g++")
check("Chromium (console tests)",
      subprocess.run([sys.executable, "tests/chromium.py"], capture_output=True).returncode == 0,
      "apt-get install chromium, or: playwright install chromium")
check("NIXL (PD tests)", any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")),
      'pip install --no-deps "nixl-cu12==1.5.1"')
try:
    from mooncake.engine import TransferEngine  # noqa: F401
    mooncake = True
except ImportError as e:
    mooncake, why = False, str(e)
check("Mooncake (PD tests)", mooncake,
      "apt-get install libibverbs1 libnuma1 libcurl4" + ("" if mooncake else f" ({why})"))
check("Codex CLI (Responses API test)", shutil.which(".ci/node/node_modules/.bin/codex"),
      "npm install --prefix .ci/node @openai/codex@0.171.0")
sys.path.insert(0, "bench")
import sbs_servers
check("transformers serve + accelerate (side-by-side test)", sbs_servers.peer_available(),
      'pip install -e ".[test]"')
if failed:
    print("install.sh: these are missing, and their tests would skip:\n" + "\n".join(failed))
    sys.exit(1)
print("install.sh: everything the tests need is here")
EOF
