#!/usr/bin/env bash
# Install everything the tests need (packages, headless Chromium for the report test), run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the Ray extra: the sweep test starts a local Ray cluster (not needed for the main job)
"${PYTHON:-python3}" -m pip install --quiet -e ".[ray]"
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
            || echo "warning: could not install chromium; the browser test will be skipped" >&2
    fi
fi
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
