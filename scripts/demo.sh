#!/usr/bin/env bash
# The whole pipeline on the embedded default, no account or server: scikit-learn's digits written
# as a raw lake in a local folder -> manifest job (spark-submit) -> shard job (spark-submit, 2
# shards: one per rank) -> 2-rank DDP training (torchrun, gloo) -> test accuracy, images/s and
# the share of step time spent waiting for data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$PWD/.venv/bin/python"

DEMO=${DEMO_DIR:-demo}
python scripts/make_digits_lake.py "$DEMO/lake/raw"
spark-submit --master "local[2]" --driver-memory 2g --conf spark.log.level=WARN jobs/manifest.py --conf conf/manifest.yaml \
    --input "$DEMO/lake/raw" --output "$DEMO/datasets/digits" --seed 7 --min-per-class 5 --overwrite
spark-submit --master "local[2]" --driver-memory 2g --conf spark.log.level=WARN jobs/shard.py --conf conf/shard.yaml \
    --dataset "$DEMO/datasets/digits" --num-shards 2 --image-size 32 --image-format png --overwrite
torchrun --standalone --nproc_per_node=2 -m loaders.train --conf conf/train.yaml \
    --dataset "$DEMO/datasets/digits" --output "$DEMO/runs/digits" --epochs "${EPOCHS:-10}" --batch-size 64 --lr 0.01 \
    --no-augment  # a mirrored digit is another shape: no flips
