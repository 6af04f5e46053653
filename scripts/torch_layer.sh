# Sourced by scripts/setup_peers.sh and scripts/setup_petastorm.sh: one CPU torch for the side
# environments (.venv-peers/*, .venv-petastorm) instead of one per environment (about 50 s and
# 900 MB each). torch==$TORCH is installed once into .venv-torch/<python> (pip --target: torch and
# its own requirements, nothing else), and each side environment reads it through a .pth file,
# which Python puts on sys.path after the environment's own site-packages: a package the
# environment installs itself (a newer fsspec, say) wins over the layer's. pip in the environment
# sees the layer's torch as installed, so a requirement on torch is met by it, and the
# environment's constraints file (torch==$TORCH) keeps any other torch out.
# The main environment (.venv, scripts/setup.sh) keeps its own torch: it is the one users make.

TORCH=2.13.0

torch_layer() { # torch_layer VENV: put the shared torch on VENV's path (installing it once)
    local venv=$1 tag layer site out
    tag=$("$venv/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    layer=$PWD/.venv-torch/$tag
    mkdir -p .venv-torch
    # The side environments are set up side by side (scripts/test.sh): the first to come installs
    # the layer under the lock, the others wait for it.
    (
        flock 9
        if [ ! -f "$layer/.lakeshard-torch-$TORCH" ]; then
            echo "setup: installing torch $TORCH once for the side environments ($layer)" >&2
            rm -rf "$layer"
            out=$("$venv/bin/python" -m pip install -q --target "$layer" "torch==$TORCH" 2>&1) || {
                echo "$out" >&2
                exit 1
            }
            touch "$layer/.lakeshard-torch-$TORCH"
        fi
    ) 9>.venv-torch/.lock || return 1
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$layer" >"$site/lakeshard-torch.pth"
    # torch found in the layer, pip installs here only what the environment's own older copy
    # shadows (Python 3.11's venv comes with setuptools 65; torch wants >= 77.0.3).
    out=$("$venv/bin/python" -m pip install -q "torch==$TORCH" 2>&1) || {
        echo "$out" >&2
        return 1
    }
}
