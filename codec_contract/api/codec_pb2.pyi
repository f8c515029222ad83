from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Policy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_UNSPECIFIED: _ClassVar[Policy]
    POLICY_REFERENCE: _ClassVar[Policy]
    POLICY_STREAMING: _ClassVar[Policy]

class SampleFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_FORMAT_UNSPECIFIED: _ClassVar[SampleFormat]
    SAMPLE_FORMAT_F32LE: _ClassVar[SampleFormat]
    SAMPLE_FORMAT_S16LE: _ClassVar[SampleFormat]
POLICY_UNSPECIFIED: Policy
POLICY_REFERENCE: Policy
POLICY_STREAMING: Policy
SAMPLE_FORMAT_UNSPECIFIED: SampleFormat
SAMPLE_FORMAT_F32LE: SampleFormat
SAMPLE_FORMAT_S16LE: SampleFormat

class SessionHeader(_message.Message):
    __slots__ = ("seed", "policy", "sample_format", "first_frame", "emit_from_sample", "stream_id", "listener_pace", "listener_ahead_s")
    SEED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    EMIT_FROM_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    LISTENER_PACE_FIELD_NUMBER: _ClassVar[int]
    LISTENER_AHEAD_S_FIELD_NUMBER: _ClassVar[int]
    seed: int
    policy: Policy
    sample_format: SampleFormat
    first_frame: int
    emit_from_sample: int
    stream_id: str
    listener_pace: float
    listener_ahead_s: float
    def __init__(self, seed: _Optional[int] = ..., policy: _Optional[_Union[Policy, str]] = ..., sample_format: _Optional[_Union[SampleFormat, str]] = ..., first_frame: _Optional[int] = ..., emit_from_sample: _Optional[int] = ..., stream_id: _Optional[str] = ..., listener_pace: _Optional[float] = ..., listener_ahead_s: _Optional[float] = ...) -> None: ...

class Frames(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: bytes
    def __init__(self, codes: _Optional[bytes] = ...) -> None: ...

class EndOfStream(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("header", "frames", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: SessionHeader
    frames: Frames
    end: EndOfStream
    def __init__(self, header: _Optional[_Union[SessionHeader, _Mapping]] = ..., frames: _Optional[_Union[Frames, _Mapping]] = ..., end: _Optional[_Union[EndOfStream, _Mapping]] = ...) -> None: ...

class PcmChunk(_message.Message):
    __slots__ = ("first_sample", "pcm", "final")
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    first_sample: int
    pcm: bytes
    final: bool
    def __init__(self, first_sample: _Optional[int] = ..., pcm: _Optional[bytes] = ..., final: _Optional[bool] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("sample_rate", "pcm")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    pcm: bytes
    def __init__(self, sample_rate: _Optional[int] = ..., pcm: _Optional[bytes] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: bytes
    def __init__(self, codes: _Optional[bytes] = ...) -> None: ...
