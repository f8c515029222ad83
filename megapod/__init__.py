"""The MegaPod as a whole: its topology, the local launcher (`megapod up`), Kubernetes deploys, the doctor and the
CLI. The front endpoint itself is orpheus_front, which this package launches."""
