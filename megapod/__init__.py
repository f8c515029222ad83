"""The MegaPod as a whole: its topology, the local launcher, the front endpoint and the CLI."""
