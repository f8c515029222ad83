#!/bin/sh
# Mark the node that holds the MegaPod and ask the MIG manager for its layout.
#   deploy/cluster/label-node.sh NODE [MIG_CONFIG]     (MIG_CONFIG: megapod-h100 or megapod-h200)
# The MIG manager repartitions GPU 7 when the label changes; no GPU pod may run on that GPU then.
set -eu
node=${1:?usage: label-node.sh NODE [megapod-h100|megapod-h200]}
mig_config=${2:-megapod-h100}
kubectl label node "$node" orpheus-megapod/role=megapod "nvidia.com/mig.config=$mig_config" --overwrite
echo "waiting for the MIG manager (label nvidia.com/mig.config.state=success)..."
kubectl wait node "$node" --for=jsonpath='{.metadata.labels.nvidia\.com/mig\.config\.state}'=success --timeout=15m
kubectl get node "$node" -o jsonpath='{.status.allocatable}'; echo
