"""Failures only Events tell (issue 30, defect 5): a pod in ContainerCreating because a Secret volume is missing or
lacks the mounted key (the kubelet's FailedMount), or because a ReadWriteOnce volume is attached to another node
(the attach/detach controller's FailedAttachVolume, "Multi-Attach error"). The pod's own status then says only
ContainerCreating, with no message; the fixtures below are what a kubelet and the controller write (core/v1 Events,
as `kubectl get events -o yaml` shows them, and the pod status of such a pod).
"""

from __future__ import annotations

from typing import Any

from minedraft.operator import status as st

NS = "serving"


def creating_pod(name: str, component: str, uid: str) -> dict[str, Any]:
    """A scheduled pod whose volumes do not mount: what the kubelet reports in its status."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": uid,
                         "labels": {"minedraft.io/instance": "qwen3-8b", "minedraft.io/component": component}},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodReadyToStartContainers", "status": "False"},
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
                 "message": f"containers with unready status: [{component}]"},
                {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
                {"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [{"name": component, "ready": False, "restartCount": 0, "started": False,
                                       "image": "ghcr.io/minedraft/gateway:0.1.0", "imageID": "",
                                       "state": {"waiting": {"reason": "ContainerCreating"}}}]}}


def kubelet_event(pod: dict[str, Any], reason: str, message: str, last: str, count: int = 1,
                  component: str = "kubelet") -> dict[str, Any]:
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.17e0a1b2c3d4e5f6", "namespace": NS},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": NS,
                               "uid": meta["uid"], "resourceVersion": "81734"},
            "reason": reason, "message": message, "type": "Warning", "count": count,
            "firstTimestamp": "2026-12-04T15:00:02Z", "lastTimestamp": last,
            "source": {"component": component, "host": "gpu-node-7"} if component == "kubelet"
            else {"component": component},
            "reportingComponent": component, "reportingInstance": "gpu-node-7" if component == "kubelet" else ""}


GATEWAY = creating_pod("qwen3-8b-gateway-6f9c7d8b5-x2kqp", "gateway", "0b4e...-gw")
ENGINE = creating_pod("qwen3-8b-engine-7c6d5f4b9-mm4zt", "engine", "9a1c...-en")
MISSING = 'MountVolume.SetUp failed for volume "auth" : secret "minedraft-token" not found'
MISKEYED = 'MountVolume.SetUp failed for volume "auth" : references non-existent secret key: token'
MULTI_ATTACH = ('Multi-Attach error for volume "pvc-5b0e3c1a-27f4-4d8e-9c2b-7f1e0d9a6b21" Volume is already used by '
                'pod(s) qwen3-8b-engine-7c6d5f4b9-abcde')


def test_pod_status_alone_says_nothing() -> None:
    """What the operator saw before: ContainerCreating is not a stuck reason, and there is no message."""
    assert st.pod_issues([GATEWAY, ENGINE]) == []


def test_failed_mount_and_multi_attach_reach_the_issues() -> None:
    events = [kubelet_event(GATEWAY, "FailedMount", MISSING, "2026-12-04T15:02:10Z", count=4),
              kubelet_event(ENGINE, "FailedAttachVolume", MULTI_ATTACH, "2026-12-04T15:01:00Z",
                            component="attachdetach-controller"),
              # Not a problem of ours: Normal events, another pod, a later Scheduled.
              {**kubelet_event(ENGINE, "Scheduled", "Successfully assigned", "2026-12-04T15:03:00Z"),
               "type": "Normal"},
              {**kubelet_event(GATEWAY, "FailedMount", MISSING, "2026-12-04T15:02:00Z"),
               "involvedObject": {"kind": "Pod", "name": "other-pod", "namespace": NS}}]
    issues = st.event_issues([GATEWAY, ENGINE], events)
    assert issues == [st.PodIssue("engine", ENGINE["metadata"]["name"], "FailedAttachVolume", MULTI_ATTACH),
                      st.PodIssue("gateway", GATEWAY["metadata"]["name"], "FailedMount", MISSING)]


def test_the_latest_event_wins_and_a_started_pod_is_not_reported() -> None:
    events = [kubelet_event(GATEWAY, "FailedMount", MISSING, "2026-12-04T15:02:10Z"),
              kubelet_event(GATEWAY, "FailedMount", MISKEYED, "2026-12-04T15:04:10Z")]
    assert [i.message for i in st.event_issues([GATEWAY], events)] == [MISKEYED]
    running = {**GATEWAY, "status": {**GATEWAY["status"], "containerStatuses": [
        {"name": "gateway", "ready": True, "state": {"running": {"startedAt": "2026-12-04T15:05:00Z"}}}]}}
    assert st.event_issues([running], events) == []
    # A recreated pod of the same name does not inherit its predecessor's events.
    again = {**GATEWAY, "metadata": {**GATEWAY["metadata"], "uid": "new-uid"}}
    assert st.event_issues([again], events) == []


def test_events_api_events_are_read_too() -> None:
    """events.k8s.io/v1 shape (regarding, note, series) as newer kubelets write them."""
    event = {"kind": "Event", "type": "Warning", "reason": "FailedMount", "note": MISSING,
             "regarding": {"kind": "Pod", "name": GATEWAY["metadata"]["name"], "uid": GATEWAY["metadata"]["uid"]},
             "eventTime": "2026-12-04T15:02:10.000000Z", "series": {"count": 5,
                                                                   "lastObservedTime": "2026-12-04T15:06:10Z"}}
    assert st.event_issues([GATEWAY], [event]) == [st.PodIssue("gateway", GATEWAY["metadata"]["name"], "FailedMount",
                                                               MISSING)]


def test_progressing_says_why() -> None:
    from minedraft.operator import spec as s

    spec = s.parse_spec({"target": {"source": {"huggingFace": {"id": "a/b"}}},
                         "draft": {"source": {"huggingFace": {"id": "a/c"}}}})
    meta = s.ObjectMeta("qwen3-8b", NS, "u")
    issues = tuple(st.event_issues([GATEWAY], [kubelet_event(GATEWAY, "FailedMount", MISSING, "2026-12-04T15:02:10Z")]))
    out = st.compute_status(st.Observed(generation=1, spec=spec, meta=meta, pod_issues=issues), "2026-12-04T15:07:00Z")
    progressing = next(c for c in out["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "False" and progressing["reason"] == "FailedMount"
    assert 'secret "minedraft-token" not found' in progressing["message"]
