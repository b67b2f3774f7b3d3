"""deploy/ is checked, not sketched: every manifest validates against the Kubernetes
schemas (offline, with kubernetes-validate's bundled ones), the objects agree with each
other and with the programs' flags, and the Grafana dashboard queries only metrics Sluice
exports."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sluice.balancer.settings import BalancerSettings
from sluice.core.stats import ServingStats
from sluice.runtime import config
from sluice.runtime.metrics import ServingCollector, new_registry
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.models import Models
from sluice.server.metrics import DataplaneCollector
from sluice.server.settings import ServerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "sluice.json"
# Components that put an autoscaler on the servers: users add one to deploy/.
AUTOSCALING = (DEPLOY / "autoscaling" / "hpa", DEPLOY / "autoscaling" / "keda")

# Fixed, so a new kubernetes-validate release cannot change the verdict: the oldest
# Kubernetes minor the manifests promise to work on, and a recent one. Both ship with
# kubernetes-validate >= 1.33 (it bundles 1.25 onwards).
KUBERNETES_VERSIONS = ("1.30", "1.33")
# Custom resources: no schema in Kubernetes' own; checked by hand below.
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}
KUSTOMIZATION = ("kustomize.config.k8s.io/v1beta1", "Kustomization")
# A Kustomize component: patches that a kustomization may add (gpu/, the servers on GPUs).
COMPONENT = ("kustomize.config.k8s.io/v1alpha1", "Component")

# What Sluice exports; the dashboard may name nothing else.
METRICS = frozenset(
    {
        "sluice_calls_total",
        "sluice_call_seconds_bucket",
        "sluice_call_seconds_sum",
        "sluice_loop_cpu_seconds_total",
        "sluice_in_flight",
        "sluice_queue_depth",
        "sluice_queue_wait_seconds_bucket",
        "sluice_model_seconds_bucket",
        "sluice_batch_rows_bucket",
        "sluice_cache_hits_total",
        "sluice_cache_misses_total",
        "sluice_cache_evictions_total",
        "sluice_cache_bytes",
        "sluice_admission_refused_total",
        "sluice_backend_in_flight",
        "sluice_backend_healthy",
        "sluice_backend_breaker_open",
        "sluice_backend_ewma_seconds",
        "sluice_retries_total",
        "sluice_retry_budget_refused_total",
        "sluice_shed_total",
    }
)


@dataclass(frozen=True)
class Doc:
    path: Path
    index: int
    body: dict[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return (self.body["apiVersion"], self.body["kind"])

    def __str__(self) -> str:
        name = self.body.get("metadata", {}).get("name", "")
        return f"{self.path.relative_to(DEPLOY)}#{self.index}:{self.body['kind']}/{name}"


# YAML under deploy/ that is no Kubernetes object: checked on its own (or by its owner).
ADAPTER_VALUES = DEPLOY / "autoscaling" / "hpa" / "prometheus-adapter-values.yaml"
NOT_KUBERNETES = {DEPLOY / "compose.yaml", ADAPTER_VALUES}


def load_docs() -> list[Doc]:
    docs = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        if path in NOT_KUBERNETES:
            continue
        for index, body in enumerate(yaml.safe_load_all(path.read_text())):
            if body is not None:
                docs.append(Doc(path, index, body))
    return docs


DOCS = load_docs()
OBJECTS = [doc for doc in DOCS if doc.key not in (KUSTOMIZATION, COMPONENT)]
CORE = [doc for doc in OBJECTS if doc.key not in CUSTOM_RESOURCES]


def only(kind: str, name: str) -> dict[str, Any]:
    found = [
        d.body for d in OBJECTS if d.body["kind"] == kind and d.body["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (or a Service's plain selector) against a pod's labels."""
    match_labels = selector.get("matchLabels", {})
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        match_labels = selector
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        present, value = key in labels, labels.get(key)
        if operator == "In":
            ok = value in expression["values"]
        elif operator == "NotIn":
            ok = value not in expression["values"]
        else:
            ok = present == (operator == "Exists")
        if not ok:
            return False
    return True


