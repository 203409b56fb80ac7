#!/usr/bin/env bash
# The wheels the lent GPU node lacks (../shared/reference/gpu-device.md: Python 3.12, no internet),
# fetched here into .whl/ (ignored by git), which travels with the working tree and which bash
# tests/gpu/run.sh installs into a folder of its own before the tests:
#   bash tests/gpu/wheels.sh [python version, default 3.12]
# simplejpeg: --decode fast's decoder (and the host fallback of --decode gpu). Not fetched:
# nvImageCodec (80 MB) and DALI (425 MB) exceed the 64 MiB that may travel; dlojz decodes whole
# files without the first, and refuses --loader dali in one sentence without the second.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d .whl "$(grep -E '^simplejpeg' requirements.txt)"
kib=$(du -sk .whl | cut -f1)
if [ "$kib" -ge $((64 * 1024)) ]; then
    echo "wheels.sh: .whl/ holds ${kib} KiB, over the 64 MiB that may travel to the GPU node;" \
         "remove a wheel." >&2
    exit 1
fi
ls .whl
echo "${kib} KiB in .whl/: pass carry [\".whl\"] to the device's run (tests/gpu/README.md)."
