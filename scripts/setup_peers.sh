#!/usr/bin/env bash
# The peer data loaders we benchmark against (benchmarks/peers/), each in its own virtualenv under
# .venv-peers/ (git-ignored), so that their pins fight neither each other nor .venv:
#
#   .venv-peers/streaming   mosaicml-streaming (MDS shards, streaming.StreamingDataset)
#   .venv-peers/litdata     litdata (litdata.optimize chunks, litdata.StreamingDataset)
#   .venv-peers/webdataset  webdataset (tar shards)
#   .venv-peers/dataloader  plain torch (a Dataset over files, torch's DataLoader)
#   .venv-peers/ray         ray[data,train] (Ray Data: read_parquet, map_batches, iter_torch_batches)
#
#   bash scripts/setup_peers.sh                      # all five
#   bash scripts/setup_peers.sh streaming litdata    # only these
#
# torch==2.13.0 comes first, alone: that exact pin takes the CPU wheel on this machine's disk,
# while any other torch requirement met with no torch installed pulls GBs of CUDA packages
# (nvidia-*). It is installed once for every side environment (scripts/torch_layer.sh: .venv-torch,
# read through a .pth file). Every install runs under a constraints file that holds torch at
# 2.13.0, so a tool that wants another torch fails to resolve instead of replacing it. Then the deps every peer's
# reader uses (numpy, pillow, simplejpeg, psutil, boto3), then the tool, pinned.
#
# No torchvision anywhere: no build of it imports beside torch 2.13.0 CPU (PyPI's 0.28.0, the one
# made for torch 2.13.0, is a CUDA build: "operator torchvision::nms does not exist"). Hence:
#   * mosaicml-streaming goes in with --no-deps and the requirements its reader imports, listed
#     below from its metadata. Left out: torchvision (only streaming.vision's CIFAR/ImageNet
#     classes use it) and the clients of the other clouds (google-cloud-storage, azure-*, oci,
#     paramiko; imported only for gs://, azure://, oci://, sftp:// remotes) and matplotlib
#     (the simulator). `import streaming` imports streaming.vision, so the venv gets a stand-in
#     for that one module (a .pth import hook, written below): streaming imports, and touching
#     streaming.vision raises an ImportError that says why.
#   * litdata goes in with --no-deps and its requirements but torchvision, which it treats as
#     optional (JPEG/video decoding when present; we hand it bytes).
# Each venv is checked after the install and on every run: torch is 2.13.0+cpu, no nvidia-* and
# no torchvision package, pip check finds nothing missing but what is left out on purpose, the
# tool imports at its pin. Idempotent (a stamp per venv): a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
source scripts/torch_layer.sh # TORCH, torch_layer
STREAMING=0.13.0  # mosaicml-streaming
LITDATA=0.2.76
WEBDATASET=1.0.2
RAY=2.60.0
COMMON=(numpy pillow simplejpeg psutil boto3)
ALL=(streaming litdata webdataset dataloader ray)

[ $# -gt 0 ] || set -- "${ALL[@]}"
for name in "$@"; do
    case $name in
        streaming | litdata | webdataset | dataloader | ray) ;;
        *)
            echo "setup_peers: unknown peer '$name' (choose from: ${ALL[*]})" >&2
            exit 2
            ;;
    esac
done

VENV=
pip() { # quiet unless it fails; always under the venv's constraints (torch stays 2.13.0)
    local out
    out=$("$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "$@" 2>&1) || {
        echo "$out" >&2
        return 1
    }
}

install_tool() { # what each peer adds on top of torch and COMMON
    case $1 in
        streaming)
            # mosaicml-streaming 0.13.0's requirements as its metadata gives them, less those
            # left out (see the top); numpy < 2.2 is its pin.
            pip "${COMMON[@]}" "numpy>=1.21.5,<2.2.0" "boto3>=1.21.45,<2" "Brotli>=1.0.9" \
                "python-snappy>=0.6.1,<1" "tqdm>=4.64.0,<5" "transformers>=4.21.3,<5" \
                "xxhash>=3.0.0,<4" "zstd>=1.5.2.5,<2" "catalogue>=2,<3"
            pip --no-deps "mosaicml-streaming==$STREAMING"
            streaming_vision_standin
            ;;
        litdata)
            pip "${COMMON[@]}" lightning-utilities filelock requests "urllib3>=1.26" tifffile obstore
            pip --no-deps "litdata==$LITDATA"
            ;;
        webdataset) pip "${COMMON[@]}" "webdataset==$WEBDATASET" ;;
        dataloader) pip "${COMMON[@]}" ;;
        # data: Ray Data (pandas, pyarrow, fsspec); train: iter_torch_batches imports
        # ray.train.torch, which needs pydantic (and the extra brings tensorboardX, small).
        ray) pip "${COMMON[@]}" "ray[data,train]==$RAY" ;;
    esac
}
left_out() { # requirements pip check may find missing, on purpose (a regex of names)
    case $1 in
        streaming) echo "torchvision|google-cloud-storage|azure-[a-z-]*|oci|paramiko|matplotlib" ;;
        litdata) echo "torchvision" ;;
        *) echo "-none-" ;;
    esac
}
tool_import() { # python that imports the tool as m, its name n and its pin want
    case $1 in
        streaming) echo "import streaming as m; n = 'mosaicml-streaming'; want = '$STREAMING'" ;;
        litdata) echo "import litdata as m; n = 'litdata'; want = '$LITDATA'" ;;
        webdataset) echo "import webdataset as m; n = 'webdataset'; want = '$WEBDATASET'" ;;
        dataloader) echo "import torch.utils.data, torch as m; n = 'torch'; want = '$TORCH'" ;;
        ray) echo "import ray.data, ray.train.torch, pyarrow.fs, ray as m; n = 'ray'; want = '$RAY'" ;;
    esac
}