def flags(args: list[str]) -> dict[str, str]:
    """--name value pairs (every flag of both programs takes a value)."""
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return dict(zip(args[::2], args[1::2], strict=True))


def container_port(box: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port, a number or a name, as a declared container port."""
    for declared in box.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            number: int = declared["containerPort"]
            return number
    raise AssertionError(f"port {port!r} is not declared by container {box['name']}")


SERVER = only("Deployment", "sluice-server")
BALANCER = only("Deployment", "sluice-balancer")
HEADLESS = only("Service", "sluice-servers")
FRONT = only("Service", "sluice")


# -- schemas -------------------------------------------------------------------------------


def test_deploy_holds_the_expected_objects() -> None:
    kinds = sorted((d.body["kind"], d.body["metadata"]["name"]) for d in OBJECTS)
    assert kinds == [
        ("Deployment", "sluice-balancer"),
        ("Deployment", "sluice-server"),
        ("HorizontalPodAutoscaler", "sluice-server"),
        ("PodDisruptionBudget", "sluice-balancer"),
        ("PodDisruptionBudget", "sluice-server"),
        ("PodMonitor", "sluice"),
        ("ScaledObject", "sluice-server"),
        ("Service", "sluice"),
        ("Service", "sluice-servers"),
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", CORE, ids=str)
def test_manifest_validates_against_kubernetes_schema(doc: Doc, version: str) -> None:
    # strict: a misspelt or misplaced field is an error, not silently ignored.
    problem = ""
    try:
        checked = kubernetes_validate.validate(doc.body, version, strict=True)
    except kubernetes_validate.ValidationError as exc:  # its str() dumps the whole schema
        where = "/".join(str(p) for p in exc.path)
        problem = f"{doc} is invalid for Kubernetes {version} at {where}: {exc.message}"
    if problem:
        pytest.fail(problem)
    assert checked == version  # validated against that very version's schema


def test_custom_resources_are_the_known_ones() -> None:
    """kubernetes-validate has no schema for CRDs: name them, so no other kind slips by."""
    custom = [d for d in OBJECTS if d.key in CUSTOM_RESOURCES]
    assert [d.path.relative_to(DEPLOY).as_posix() for d in custom] == [
        "autoscaling/keda/scaledobject.yaml",
        "monitoring/podmonitor.yaml",
    ]
    for doc in custom:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc.body, KUBERNETES_VERSIONS[0], strict=True)


def test_kustomizations_list_every_manifest_beside_them() -> None:
    kustomizations = [d for d in DOCS if d.key == KUSTOMIZATION]
    assert {d.path.parent for d in kustomizations} == {DEPLOY, DEPLOY / "monitoring"}
    components = [d for d in DOCS if d.key == COMPONENT and "resources" in d.body]
    assert {d.path.parent for d in components} == set(AUTOSCALING)
    for doc in [*kustomizations, *components]:
        here = doc.path.parent
        listed = {(here / r).resolve() for r in doc.body["resources"]}
        beside = {d.path.resolve() for d in OBJECTS if d.path.parent == here}
        assert listed == beside, f"{doc.path}: resources must be exactly {sorted(beside)}"
    # CRDs stay out of the default `kubectl apply -k deploy/`: it must work without them.
    default = {d.path.parent for d in OBJECTS if d.key in CUSTOM_RESOURCES}
    assert DEPLOY not in default


def test_kustomization_image_is_the_one_the_deployments_run() -> None:
    (kustomization,) = [d.body for d in DOCS if d.path == DEPLOY / "kustomization.yaml"]
    names = {image["name"] for image in kustomization["images"]}
    for deployment in (SERVER, BALANCER):
        image = container(deployment)["image"]
        assert image.rsplit(":", 1)[0] in names, f"{image} is not rewritten by `images:`"


# -- the GPU variant -----------------------------------------------------------------------


def json_patch(body: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """`body` with RFC 6902 add, replace and remove operations applied, as Kustomize applies
    them."""
    result = copy.deepcopy(body)
    for operation in operations:
        assert operation["op"] in ("add", "replace", "remove"), operation
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~") for part in operation["path"][1:].split("/")
        ]
        box: Any = result
        for part in parents:
            box = box[int(part)] if isinstance(box, list) else box[part]
        if operation["op"] == "remove":
            del box[int(last) if isinstance(box, list) else last]
        elif isinstance(box, list):
            at = len(box) if last == "-" else int(last)
            if operation["op"] == "add":
                box.insert(at, operation["value"])
            else:
                box[at] = operation["value"]
        else:
            assert operation["op"] == "add" or last in box, f"replace of a missing {last}"
            box[last] = operation["value"]
    return result


def gpu_server() -> dict[str, Any]:
    """The server Deployment with the gpu/ component's patches applied."""
    (component,) = [d.body for d in DOCS if d.path == DEPLOY / "gpu" / "kustomization.yaml"]
    assert component["kind"] == "Component"
    assert component.keys() <= {"apiVersion", "kind", "metadata", "patches"}
    deployment = SERVER
    for patch in component["patches"]:
        target = patch["target"]
        assert (target["kind"], target["name"]) == ("Deployment", "sluice-server"), target
        deployment = json_patch(deployment, yaml.safe_load(patch["patch"]))
    return deployment


GPU_SERVER = gpu_server()


def test_the_gpu_component_is_there_and_off_by_default() -> None:
    components = {d.path.parent for d in DOCS if d.key == COMPONENT}
    assert components == {DEPLOY / "gpu", *AUTOSCALING}
    (kustomization,) = [d.body for d in DOCS if d.path == DEPLOY / "kustomization.yaml"]
    assert "components" not in kustomization, "deploy/ serves on the CPU unless asked"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_gpu_server_validates_against_kubernetes_schema(version: str) -> None:
    assert kubernetes_validate.validate(GPU_SERVER, version, strict=True) == version


def test_the_gpu_server_runs_the_gpu_image_on_one_gpu() -> None:
    box = container(GPU_SERVER)
    assert box["resources"]["limits"]["nvidia.com/gpu"] == 1
    requests, limits = box["resources"]["requests"], box["resources"]["limits"]
    assert requests["memory"] == limits["memory"]
    # Kustomize rewrites images by name: the base's `images:` must leave the GPU one alone.
    (kustomization,) = [d.body for d in DOCS if d.path == DEPLOY / "kustomization.yaml"]
    name = box["image"].rsplit(":", 1)[0]
    assert name != container(SERVER)["image"].rsplit(":", 1)[0]
    assert name not in {image["name"] for image in kustomization["images"]}
    args = [arg.replace("$(POD_NAME)", "pod-0") for arg in box["args"]]
    namespace, unknown = config.build_parser(ServerSettings, "sluice-server", "").parse_known_args(
        args
    )
    assert unknown == []
    assert config.from_namespace(ServerSettings, namespace, environ={}).device == "cuda"
    # All else is the CPU server's: probes, ports, drain timing, security.
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "ports", "securityContext"):
        assert box[key] == container(SERVER)[key], key
    assert GPU_SERVER["spec"]["template"]["metadata"] == SERVER["spec"]["template"]["metadata"]


