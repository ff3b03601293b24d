"""A JSON Schema of the JobSet fields Relay writes, from JobSet's API reference for v0.8
(`jobset.x-k8s.io/v1alpha2`, api/jobset/v1alpha2/jobset_types.go): kubernetes-validate has no
schema for a custom resource. Unknown fields are refused at every level Relay writes, as
`--strict` refuses them in the built-in kinds; each replicated job's template is a
batch/v1 JobTemplateSpec, which the tests validate with kubernetes-validate as a Job."""

from __future__ import annotations

JOBSET_VERSION = "v0.8"
RULE_NAME = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

LABELS = {"type": "object", "additionalProperties": {"type": "string"}}

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": LABELS,
                "annotations": LABELS,
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["replicatedJobs"],
            "properties": {
                "suspend": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "startupPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}},
                },
                "successPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["operator"],
                    "properties": {
                        "operator": {"enum": ["All", "Any"]},
                        "targetReplicatedJobs": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name", "action"],
                                "properties": {
                                    "name": {"type": "string", "pattern": RULE_NAME},
                                    "action": {
                                        "enum": [
                                            "FailJobSet",
                                            "RestartJobSet",
                                            "RestartJobSetAndIgnoreMaxRestarts",
                                        ]
                                    },
                                    "onJobFailureReasons": {
                                        "type": "array",
                                        "uniqueItems": True,
                                        "items": {"type": "string"},
                                    },
                                    "targetReplicatedJobs": {
                                        "type": "array",
                                        "items": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "template"],
                        "properties": {
                            "name": {
                                "type": "string",
                                "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                            },
                            "replicas": {"type": "integer", "minimum": 1},
                            "template": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["spec"],
                                "properties": {
                                    "metadata": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {"labels": LABELS, "annotations": LABELS},
                                    },
                                    "spec": {"type": "object"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
