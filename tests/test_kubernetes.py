"""cluster=kubernetes without a cluster: what can be proven on this machine (docs/kubernetes.md
says what cannot).

- The objects are a pure function of the plan: `rl ... action=manifests` prints the same
  stream as the golden files, for `model=tiny` on CPU and for the flagship.
- Every object validates strictly against the official Kubernetes 1.33 schemas
  (kubernetes-validate), and a JobSet against tests/support/jobset_schema.py.
- The pods run as the kubelet would run them (tests/support/pod_runner.py) and train a short
  run to its end; the trainer's pod is preempted, stopped as the kubelet stops a pod, and
  recreated as the Job controller does, and the run resumes with every step recorded once.
- Submission, status and cancel are driven through the `kubernetes` client's own API classes
  answering with the client's models, read from the API's JSON (tests/fixtures/kubernetes/api);
  `kubectl` is a script printing that JSON. A live cluster is used only where KUBECONFIG
  points at one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.clusters.kubernetes import api as kube_api
from launcher.clusters.kubernetes.manifests import EXIT_RUN_ENDED, EXIT_TIME_LIMIT
from rl.core.rundir import RunDir
from tests.support.pod_runner import PodRunner, hosts_writable, policy_action

ROOT = Path(__file__).resolve().parents[1]
RL = str(Path(sys.executable).with_name("rl"))
VALIDATE = str(Path(sys.executable).with_name("kubernetes-validate"))
GOLDEN = ROOT / "tests" / "fixtures" / "kubernetes"
RESPONSES = GOLDEN / "api"
IMAGE = ["cluster.image=registry.example.com/relay:0.1", "cluster.volume_claim=relay-runs"]
RUNS = {
    "tiny": ["cluster=kubernetes_cpu", *IMAGE],
    "glm5_ep8": ["model=glm5", "parallel=ep8", "cluster=kubernetes", *IMAGE],
    "options": [
        "model=glm5", "parallel=ep8", "cluster=kubernetes", *IMAGE,
        "cluster.allocation=per_role", "cluster.queue=team-a", "cluster.rdma_resource=rdma/ib",
        "cluster.rdma_per_node=8", "cluster.networks=[ib-a,ib-b]",
        "+cluster.node_selector.pool=h100", "cluster.priority_class=training",
        "cluster.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        "+cluster.env.NCCL_IB_HCA=mlx5", "+cluster.secrets.WANDB_API_KEY=wandb/api-key",
    ],
    "jobset": ["cluster=kubernetes_cpu", *IMAGE, "cluster.allocation=per_role",
               "cluster.jobset=true", "cluster.queue=team-a"],
}  # fmt: skip


def rl(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.run([RL, *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each run's `action=manifests` output, as a user would write it to a file. The run
    directory's last two parts name the run on the cluster, so `<name>/golden` is stable."""
    tmp = tmp_path_factory.mktemp("manifests")
    found = {}
    for name, args in RUNS.items():
        done = rl(tmp, *args, "action=manifests", f"hydra.run.dir={tmp / name / 'golden'}")
        assert done.returncode == 0, done.stderr
        found[name] = done.stdout
        assert not (tmp / name / "golden").exists()  # nothing written: the objects only
    return found


def objects(stream: str) -> list[dict[str, Any]]:
    return [obj for obj in yaml.safe_load_all(stream) if obj is not None]


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [VALIDATE, "--strict", "-k", "1.33.0", str(path)], capture_output=True, text=True
    )


# --- the objects -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "glm5_ep8"])
def test_the_manifests_are_the_golden_ones(streams: dict[str, str], name: str) -> None:
    """A pure function of the plan: the same stream every time, on any machine. Rewrite the
    golden files with RELAY_UPDATE_GOLDEN=1 when the objects change on purpose."""
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("RELAY_UPDATE_GOLDEN"):
        golden.write_text(streams[name])
    assert streams[name] == golden.read_text()
    kinds = [obj["kind"] for obj in objects(streams[name])]
    assert kinds == ["ConfigMap", "Service", "Job"]  # one job: every node a pod of it