streaming_vision_standin() { # see the top: a stand-in for streaming.vision, imported by .pth
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cat >"$site/_lakeshard_streaming_vision.py" <<'PY'
"""Written by lakeshard's scripts/setup_peers.sh (with lakeshard-streaming-vision.pth, which
imports it at start-up). `import streaming` imports streaming.vision, which needs torchvision,
and no torchvision imports beside torch 2.13.0 CPU. This finder answers for that one module
with an empty stand-in, so the rest of streaming imports; using it raises ImportError."""

import importlib.abc
import importlib.util
import sys

_WHY = (
    "streaming.vision needs torchvision, which this venv (.venv-peers/streaming) does not have: "
    "no torchvision build imports beside torch 2.13.0 CPU (see scripts/setup_peers.sh)"
)


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "streaming.vision" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            raise ImportError(f"{_WHY}: streaming.vision.{attr}")

        module.__getattr__ = __getattr__
        module.__doc__ = _WHY


sys.meta_path.insert(0, _StandIn())
PY
    echo "import _lakeshard_streaming_vision" >"$site/lakeshard-streaming-vision.pth"
}

check() { # the venv as it should be; prints its summary line
    local name=$1 line missing
    if "$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia|torchvision)'; then
        echo "setup_peers: $VENV has the packages above (a CUDA torch came in): rm -r $VENV and rerun" >&2
        return 1
    fi
    missing=$("$VENV/bin/python" -m pip check 2>&1 | grep -vE "requires ($(left_out "$name")), which is not installed" |
        grep -v '^No broken requirements' || true)
    if [ -n "$missing" ]; then
        echo "setup_peers: pip check in $VENV: $missing" >&2
        return 1
    fi
    line=$(
        "$VENV/bin/python" - <<PY
$(tool_import "$name")
import numpy, PIL, simplejpeg, psutil, boto3, torch
v = getattr(m, "__version__", "?")
assert v.split("+")[0] == want, f"{n} {v}, want {want}"
assert torch.__version__ == "$TORCH+cpu", f"torch {torch.__version__}, want $TORCH+cpu"
print(n if n == "torch" else f"{n} {v}, torch", torch.__version__, "numpy", numpy.__version__, end="")
PY
    ) || {
        echo "setup_peers: $VENV is broken ($name does not import at its pin): rm -r $VENV and rerun" >&2
        return 1
    }
    echo "setup: $VENV ready ($line, $(du -sh "$VENV" | cut -f1))"
}

setup_one() { # setup_one NAME: install the peer's venv unless its stamp is current, then check it
    local name=$1 stamp
    VENV=.venv-peers/$name
    stamp=$VENV/.lakeshard-peers-installed
    if [ ! -f "$stamp" ] || [ scripts/setup_peers.sh -nt "$stamp" ] || [ scripts/torch_layer.sh -nt "$stamp" ]; then
        echo "setup: installing $VENV (a minute or two)" >&2
        [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
        # The CPU wheel on disk is for CPython 3.11; on another Python the same pin is a CUDA build.
        "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
            echo "setup_peers: $VENV is not Python 3.11 (torch $TORCH's CPU wheel here is cp311):" \
                "rm -r $VENV and rerun with PYTHON=<a python3.11>" >&2
            return 1
        }
        echo "torch==$TORCH" >"$VENV/constraints.txt"
        torch_layer "$VENV"
        install_tool "$name"
        check "$name" >/dev/null
        touch "$stamp"
    fi
    check "$name"
}

# Side by side: an install waits mostly on the package index, not the CPU (four in turn took 5
# minutes, side by side under 2). Each one's lines are printed together when it ends.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
names=("$@")
pids=()
for name in "${names[@]}"; do
    (setup_one "$name") >"$logs/$name" 2>&1 &
    pids+=($!)
done
failed=()
for i in "${!pids[@]}"; do
    name=${names[$i]}
    wait "${pids[$i]}" || failed+=("$name")
    cat "$logs/$name"
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "setup_peers: failed: ${failed[*]} (their lines above)" >&2
    exit 1
fi