# -- the objects agree with each other ------------------------------------------------------


def test_deployments_select_their_own_pods_only() -> None:
    for deployment, other in ((SERVER, BALANCER), (BALANCER, SERVER)):
        assert selects(deployment["spec"]["selector"], pod_labels(deployment))
        assert not selects(deployment["spec"]["selector"], pod_labels(other))
        for spread in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert selects(spread["labelSelector"], pod_labels(deployment))
            assert not selects(spread["labelSelector"], pod_labels(other))


def test_services_select_their_pods_and_ports() -> None:
    assert HEADLESS["spec"]["clusterIP"] == "None"
    assert not HEADLESS["spec"].get("publishNotReadyAddresses", False)
    assert FRONT["spec"].get("type", "ClusterIP") == "ClusterIP"
    for service, deployment, other in ((HEADLESS, SERVER, BALANCER), (FRONT, BALANCER, SERVER)):
        assert selects(service["spec"]["selector"], pod_labels(deployment))
        assert not selects(service["spec"]["selector"], pod_labels(other))
        box = container(deployment)
        listen = int(flags(box["args"])["--port"])
        (port,) = service["spec"]["ports"]
        assert container_port(box, port.get("targetPort", port["port"])) == listen
    assert FRONT["spec"]["ports"][0]["port"] == 8000


