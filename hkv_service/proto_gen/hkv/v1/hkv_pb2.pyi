from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    KIND_COMPRESSED: _ClassVar[Kind]
    KIND_TAIL: _ClassVar[Kind]
    KIND_SWA: _ClassVar[Kind]
    KIND_INDEXER: _ClassVar[Kind]
    KIND_DISK: _ClassVar[Kind]
    KIND_STATE: _ClassVar[Kind]

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    STATE_ALLOCATED: _ClassVar[State]
    STATE_WRITING: _ClassVar[State]
    STATE_COMPRESSED_READY: _ClassVar[State]
    STATE_TAIL_PARTIAL: _ClassVar[State]
    STATE_TAIL_COMPLETE: _ClassVar[State]
    STATE_SWA_VALID: _ClassVar[State]
    STATE_INDEXER_WRITTEN: _ClassVar[State]
    STATE_INDEXER_SYNCED: _ClassVar[State]
    STATE_OFFLOADING: _ClassVar[State]
    STATE_ON_DISK: _ClassVar[State]
    STATE_ON_DISK_INFLIGHT: _ClassVar[State]
    STATE_ON_DISK_READY: _ClassVar[State]
    STATE_EVICTED: _ClassVar[State]
    STATE_LOST: _ClassVar[State]
    STATE_CORRUPT: _ClassVar[State]
    STATE_STATE_READY: _ClassVar[State]

class Event(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_UNSPECIFIED: _ClassVar[Event]
    EVENT_BEGIN_WRITE: _ClassVar[Event]
    EVENT_WRITE_DONE: _ClassVar[Event]
    EVENT_TAIL_APPEND: _ClassVar[Event]
    EVENT_TAIL_DONE: _ClassVar[Event]
    EVENT_INDEXER_SYNC: _ClassVar[Event]
    EVENT_OFFLOAD_BEGIN: _ClassVar[Event]
    EVENT_OFFLOAD_COMMITTED: _ClassVar[Event]
    EVENT_OFFLOAD_FAILED: _ClassVar[Event]
    EVENT_LOAD_BEGIN: _ClassVar[Event]
    EVENT_LOAD_VERIFIED: _ClassVar[Event]
    EVENT_LOAD_FAILED: _ClassVar[Event]
    EVENT_DROP_COPY: _ClassVar[Event]
    EVENT_EVICT: _ClassVar[Event]
    EVENT_LOSE: _ClassVar[Event]
    EVENT_MARK_CORRUPT: _ClassVar[Event]
    EVENT_COPY_LOST: _ClassVar[Event]

class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[Reason]
    REASON_PARTIAL_BLOCK: _ClassVar[Reason]
    REASON_ABI_MISMATCH: _ClassVar[Reason]
    REASON_MISSING_COMPONENT: _ClassVar[Reason]
    REASON_NOT_WRITTEN: _ClassVar[Reason]
    REASON_TAIL_INCOMPLETE: _ClassVar[Reason]
    REASON_SWA_WINDOW_INCOMPLETE: _ClassVar[Reason]
    REASON_INDEXER_STALE: _ClassVar[Reason]
    REASON_DISK_INFLIGHT: _ClassVar[Reason]
    REASON_OWNER_LOST: _ClassVar[Reason]
    REASON_CORRUPT: _ClassVar[Reason]
    REASON_MISALIGNED: _ClassVar[Reason]
    REASON_STALE_HANDLE: _ClassVar[Reason]
    REASON_ADMISSION: _ClassVar[Reason]
    REASON_TOPOLOGY_CHANGED: _ClassVar[Reason]
    REASON_SERVICE_UNAVAILABLE: _ClassVar[Reason]
    REASON_NO_STATE_AT_BOUNDARY: _ClassVar[Reason]
KIND_UNSPECIFIED: Kind
KIND_COMPRESSED: Kind
KIND_TAIL: Kind
KIND_SWA: Kind
KIND_INDEXER: Kind
KIND_DISK: Kind
KIND_STATE: Kind
STATE_UNSPECIFIED: State
STATE_ALLOCATED: State
STATE_WRITING: State
STATE_COMPRESSED_READY: State
STATE_TAIL_PARTIAL: State
STATE_TAIL_COMPLETE: State
STATE_SWA_VALID: State
STATE_INDEXER_WRITTEN: State
STATE_INDEXER_SYNCED: State
STATE_OFFLOADING: State
STATE_ON_DISK: State
STATE_ON_DISK_INFLIGHT: State
STATE_ON_DISK_READY: State
STATE_EVICTED: State
STATE_LOST: State
STATE_CORRUPT: State
STATE_STATE_READY: State
EVENT_UNSPECIFIED: Event
EVENT_BEGIN_WRITE: Event
EVENT_WRITE_DONE: Event
EVENT_TAIL_APPEND: Event
EVENT_TAIL_DONE: Event
EVENT_INDEXER_SYNC: Event
EVENT_OFFLOAD_BEGIN: Event
EVENT_OFFLOAD_COMMITTED: Event
EVENT_OFFLOAD_FAILED: Event
EVENT_LOAD_BEGIN: Event
EVENT_LOAD_VERIFIED: Event
EVENT_LOAD_FAILED: Event
EVENT_DROP_COPY: Event
EVENT_EVICT: Event
EVENT_LOSE: Event
EVENT_MARK_CORRUPT: Event
EVENT_COPY_LOST: Event
REASON_UNSPECIFIED: Reason
REASON_PARTIAL_BLOCK: Reason
REASON_ABI_MISMATCH: Reason
REASON_MISSING_COMPONENT: Reason
REASON_NOT_WRITTEN: Reason
REASON_TAIL_INCOMPLETE: Reason
REASON_SWA_WINDOW_INCOMPLETE: Reason
REASON_INDEXER_STALE: Reason
REASON_DISK_INFLIGHT: Reason
REASON_OWNER_LOST: Reason
REASON_CORRUPT: Reason
REASON_MISALIGNED: Reason
REASON_STALE_HANDLE: Reason
REASON_ADMISSION: Reason
REASON_TOPOLOGY_CHANGED: Reason
REASON_SERVICE_UNAVAILABLE: Reason
REASON_NO_STATE_AT_BOUNDARY: Reason

class Handle(_message.Message):
    __slots__ = ("object_id", "generation", "shard", "column", "block", "kind", "group", "nbytes", "abi_fingerprint", "address")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ABI_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    generation: int
    shard: str
    column: int
    block: int
    kind: Kind
    group: str
    nbytes: int
    abi_fingerprint: int
    address: int
    def __init__(self, object_id: _Optional[int] = ..., generation: _Optional[int] = ..., shard: _Optional[str] = ..., column: _Optional[int] = ..., block: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., group: _Optional[str] = ..., nbytes: _Optional[int] = ..., abi_fingerprint: _Optional[int] = ..., address: _Optional[int] = ...) -> None: ...

class HandleColumn(_message.Message):
    __slots__ = ("group", "column", "kind", "nbytes", "abi_fingerprint", "records", "strides")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ABI_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    group: str
    column: int
    kind: Kind
    nbytes: int
    abi_fingerprint: int
    records: bytes
    strides: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group: _Optional[str] = ..., column: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., nbytes: _Optional[int] = ..., abi_fingerprint: _Optional[int] = ..., records: _Optional[bytes] = ..., strides: _Optional[_Iterable[int]] = ...) -> None: ...

class GetSpecRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ColumnInfo(_message.Message):
    __slots__ = ("index", "name", "kind", "nbytes", "abi_fingerprint")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ABI_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    kind: Kind
    nbytes: int
    abi_fingerprint: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[Kind, str]] = ..., nbytes: _Optional[int] = ..., abi_fingerprint: _Optional[int] = ...) -> None: ...

class GetSpecResponse(_message.Message):
    __slots__ = ("spec_json", "model_id", "hash_block_size", "lcm_block_size", "columns")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LCM_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    model_id: str
    hash_block_size: int
    lcm_block_size: int
    columns: _containers.RepeatedCompositeFieldContainer[ColumnInfo]
    def __init__(self, spec_json: _Optional[str] = ..., model_id: _Optional[str] = ..., hash_block_size: _Optional[int] = ..., lcm_block_size: _Optional[int] = ..., columns: _Optional[_Iterable[_Union[ColumnInfo, _Mapping]]] = ...) -> None: ...

class PoolConfig(_message.Message):
    __slots__ = ("num_blocks", "stride", "base_align", "first_block", "device", "generation_floor")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    BASE_ALIGN_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FLOOR_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    stride: int
    base_align: int
    first_block: int
    device: str
    generation_floor: int
    def __init__(self, num_blocks: _Optional[int] = ..., stride: _Optional[int] = ..., base_align: _Optional[int] = ..., first_block: _Optional[int] = ..., device: _Optional[str] = ..., generation_floor: _Optional[int] = ...) -> None: ...

class RegisterOwnerRequest(_message.Message):
    __slots__ = ("owner", "pools", "instance")
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PoolConfig
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PoolConfig, _Mapping]] = ...) -> None: ...
    OWNER_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    pools: _containers.MessageMap[str, PoolConfig]
    instance: int
    def __init__(self, owner: _Optional[str] = ..., pools: _Optional[_Mapping[str, PoolConfig]] = ..., instance: _Optional[int] = ...) -> None: ...

