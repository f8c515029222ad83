"""`megapod deploy`: render the MegaPod for a cluster, apply it, wait until it serves.

    megapod deploy                         # H100 profile, Helm chart, current kubeconfig context
    megapod deploy --profile cpu --dry-run # print the objects it would apply, touch nothing
    megapod deploy --workers 6 --snac-max-batch 64 -f my-values.yaml --set images.llm.tag=abc
    megapod deploy --kustomize k8s/overlays/h100
    kubectl kustomize k8s/overlays/cpu | megapod deploy --manifest -

The topology flags are the MegaPodConfig fields megapod/render.py passes to the chart, read as
`megapod up` reads them (pydantic checks each, orpheus_common/settings.py); their defaults are the profile's
(megapod/cluster.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from orpheus_common.settings import explain, flag

from .cluster import PROFILES, ClusterProfile
from .deploy import DeployError, KubeApis, apply_all, deployments_of, describe, endpoints, wait_for_rollouts
from .render import CHART, HelmRender, RenderError, dump_manifests, find_helm, kustomize, parse_manifests
from .topology import MegaPodConfig

# MegaPodConfig field -> the chart values it sets: exactly the fields render.profile_values passes
# to the chart (host, local ports and GPU indices stay with `megapod up`).
TOPOLOGY = MegaPodConfig.chart_paths()


def _topology_help(field: str) -> str:
    defaults = {name: getattr(p.megapod, field) for name, p in sorted(PROFILES.items())}
    shown = ", ".join(f"{k}: {v}" for k, v in defaults.items())
    if len(set(defaults.values())) == 1:
        shown = str(next(iter(defaults.values())))  # every profile's
    return f"sets {', '.join(TOPOLOGY[field])} (default {shown})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megapod deploy", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h100")
    parser.add_argument("-n", "--namespace", default="orpheus-megapod")
    parser.add_argument("--release", default="orpheus-megapod")
    parser.add_argument("--chart", type=Path, default=CHART)
    parser.add_argument("--helm", help="helm binary (default: the one `make install` puts in .venv/bin, then PATH)")
    parser.add_argument("-f", "--values", type=Path, action="append", default=[], help="more chart values files")
    parser.add_argument("--set", dest="set_values", action="append", default=[], metavar="KEY=VALUE")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kustomize", type=Path, metavar="OVERLAY", help="render an overlay instead of the chart")
    source.add_argument("--manifest", metavar="FILE", help="apply already rendered objects (- for stdin)")
    parser.add_argument("--dry-run", action="store_true", help="print the objects it would apply and stop")
    parser.add_argument("--no-create-namespace", dest="create_namespace", action="store_false")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the rollouts")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    topology = parser.add_argument_group(
        "topology", "MegaPodConfig fields, read as `megapod up` reads them; defaults are the --profile's")
    for field in TOPOLOGY:
        topology.add_argument(flag(field), dest=field, metavar=field.upper(), help=_topology_help(field))
    return parser


def profile_from_args(args: argparse.Namespace) -> ClusterProfile:
    """The chosen profile with the topology flags applied; ValueError when they do not fit."""
    profile = PROFILES[args.profile]
    changes = {name: getattr(args, name) for name in TOPOLOGY if getattr(args, name) is not None}
    if changes and (args.kustomize or args.manifest):
        raise ValueError("topology flags shape the Helm render only, not --kustomize or --manifest")
    try:
        return dataclasses.replace(profile, megapod=profile.megapod.replace(**changes))
    except ValidationError as exc:
        raise ValueError(explain(exc)) from None


def render_objects(args: argparse.Namespace, profile: ClusterProfile) -> list[dict]:
    if args.manifest:
        text = sys.stdin.read() if args.manifest == "-" else Path(args.manifest).read_text()
    elif args.kustomize:
        text = kustomize(args.kustomize)
    else:
        render = HelmRender(profile, args.release, args.namespace, args.chart, args.values, args.set_values)
        text = render.run(find_helm(args.helm))
    objects = parse_manifests(text)
    if args.create_namespace and not any(o["kind"] == "Namespace" for o in objects):
        objects.insert(0, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": args.namespace}})
    return objects


def deploy(apis: KubeApis, objects: list[dict], args: argparse.Namespace) -> None:
    """Apply, wait for every Deployment to be rolled out and ready, print the endpoints."""
    apply_all(apis, objects, args.namespace, _progress)
    wait_for_rollouts(apis, deployments_of(objects, args.namespace), args.timeout, _progress)
    print("\nMegaPod ready:")
    for line in endpoints(apis, objects, args.namespace):
        print(f"  {line}")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        profile = profile_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        objects = render_objects(args, profile)
        if args.dry_run:
            sys.stdout.write(dump_manifests(objects))
            kinds = ", ".join(describe(o) for o in objects)
            print(f"megapod deploy --dry-run: would apply {len(objects)} objects: {kinds}", file=sys.stderr)
            return
        deploy(KubeApis.from_kubeconfig(args.context), objects, args)
    except (RenderError, DeployError, ApiException, HTTPError, OSError) as exc:
        sys.exit(f"megapod deploy: {exc}")  # unreachable API server, refusals, timeouts: one line, no traceback