def test_balancer_resolves_the_headless_service() -> None:
    name, _, port = flags(container(BALANCER)["args"])["--backends-dns"].rpartition(":")
    # A short name, or NAME.NAMESPACE..., resolved through the pod's DNS search path.
    assert name.split(".")[0] == HEADLESS["metadata"]["name"]
    assert int(port) in [p["port"] for p in HEADLESS["spec"]["ports"]]
    assert int(port) == int(flags(container(SERVER)["args"])["--port"])


@pytest.mark.parametrize("deployment", [SERVER, BALANCER], ids=["server", "balancer"])
def test_probes_point_at_declared_ports(deployment: dict[str, Any]) -> None:
    box = container(deployment)
    listen = int(flags(box["args"])["--port"])
    # Readiness is grpc.health.v1 on the gRPC port; liveness exists.
    assert box["readinessProbe"]["grpc"]["port"] == listen
    assert "livenessProbe" in box
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = box.get(kind)
        if probe is None:
            continue
        (handler,) = [k for k in ("grpc", "tcpSocket", "httpGet", "exec") if k in probe]
        if handler != "exec":
            assert container_port(box, probe[handler]["port"]) == listen, f"{kind} port"


def test_server_probes_are_grpc_health() -> None:
    box = container(SERVER)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert box[kind]["grpc"].get("service", "") == "", f"{kind} checks the whole server"


def prestop_sleep_s(box: dict[str, Any]) -> float:
    hook = box.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"unexpected preStop {command}"
    return float(command[1])


