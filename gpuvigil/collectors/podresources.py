"""The kubelet's PodResources API (`v1.PodResourcesLister/List`), as dcgm-exporter reads it.

The kubelet serves it over gRPC on a unix socket (`/var/lib/kubelet/pod-resources/kubelet.sock`)
and answers which pod and container holds which device (`nvidia.com/gpu`: GPU UUIDs, or MIG
device ids, or indices under the device plugin's `index` strategy). No maintained Python package
ships its protobuf stubs, so the few messages we read are declared here in code (field numbers
from kubernetes' `pkg/kubelet/apis/podresources/v1/api.proto`; unknown fields such as
`cpu_ids`, `memory`, `topology`, `dynamic_resources` are skipped by protobuf) and the call goes
through grpcio's generic unary-unary API.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD = "/v1.PodResourcesLister/List"
GPU_RESOURCES = ("nvidia.com/gpu",)
MAX_MESSAGE_BYTES = 16 << 20  # as dcgm-exporter: a busy node lists many pods


@lru_cache(maxsize=1)
def messages() -> tuple[Any, Any]:
    """(ListPodResourcesRequest, ListPodResourcesResponse) message classes."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="gpuvigil_podresources_v1.proto", package="v1", syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str | None]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("ListPodResourcesRequest")
    message("ContainerDevices", ("resource_name", 1, F.TYPE_STRING, opt, None), ("device_ids", 2, F.TYPE_STRING, rep, None))
    message("ContainerResources", ("name", 1, F.TYPE_STRING, opt, None), ("devices", 2, F.TYPE_MESSAGE, rep, ".v1.ContainerDevices"))
    message(
        "PodResources",
        ("name", 1, F.TYPE_STRING, opt, None),
        ("namespace", 2, F.TYPE_STRING, opt, None),
        ("containers", 3, F.TYPE_MESSAGE, rep, ".v1.ContainerResources"),
    )
    message("ListPodResourcesResponse", ("pod_resources", 1, F.TYPE_MESSAGE, rep, ".v1.PodResources"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    get = message_factory.GetMessageClass
    return get(pool.FindMessageTypeByName("v1.ListPodResourcesRequest")), get(pool.FindMessageTypeByName("v1.ListPodResourcesResponse"))


@dataclass(frozen=True)
class DeviceAssignment:
    device_id: str  # as the device plugin reports it (GPU UUID, MIG id or index; sharing suffix removed)
    pod: str
    namespace: str
    container: str
    resource: str


def _device_id(raw: str) -> str:
    # Time-slicing/MPS sharing makes replicas `GPU-uuid::N`: the GPU is the part before `::`.
    return raw.split("::", 1)[0]


def assignments(response: Any, resources: tuple[str, ...] = GPU_RESOURCES) -> list[DeviceAssignment]:
    out = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for dev in container.devices:
                if dev.resource_name not in resources:
                    continue
                out.extend(DeviceAssignment(_device_id(d), pod.name, pod.namespace, container.name, dev.resource_name) for d in dev.device_ids)
    return out


def list_gpu_assignments(socket_path: str = DEFAULT_SOCKET, *, timeout_seconds: float = 5.0, resources: tuple[str, ...] = GPU_RESOURCES) -> list[DeviceAssignment]:
    """Ask the kubelet which pod holds which GPU. Raises OSError with the reason on failure."""
    import grpc

    request_cls, response_cls = messages()
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"unix://{socket_path}", options=options) as channel:
        call = channel.unary_unary(LIST_METHOD, request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString)
        try:
            response = call(request_cls(), timeout=timeout_seconds)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") and exc.code() is not None else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise OSError(f"kubelet PodResources at {socket_path}: {code}: {details}") from None
    return assignments(response, resources)


__all__ = ["DEFAULT_SOCKET", "DeviceAssignment", "LIST_METHOD", "assignments", "list_gpu_assignments", "messages"]