class RegisterOwnerResponse(_message.Message):
    __slots__ = ("incarnation",)
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    def __init__(self, incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("owner", "incarnation")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    incarnation: int
    def __init__(self, owner: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MarkOwnerLostRequest(_message.Message):
    __slots__ = ("owner", "witnesses", "instance")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WITNESSES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    witnesses: _containers.RepeatedScalarFieldContainer[int]
    instance: int
    def __init__(self, owner: _Optional[str] = ..., witnesses: _Optional[_Iterable[int]] = ..., instance: _Optional[int] = ...) -> None: ...

class MarkOwnerLostResponse(_message.Message):
    __slots__ = ("lost", "stale")
    LOST_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    lost: int
    stale: bool
    def __init__(self, lost: _Optional[int] = ..., stale: _Optional[bool] = ...) -> None: ...

class ObjectReport(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "depth", "column", "state", "block", "generation", "version", "lo", "hi")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    depth: int
    column: str
    state: State
    block: int
    generation: int
    version: int
    lo: int
    hi: int
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., depth: _Optional[int] = ..., column: _Optional[str] = ..., state: _Optional[_Union[State, str]] = ..., block: _Optional[int] = ..., generation: _Optional[int] = ..., version: _Optional[int] = ..., lo: _Optional[int] = ..., hi: _Optional[int] = ...) -> None: ...

class ConfirmRequest(_message.Message):
    __slots__ = ("owner", "reports", "incarnation")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    reports: _containers.RepeatedCompositeFieldContainer[ObjectReport]
    incarnation: int
    def __init__(self, owner: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[ObjectReport, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class ConfirmResponse(_message.Message):
    __slots__ = ("confirmed", "object_ids")
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    confirmed: int
    object_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, confirmed: _Optional[int] = ..., object_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocSlot(_message.Message):
    __slots__ = ("depth", "column", "replace")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    depth: int
    column: str
    replace: int
    def __init__(self, depth: _Optional[int] = ..., column: _Optional[str] = ..., replace: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("block_hashes", "slots", "owner", "first_block", "token_ids")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedCompositeFieldContainer[AllocSlot]
    owner: str
    first_block: int
    token_ids: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[_Union[AllocSlot, _Mapping]]] = ..., owner: _Optional[str] = ..., first_block: _Optional[int] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("handles", "existing", "states", "versions")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[Handle]
    existing: _containers.RepeatedScalarFieldContainer[bool]
    states: _containers.RepeatedScalarFieldContainer[State]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ..., existing: _Optional[_Iterable[bool]] = ..., states: _Optional[_Iterable[_Union[State, str]]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class TransitionItem(_message.Message):
    __slots__ = ("object_id", "event", "version", "lo", "hi", "tail_len", "expect_seq", "generation")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    TAIL_LEN_FIELD_NUMBER: _ClassVar[int]
    EXPECT_SEQ_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    event: Event
    version: int
    lo: int
    hi: int
    tail_len: int
    expect_seq: int
    generation: int
    def __init__(self, object_id: _Optional[int] = ..., event: _Optional[_Union[Event, str]] = ..., version: _Optional[int] = ..., lo: _Optional[int] = ..., hi: _Optional[int] = ..., tail_len: _Optional[int] = ..., expect_seq: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class TransitionRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TransitionItem]
    def __init__(self, items: _Optional[_Iterable[_Union[TransitionItem, _Mapping]]] = ...) -> None: ...

class TransitionResult(_message.Message):
    __slots__ = ("object_id", "state", "version", "seq")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    state: State
    version: int
    seq: int
    def __init__(self, object_id: _Optional[int] = ..., state: _Optional[_Union[State, str]] = ..., version: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "error_class", "message", "retry_after_ms", "state", "event", "precondition", "event_index")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    PRECONDITION_FIELD_NUMBER: _ClassVar[int]
    EVENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    code: int
    error_class: str
    message: str
    retry_after_ms: int
    state: State
    event: Event
    precondition: str
    event_index: int
    def __init__(self, code: _Optional[int] = ..., error_class: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., state: _Optional[_Union[State, str]] = ..., event: _Optional[_Union[Event, str]] = ..., precondition: _Optional[str] = ..., event_index: _Optional[int] = ...) -> None: ...

class TransitionOutcome(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: TransitionResult
    error: ItemError
    def __init__(self, result: _Optional[_Union[TransitionResult, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class TransitionResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[TransitionOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[TransitionOutcome, _Mapping]]] = ...) -> None: ...

class TransitionStep(_message.Message):
    __slots__ = ("event", "version", "lo", "hi", "tail_len", "expect_seq")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    TAIL_LEN_FIELD_NUMBER: _ClassVar[int]
    EXPECT_SEQ_FIELD_NUMBER: _ClassVar[int]
    event: Event
    version: int
    lo: int
    hi: int
    tail_len: int
    expect_seq: int
    def __init__(self, event: _Optional[_Union[Event, str]] = ..., version: _Optional[int] = ..., lo: _Optional[int] = ..., hi: _Optional[int] = ..., tail_len: _Optional[int] = ..., expect_seq: _Optional[int] = ...) -> None: ...

class ObjectTransitions(_message.Message):
    __slots__ = ("object_id", "steps", "generation")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    steps: _containers.RepeatedCompositeFieldContainer[TransitionStep]
    generation: int
    def __init__(self, object_id: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[TransitionStep, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class TransitionManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ObjectTransitions]
    def __init__(self, items: _Optional[_Iterable[_Union[ObjectTransitions, _Mapping]]] = ...) -> None: ...

class TransitionManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[TransitionOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[TransitionOutcome, _Mapping]]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("object_id",)
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    def __init__(self, object_id: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BeginOffloadRequest(_message.Message):
    __slots__ = ("object_id", "disk_owner")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    DISK_OWNER_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    disk_owner: str
    def __init__(self, object_id: _Optional[int] = ..., disk_owner: _Optional[str] = ...) -> None: ...

class BeginOffloadResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: Handle
    def __init__(self, handle: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class BeginLoadRequest(_message.Message):
    __slots__ = ("object_id", "owner")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    owner: str
    def __init__(self, object_id: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class BeginLoadResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: Handle
    def __init__(self, handle: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "packed_hashes", "resume_tokens", "reader_abi", "alignment", "lease_ttl_s", "match_only", "first_block", "open_end")
    class ReaderAbiEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READER_ABI_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MATCH_ONLY_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    OPEN_END_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    packed_hashes: bytes
    resume_tokens: int
    reader_abi: _containers.ScalarMap[str, int]
    alignment: int
    lease_ttl_s: float
    match_only: bool
    first_block: int
    open_end: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., packed_hashes: _Optional[bytes] = ..., resume_tokens: _Optional[int] = ..., reader_abi: _Optional[_Mapping[str, int]] = ..., alignment: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., match_only: _Optional[bool] = ..., first_block: _Optional[int] = ..., open_end: _Optional[bool] = ...) -> None: ...

class Downgrade(_message.Message):
    __slots__ = ("reason", "group", "position")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    reason: Reason
    group: str
    position: int
    def __init__(self, reason: _Optional[_Union[Reason, str]] = ..., group: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class Match(_message.Message):
    __slots__ = ("usable_tokens", "matched_tokens", "handles", "downgrades", "lease_id", "shard_names")
    USABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    DOWNGRADES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_NAMES_FIELD_NUMBER: _ClassVar[int]
    usable_tokens: int
    matched_tokens: int
    handles: _containers.RepeatedCompositeFieldContainer[HandleColumn]
    downgrades: _containers.RepeatedCompositeFieldContainer[Downgrade]
    lease_id: int
    shard_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, usable_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., handles: _Optional[_Iterable[_Union[HandleColumn, _Mapping]]] = ..., downgrades: _Optional[_Iterable[_Union[Downgrade, _Mapping]]] = ..., lease_id: _Optional[int] = ..., shard_names: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[LookupRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[LookupRequest, _Mapping]]] = ...) -> None: ...

class LookupBatchResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[Match]
    def __init__(self, matches: _Optional[_Iterable[_Union[Match, _Mapping]]] = ...) -> None: ...

class LookupStreamRequest(_message.Message):
    __slots__ = ("tag", "requests")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    tag: int
    requests: _containers.RepeatedCompositeFieldContainer[LookupRequest]
    def __init__(self, tag: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[LookupRequest, _Mapping]]] = ...) -> None: ...

class LookupStreamResponse(_message.Message):
    __slots__ = ("tag", "matches", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    matches: _containers.RepeatedCompositeFieldContainer[Match]
    error: ItemError
    def __init__(self, tag: _Optional[int] = ..., matches: _Optional[_Iterable[_Union[Match, _Mapping]]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class AdmitSaveRequest(_message.Message):
    __slots__ = ("block_hashes", "needed", "offered_from")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NEEDED_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FROM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    needed: int
    offered_from: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., needed: _Optional[int] = ..., offered_from: _Optional[int] = ...) -> None: ...

class AdmitSaveResponse(_message.Message):
    __slots__ = ("admitted",)
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    admitted: int
    def __init__(self, admitted: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckReadRequest(_message.Message):
    __slots__ = ("handle", "lease_id")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    handle: Handle
    lease_id: int
    def __init__(self, handle: _Optional[_Union[Handle, _Mapping]] = ..., lease_id: _Optional[int] = ...) -> None: ...

class CheckReadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterCaptureRequest(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[Handle]
    def __init__(self, handles: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ...) -> None: ...

class RegisterCaptureResponse(_message.Message):
    __slots__ = ("capture_id", "topology_epoch")
    CAPTURE_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    capture_id: int
    topology_epoch: int
    def __init__(self, capture_id: _Optional[int] = ..., topology_epoch: _Optional[int] = ...) -> None: ...

class ReleaseCaptureRequest(_message.Message):
    __slots__ = ("capture_id",)
    CAPTURE_ID_FIELD_NUMBER: _ClassVar[int]
    capture_id: int
    def __init__(self, capture_id: _Optional[int] = ...) -> None: ...

class ReleaseCaptureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CaptureStatusRequest(_message.Message):
    __slots__ = ("capture_id",)
    CAPTURE_ID_FIELD_NUMBER: _ClassVar[int]
    capture_id: int
    def __init__(self, capture_id: _Optional[int] = ...) -> None: ...

class CaptureStatusResponse(_message.Message):
    __slots__ = ("valid", "topology_epoch")
    VALID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    topology_epoch: int
    def __init__(self, valid: _Optional[bool] = ..., topology_epoch: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("from_seq", "max_batch")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    max_batch: int
    def __init__(self, from_seq: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class TransitionEvent(_message.Message):
    __slots__ = ("seq", "object_id", "kind", "state", "column", "block_hash", "at")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    object_id: int
    kind: Kind
    state: State
    column: str
    block_hash: bytes
    at: float
    def __init__(self, seq: _Optional[int] = ..., object_id: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., state: _Optional[_Union[State, str]] = ..., column: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., at: _Optional[float] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("events", "gap")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TransitionEvent]
    gap: bool
    def __init__(self, events: _Optional[_Iterable[_Union[TransitionEvent, _Mapping]]] = ..., gap: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("transitions", "downgrades", "lookups", "evictions", "events", "gauges", "partition", "range_blocks")
    class TransitionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DowngradesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LookupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GaugesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    DOWNGRADES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAUGES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RANGE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transitions: _containers.ScalarMap[str, int]
    downgrades: _containers.ScalarMap[str, int]
    lookups: _containers.ScalarMap[str, int]
    evictions: _containers.ScalarMap[str, int]
    events: _containers.ScalarMap[str, int]
    gauges: _containers.ScalarMap[str, int]
    partition: str
    range_blocks: int
    def __init__(self, transitions: _Optional[_Mapping[str, int]] = ..., downgrades: _Optional[_Mapping[str, int]] = ..., lookups: _Optional[_Mapping[str, int]] = ..., evictions: _Optional[_Mapping[str, int]] = ..., events: _Optional[_Mapping[str, int]] = ..., gauges: _Optional[_Mapping[str, int]] = ..., partition: _Optional[str] = ..., range_blocks: _Optional[int] = ...) -> None: ...

class ResumableRequest(_message.Message):
    __slots__ = ("packed_hashes", "token_ids", "adapter_id", "cache_salt", "reader_abi")
    class ReaderAbiEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    READER_ABI_FIELD_NUMBER: _ClassVar[int]
    packed_hashes: bytes
    token_ids: bytes
    adapter_id: str
    cache_salt: str
    reader_abi: _containers.ScalarMap[str, int]
    def __init__(self, packed_hashes: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., adapter_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., reader_abi: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ResumableResponse(_message.Message):
    __slots__ = ("prompt_tokens", "tokens", "memory_tokens", "stop", "reason", "memory_stop", "downgrades", "lookups")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STOP_FIELD_NUMBER: _ClassVar[int]
    DOWNGRADES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    tokens: int
    memory_tokens: int
    stop: str
    reason: Reason
    memory_stop: str
    downgrades: _containers.RepeatedCompositeFieldContainer[Downgrade]
    lookups: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., tokens: _Optional[int] = ..., memory_tokens: _Optional[int] = ..., stop: _Optional[str] = ..., reason: _Optional[_Union[Reason, str]] = ..., memory_stop: _Optional[str] = ..., downgrades: _Optional[_Iterable[_Union[Downgrade, _Mapping]]] = ..., lookups: _Optional[int] = ...) -> None: ...