def test_server_drain_fits_the_termination_grace_period() -> None:
    box = container(SERVER)
    given = flags(box["args"])
    drain, grace = float(given["--drain-delay-s"]), float(given["--grace-s"])
    assert drain > 0, "without a drain delay, calls already routed here are refused"
    budget = SERVER["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert budget > prestop_sleep_s(box) + drain + grace


def test_balancer_drain_fits_the_termination_grace_period() -> None:
    box = container(BALANCER)
    given = flags(box["args"])
    grace = float(given["--grace-s"])
    needed = prestop_sleep_s(box) + grace
    if int(given.get("--workers", "1")) > 1:
        needed += grace + 5.0  # the first process then waits for its workers (main.py)
    assert BALANCER["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed


@pytest.mark.parametrize(
    ("deployment", "program", "settings_class"),
    [(SERVER, "sluice-server", ServerSettings), (BALANCER, "sluice-balancer", BalancerSettings)],
    ids=["server", "balancer"],
)
def test_arguments_are_flags_the_program_takes(
    deployment: dict[str, Any], program: str, settings_class: type[Any]
) -> None:
    """Parsed by the program's own parser, so a misspelt flag or a bad value fails here."""
    box = container(deployment)
    assert box["command"] == [program]
    env = {item["name"]: item for item in box.get("env", [])}
    args = []
    for arg in box["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"$({var}) in the args is not set in env"
            arg = arg.replace(f"$({var})", "pod-0")
        args.append(arg)
    if "metrics_port" not in settings_class.__dataclass_fields__:
        # --metrics-port is landing with the metrics work; until then only it is skipped.
        at = args.index("--metrics-port")
        del args[at : at + 2]
    namespace, unknown = config.build_parser(settings_class, program, "").parse_known_args(args)
    assert unknown == [], f"{program}: unknown flags {unknown}"
    settings = config.from_namespace(settings_class, namespace, environ={})
    assert settings.host == "0.0.0.0"


def test_server_node_id_is_the_pod_name() -> None:
    box = container(SERVER)
    env = {item["name"]: item for item in box["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flags(box["args"])["--node-id"] == "$(POD_NAME)"


@pytest.mark.parametrize("deployment", [SERVER, BALANCER], ids=["server", "balancer"])
def test_metrics_port_is_declared_and_annotated(deployment: dict[str, Any]) -> None:
    box = container(deployment)
    port = int(flags(box["args"])["--metrics-port"])
    assert port == 9100
    assert container_port(box, "metrics") == port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_every_declared_metrics_port_is_annotated() -> None:
    for doc in OBJECTS:
        if doc.body["kind"] != "Deployment":
            continue
        template = doc.body["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        for box in template["spec"]["containers"]:
            for declared in box.get("ports", []):
                if declared.get("name") == "metrics":
                    assert annotations.get("prometheus.io/port") == str(declared["containerPort"])


def test_disruption_budgets_cover_each_deployment_alone() -> None:
    budgets = [d.body for d in OBJECTS if d.body["kind"] == "PodDisruptionBudget"]
    for deployment in (SERVER, BALANCER):
        covering = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(deployment))]
        assert len(covering) == 1, f"{deployment['metadata']['name']}: one PDB, not {covering}"
        (budget,) = covering
        # One pod at a time, and never a budget that blocks every eviction.
        replicas = deployment["spec"]["replicas"]
        if "maxUnavailable" in budget["spec"]:
            assert 1 <= budget["spec"]["maxUnavailable"] < replicas
        else:
            assert budget["spec"]["minAvailable"] < replicas


def test_pod_monitor_scrapes_both_kinds_of_pod() -> None:
    monitor = only("PodMonitor", "sluice")
    for deployment in (SERVER, BALANCER):
        assert selects(monitor["spec"]["selector"], pod_labels(deployment))
        box = container(deployment)
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert container_port(box, endpoint["port"]) == 9100
            assert endpoint["path"] == "/metrics"


# -- the dashboard -------------------------------------------------------------------------

PROMQL_FUNCTIONS = frozenset(
    {
        "abs",
        "avg",
        "clamp_max",
        "clamp_min",
        "count",
        "histogram_quantile",
        "increase",
        "irate",
        "max",
        "min",
        "quantile",
        "rate",
        "sum",
        "topk",
    }
)
PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"


def promql_metrics(expr: str) -> set[str]:
    """The metric names an expression reads: what is left once strings, label matchers,
    ranges and grouping clauses are removed, less function names and keywords."""
    assert expr.count("(") == expr.count(")"), f"unbalanced parentheses: {expr}"
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(GROUPING, " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        if word in PROMQL_KEYWORDS:
            continue
        if text[match.end() :].lstrip().startswith("("):
            assert word in PROMQL_FUNCTIONS, f"unexpected function {word} in {expr}"
            continue
        names.add(word)
    return names


def test_promql_metrics_reads_names_not_labels_or_functions() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, method) (rate(sluice_call_seconds_bucket{code="OK",'
        ' instance=~"$instance"}[$__rate_interval]))) / on (instance) sluice_in_flight'
    )
    assert promql_metrics(expr) == {"sluice_call_seconds_bucket", "sluice_in_flight"}
    with pytest.raises(AssertionError):
        promql_metrics("made_up(sluice_in_flight)")


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # inside collapsed rows


def test_dashboard_is_an_importable_grafana_dashboard() -> None:
    board = dashboard()
    assert board["schemaVersion"] == 39
    assert board["uid"] and board["title"]
    (source,) = board["__inputs"]
    assert source["name"] == "DS_PROMETHEUS" and source["pluginId"] == "prometheus"
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        place = panel["gridPos"]
        assert place["x"] >= 0 and place["w"] > 0 and place["x"] + place["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    for variable in board["templating"]["list"]:
        assert variable["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_dashboard_queries_only_sluice_metrics_and_shows_them_all() -> None:
    board = dashboard()
    used: set[str] = set()
    for panel in panels(board):
        for target in panel.get("targets", []):
            names = promql_metrics(target["expr"])
            assert names, f"{panel['title']}: {target['expr']} reads no metric"
            assert names <= METRICS, f"{panel['title']}: unknown {sorted(names - METRICS)}"
            used |= names
    for variable in board["templating"]["list"]:
        query = variable["query"]["query"]
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert match and match[1] in METRICS, query
    assert used == METRICS, f"no panel shows {sorted(METRICS - used)}"


# -- autoscaling -----------------------------------------------------------------------------


def exported_server_metrics() -> set[str]:
    """The sample names a server's registry holds, idle, as sluice.runtime.program makes it:
    read from the code, so renaming a metric fails the autoscaling checks that name it."""
    registry = new_registry(
        ServingCollector(ServingStats()), DataplaneCollector(Models(), LRUCache(1, 1))
    )
    return {s.name for family in registry.collect() for s in family.samples}


SERVER_METRICS = exported_server_metrics()
HPA = only("HorizontalPodAutoscaler", "sluice-server")
SCALED = only("ScaledObject", "sluice-server")
ADAPTER_RULES: list[dict[str, Any]] = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def with_component(here: Path) -> tuple[dict[str, Any], list[Doc]]:
    """The server Deployment with a component's patches applied, and the component's own
    objects. (A component, not an overlay: Kustomize refuses an overlay inside its base.)"""
    (component,) = [d.body for d in DOCS if d.path == here / "kustomization.yaml"]
    assert component["kind"] == "Component"
    assert component.keys() <= {"apiVersion", "kind", "metadata", "resources", "patches"}
    (own,) = component["resources"]
    deployment = SERVER
    for patch in component["patches"]:
        target = patch["target"]
        assert (target["kind"], target["name"]) == ("Deployment", "sluice-server"), target
        deployment = json_patch(deployment, yaml.safe_load(patch["patch"]))
    return deployment, [d for d in OBJECTS if d.path == here / own]


def pod_name_matches(pattern: str, deployment: str) -> bool:
    """Whether a PromQL `pod=~` regex (anchored, as PromQL anchors it) matches the names of
    a Deployment's pods: NAME-<replicaset hash>-<suffix>."""
    return re.fullmatch(pattern, f"{deployment}-7d9f8b6c5d-x2k4q") is not None


def test_pod_names_match() -> None:
    assert pod_name_matches(r"sluice-server-.+", "sluice-server")
    assert not pod_name_matches(r"sluice-server-.+", "sluice-balancer")


@pytest.mark.parametrize("here", AUTOSCALING, ids=lambda p: p.name)
def test_a_component_adds_one_autoscaler_owning_the_servers(here: Path) -> None:
    deployment, own = with_component(here)
    assert "replicas" not in deployment["spec"], "the autoscaler sets it, not each apply"
    for version in KUBERNETES_VERSIONS:
        assert kubernetes_validate.validate(deployment, version, strict=True) == version
    (scaler,) = [d.body for d in own]
    assert scaler["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
    target = scaler["spec"]["scaleTargetRef"]
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment")) == (
        SERVER["apiVersion"],
        SERVER["kind"],
    )
    assert target["name"] == SERVER["metadata"]["name"]


def test_deploy_itself_has_no_autoscaler() -> None:
    """`kubectl apply -k deploy/` runs 3 servers, fixed; an autoscaler is a component's."""
    scalers = [d for d in OBJECTS if d.body["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert sorted(d.path.parent for d in scalers) == sorted(AUTOSCALING)
    assert SERVER["spec"]["replicas"] == HPA["spec"]["minReplicas"]


def series_of(rule: dict[str, Any]) -> str:
    """The series an adapter rule reads (its seriesQuery's name), checked to be the server's
    and tied to the pod it comes from."""
    series = re.fullmatch(r"(\w+)\{([^}]*)\}", rule["seriesQuery"])
    assert series, rule["seriesQuery"]
    name, matchers = series[1], series[2]
    assert name in SERVER_METRICS, f"{name} is not exported by the server"
    # The labels that tie a series to its pod, and nothing the HPA does not ask about.
    overrides = rule["resources"]["overrides"]
    assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert set(re.findall(r'(\w+)!=""', matchers)) == set(overrides)
    return name


def served_metrics() -> dict[str, str]:
    """The adapter's metric names (which the HPA asks for) by the series each is made of."""
    served = {}
    for rule in ADAPTER_RULES:
        name = series_of(rule)
        # The adapter renames the series by `matches` and `as`.
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), name)
        served[re.sub(rule["name"]["matches"], rule["name"]["as"], name)] = name
    return served


def hpa_targets() -> dict[str, float]:
    """Each metric of the HPA's and its target per server."""
    targets = {}
    for metric in HPA["spec"]["metrics"]:
        assert metric["type"] == "Pods"
        target = metric["pods"]["target"]
        assert target["type"] == "AverageValue"
        targets[metric["pods"]["metric"]["name"]] = float(target["averageValue"])
    return targets


def test_the_adapter_rules_serve_the_metrics_the_hpa_reads() -> None:
    served = served_metrics()
    assert set(served) == set(hpa_targets())
    assert set(served.values()) == {"sluice_call_seconds_sum", "sluice_loop_cpu_seconds_total"}
    for rule in ADAPTER_RULES:
        name = series_of(rule)
        # The query, as the adapter fills it in for the pods the HPA asks about.
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", name)
            .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"sluice-server-a|sluice-b"')
            .replace("<<.GroupBy>>", "pod")
        )
        assert "<<" not in query, query
        assert promql_metrics(query) == {name}
        # A counter's rate: seconds in calls (or on the loop's CPU) per second.
        assert re.search(rf"\brate\({name}\{{", query), query
        assert re.match(r"sum by \(pod\) ", query), "one value per pod, whatever its labels"


def test_the_hpa_targets_a_value_per_server() -> None:
    targets = hpa_targets()
    assert all(value > 0 for value in targets.values())
    assert targets["sluice_loop_busy"] < 1, "a busy share, below where the loop saturates"
    assert 1 <= HPA["spec"]["minReplicas"] < HPA["spec"]["maxReplicas"]


def behaviors() -> list[dict[str, Any]]:
    return [
        HPA["spec"]["behavior"],
        SCALED["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
    ]


@pytest.mark.parametrize("behavior", behaviors(), ids=["hpa", "keda"])
def test_scale_down_waits_for_each_drain(behavior: dict[str, Any]) -> None:
    down = behavior["scaleDown"]
    # Several minutes of agreement first: a dip in load does not cost a server's cache.
    assert down["stabilizationWindowSeconds"] >= 120
    grace = SERVER["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = flags(container(SERVER)["args"])
    assert grace > float(drain["--drain-delay-s"]) + float(drain["--grace-s"])
    # One server leaves per period, and a period outlasts a whole drain: drains never
    # overlap, whatever the policies' other choices (Min picks the most cautious one).
    policies = down["policies"]
    assert policies and all(p["type"] == "Pods" and p["value"] == 1 for p in policies)
    assert all(p["periodSeconds"] > grace for p in policies)
    assert down.get("selectPolicy", "Max") != "Disabled"
    # Scale-up is not held back by a window (new servers take minutes to start anyway).
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0


def test_the_server_budget_is_an_absolute_count_below_the_minimum() -> None:
    """A PDB in percent or minAvailable moves with the replicas an autoscaler sets; one
    server at a time, below the fewest the autoscalers keep, always lets a drain proceed."""
    budget = only("PodDisruptionBudget", "sluice-server")["spec"]
    assert "minAvailable" not in budget
    assert budget["maxUnavailable"] == 1
    assert budget["maxUnavailable"] < min(
        HPA["spec"]["minReplicas"], SCALED["spec"]["minReplicaCount"]
    )


# What the ScaledObject may hold: the fields of KEDA 2.x's CRD (keda.sh_scaledobjects.yaml)
# that these manifests use, strict, so a misspelt or misplaced field fails here as
# kubernetes-validate fails one of Kubernetes' own.
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer"},
                "initialCooldownPeriod": {"type": "integer"},
                "idleReplicaCount": {"type": "integer"},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {"type": "object"},
                            },
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object"},
                            # KEDA reads every trigger setting as a string.
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}
# The prometheus scaler's settings (KEDA's docs, scalers/prometheus).
PROMETHEUS_TRIGGER = {
    "serverAddress",
    "query",
    "threshold",
    "activationThreshold",
    "ignoreNullValues",
    "namespace",
    "customHeaders",
    "queryParameters",
    "unsafeSsl",
}


def test_the_scaled_object_fits_kedas_crd() -> None:
    jsonschema.validate(SCALED, SCALED_OBJECT_SCHEMA)
    broken = copy.deepcopy(SCALED)
    broken["spec"]["minReplicas"] = 3  # the HPA's word, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)
    # Its behavior is an HPA's: check it with Kubernetes' own schema, in an HPA.
    as_hpa = copy.deepcopy(HPA)
    as_hpa["spec"]["behavior"] = SCALED["spec"]["advanced"]["horizontalPodAutoscalerConfig"][
        "behavior"
    ]
    for version in KUBERNETES_VERSIONS:
        assert kubernetes_validate.validate(as_hpa, version, strict=True) == version


def test_the_scaled_object_is_the_hpa_in_kedas_words() -> None:
    spec = SCALED["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (
        HPA["spec"]["minReplicas"],
        HPA["spec"]["maxReplicas"],
    )
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == HPA["spec"]["behavior"]
    assert spec["minReplicaCount"] >= 1, "a server takes minutes to load: no scale to zero"
    # A trigger for each of the HPA's metrics, on the same series, with the same target.
    series = {name: metric for metric, name in served_metrics().items()}
    targets = hpa_targets()
    thresholds = {}
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        settings = trigger["metadata"]
        assert set(settings) <= PROMETHEUS_TRIGGER, sorted(set(settings) - PROMETHEUS_TRIGGER)
        assert settings["serverAddress"].startswith("http")
        # Per server, as the HPA's targets: the sum divided by the replicas.
        assert trigger["metricType"] == "AverageValue"
        assert settings["ignoreNullValues"] == "false", "no answer must not read as idle"
        (name,) = promql_metrics(settings["query"])
        thresholds[series[name]] = float(settings["threshold"])
    assert thresholds == targets


@pytest.mark.parametrize("trigger", SCALED["spec"]["triggers"], ids=lambda t: t["name"])
def test_the_scaled_object_queries_the_servers_metrics(trigger: dict[str, Any]) -> None:
    query = trigger["metadata"]["query"]
    names = promql_metrics(query)
    assert names <= SERVER_METRICS, f"not exported by the server: {sorted(names - SERVER_METRICS)}"
    # One of the adapter rules' series, summed over the servers' pods only.
    assert len(names) == 1 and names <= set(served_metrics().values())
    assert re.fullmatch(r"sum\(rate\(\w+\{[^}]*\}\[1m\]\)\)", query), query
    pods = re.search(r'pod=~"([^"]+)"', query)
    assert pods, "without a pod matcher the balancers' calls would count too"
    assert pod_name_matches(pods[1], SERVER["metadata"]["name"])
    assert not pod_name_matches(pods[1], BALANCER["metadata"]["name"])
    assert re.search(r'namespace="[^"]+"', query), "one namespace's servers only"
