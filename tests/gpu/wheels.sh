#!/usr/bin/env bash
# The wheels the lent GPU node lacks (../shared/reference/gpu-device.md: Python 3.12, torch built
# for CUDA 13, no internet), fetched here into .whl/ (ignored by git), which travels with the
# working tree and which bash tests/gpu/run.sh installs into a folder of its own before the tests:
#   bash tests/gpu/wheels.sh [python version, default 3.12] [torch's CUDA major, default 13]
# - simplejpeg: --decode fast's decoder (and the host fallback of --decode gpu);
# - nvImageCodec built for torch's CUDA major, with that CUDA's nvJPEG: --decode gpu's decoder (the
#   crops only, on the hardware JPEG engines); the cu13 wheel is 25 MB, nvJPEG 13 4 MB (the cu12
#   wheel, 80 MB, did not fit the 64 MiB that may travel);
# - pytest-timeout 2.3.0 or later: run.sh's --session-timeout, which ends the test stage between
#   two tests (the node's own version is not known).
# Not fetched: DALI (425 MB): --loader dali is refused in one sentence there.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
cuda=${2:-13}
nvimgcodec=$(sed -nE 's/^nvidia-nvimgcodec-cu[0-9]+>=([0-9.]+).*/\1/p' requirements.txt)
case $cuda in
    12) nvjpeg='nvidia-nvjpeg-cu12' ;;
    *) nvjpeg="nvidia-nvjpeg>=${cuda},<$((cuda + 1))" ;;
esac
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d .whl "$(grep -E '^simplejpeg' requirements.txt)" \
    "nvidia-nvimgcodec-cu${cuda}==${nvimgcodec}" \
    "$nvjpeg" 'pytest-timeout>=2.3.0'
kib=$(du -sk .whl | cut -f1)
if [ "$kib" -ge $((64 * 1024)) ]; then
    echo "wheels.sh: .whl/ holds ${kib} KiB, over the 64 MiB that may travel to the GPU node;" \
         "remove a wheel." >&2
    exit 1
fi
ls .whl
echo "${kib} KiB in .whl/: pass carry [\".whl\"] to the device's run (tests/gpu/README.md)."
