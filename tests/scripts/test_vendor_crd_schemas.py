"""scripts/vendor_crd_schemas.py: a CRD's served schemas, without their prose, with where they came from; and the
schemas vendored in tests/data/crds say so."""
import json
import re
import sys

from locations import DATA, SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import vendor_crd_schemas  # noqa: E402

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "spec": {"group": "example.com", "names": {"kind": "Widget", "plural": "widgets"}, "versions": [
        {"name": "v1", "served": True, "schema": {"openAPIV3Schema": {
            "description": "A widget.", "type": "object",
            "properties": {"spec": {"description": "Its spec.", "type": "object", "properties": {
                "description": {"description": "A field named description.", "type": "string"},
                "size": {"type": "integer", "enum": [1, 2]}}}}}}},
        {"name": "v0", "served": False, "schema": {"openAPIV3Schema": {"type": "object"}}},
    ]},
}


def test_served_versions_without_prose_and_with_their_source():
    ((name, content),) = vendor_crd_schemas.vendored(CRD, "owner/repo@abc", "Apache-2.0")
    assert name == "example.com_widgets_v1.json"
    assert (content["group"], content["kind"], content["version"], content["source"], content["license"]) == \
        ("example.com", "Widget", "v1", "owner/repo@abc", "Apache-2.0")
    spec = content["openAPIV3Schema"]["properties"]["spec"]
    assert "description" not in content["openAPIV3Schema"] and "description" not in spec
    # a property named `description` stays (without its own prose); everything else is as published
    assert spec["properties"] == {"description": {"type": "string"}, "size": {"type": "integer", "enum": [1, 2]}}
    assert vendor_crd_schemas.vendored(CRD, "s", "l", only="v2") == []


def test_vendored_schemas_name_their_source_commit_and_license():
    files = sorted((DATA / "crds").glob("*.json"))
    assert {f.name for f in files} >= {"leaderworkerset.x-k8s.io_leaderworkersets_v1.json",
                                       "inference.networking.k8s.io_inferencepools_v1.json"}
    readme = (DATA / "crds" / "README.md").read_text()
    for f in files:
        content = json.loads(f.read_text())
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", content["source"]), (f.name, content["source"])
        assert content["license"] == "Apache-2.0" and f.name in readme
        assert content["source"].split("@")[1] in readme, f.name