@pytest.mark.parametrize("name", ["tiny", "glm5_ep8", "options"])
def test_every_object_validates_strictly(
    streams: dict[str, str], name: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(streams[name])
    done = validate(path)
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.findall(r"passed for resource (\S+)", done.stdout)
    assert len(passed) == len(objects(streams[name])), done.stdout


def test_the_validator_refuses_what_the_api_would(streams: dict[str, str], tmp_path: Path) -> None:
    """The check can fail: a field the API does not know, and a disruption rule without the
    condition's status, are refused."""
    for broken in ("unknown", "no_status"):
        docs = objects(streams["tiny"])
        job = docs[-1]
        if broken == "unknown":
            job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
        else:
            del job["spec"]["podFailurePolicy"]["rules"][1]["onPodConditions"][0]["status"]
        path = tmp_path / f"{broken}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        assert validate(path).returncode != 0


def test_the_flagships_objects_carry_its_plan(streams: dict[str, str]) -> None:
    """GLM-5 on 29 nodes: one Indexed Job of 29 pods, each with 8 GPUs and most of its node,
    the plan and config in the ConfigMap, the grace period the checkpoint needs, the pod
    failure policy, and the run directory on the claim."""
    config_map, svc, job = objects(streams["glm5_ep8"])
    plan = json.loads(config_map["data"]["plan.json"])
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["action"] == "run" and config["cluster"]["kind"] == "kubernetes"
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == plan["jobs"][0]["nodes"] == 29
    assert spec["backoffLimit"] == config["max_restarts"]
    assert spec["activeDeadlineSeconds"] == config["cluster"]["time_min"] * 60 + 600
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # the trainer's checkpoint of the step under way, and the roles' stop, fit the grace
    assert pod["terminationGracePeriodSeconds"] == config["cluster"]["signal_delay_s"] - 30 + 30
    assert pod["subdomain"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    run_dir = container["args"][container["args"].index("--run-dir") + 1]
    assert run_dir == f"/relay/{svc['metadata']['labels']['relay.dev/run']}"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/relay": "runs", "/etc/relay": "config", "/dev/shm": "shm"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "relay-runs"
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory"}
    # The Job controller's reading of the policy (the pod runner's, from the API reference):
    assert policy_action(spec, EXIT_RUN_ENDED, False) == "FailJob"
    assert policy_action(spec, EXIT_TIME_LIMIT, False) == "FailJob"
    assert policy_action(spec, 143, True) == "Ignore"  # preempted, evicted, drained
    assert policy_action(spec, 143, False) == "Count"  # a pod deleted by hand
    assert policy_action(spec, 1, False) == "Count"


def test_the_sites_options_reach_every_pod(streams: dict[str, str]) -> None:
    """Per role: three Jobs and three Services; Kueue's label on each Job, created suspended;
    the RDMA devices with IPC_LOCK, the Multus networks, node selector, tolerations and
    priority class on every pod."""
    docs = objects(streams["options"])
    assert [d["kind"] for d in docs] == ["ConfigMap", *["Service", "Job"] * 3]
    for job in (d for d in docs if d["kind"] == "Job"):
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert job["spec"]["suspend"] is True
        template = job["spec"]["template"]
        pod = template["spec"]
        assert template["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/networks": "ib-a,ib-b"}
        assert pod["nodeSelector"] == {"pool": "h100"}
        assert pod["priorityClassName"] == "training"
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["rdma/ib"] == 8
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in container["env"]
        secret = {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
        assert {"name": "WANDB_API_KEY", "valueFrom": secret} in container["env"]
    control = next(
        d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-control")
    )
    assert (
        "nvidia.com/gpu"
        not in control["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


def test_a_jobset_holds_the_jobs_and_validates(streams: dict[str, str], tmp_path: Path) -> None:
    """cluster.jobset=true: the ConfigMap and one JobSet, valid against JobSet's schema, whose
    replicated jobs' templates validate strictly as batch/v1 Jobs; pods find each other by the
    JobSet's hostnames, and a Job failed by its pod failure policy fails the JobSet."""
    import jsonschema

    from tests.support.jobset_schema import SCHEMA

    config_map, jobset = objects(streams["jobset"])
    jsonschema.validate(jobset, SCHEMA)
    rid = jobset["metadata"]["name"]
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert jobset["spec"]["suspend"] is True
    assert jobset["spec"]["network"] == {
        "enableDNSHostnames": True, "subdomain": rid, "publishNotReadyAddresses": True,
    }  # fmt: skip
    (rule,) = jobset["spec"]["failurePolicy"]["rules"]
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    jobs = []
    for replicated in jobset["spec"]["replicatedJobs"]:
        name = f"{rid}-{replicated['name']}-0"
        env = {
            e["name"]: e.get("value")
            for e in replicated["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert (env["RELAY_JOB_NAME"], env["RELAY_SUBDOMAIN"]) == (name, rid)
        jobs.append({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, **replicated["template"].get("metadata", {})},
            "spec": replicated["template"]["spec"],
        })  # fmt: skip
    assert [j["metadata"]["name"].rsplit("-", 2)[1] for j in jobs] == [
        "control",
        "inference",
        "trainer",
    ]
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([config_map, *jobs]))
    done = validate(path)
    assert done.returncode == 0 and done.stdout.count("passed") == 4, done.stdout
    broken = {**jobset, "spec": {**jobset["spec"], "replicas": 2}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_a_dry_run_names_the_objects(tmp_path: Path) -> None:
    """As for Slurm, the plan's jobs, then what each becomes on the cluster; nothing is
    created and no kubeconfig is needed."""
    args = ["model=glm5", "parallel=ep8", "cluster=kubernetes", "cluster.queue=team-a"]
    done = rl(tmp_path, *args, "dry_run=true", f"hydra.run.dir={tmp_path}/out/run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("job "))) + 1].split() == [
        "run", "29", "8", "96", "all", "1440m", "default/team-a",
    ]  # fmt: skip
    rid = re.search(r"objects labelled relay.dev/run=(\S+)", done.stdout)[1]
    assert f"Job {rid}-run: Indexed, 29 pods at once; headless Service {rid}-run" in lines
    assert "kueue: queue team-a, created suspended until admitted whole" in lines
    assert (
        "note: cluster.image and cluster.volume_claim not set: needed to write or apply "
        "the objects" in lines
    )
    assert not (tmp_path / "out" / "run").exists()


def test_manifests_refuse_what_they_cannot_write(tmp_path: Path) -> None:
    """No image or claim, or a cluster with no objects: one line on stderr, nothing on
    stdout (a pipe into kubectl gets nothing)."""
    no_image = rl(
        tmp_path, "cluster=kubernetes_cpu", "cluster.volume_claim=runs", "action=manifests"
    )
    assert no_image.returncode == 2 and no_image.stdout == ""
    assert no_image.stderr.strip().splitlines()[-1].startswith("error: cluster.image: not set")
    local = rl(tmp_path, "action=manifests")
    assert local.returncode == 2 and local.stdout == ""
    assert "action=manifests: cluster=local creates no objects" in local.stderr
    assert not list(tmp_path.glob("outputs/**/config.yaml"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cluster.namespace=Team_A", "cluster.namespace: 'Team_A' is not a DNS label"),
        ("cluster.queue=a/b", "cluster.queue: 'a/b' is not a label value"),
        ("cluster.rdma_resource=ib", "cluster.rdma_resource: 'ib' is not an extended resource"),
        ("cluster.mount_path=relay", "cluster.mount_path: 'relay': give an absolute path"),
        ("+cluster.secrets.KEY=wandb", "cluster.secrets.KEY: 'wandb': give <secret>/<key>"),
        ("cluster.tolerations=[{key: a, operatr: Exists}]", "cluster.tolerations: 'operatr' is"),
        ("cluster.tolerations=[{key: a, effect: Never}]", "cluster.tolerations effect: 'Never'"),
    ],
)
def test_settings_the_api_would_refuse_are_refused_at_plan_time(override: str, message: str):
    """Before anything is written: one line naming the setting, not an API error later."""
    from launcher.errors import PlanError
    from launcher.plan.planner import plan
    from tests.support.runs import compose_run

    with pytest.raises(PlanError) as err:
        plan(compose_run("cluster=kubernetes", override))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# --- the pods, as the kubelet runs them ----------------------------------------------------


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "reward/mean" in r]


@pytest.mark.skipif(not hosts_writable(), reason="the pod runner resolves pod names in /etc/hosts")
def test_the_pods_train_a_run_and_a_preempted_trainer_resumes(tmp_path: Path) -> None:
    """The tiny run's objects, played here: two pods of one Indexed Job (the queue,
    orchestrator and inference on node 0, the trainer on node 1). Once it has trained, the
    trainer's pod is preempted: SIGTERM, the trainer checkpoints the step under way within the
    grace period, the pod exits 143. The Job controller, reading the pod failure policy,
    recreates it without spending the backoff; the trainer resumes from that checkpoint, the
    run ends complete with every step recorded once, and each pod exits 0."""
    max_steps = 40
    done = rl(
        tmp_path, *RUNS["tiny"], "warmup.steps=10", f"max_steps={max_steps}",
        "trainer.checkpoint_every=0", "action=manifests", f"hydra.run.dir={tmp_path}/out/run",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runner = PodRunner(done.stdout, tmp_path / "cluster")
    (job,) = runner.jobs
    plan = json.loads(objects(done.stdout)[0]["data"]["plan.json"])
    trainer_node = next(p["node"] for p in plan["processes"] if p["role"] == "trainer")
    try:
        runner.start_all()
        run_dir = next(iter(runner.claims.values()))
        run_dir = run_dir / objects(done.stdout)[0]["metadata"]["labels"]["relay.dev/run"]
        deadline = time.monotonic() + 300
        while len(train_steps(run_dir)) < 8:
            runner.step()
            assert time.monotonic() < deadline, "the pods trained no 8 steps in 300 s"
            assert not runner.jobs[job].failed, runner.jobs[job].failed
            time.sleep(0.5)
        first = runner.jobs[job].pods[trainer_node]
        assert runner.preempt(job, trainer_node) == 143
        runner.step()  # the controller recreates it with the same index
        again = runner.jobs[job].pods[trainer_node]
        assert again.name != first.name and runner.jobs[job].failures == 0
        ends = runner.wait_ended(400)
    finally:
        runner.close()
    assert ends == {job: "complete"}
    assert sorted(p.proc.returncode for p in runner.jobs[job].ended) == [0, 0, 143]
    stopped = int(re.search(r"trainer checkpointed at step (\d+)", first.log.read_text())[1])
    trainer_log = (run_dir / "logs" / "trainer-node0.log").read_text()
    assert f"resumed from {run_dir}/checkpoints/step_{stopped}" in trainer_log
    assert f"continuing at step {stopped + 1}" in trainer_log
    assert 8 <= stopped < max_steps
    assert train_steps(run_dir) == list(range(1, max_steps + 1))
    run = RunDir(run_dir)
    assert run.complete.exists() and not run.failure.exists()
    assert json.loads(run.summary.read_text())["status"] == "finished"
    assert run.submission.read_text() == "1"
    assert f"{job}-0." not in Path("/etc/hosts").read_text()  # the runner's names are gone


FAKE_KUBECTL = """#!/bin/sh
# kubectl as a cluster whose API the test plays: `create -f -` keeps each object, `get`
# answers from the state the test wrote, `delete` removes it.
state={state}
case "$1" in
  create) n=$(ls "$state/created" | wc -l); cat > "$state/created/$(printf %03d "$n").json";;
  get) if [ -f "$state/$2.json" ]; then cat "$state/$2.json";
       else echo '{{"apiVersion": "v1", "kind": "List", "items": []}}'; fi;;
  delete) echo "$*" >> "$state/deleted"; rm -f "$state/jobs.json" "$state/pods.json";;
esac
"""


def fake_kubectl(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    state = tmp_path / "api"
    (state / "created").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL.format(state=state))
    (bin_dir / "kubectl").chmod(0o755)
    return state, {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def created_since(state: Path, first: int) -> str:
    """The objects `rl` created from the `first`-th on, as one YAML stream."""
    files = sorted((state / "created").glob("*.json"))[first:]
    return "---\n".join(yaml.safe_dump(json.loads(f.read_text())) for f in files)


def answer_with(state: Path, runner: PodRunner) -> None:
    """What the API would say of the runner's Jobs and pods once they have ended."""
    items, pods = [], []
    for job in runner.jobs.values():
        if job.failed:
            ended = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}
            ended["message"] = job.failed
        else:
            ended = {"type": "Complete", "status": "True"}
        status = {"failed": len(job.ended), "conditions": [ended]}
        items.append({"metadata": job.obj["metadata"], "spec": job.obj["spec"], "status": status})
        for pod in job.ended:
            code = pod.proc.returncode
            container = {"name": "supervisor", "ready": False, "restartCount": 0, "image": "i",
                         "imageID": "", "state": {"terminated": {"exitCode": code}}}  # fmt: skip
            phase = "Succeeded" if code == 0 else "Failed"
            pods.append(
                {"metadata": {"name": pod.name},
                 "status": {"phase": phase, "containerStatuses": [container]}}
            )  # fmt: skip
    (state / "jobs.json").write_text(json.dumps({"kind": "JobList", "items": items}))
    (state / "pods.json").write_text(json.dumps({"kind": "PodList", "items": pods}))


@pytest.mark.skipif(not hosts_writable(), reason="the pod runner resolves pod names in /etc/hosts")
def test_the_time_limit_stops_the_run_and_rl_resume_continues_it(tmp_path: Path) -> None:
    """`rl` submits a per_role run (through kubectl, played by a script): a control, an
    inference and a trainer Job, whose pods wait for each other. Kubernetes warns no one of a
    deadline: at `cluster.time_min` less `signal_delay_s` the supervisors stop the run
    themselves, the trainer checkpointing the step it is on, and exit 4, which fails each Job
    at once. `rl action=status` says so; `rl resume=` deletes the ended objects and creates
    them as submission 2, whose first pod opens the run directory again while the others
    wait for it, and the run ends complete with every step recorded once."""
    state, path = fake_kubectl(tmp_path)
    env = {**os.environ, **path, "WANDB_MODE": "offline"}

    def rl_here(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([RL, *args], cwd=tmp_path, capture_output=True, text=True, env=env)

    limit = ["cluster.time_min=1", "cluster.signal_delay_s=30", "trainer.checkpoint_every=0"]
    done = rl_here(*RUNS["tiny"], "cluster.client=kubectl", "cluster.allocation=per_role",
                   "warmup.steps=10", "max_steps=5000", *limit,
                   f"hydra.run.dir={tmp_path}/out/run")  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = Path(done.stdout.split("run record: ", 1)[1].splitlines()[0])
    assert "created Job " in done.stdout and (record / ".relay" / "kubernetes.json").exists()
    first = PodRunner(created_since(state, 0), tmp_path / "cluster1")
    try:
        first.start_all()
        ends = first.wait_ended(300)
    finally:
        first.close()
    assert [name.rsplit("-", 1)[1] for name in ends] == ["control", "inference", "trainer"]
    for name, ended in first.jobs.items():  # the FailJob rule, not a backoff
        assert ends[name] == f"failed ({ended.failed})" and "exited 4" in ended.failed
    run_dir = (
        next(iter(first.claims.values()))
        / json.loads((record / ".relay" / "kubernetes.json").read_text())["run"]
    )
    stopped = train_steps(run_dir)[-1]
    trainer_log = (run_dir / "logs" / "trainer-node0.log").read_text()
    assert f"checkpointed at step {stopped}" in trainer_log
    assert 0 < stopped < 5000 and not RunDir(run_dir).failure.exists()
    answer_with(state, first)
    status = rl_here("action=status", f"run_dir={record}")
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == (
        f"run {record}: stopped at the time limit (cluster.time_min), after a checkpoint"
    )
    assert "exit 4 (stopped at the time limit)" in status.stdout
    made = len(list((state / "created").glob("*.json")))
    resumed = rl_here(f"resume={record}", f"max_steps={stopped + 6}")
    assert resumed.returncode == 0, resumed.stderr
    assert "--cascade=foreground" in (state / "deleted").read_text()
    again = created_since(state, made)
    config_map = objects(again)[0]
    assert config_map["data"]["submission"] == "2"
    second = PodRunner(again, tmp_path / "cluster2", claims=tmp_path / "cluster1" / "claims")
    try:
        second.start_all()
        assert set(second.wait_ended(300).values()) == {"complete"}
    finally:
        second.close()
    assert train_steps(run_dir) == list(range(1, stopped + 7))
    trainer_log = (run_dir / "logs" / "trainer-node0.log").read_text()
    assert f"continuing at step {stopped + 1}" in trainer_log
    run = RunDir(run_dir)
    assert run.submission.read_text() == "2" and run.load_config().max_steps == stopped + 6
    marks = sorted(p.name for p in run.control.glob("started.*.*"))  # each job's, each time
    assert marks == [f"started.{job}.{n}" for job in ("control", "inference", "trainer")
                     for n in (1, 2)]  # fmt: skip
    assert json.loads(run.summary.read_text())["status"] == "finished"


@pytest.mark.skipif(not hosts_writable(), reason="the pod runner resolves pod names in /etc/hosts")
def test_a_jobsets_pods_find_each_other_and_finish(tmp_path: Path) -> None:
    """cluster.jobset=true, per role: the three Jobs the JobSet controller makes, their pods
    named in the JobSet's subdomain (the trainer's rendezvous among them), wait for each
    other and end complete, every step once."""
    done = rl(tmp_path, *RUNS["jobset"], "warmup.steps=10", "max_steps=10",
              "action=manifests", f"hydra.run.dir={tmp_path}/out/run")  # fmt: skip
    assert done.returncode == 0, done.stderr
    runner = PodRunner(done.stdout, tmp_path / "cluster")
    rid = objects(done.stdout)[1]["metadata"]["name"]
    assert list(runner.jobs) == [f"{rid}-{job}-0" for job in ("control", "inference", "trainer")]
    try:
        runner.start_all()
        assert set(runner.wait_ended(300).values()) == {"complete"}
    finally:
        runner.close()
    run_dir = next(iter(runner.claims.values())) / rid
    assert train_steps(run_dir) == list(range(1, 11))
    (trainer_pod,) = runner.jobs[f"{rid}-trainer-0"].ended
    assert f"--master-addr {rid}-trainer-0-0.{rid} " in trainer_pod.log.read_text()


# --- the API, answered with the client's models ---------------------------------------------


def response(name: str) -> Any:
    return json.loads((RESPONSES / f"{name}.json").read_text())


class Recorded:
    """The kubernetes client's CoreV1Api, BatchV1Api and CustomObjectsApi, answering from the
    API's JSON read into the client's models, and keeping every call."""

    def __init__(
        self,
        jobs: str = "jobs_running",
        pods: str = "pods_running",
        refuse: str = "",
        interrupt: str = "",
    ) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.jobs, self.pods, self.refuse, self.interrupt = jobs, pods, refuse, interrupt

    def __getattr__(self, method: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, (args, kwargs)))
            from kubernetes.client.exceptions import ApiException

            if self.interrupt and method.endswith(self.interrupt):
                raise KeyboardInterrupt  # Ctrl-C while the client waits for the API
            if self.refuse and method.endswith(self.refuse):
                err = ApiException(status=409, reason="Conflict")
                err.body = json.dumps(response("status_conflict"))
                raise err
            if method == "list_namespaced_job":
                return kube_api.from_json(response(self.jobs), "V1JobList")
            if method == "list_namespaced_pod":
                return kube_api.from_json(response(self.pods), "V1PodList")
            if method.startswith("delete_namespaced_config_map"):
                err = ApiException(status=404, reason="Not Found")
                err.body = json.dumps(response("status_not_found"))
                raise err
            return None

        return call


def recorded_api(**answers: str) -> kube_api.PythonApi:
    api = kube_api.PythonApi.__new__(kube_api.PythonApi)
    api.core = api.batch = api.custom = Recorded(**answers)
    return api


def k8s_run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.internal.mkdir(parents=True)
    run.config.write_text(
        "name: reverse_text-tiny\ncluster:\n  name: kubernetes\n  kind: kubernetes\n"
    )
    record = {
        "namespace": "ml", "run": "reverse-text-tiny-1a2b3c4d", "client": "python",
        "submission": 1,
        "objects": [["ConfigMap", "reverse-text-tiny-1a2b3c4d-run"],
                    ["Service", "reverse-text-tiny-1a2b3c4d-run"],
                    ["Job", "reverse-text-tiny-1a2b3c4d-run"]],
    }  # fmt: skip
    run.kubernetes.write_text(json.dumps(record))
    return run


def test_status_reads_jobs_and_pods(tmp_path: Path) -> None:
    from launcher.clusters.kubernetes.submit import format_status
    from launcher.watch.status import fast_status

    run = k8s_run(tmp_path)
    # Not answered from the record alone (it holds no metrics): the cluster is asked.
    assert not fast_status(["action=status", f"run_dir={run.root}"])
    running = format_status(run, recorded_api()).splitlines()
    assert running[0] == f"run {run.root}: running"
    assert "  Job reverse-text-tiny-1a2b3c4d-run: running, 0/2 pods done" in running
    assert any("Pending, ImagePullBackOff" in line for line in running)
    limit = format_status(run, recorded_api(jobs="jobs_failed", pods="pods_time_limit"))
    assert limit.splitlines()[0].endswith(
        "stopped at the time limit (cluster.time_min), after a checkpoint"
    )
    assert "exit 4 (stopped at the time limit)" in limit and f"resume={run.root}" in limit
    queued = format_status(run, recorded_api(jobs="jobs_suspended", pods="pods_none"))
    assert queued.splitlines()[0].endswith(": queued")
    assert "queued (suspended until admitted)" in queued
    preempted = format_status(run, recorded_api(pods="pods_preempted"))
    assert "Failed, exit 143 (stopped on SIGTERM), disrupted (PreemptionByScheduler)" in preempted


def three_objects() -> list[dict[str, Any]]:
    """A ConfigMap, a Service and a Job, as `create_all` gets them."""
    meta = {"namespace": "ml"}
    kinds = ("ConfigMap", "Service", "Job")
    return [
        {"kind": kind, "apiVersion": "v1", "metadata": {**meta, "name": f"r-{kind.lower()}"}}
        for kind in kinds
    ]


def test_a_refused_object_leaves_nothing_created() -> None:
    """The Job is refused (409): the ConfigMap and Service created before it are deleted
    again, at once, and the error names the object and the API's message."""
    from launcher.clusters.kubernetes.submit import create_all
    from launcher.errors import ConfigError

    api = recorded_api(refuse="namespaced_job")
    docs = three_objects()
    with pytest.raises(
        ConfigError, match=r'create Job r-job: 409 jobs.batch "r-job" already exists'
    ):
        create_all(api, docs)
    calls = [name for name, _ in api.core.calls]
    assert calls == [
        "create_namespaced_config_map", "create_namespaced_service", "create_namespaced_job",
        "delete_namespaced_service", "delete_namespaced_config_map",
    ]  # fmt: skip
    deleted = api.core.calls[3][1][1]["body"]
    assert deleted.propagation_policy == "Foreground" and deleted.grace_period_seconds == 0


def test_ctrl_c_between_two_objects_leaves_nothing_created() -> None:
    from launcher.clusters.kubernetes.submit import create_all

    api = recorded_api(interrupt="create_namespaced_job")
    docs = three_objects()
    with pytest.raises(KeyboardInterrupt):
        create_all(api, docs)
    deleted = [name for name, _ in api.core.calls if name.startswith("delete")]
    assert deleted == ["delete_namespaced_service", "delete_namespaced_config_map"]


def test_cancel_deletes_the_jobs_first_in_the_foreground(tmp_path: Path, capsys) -> None:
    """Each pod gets SIGTERM with its grace period (the trainer checkpoints); an object
    already gone (404) is no error; `force` gives no grace."""
    from launcher.clusters.kubernetes.submit import cancel, check_ended
    from launcher.errors import ConfigError

    run = k8s_run(tmp_path)
    api = recorded_api()
    cancel(run, api=api)
    deletes = [(name, args) for name, args in api.core.calls if name.startswith("delete")]
    assert [name for name, _ in deletes][0] == "delete_namespaced_job"
    assert all(a[1]["body"].propagation_policy == "Foreground" for _, a in deletes)
    assert all(a[1]["body"].grace_period_seconds is None for _, a in deletes)
    assert f"resume: uv run rl resume={run.root}" in capsys.readouterr().out
    forced = recorded_api()
    cancel(run, force=True, api=forced)
    assert all(
        a[1]["body"].grace_period_seconds == 0
        for n, a in forced.core.calls
        if n.startswith("delete")
    )
    with pytest.raises(
        ConfigError, match="Jobs reverse-text-tiny-1a2b3c4d-run are still queued or running"
    ):
        check_ended(run, recorded_api())
    check_ended(run, recorded_api(jobs="jobs_failed"))


def test_commands_that_need_the_runs_files_refuse_a_kubernetes_record(tmp_path: Path) -> None:
    """The record holds no weights (they are on the cluster's volume): `action=eval` says so
    in one line, and `action=cancel` goes to the cluster (here: no kubeconfig to reach it)."""
    run = k8s_run(tmp_path)
    run.token_file.write_text("t")
    evaluated = rl(tmp_path, "action=eval", f"run_dir={run.root}")
    assert evaluated.returncode == 2 and evaluated.stdout == ""
    assert (
        evaluated.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: action=eval run_dir={run.root}: a run on cluster=kubernetes, whose weights"
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env["KUBECONFIG"] = str(tmp_path / "none")  # and not inside a cluster's pod either
    cancelled = subprocess.run(
        [RL, "action=cancel", f"run_dir={run.root}"], cwd=tmp_path, capture_output=True,
        text=True, env=env,
    )  # fmt: skip
    assert cancelled.returncode == 2
    assert "cluster.client=python: no kubeconfig" in cancelled.stderr


def test_kubectl_answers_as_the_python_client(tmp_path: Path, monkeypatch) -> None:
    """cluster.client=kubectl: `kubectl get -o json` read into the same models; a refusal
    names the command and kubectl's message."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(
        "#!/bin/sh\n"
        f'case "$2" in jobs) cat {RESPONSES / "jobs_running.json"};; '
        f"pods) cat {RESPONSES / 'pods_running.json'};; "
        "*) echo 'Error from server (Forbidden): jobs.batch is forbidden' >&2; exit 1;; esac\n"
    )
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    api = kube_api.KubectlApi()
    (job,) = api.jobs("ml", "relay.dev/run=x")
    assert job.status.active == 2 and job.metadata.name == "reverse-text-tiny-1a2b3c4d-run"
    assert len(api.pods("ml", "relay.dev/run=x")) == 2
    with pytest.raises(kube_api.KubeError, match="kubectl delete job: Error from server"):
        api.delete("Job", "x", "ml")


def test_an_api_server_that_does_not_answer_leaves_no_run(tmp_path: Path) -> None:
    """The kubeconfig's server refuses connections (a loopback port nothing listens on): one
    line naming the object it was creating, and no run record left behind."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "here",
            "clusters": [{"name": "here", "cluster": {"server": "https://127.0.0.1:1"}}],
            "contexts": [{"name": "here", "context": {"cluster": "here", "user": "me"}}],
            "users": [{"name": "me", "user": {"token": "t"}}],
        })
    )  # fmt: skip
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "WANDB_MODE": "offline"}
    args = [RL, *RUNS["tiny"], f"hydra.run.dir={tmp_path}/out/run"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    (last,) = done.stderr.strip().splitlines()  # one line: no retry warnings before it
    assert last.startswith("error: submission failed, nothing left created: create ConfigMap ")
    assert "the API server did not answer" in last
    assert not (tmp_path / "out" / "run").exists()


@pytest.mark.skipif(
    not os.environ.get("KUBECONFIG") or not os.environ.get("RELAY_TEST_IMAGE"),
    reason="no Kubernetes cluster here: set KUBECONFIG, RELAY_TEST_IMAGE (an image built from "
    "launcher/clusters/kubernetes/Dockerfile) and RELAY_TEST_CLAIM (a ReadWriteMany claim)",
)
def test_a_live_cluster_runs_the_tiny_run(tmp_path: Path) -> None:
    """Where KUBECONFIG points at a cluster (kind, or a real one): submit the tiny run with
    the Python client, wait for it to finish, read its status."""
    image = f"cluster.image={os.environ['RELAY_TEST_IMAGE']}"
    claim = f"cluster.volume_claim={os.environ.get('RELAY_TEST_CLAIM', 'relay-runs')}"
    done = rl(tmp_path, "cluster=kubernetes_cpu", image, claim, "warmup.steps=10", "max_steps=8")
    assert done.returncode == 0, done.stderr
    record = Path(next(x for x in done.stdout.splitlines() if x.startswith("run record: "))[12:])
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        status = rl(tmp_path, "action=status", f"run_dir={record}")
        if status.stdout.splitlines()[0].endswith((": finished", ": failed")):
            break
        time.sleep(10)
    assert status.stdout.splitlines()[0].endswith(": finished"), status.stdout


# --- the pod's own part --------------------------------------------------------------------


def config_folder(tmp_path: Path, submission: int, max_steps: int) -> Path:
    """A ConfigMap's files as a pod mounts them, for the tiny run."""
    from launcher.clusters.kubernetes.manifests import config_files
    from launcher.plan.planner import plan
    from tests.support.runs import compose_run

    planned = plan(compose_run("cluster=kubernetes_cpu", f"max_steps={max_steps}"))
    from omegaconf import OmegaConf

    files = config_files(
        OmegaConf.to_yaml(planned.config, resolve=True), planned.to_json(), ["x=1"], submission
    )
    folder = tmp_path / f"config{submission}-{max_steps}"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_the_first_pod_brings_the_run_directory_to_its_submission(tmp_path: Path) -> None:
    """The first submission creates the run directory (a token, the overrides); another pod
    waits for it. A resubmission (`rl resume=`) writes its config and clears what the ended
    one left, so that the run goes on; a recreated first pod changes nothing."""
    from launcher.clusters.kubernetes.pod import prepare
    from launcher.errors import ConfigError

    run = RunDir(tmp_path / "run")
    prepare(run, config_folder(tmp_path, 1, 20), first=True)
    token = run.token()
    assert run.is_run() and run.submission.read_text() == "1" and run.overrides() == ["x=1"]
    assert run.load_config().max_steps == 20
    prepare(run, config_folder(tmp_path, 1, 99), first=True)  # recreated: nothing rewritten
    assert run.load_config().max_steps == 20
    run.complete.touch()
    run.mark_done("trainer")
    run.record_failure("cancelled")
    later = config_folder(tmp_path, 2, 40)
    import launcher.clusters.kubernetes.pod as pod

    waiting = pod.SETUP_WAIT_S
    pod.SETUP_WAIT_S = 0.0
    try:
        with pytest.raises(ConfigError, match="the first pod did not prepare"):
            prepare(run, later, first=False)  # the first pod has not yet
    finally:
        pod.SETUP_WAIT_S = waiting
    prepare(run, later, first=True)
    assert run.submission.read_text() == "2" and run.token() == token
    assert run.load_config().max_steps == 40 and not run.edited_config()
    assert not run.complete.exists() and not run.done("trainer").exists()
    assert not run.failure.exists() and (run.ended / "failure-0.json").exists()
    prepare(run, later, first=False)  # ready: returns at once
