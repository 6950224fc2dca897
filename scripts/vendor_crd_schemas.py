"""Vendors a CustomResourceDefinition's schema for the offline manifest tests (tests/deploy/test_manifests.py).

Keeps, of each served version, only what validation reads: the group, kind, version and openAPIV3Schema, less the
schema's prose (`description`), which is most of a published CRD's bytes (LeaderWorkerSet's embeds two pod templates).
The source (repository@commit) and its license go into the file, so a vendored schema says where it came from.

    python scripts/vendor_crd_schemas.py tests/data/crds CRD.yaml --source OWNER/REPO@COMMIT [--version v1]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def strip_descriptions(node, in_properties: bool = False):
    """The schema without its prose. A property *named* `description` (a key of `properties`) is kept."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v, k == "properties") for k, v in node.items()
                if in_properties or not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def vendored(crd: dict, source: str, license_id: str, only: str | None = None) -> list[tuple[str, dict]]:
    """(file name, content) for each served version of the CRD (or only the version named `only`)."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind {crd.get('kind')!r}")
    spec = crd["spec"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", False) or only not in (None, version["name"]):
            continue
        content = {"source": source, "license": license_id, "group": spec["group"], "kind": spec["names"]["kind"],
                   "version": version["name"],
                   "openAPIV3Schema": strip_descriptions(version["schema"]["openAPIV3Schema"])}
        out.append((f"{spec['group']}_{spec['names']['plural']}_{version['name']}.json", content))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("crd", type=Path, help="the published CRD (YAML)")
    p.add_argument("--source", required=True, help="OWNER/REPO@COMMIT the CRD file came from")
    p.add_argument("--license", default="Apache-2.0", dest="license_id")
    p.add_argument("--version", dest="only", help="vendor only this version (default: every served one)")
    args = p.parse_args(argv)
    docs = [d for d in yaml.safe_load_all(args.crd.read_text()) if d]
    if len(docs) != 1:
        print(f"vendor_crd_schemas: {args.crd} holds {len(docs)} documents, expected one CRD", file=sys.stderr)
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in vendored(docs[0], args.source, args.license_id, args.only):
        (args.out_dir / name).write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")
        print(args.out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
