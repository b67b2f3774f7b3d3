from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SharedMemoryRef(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("name", "key", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegionStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RegionStatusResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegisterRegionRequest]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegisterRegionRequest, _Mapping]]] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("id", "request", "timeout_s", "metadata", "method")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: bytes
    timeout_s: float
    metadata: _containers.ScalarMap[str, str]
    method: str
    def __init__(self, id: _Optional[int] = ..., request: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ..., method: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("id", "code", "message", "response", "trailers", "retryable")
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    message: str
    response: bytes
    trailers: _containers.ScalarMap[str, str]
    retryable: bool
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[bytes] = ..., trailers: _Optional[_Mapping[str, str]] = ..., retryable: _Optional[bool] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw_data", "bool_data", "int_data", "int64_data", "uint_data", "uint64_data", "fp32_data", "fp64_data", "shared_memory")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_DATA_FIELD_NUMBER: _ClassVar[int]
    BOOL_DATA_FIELD_NUMBER: _ClassVar[int]
    INT_DATA_FIELD_NUMBER: _ClassVar[int]
    INT64_DATA_FIELD_NUMBER: _ClassVar[int]
    UINT_DATA_FIELD_NUMBER: _ClassVar[int]
    UINT64_DATA_FIELD_NUMBER: _ClassVar[int]
    FP32_DATA_FIELD_NUMBER: _ClassVar[int]
    FP64_DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw_data: bytes
    bool_data: _containers.RepeatedScalarFieldContainer[bool]
    int_data: _containers.RepeatedScalarFieldContainer[int]
    int64_data: _containers.RepeatedScalarFieldContainer[int]
    uint_data: _containers.RepeatedScalarFieldContainer[int]
    uint64_data: _containers.RepeatedScalarFieldContainer[int]
    fp32_data: _containers.RepeatedScalarFieldContainer[float]
    fp64_data: _containers.RepeatedScalarFieldContainer[float]
    shared_memory: SharedMemoryRef
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw_data: _Optional[bytes] = ..., bool_data: _Optional[_Iterable[bool]] = ..., int_data: _Optional[_Iterable[int]] = ..., int64_data: _Optional[_Iterable[int]] = ..., uint_data: _Optional[_Iterable[int]] = ..., uint64_data: _Optional[_Iterable[int]] = ..., fp32_data: _Optional[_Iterable[float]] = ..., fp64_data: _Optional[_Iterable[float]] = ..., shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("inputs", "outputs", "typed_outputs", "model", "version", "output_memory")
    class OutputMemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SharedMemoryRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TYPED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MEMORY_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    typed_outputs: bool
    model: str
    version: str
    output_memory: _containers.MessageMap[str, SharedMemoryRef]
    def __init__(self, inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., typed_outputs: _Optional[bool] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., output_memory: _Optional[_Mapping[str, SharedMemoryRef]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("model", "outputs", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    version: str
    def __init__(self, model: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "shape", "accepts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    accepts: _containers.RepeatedCompositeFieldContainer[WireType]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., accepts: _Optional[_Iterable[_Union[WireType, _Mapping]]] = ...) -> None: ...

class WireType(_message.Message):
    __slots__ = ("datatype", "scale", "offset")
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    datatype: str
    scale: float
    offset: float
    def __init__(self, datatype: _Optional[str] = ..., scale: _Optional[float] = ..., offset: _Optional[float] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "inputs", "outputs", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    version: str
    def __init__(self, name: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "versions", "default", "provider", "fallback")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    default: bool
    provider: str
    fallback: str
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[str]] = ..., default: _Optional[bool] = ..., provider: _Optional[str] = ..., fallback: _Optional[str] = ...) -> None: ...

class MetadataRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class MetadataResponse(_message.Message):
    __slots__ = ("model", "platform", "provider", "models")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    platform: str
    provider: str
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., platform: _Optional[str] = ..., provider: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("count", "p50_ms", "p90_ms", "p99_ms", "max_ms")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P90_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    def __init__(self, count: _Optional[int] = ..., p50_ms: _Optional[float] = ..., p90_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., max_ms: _Optional[float] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("node_id", "status", "model", "provider", "uptime_s", "requests", "errors", "errors_by_code", "latency", "in_flight", "batcher", "cache", "buffers", "role", "backends", "balancer", "models", "fallback", "refusals", "tenants", "max_message_bytes")
    class ErrorsByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BATCHER_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    BALANCER_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    status: str
    model: ModelInfo
    provider: str
    uptime_s: float
    requests: int
    errors: int
    errors_by_code: _containers.ScalarMap[str, int]
    latency: LatencySummary
    in_flight: int
    batcher: BatcherStats
    cache: CacheStats
    buffers: BufferPoolStats
    role: str
    backends: _containers.RepeatedCompositeFieldContainer[BackendStatus]
    balancer: BalancerStats
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    fallback: str
    refusals: _containers.ScalarMap[str, int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    max_message_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., status: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., provider: _Optional[str] = ..., uptime_s: _Optional[float] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., errors_by_code: _Optional[_Mapping[str, int]] = ..., latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., in_flight: _Optional[int] = ..., batcher: _Optional[_Union[BatcherStats, _Mapping]] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ..., buffers: _Optional[_Union[BufferPoolStats, _Mapping]] = ..., role: _Optional[str] = ..., backends: _Optional[_Iterable[_Union[BackendStatus, _Mapping]]] = ..., balancer: _Optional[_Union[BalancerStats, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., fallback: _Optional[str] = ..., refusals: _Optional[_Mapping[str, int]] = ..., tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("name", "priority", "rate", "burst", "concurrency", "in_flight", "calls", "ok", "refused", "failed", "admin")
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    priority: str
    rate: float
    burst: float
    concurrency: int
    in_flight: int
    calls: int
    ok: int
    refused: _containers.ScalarMap[str, int]
    failed: _containers.ScalarMap[str, int]
    admin: bool
    def __init__(self, name: _Optional[str] = ..., priority: _Optional[str] = ..., rate: _Optional[float] = ..., burst: _Optional[float] = ..., concurrency: _Optional[int] = ..., in_flight: _Optional[int] = ..., calls: _Optional[int] = ..., ok: _Optional[int] = ..., refused: _Optional[_Mapping[str, int]] = ..., failed: _Optional[_Mapping[str, int]] = ..., admin: _Optional[bool] = ...) -> None: ...

class BackendStatus(_message.Message):
    __slots__ = ("address", "health", "breaker", "in_flight", "calls", "failures", "ewma_ms", "share", "limit", "models", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    EWMA_MS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    health: str
    breaker: str
    in_flight: int
    calls: int
    failures: int
    ewma_ms: float
    share: float
    limit: float
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    reason: str
    def __init__(self, address: _Optional[str] = ..., health: _Optional[str] = ..., breaker: _Optional[str] = ..., in_flight: _Optional[int] = ..., calls: _Optional[int] = ..., failures: _Optional[int] = ..., ewma_ms: _Optional[float] = ..., share: _Optional[float] = ..., limit: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class BalancerStats(_message.Message):
    __slots__ = ("calls", "retries", "retries_refused", "unavailable", "shed", "hedges", "hedges_won", "hedges_cancelled", "hedges_refused", "hedge_after_ms")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    HEDGES_FIELD_NUMBER: _ClassVar[int]
    HEDGES_WON_FIELD_NUMBER: _ClassVar[int]
    HEDGES_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    HEDGES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    HEDGE_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    calls: int
    retries: int
    retries_refused: int
    unavailable: int
    shed: int
    hedges: int
    hedges_won: int
    hedges_cancelled: int
    hedges_refused: int
    hedge_after_ms: float
    def __init__(self, calls: _Optional[int] = ..., retries: _Optional[int] = ..., retries_refused: _Optional[int] = ..., unavailable: _Optional[int] = ..., shed: _Optional[int] = ..., hedges: _Optional[int] = ..., hedges_won: _Optional[int] = ..., hedges_cancelled: _Optional[int] = ..., hedges_refused: _Optional[int] = ..., hedge_after_ms: _Optional[float] = ...) -> None: ...

class BatcherStats(_message.Message):
    __slots__ = ("batches", "requests", "rows", "mean_batch_size", "flush_full", "flush_budget", "flush_drained", "queue_depth", "rejected", "expired", "max_batch", "budget_ms", "instances", "busy_instances", "instance_batches", "real_tokens", "padded_tokens", "padding_efficiency", "buckets", "max_length", "bucket_batches")
    class BucketBatchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FULL_FIELD_NUMBER: _ClassVar[int]
    FLUSH_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FLUSH_DRAINED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    BUSY_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDING_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: int
    requests: int
    rows: int
    mean_batch_size: float
    flush_full: int
    flush_budget: int
    flush_drained: int
    queue_depth: int
    rejected: int
    expired: int
    max_batch: int
    budget_ms: float
    instances: int
    busy_instances: int
    instance_batches: _containers.RepeatedScalarFieldContainer[int]
    real_tokens: int
    padded_tokens: int
    padding_efficiency: float
    buckets: _containers.RepeatedScalarFieldContainer[int]
    max_length: int
    bucket_batches: _containers.ScalarMap[str, int]
    def __init__(self, batches: _Optional[int] = ..., requests: _Optional[int] = ..., rows: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., flush_full: _Optional[int] = ..., flush_budget: _Optional[int] = ..., flush_drained: _Optional[int] = ..., queue_depth: _Optional[int] = ..., rejected: _Optional[int] = ..., expired: _Optional[int] = ..., max_batch: _Optional[int] = ..., budget_ms: _Optional[float] = ..., instances: _Optional[int] = ..., busy_instances: _Optional[int] = ..., instance_batches: _Optional[_Iterable[int]] = ..., real_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., padding_efficiency: _Optional[float] = ..., buckets: _Optional[_Iterable[int]] = ..., max_length: _Optional[int] = ..., bucket_batches: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("enabled", "entries", "bytes", "hits", "misses", "evictions", "hit_rate", "shared", "max_entries", "max_bytes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    hit_rate: float
    shared: int
    max_entries: int
    max_bytes: int
    def __init__(self, enabled: _Optional[bool] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., hit_rate: _Optional[float] = ..., shared: _Optional[int] = ..., max_entries: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class BufferPoolStats(_message.Message):
    __slots__ = ("pinned", "buffers", "bytes", "reused", "allocated", "dropped")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    pinned: bool
    buffers: int
    bytes: int
    reused: int
    allocated: int
    dropped: int
    def __init__(self, pinned: _Optional[bool] = ..., buffers: _Optional[int] = ..., bytes: _Optional[int] = ..., reused: _Optional[int] = ..., allocated: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...
