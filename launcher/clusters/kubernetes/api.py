"""The Kubernetes API as a Kubernetes run uses it: create its objects, list its Jobs and pods
by label, delete them. Two clients give the same answers, as the `kubernetes` package's
models (`V1Job`, `V1Pod`): the official Python client (`cluster.client=python`, the
kubeconfig `kubectl` uses, or the pod's service account inside a cluster), and `kubectl`
(`cluster.client=kubectl`), whose JSON is read into the same models.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from launcher.clusters.kubernetes.manifests import JOBSET_API
from launcher.errors import ConfigError

KUBECTL_TIMEOUT_S = 60


class KubeError(RuntimeError):
    """The API refused or could not be reached: its status and message."""


def models() -> Any:
    from kubernetes import client

    return client


def from_json(data: Any, model: str) -> Any:
    """The API's JSON answer as the client's model `model` (`V1JobList`, `V1Pod`, ...)."""
    return models().ApiClient().deserialize(json.dumps(data), model, "application/json")


class Api:
    """What a Kubernetes run asks of the API server."""

    def create(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def delete(self, kind: str, name: str, namespace: str, grace_s: int | None = None) -> None:
        """Delete with foreground propagation: a Job's pods go first (each gets SIGTERM and
        its grace period); an object already gone is no error."""
        raise NotImplementedError

    def jobs(self, namespace: str, selector: str) -> list[Any]:
        """The Jobs (V1Job) carrying the label selector."""
        raise NotImplementedError

    def pods(self, namespace: str, selector: str) -> list[Any]:
        """The pods (V1Pod) carrying the label selector."""
        raise NotImplementedError


class PythonApi(Api):
    """The official `kubernetes` client."""

    def __init__(self) -> None:
        from kubernetes import client, config

        try:
            config.load_kube_config()
        except Exception:
            try:
                config.load_incluster_config()
            except Exception as err:
                raise ConfigError(
                    f"cluster.client=python: no kubeconfig and not inside a cluster ({err}); "
                    f"point KUBECONFIG at the cluster's"
                ) from None
        # urllib3 warns of each retry on its own line; what failed is said once, as KubeError
        logging.getLogger("urllib3").setLevel(logging.ERROR)
        self.core, self.batch = client.CoreV1Api(), client.BatchV1Api()
        self.custom = client.CustomObjectsApi()

    def create(self, obj: dict[str, Any]) -> None:
        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        with answered(f"create {kind} {obj['metadata']['name']}"):
            if kind == "ConfigMap":
                self.core.create_namespaced_config_map(ns, obj)
            elif kind == "Service":
                self.core.create_namespaced_service(ns, obj)
            elif kind == "Job":
                self.batch.create_namespaced_job(ns, obj)
            else:
                group, version = obj["apiVersion"].split("/")
                self.custom.create_namespaced_custom_object(group, version, ns, plural(kind), obj)

    def delete(self, kind: str, name: str, namespace: str, grace_s: int | None = None) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = client.V1DeleteOptions(propagation_policy="Foreground", grace_period_seconds=grace_s)
        try:
            with answered(f"delete {kind} {name}"):
                if kind == "ConfigMap":
                    self.core.delete_namespaced_config_map(name, namespace, body=body)
                elif kind == "Service":
                    self.core.delete_namespaced_service(name, namespace, body=body)
                elif kind == "Job":
                    self.batch.delete_namespaced_job(name, namespace, body=body)
                else:
                    group, version = JOBSET_API.split("/")
                    self.custom.delete_namespaced_custom_object(
                        group, version, namespace, plural(kind), name, body=body
                    )
        except KubeError as err:
            if not isinstance(err.__cause__, ApiException) or err.__cause__.status != 404:
                raise

    def jobs(self, namespace: str, selector: str) -> list[Any]:
        with answered("list jobs"):
            return self.batch.list_namespaced_job(namespace, label_selector=selector).items

    def pods(self, namespace: str, selector: str) -> list[Any]:
        with answered("list pods"):
            return self.core.list_namespaced_pod(namespace, label_selector=selector).items


class KubectlApi(Api):
    """`kubectl` on the command line (its current context)."""

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        try:
            done = subprocess.run(
                ["kubectl", *args],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=KUBECTL_TIMEOUT_S,
            )
        except FileNotFoundError:
            raise ConfigError("cluster.client=kubectl: no kubectl on PATH") from None
        except subprocess.TimeoutExpired:
            raise KubeError(f"kubectl {args[0]}: no answer in {KUBECTL_TIMEOUT_S} s") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise KubeError(f"kubectl {' '.join(args[:2])}: {said[-1] if said else 'failed'}")
        return done.stdout

    def create(self, obj: dict[str, Any]) -> None:
        self.kubectl("create", "-f", "-", stdin=json.dumps(obj))

    def delete(self, kind: str, name: str, namespace: str, grace_s: int | None = None) -> None:
        args = ["delete", kind.lower(), name, "-n", namespace, "--cascade=foreground"]
        args += ["--ignore-not-found", "--wait=false"]
        if grace_s is not None:
            args.append(f"--grace-period={grace_s}")
        self.kubectl(*args)

    def jobs(self, namespace: str, selector: str) -> list[Any]:
        out = self.kubectl("get", "jobs", "-n", namespace, "-l", selector, "-o", "json")
        return from_json(json.loads(out), "V1JobList").items

    def pods(self, namespace: str, selector: str) -> list[Any]:
        out = self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
        return from_json(json.loads(out), "V1PodList").items


def plural(kind: str) -> str:
    return kind.lower() + "s"


@contextmanager
def answered(what: str) -> Iterator[None]:
    """The client's exceptions as KubeError, naming what was asked and why it failed."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as err:
        raise KubeError(f"{what}: {err.status} {api_reason(err)}") from err
    except (OSError, HTTPError) as err:
        raise KubeError(f"{what}: the API server did not answer ({err})") from err


def api_reason(err: Any) -> str:
    """The API's own message in an ApiException (its Status object), else its reason."""
    try:
        return json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(err.reason)


CLIENTS = {"python": PythonApi, "kubectl": KubectlApi}


def api_for(client: str) -> Api:
    """The client `cluster.client` names."""
    return CLIENTS[str(client)]()
