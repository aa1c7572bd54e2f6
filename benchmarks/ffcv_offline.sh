#!/bin/bash
# FFCV for a machine that cannot install it (the GPU machine: no network, no apt, Python 3.12):
# its sdist's Python package plus its C++ extension built here as a stable-ABI module (any
# Python >= 3.8), linked against Debian's static OpenCV core + imgproc (it calls cv::resize
# alone), with libturbojpeg and libtbb beside it (RUNPATH $ORIGIN). Needs g++, the Python
# headers, apt-get download (Debian 12) and curl.
#   benchmarks/ffcv_offline.sh OUT_DIR   -> OUT_DIR/ffcv, a package folder to put on PYTHONPATH
# Its Python needs (numba, llvmlite, terminaltables, pytorch_pfn_extras, fastargs, assertpy,
# psutil) travel as wheels; docs/benchmarks.md#peers says how they were carried.
set -euo pipefail
out=$(realpath -m "${1:?usage: benchmarks/ffcv_offline.sh OUT_DIR}")
[ -e "$out/ffcv" ] && { echo "$out/ffcv exists: move it away first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download -qq libturbojpeg0 libturbojpeg0-dev libopencv-core-dev libopencv-imgproc-dev \
  libopencv-core406 libopencv-imgproc406 libtbb12 libtbb-dev 2> apt.log ||
  { cat apt.log >&2; exit 1; }
for f in *.deb; do dpkg -x "$f" x; done
curl -sSfLO https://files.pythonhosted.org/packages/db/95/de56ae69d42c65fe04e408cd27a3e62a925fb576f0f2330a2b3588e488d5/ffcv-1.0.2.tar.gz
echo "42766a487c8a659b543d070f24732c4b65aab8d96980f5792c63e91e55511f00  ffcv-1.0.2.tar.gz" | sha256sum -c --quiet
tar xzf ffcv-1.0.2.tar.gz
lib=x/usr/lib/$(gcc -print-multiarch)
# opencv.hpp would include every module: only the two it uses. glX is referenced by core's
# OpenGL interop, which resize never reaches.
mkdir -p shim/opencv2 pkg
printf '#include <opencv2/core.hpp>\n#include <opencv2/imgproc.hpp>\n' > shim/opencv2/opencv.hpp
echo 'extern "C" void* glXGetProcAddressARB(const unsigned char*) { return 0; }' > glx.cpp
py=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
cp -r ffcv-1.0.2/ffcv pkg/
g++ -O3 -shared -fPIC -DPy_LIMITED_API=0x03080000 -Ishim -Ix/usr/include/opencv4 -Ix/usr/include \
  -I"$py" ffcv-1.0.2/libffcv/libffcv.cpp glx.cpp -o pkg/ffcv/_libffcv.abi3.so \
  -Wl,--gc-sections -Wl,-rpath,'$ORIGIN' "$lib/libopencv_imgproc.a" "$lib/libopencv_core.a" \
  -L"$lib" -l:libturbojpeg.so.0 -l:libtbb.so.12 -lz -lpthread -ldl 2> build.log ||
  { cat build.log >&2; exit 1; }
cp -L "$lib/libturbojpeg.so.0" "$lib/libtbb.so.12" pkg/ffcv/
mkdir -p "$out" && mv pkg/ffcv "$out/"
echo "FFCV 1.0.2 in $out/ffcv ($(du -sh "$out/ffcv" | cut -f1))"
