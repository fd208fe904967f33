# Sourced by the GPU scripts: makes libnvrtc findable for the cuda backend, which loads
# libcuda and libnvrtc at run time. Adds the first toolkit or pip-wheel folder that holds
# NVRTC when the loader does not find it already, and keeps the kernel cache out of the
# home folder of a shared machine. $1 names the calling script in messages.
setup_nvrtc() {
    local who=$1 nvrtc libdir shim
    if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so '; then
        nvrtc=$(find /usr/local /usr/lib /opt /usr/local/lib/python3* /usr/lib/python3* \
            -name 'libnvrtc.so*' -not -name '*builtins*' 2>/dev/null | sort | head -n 1)
        if [ -n "$nvrtc" ]; then
            libdir=$(dirname "$nvrtc")
            shim=/tmp/tether-nvrtc
            mkdir -p "$shim"
            # cudarc looks for the unversioned name (or .so.12); point it at what exists.
            [ -e "$libdir/libnvrtc.so" ] || ln -sf "$nvrtc" "$shim/libnvrtc.so"
            export LD_LIBRARY_PATH="$shim:$libdir:${LD_LIBRARY_PATH:-}"
            echo "$who: using NVRTC from $nvrtc"
        else
            echo "$who: warning: no libnvrtc found; cuda kernels will fail to compile" >&2
        fi
    fi
    export TETHER_CACHE=${TETHER_CACHE:-/tmp/tether-cache}
}
